"""The model: KV-cache decoding equals no-cache recomputation; architecture variants run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_config
from jaxrl.models import KVCache, init_model
from jaxrl.models.layers import MASK_VALUE, ONE_HOT_EMBED_MAX_VOCAB, attention, embed_lookup
from jaxrl.models.logprobs import left_positions, token_logprobs
from jaxrl.rollout.static_sampler import make_sampler

VARIANTS = {
    "llama_unrolled": {"scan_layers": False},
    "qwen2_bias_tied": {"qkv_bias": True, "tie_embeddings": True},
    "qwen3_qknorm_scan": {"qk_norm": True, "scan_layers": True},
    # head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 fall in the kept, blended, divided,
    # divided bands of original context 64.
    "llama3_rope_unrolled": {"rope_scaling": "llama3", "rope_factor": 8.0,
                             "rope_original_max_positions": 64, "scan_layers": False},
}


def _prompts():
  # Two prompt lengths, left-padded: row 0 has 3 pads.
  tokens = np.array([[0, 0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10]], np.int32)
  return tokens, tokens > 0


def _randomise_biases(params, seed):
  # Zero-initialised biases would hide a bias applied in the wrong place. (NumPy noise: a jitted
  # or eager jax.random draw per leaf compiled for ~10 s on 2 cores.)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: (np.asarray(x) + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype), params)


# One variant in the fast suite, the others with `pytest -m slow` (fast-suite time budget).
@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.slow)
    if v in ("llama3_rope_unrolled", "qwen2_bias_tied", "qwen3_qknorm_scan")
    else v for v in sorted(VARIANTS)])
def test_cached_greedy_decode_equals_no_cache_recompute(variant):
  cfg = tiny_model_config(**VARIANTS[variant])
  graphdef, params = init_model(cfg, seed=1)
  params = _randomise_biases(params, 2)
  prompts, valid = _prompts()
  n_new = 10
  gen = make_sampler(graphdef, num_samples=1, max_new_tokens=n_new, eos_id=cfg.vocab_size,
                     pad_id=0)
  out = gen(params, prompts, valid, jax.random.key(0), np.arange(2), 0.0)

  # Reference: re-run the whole sequence without a cache and take the argmax. One fixed-size
  # buffer (future slots marked invalid; causality hides them anyway) keeps it to one compile.
  lp = prompts.shape[1]

  @jax.jit
  def next_token(seq, seq_valid, i):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(seq, left_positions(seq_valid), seq_valid)
    return jnp.argmax(model.logits(hidden[:, lp - 1 + i]), -1).astype(jnp.int32)

  seq = jnp.concatenate([jnp.asarray(prompts), jnp.zeros((2, n_new), jnp.int32)], 1)
  seq_valid = jnp.concatenate([jnp.asarray(valid), jnp.zeros((2, n_new), bool)], 1)
  expected = []
  for i in range(n_new):
    nxt = next_token(seq, seq_valid, i)
    expected.append(nxt)
    seq = seq.at[:, lp + i].set(nxt)
    seq_valid = seq_valid.at[:, lp + i].set(True)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.stack(expected, 1))
  assert out.mask.all()  # eos_id is out of vocabulary, so no row stops early


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_left_padding_does_not_change_a_prompts_continuation():
  # The same prompt with 0 and with 4 pads must decode identically: pads are masked out and
  # positions start at the first real token.
  cfg = tiny_model_config()
  graphdef, params = init_model(cfg, seed=3)
  gen = make_sampler(graphdef, num_samples=1, max_new_tokens=6, eos_id=cfg.vocab_size, pad_id=0)
  short = [5, 6, 7, 8]
  prompts = np.array([[0, 0, 0, 0] + short, [9, 9, 9, 9] + short], np.int32)
  valid = prompts > 0
  valid[1, :4] = True
  padded = gen(params, prompts[:1], valid[:1], jax.random.key(0), np.arange(1), 0.0)
  bare = gen(params, np.array([short], np.int32), np.ones((1, 4), bool), jax.random.key(0),
             np.arange(1), 0.0)
  np.testing.assert_array_equal(np.asarray(padded.tokens), np.asarray(bare.tokens))
  np.testing.assert_allclose(np.asarray(padded.logprobs), np.asarray(bare.logprobs), atol=1e-5)


@pytest.mark.slow  # two models compiled (fast-suite time budget)
def test_scan_and_unrolled_layers_agree():
  outs = []
  for scan in (True, False):
    cfg = tiny_model_config(scan_layers=scan)
    graphdef, params = init_model(cfg, seed=0)
    prompts, valid = _prompts()
    model = nnx.merge(graphdef, params)
    hidden, _ = model(jnp.asarray(prompts), left_positions(jnp.asarray(valid)), jnp.asarray(valid))
    outs.append(np.asarray(model.logits(hidden)))
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)


def test_kv_cache_buffers_are_distinct_for_donation():
  stacked = KVCache.zeros(tiny_model_config(scan_layers=True), batch=2, slots=4)
  assert stacked.k is not stacked.v
  assert stacked.k.shape == (2, 2, 2, 8, 4)  # [L, B, K, Dh, S]: keys are slot-minor
  assert stacked.v.shape == (2, 2, 2, 4, 8)  # [L, B, K, S, Dh]
  per_layer = KVCache.zeros(tiny_model_config(scan_layers=False), batch=2, slots=4)
  buffers = [*per_layer.k, *per_layer.v]
  assert len({id(b) for b in buffers}) == 4
  assert buffers[0].shape == (2, 2, 8, 4) and buffers[-1].shape == (2, 2, 4, 8)
  assert stacked.valid.dtype == jnp.bool_


def test_qwen2_5_0_5b_preset_matches_the_published_shapes():
  from jaxrl.models import ModelConfig, abstract_model
  cfg = ModelConfig.qwen2_5_0_5b()
  _, params = abstract_model(cfg)
  n = sum(np.prod(x.shape) for x in jax.tree.leaves(params))
  # 494,032,768 = embed 151936*896 + 24 layers * (q 896*896+896 + k,v 2*(896*128+128)
  #   + o 896*896 + mlp 3*896*4864 + 2 norms 2*896) + final norm 896; lm_head tied.
  assert n == 494_032_768


@pytest.mark.slow  # two models compiled (fast-suite time budget)
def test_bfloat16_compute_keeps_float32_logprobs():
  # Same f32 parameters, bf16 compute: log-probs stay float32 and close to the f32 model's
  # (bf16 has ~3 significant digits, so the tolerance is loose but far below a wrong model's).
  prompts, valid = _prompts()
  outs = {}
  for dt in ("float32", "bfloat16"):
    cfg = tiny_model_config(dtype=dt)
    graphdef, params = init_model(cfg, seed=4)
    gen = make_sampler(graphdef, num_samples=1, max_new_tokens=4, eos_id=cfg.vocab_size, pad_id=0)
    outs[dt] = gen(params, prompts, valid, jax.random.key(0), np.arange(2), 0.0)
  assert outs["bfloat16"].logprobs.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(outs["bfloat16"].tokens)[:, 0],
                                np.asarray(outs["float32"].tokens)[:, 0])
  np.testing.assert_allclose(np.asarray(outs["bfloat16"].logprobs)[:, 0],
                             np.asarray(outs["float32"].logprobs)[:, 0], atol=0.05)


def _np_inv_freq(head_dim, theta, scaling="none", factor=1.0, low=1.0, high=4.0, orig=8192):
  """The rope frequency formulas written out per pair in float64, independently of the model."""
  out = []
  for i in range(head_dim // 2):
    f = theta ** (-2.0 * i / head_dim)
    if scaling == "linear":
      f /= factor
    elif scaling == "llama3":
      wavelen = 2 * np.pi / f
      if wavelen > orig / low:
        f /= factor
      elif wavelen >= orig / high:
        s = (orig / wavelen - low) / (high - low)
        f = (1 - s) * f / factor + s * f
    out.append(f)
  return np.array(out)


def test_rope_inv_freq_matches_the_formulas_in_every_band():
  from jaxrl.models.layers import rope_inv_freq

  dh, theta = 16, 10000.0
  np.testing.assert_array_equal(
      np.asarray(rope_inv_freq(dh, theta)),
      np.asarray(1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))))
  np.testing.assert_allclose(np.asarray(rope_inv_freq(dh, theta)), _np_inv_freq(dh, theta),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(rope_inv_freq(dh, theta, "linear", 4.0)),
                             _np_inv_freq(dh, theta, "linear", 4.0), rtol=1e-6)
  for low, high, orig in [(1.0, 4.0, 64), (1.0, 4.0, 8192), (2.0, 3.0, 500)]:
    wavelen = 2 * np.pi / _np_inv_freq(dh, theta)
    bands = [(wavelen > orig / low).sum(), (wavelen < orig / high).sum()]
    bands.append(dh // 2 - sum(bands))
    assert min(bands) > 0, (orig, bands)  # divided, kept and blended pairs all occur
    got = np.asarray(rope_inv_freq(dh, theta, "llama3", 8.0, low, high, orig))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _np_inv_freq(dh, theta, "llama3", 8.0, low, high, orig),
                               rtol=1e-6)


def test_rope_scaling_config_is_checked():
  with pytest.raises(ValueError, match="rope_scaling='yarn'"):
    tiny_model_config(rope_scaling="yarn")
  with pytest.raises(ValueError, match="rope_low_freq_factor < rope_high_freq_factor"):
    tiny_model_config(rope_scaling="llama3", rope_low_freq_factor=4.0,
                      rope_high_freq_factor=4.0)


@pytest.mark.slow  # ~10 s each on 2 quiet cores; the fast suite's budget is 10 min
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_remat_changes_no_loss_or_gradient(scan):
  # Rematerialisation only moves work from memory to recomputation: the same loss and the same
  # gradient of every parameter, for each policy, scanned and unrolled (up to float32 rounding:
  # XLA may fuse the recomputed forward differently).
  prompts, valid = _prompts()
  tokens, valid = jnp.asarray(prompts), jnp.asarray(valid)
  positions = left_positions(valid)
  targets = jnp.roll(tokens, -1, axis=1)

  def loss_and_grads(remat):
    cfg = tiny_model_config(scan_layers=scan, qkv_bias=True, qk_norm=True, remat=remat)
    graphdef, params = init_model(cfg, seed=3)
    params = _randomise_biases(params, 4)

    def loss(p):
      model = nnx.merge(graphdef, p)
      hidden, _ = model(tokens, positions, valid)
      lp = token_logprobs(model.logits(hidden), targets, 1.0)
      # Token mean, as the trainer's losses: gradients of order 0.1-1, so 1e-6 is a few ulps.
      return -jnp.sum(jnp.where(valid, lp, 0.0)) / jnp.sum(valid)

    return jax.jit(jax.value_and_grad(loss))(params)

  ref_loss, ref_grads = loss_and_grads("none")
  for remat in ("full", "dots"):
    got_loss, got_grads = loss_and_grads(remat)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6, atol=1e-6)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_remat_config_is_checked():
  with pytest.raises(ValueError, match="remat='some'"):
    tiny_model_config(remat="some")


@pytest.mark.parametrize("v", [16, ONE_HOT_EMBED_MAX_VOCAB, ONE_HOT_EMBED_MAX_VOCAB + 1])
def test_embed_lookup_is_the_gather_with_its_gradient(v):
  # Small vocabularies embed by a one-hot matmul (no scatter-add in the gradient), larger ones
  # by a gather; both give exactly the table's rows, and the same table gradient (repeated
  # tokens summed) up to summation order.
  k = jax.random.split(jax.random.key(0), 3)
  table = jax.random.normal(k[0], (v, 8))
  tokens = jax.random.randint(k[1], (3, 5), 0, v).at[0, :2].set(v - 1)  # repeats, last row
  cot = jax.random.normal(k[2], (3, 5, 8))
  np.testing.assert_array_equal(embed_lookup(table, tokens), table[tokens])
  g = jax.grad(lambda t: jnp.sum(embed_lookup(t, tokens) * cot))(table)
  want = np.zeros((v, 8))
  np.add.at(want, np.asarray(tokens).ravel(), np.asarray(cot).reshape(-1, 8))
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
  # Compiled, with the tokens traced too (the one-hot path's own backward rule), and in bf16.
  grad = jax.jit(jax.grad(lambda t, tok, c: jnp.sum(embed_lookup(t, tok) * c)))
  np.testing.assert_allclose(grad(table, tokens, cot), want, rtol=1e-5, atol=1e-6)
  g16 = grad(table.astype(jnp.bfloat16), tokens, cot.astype(jnp.bfloat16))
  assert g16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(g16, np.float32), want, rtol=0.05, atol=0.05)
  hlo = jax.jit(lambda t: embed_lookup(t, tokens)).lower(table).as_text()
  assert ("gather" in hlo) == (v > ONE_HOT_EMBED_MAX_VOCAB)


def _plain_attention(q, k_t, v, mask, scale):
  s = jnp.einsum("bkgtd,bkds->bkgts", q, k_t).astype(jnp.float32) * scale
  p = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bksd->bkgtd", p, v)


@pytest.mark.parametrize("dtype,tol", [
    (jnp.float32, 1e-5),
    pytest.param(jnp.bfloat16, 3e-2, marks=pytest.mark.slow)])  # fast-suite time budget
def test_attention_gradient_rule_matches_autodiff_of_the_plain_formula(dtype, tol):
  # Row 0 has no valid key at all (every query fully masked: a uniform average, no gradient);
  # the others mix causal and padding masks, with G = 2 query heads per kv head.
  # (NumPy inputs: eager jax.random draws compiled for ~15 s on 2 cores.)
  b, k, g, t, s, d = 3, 2, 2, 5, 9, 8
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, k, g, t, d)), dtype)
  k_t = jnp.asarray(rng.standard_normal((b, k, d, s)), dtype)
  v = jnp.asarray(rng.standard_normal((b, k, s, d)), dtype)
  valid = rng.random((b, s)) < 0.7
  valid[0] = False
  valid[1:, 0] = True
  causal = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
  mask = jnp.asarray(causal[None, None, None] & valid[:, None, None, None, :])
  r = jnp.asarray(rng.standard_normal((b, k, g, t, d)), jnp.float32)
  scale = d ** -0.5
  loss = lambda f: lambda *a: jnp.sum(f(*a, mask, scale).astype(jnp.float32) * r)
  outs = [jax.jit(f, static_argnums=4)(q, k_t, v, mask, scale)
          for f in (attention, _plain_attention)]
  np.testing.assert_allclose(*(np.asarray(o, np.float32) for o in outs), atol=tol, rtol=tol)
  got = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k_t, v)
  want = jax.jit(jax.grad(loss(_plain_attention), argnums=(0, 1, 2)))(q, k_t, v)
  for name, a, w in zip(("q", "k_t", "v"), got, want):
    assert a.dtype == dtype, name
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(a, np.float32), w, atol=tol * np.abs(w).max(),
                               err_msg=name)
  # The fully masked row's queries get no gradient; its keys and values none either.
  assert not np.any(np.asarray(got[0][0], np.float32)) and not np.any(np.asarray(got[1][0], np.float32))


@pytest.mark.parametrize("scan_layers", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["unrolled", "scan"])
def test_grouped_forward_equals_running_every_row_as_one_sequence(scan_layers):
  # 2 left-padded prompts, 3 continuations each, with invalid tokens in the middle and at the
  # end of some continuations: each continuation's hidden states are those of its prompt and
  # itself run as one sequence, at every valid position; the prompts their own.
  cfg = tiny_model_config(scan_layers=scan_layers, qkv_bias=True)
  graphdef, params = init_model(cfg, seed=0)
  model = nnx.merge(graphdef, _randomise_biases(params, 1))
  prompts = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], np.int32)
  prompt_valid = prompts > 0
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, (6, 4)).astype(np.int32)
  valid = np.ones((6, 4), bool)
  valid[1, 2:] = False
  valid[4, 1] = False
  p_hidden, hidden = jax.jit(model.grouped_forward)(prompts, prompt_valid, tokens, valid)
  assert p_hidden.shape == (2, 5, cfg.d_model) and hidden.shape == (6, 4, cfg.d_model)
  rows = np.repeat(np.arange(2), 3)
  seq = np.concatenate([prompts[rows], tokens], axis=1)
  seq_valid = np.concatenate([prompt_valid[rows], valid], axis=1)
  ref, _ = jax.jit(lambda a, b, c: model(a, b, c))(seq, left_positions(seq_valid), seq_valid)
  ref_p, ref_c = np.asarray(ref[:, :5]), np.asarray(ref[:, 5:])
  np.testing.assert_allclose(np.asarray(hidden)[valid], ref_c[valid], atol=2e-5, rtol=2e-5)
  for r in range(6):
    np.testing.assert_allclose(np.asarray(p_hidden[rows[r]])[prompt_valid[rows[r]]],
                               ref_p[r][prompt_valid[rows[r]]], atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="not a multiple of 4 prompts"):
    model.grouped_forward(np.ones((4, 5), np.int32), np.ones((4, 5), bool), tokens, valid)
