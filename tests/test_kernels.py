"""Fused log-prob kernel: `xla` and `pallas` (interpret mode) against the dense `reference`.

Shapes are small and ragged on purpose: V = 1000 with chunks of 128 leaves a last chunk of
1000 - 7 * 128 = 104 columns, so a kernel that reads past V, or counts the overlap of the last
chunk twice, is off by the mass of those columns.

Relative errors are normwise, `max|a - b| / max|b|`: elementwise relative error is meaningless
where a gradient entry or a KL value is ~0.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxrl.kernels import FusedLogprob, default_impl, fused_logprob, pallas_unavailable
from jaxrl.kernels.fused_logprob import pallas_gpu
from jaxrl.kernels.fused_logprob import reference as reference_impl
from jaxrl.kernels.fused_logprob.api import pallas_fused_logprob
from jaxrl.kernels.fused_logprob.common import effective_temperature
from jaxrl.losses.kl import KL_ESTIMATORS
from jaxrl.models.logprobs import token_logprobs

N, D, V, CHUNK = 37, 16, 1000, 128
IMPLS = ("xla", "pallas")


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def make_inputs(n=N, d=D, v=V, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  h = jax.random.normal(k[0], (n, d)).astype(dtype)
  w = (jax.random.normal(k[1], (d, v)) * 0.7).astype(dtype)
  targets = jax.random.randint(k[2], (n,), 0, v)
  temperature = jax.random.uniform(k[3], (n,), minval=0.5, maxval=1.5)
  rollout = jax.random.normal(k[4], (n,)) - np.log(v)
  mask = jax.random.uniform(k[5], (n,)) > 0.3
  weights = jax.random.normal(k[6], (3 + len(KL_ESTIMATORS), n))  # random cotangents
  return h, w, targets, temperature, rollout, mask, weights


def loss_and_outputs(impl, h, w, targets, temperature, rollout, mask, weights):
  """A loss touching every output (weighted logp, entropy and k3 rollout KL), plus, as aux,
  every estimator's rollout KL (forward only: the gradient through any estimator reaches the
  kernel as the cotangent of logp, which the k3 term already exercises)."""
  call = functools.partial(fused_logprob, h, w, targets, temperature=temperature,
                           rollout_logprobs=rollout, mask=mask, with_entropy=True, impl=impl,
                           chunk_size=CHUNK)
  o = call(estimator="k3")
  total = (jnp.sum(weights[0] * jnp.where(mask, o.logp, 0.0))
           + jnp.sum(weights[1] * jnp.where(mask, o.entropy, 0.0))
           + jnp.sum(weights[2] * o.rollout_kl))
  outs = {"logp": o.logp, "entropy": o.entropy}
  for est in KL_ESTIMATORS:
    outs[est] = jax.lax.stop_gradient(call(estimator=est).rollout_kl)
  return total, outs


@functools.lru_cache(maxsize=None)
def grad_fn(impl):
  """value_and_grad w.r.t. (hidden, unembedding), jitted once per impl (compiles dominate)."""
  return jax.jit(jax.value_and_grad(functools.partial(loss_and_outputs, impl), argnums=(0, 1),
                                    has_aux=True))


def test_reference_is_token_logprobs_and_its_goldens():
  h, w, targets, temperature, *_ = make_inputs()
  # Per-token T with two greedy rows (T <= 0 scores at T = 1, as in scale_logits).
  temperature = temperature.at[:2].set(jnp.array([0.0, -1.0]))
  ref = jax.jit(functools.partial(fused_logprob, with_entropy=True, impl="reference"))
  o = ref(h, w, targets, temperature=temperature)
  np.testing.assert_allclose(o.logp, token_logprobs(h @ w, targets, temperature), rtol=1e-6)
  assert o.rollout_kl is None
  # Zero hidden states give uniform logits: logp = -log V = -6.9077554 and H = log V for every
  # token; an off-by-one vocabulary (e.g. V - 1 columns) would give -6.9067548.
  o = ref(jnp.zeros_like(h), w, targets, temperature=temperature)
  np.testing.assert_allclose(o.logp, -np.log(V) * np.ones(N), rtol=1e-6)
  np.testing.assert_allclose(o.entropy, np.log(V) * np.ones(N), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_values_and_grads_match_reference(impl):
  args = make_inputs()
  (ref_loss, ref), ref_g = grad_fn("reference")(*args)
  (loss, out), g = grad_fn(impl)(*args)
  for name in ("logp", "entropy") + KL_ESTIMATORS:
    assert rel_err(out[name], ref[name]) < 1e-5, name
  assert rel_err(loss, ref_loss) < 1e-5
  for gi, ri, name in zip(g, ref_g, ("hidden", "unembedding")):
    assert np.all(np.isfinite(gi)), name
    assert rel_err(gi, ri) < 1e-5, name
  mask = np.asarray(args[5])
  for est in KL_ESTIMATORS:  # masked tokens: KL exactly 0
    assert np.all(np.asarray(out[est])[~mask] == 0.0)
  # The masked rows contribute nothing to the loss, so their hidden gradient is exactly 0...
  assert np.all(np.asarray(g[0])[~mask] == 0.0)
  # ...while kept rows carry real gradient (so the comparison above was not of zeros).
  assert np.abs(np.asarray(g[0])[mask]).max() > 1e-3


def test_xla_one_chunk_vocabulary_matches_reference():
  # V <= chunk: the xla kernel has no loop and reads the target logit (and puts its gradient)
  # through a one-hot mask instead of a gather / scatter-add. Values and gradients as the dense
  # reference, a padding target (-1) and one past V included (both pick 0 and get no one-hot
  # gradient).
  h, w, targets, temperature, rollout, mask, weights = make_inputs(v=16)
  targets = targets.at[0].set(-1).at[1].set(16)
  args = (h, w, targets, temperature, rollout, mask, weights)

  def run(impl):
    def loss(hh, ww):
      o = fused_logprob(hh, ww, targets, temperature=temperature, with_entropy=True, impl=impl,
                        chunk_size=64)
      return jnp.sum(weights[0] * o.logp) + jnp.sum(weights[1] * o.entropy), o
    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(*args[:2])

  (ref_loss, ref), ref_g = run("reference")
  (loss, out), g = run("xla")
  assert rel_err(out.logp, ref.logp) < 1e-6 and rel_err(out.entropy, ref.entropy) < 1e-6
  assert rel_err(loss, ref_loss) < 1e-6
  for gi, ri in zip(g, ref_g):
    assert rel_err(gi, ri) < 1e-5
  # The out-of-range targets: logp = 0 - lse, i.e. minus the row's logsumexp.
  z = np.asarray(h @ w, np.float64) / np.asarray(temperature)[:, None]
  lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
  np.testing.assert_allclose(np.asarray(out.logp)[:2], -lse[:2], rtol=1e-5)
  # And the lowered value+grad has no scatter (the one-hot path is the one that ran).
  hlo = jax.jit(jax.grad(lambda hh, ww: fused_logprob(hh, ww, targets, impl="xla",
                                                      chunk_size=64).logp.sum(), (0, 1))
                ).lower(h, w).as_text()
  assert "scatter" not in hlo and "gather" not in hlo


@pytest.mark.parametrize("impl", IMPLS)
def test_scalar_temperature_and_greedy(impl):
  h, w, targets, *_ = make_inputs()

  @functools.partial(jax.jit, static_argnums=0)
  def run(impl):
    hot = fused_logprob(h, w, targets, temperature=0.7, with_entropy=True, impl=impl,
                        chunk_size=CHUNK)
    greedy = fused_logprob(h, w, targets, temperature=0.0, impl=impl, chunk_size=CHUNK)
    return hot.logp, hot.entropy, greedy.logp

  ref, out = run("reference"), run(impl)
  assert all(rel_err(a, b) < 1e-5 for a, b in zip(out, ref))
  # Greedy (T = 0) scores at T = 1, i.e. token_logprobs at T = 1; dividing by 0 would give NaN
  # and reusing T = 0.7 would move logp by ~40%.
  assert rel_err(out[2], token_logprobs(h @ w, targets, 1.0)) < 1e-5
  assert rel_err(out[2], out[0]) > 1e-2


@pytest.mark.slow
def test_pallas_multiple_token_blocks():
  # block_n = 16 over N = 37: three token blocks, the last padded with 11 zero rows, times
  # eight vocabulary blocks; called below the API to pick the token block.
  h, w, targets, temperature, _, _, weights = make_inputs()
  t = effective_temperature(temperature, N)

  def loss(fn, hh, ww):
    logp, entropy = fn(hh, ww, targets, t, with_entropy=True, chunk_size=CHUNK)
    return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy)

  ref_v, ref_g = jax.value_and_grad(functools.partial(loss, reference_impl.fused_logprob),
                                    (0, 1))(h, w)
  blocked = functools.partial(pallas_fused_logprob, block_n=16)
  v, g = jax.jit(jax.value_and_grad(functools.partial(loss, blocked), (0, 1)))(h, w)
  assert rel_err(v, ref_v) < 1e-5
  assert rel_err(g[0], ref_g[0]) < 1e-5 and rel_err(g[1], ref_g[1]) < 1e-5


@pytest.mark.parametrize("n,d,v,tiles,dtype", [
    # The API's tiles: bn = 64 over N = 37 (27 pad rows), bv = 128 over V = 1000 (8 blocks, the
    # last 104 wide), one K step of bd = 16; 8 forward slices of one block each, and the whole
    # vocabulary in one backward slice.
    (N, D, V, dict(chunk_size=CHUNK), jnp.float32),
    # D = 24 padded to one K step of 32; V = 14 below the 16-column block.
    (21, 24, 14, {}, jnp.float32),
    # Ragged everything, several blocks of each loop: N = 37 in 3 token blocks of 16, D = 72 in
    # 5 K steps of 16 (the last 8 wide), V = 300 in 5 blocks of 64 (the last 44 wide); the
    # forward walks them in 2 slices (3 + 2 blocks), the backward in 3 slices of 128 columns
    # starting at 0, 128 and 192 (the last re-covers 64 columns, which it must mask).
    (37, 72, 300, dict(chunk_size=64, block_n=16, block_d=16, splits=2, slice_v=128),
     jnp.float32),
    # bf16 tiles: D = 40 in 3 K steps of 16, V = 300 in 5 blocks of 64; 3 forward slices
    # (2 + 2 + 1 blocks), 2 backward slices of 192 columns (at 0 and 128).
    (40, 40, 300, dict(chunk_size=64, block_d=16, splits=3, slice_v=192), jnp.bfloat16),
])
def test_pallas_gpu_layout(n, d, v, tiles, dtype):
  # The Triton-shaped kernels (K loop over D, the forward's vocabulary loop cut into slices that
  # run as separate programs, the backward's dl written a vocabulary slice at a time), run by
  # the interpreter: the same numbers as the dense reference. A K loop that dropped its last,
  # partial step would miss 8 of the 72 hidden units in every logit; a forward merge that
  # skipped a slice would drop 2 of 5 vocabulary blocks from lse; a last backward slice that
  # did not mask its re-covered columns would count their gradient twice.
  h, w, targets, temperature, _, _, weights = make_inputs(n, d, v, dtype)
  h = (h * np.sqrt(D / d)).astype(dtype)  # logits of the same size as at D = 16
  t = effective_temperature(temperature, n)

  def loss(fn, hh, ww):
    logp, entropy = fn(hh, ww, targets, t, with_entropy=True)
    return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy), (logp, entropy)

  grad = lambda fn: jax.jit(jax.value_and_grad(functools.partial(loss, fn), (0, 1),  # noqa: E731
                                               has_aux=True))
  (_, ref), ref_g = grad(reference_impl.fused_logprob)(h, w)
  gpu = functools.partial(pallas_gpu.fused_logprob, interpret=True, **tiles)
  (_, out), g = grad(gpu)(h, w)
  tol, gtol = (1e-5, 1e-5) if dtype == jnp.float32 else (1e-5, 2e-2)
  assert rel_err(out[0], ref[0]) < tol and rel_err(out[1], ref[1]) < tol
  assert rel_err(g[0], ref_g[0]) < gtol and rel_err(g[1], ref_g[1]) < gtol
  assert g[0].dtype == dtype and g[1].dtype == dtype


def test_pallas_gpu_layout_is_the_api_gpu_layout():
  # `pallas_fused_logprob(layout="gpu")` is this module's kernel with its default tiles.
  h, w, targets, temperature, *_ = make_inputs()
  t = effective_temperature(temperature, N)
  a = pallas_fused_logprob(h, w, targets, t, with_entropy=True, chunk_size=CHUNK, layout="gpu",
                           interpret=True)
  b = pallas_gpu.fused_logprob(h, w, targets, t, with_entropy=True, chunk_size=CHUNK,
                               interpret=True)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])


def test_pallas_gpu_tiles():
  # Qwen2.5-0.5B in bf16 (the benchmark's shape): 128 x 128 logits tiles, K steps of 64
  # (64 x 2 bytes = 128 bytes of a row per step), and no padding copy: D = 896 = 14 x 64,
  # V = 151936 = 1187 x 128, N = 8192 = 64 x 128. The backward's dl slice is 256 MiB:
  # 2**28 / (8192 x 2 bytes) = 16384 columns. In f32 the K step halves to 32 (the same bytes of
  # shared memory per pipeline stage) and so does the slice.
  assert pallas_gpu.plan_tiles(8192, 896, 151936, 2) == (128, 128, 64, None, 16384)
  assert pallas_gpu.plan_tiles(8192, 896, 151936, 4) == (128, 128, 32, None, 8192)
  # Its grids: 64 token blocks are too few programs for 132 SMs, so the forward cuts the 1187
  # vocabulary blocks into 16 slices of 75 (1024 programs); the backward runs 10 slices of
  # 128 blocks (the last one starting early), 64 x 128 = 8192 programs each.
  tiles = pallas_gpu.plan_tiles(8192, 896, 151936, 2)
  assert pallas_gpu.plan_grids(8192, 896, 151936, tiles) == ((64, 16), 75, (64, 128), 10)
  # Tiles shrink to a small input (never below Triton's 16) and round down to powers of two; a
  # vocabulary block meant for `xla` (1024) is capped at 256 (a [128, 1024] f32 tile would be
  # 512 registers per thread).
  assert pallas_gpu.plan_tiles(21, 24, 14, 4) == (32, 16, 32, None, 16)
  assert pallas_gpu.plan_tiles(5, 8, 8, 2) == (16, 16, 16, None, 16)
  assert pallas_gpu.plan_tiles(8192, 896, 151936, 2, block_n=100, block_v=1024,
                               block_d=96) == (64, 256, 64, None, 16384)
  # `splits` and `slice_v` given (the test above's third case): the forward's 5 vocabulary
  # blocks in 2 slices of up to 3, the backward's 320 padded columns in 3 slices of 128.
  tiles = pallas_gpu.plan_tiles(37, 72, 300, 4, 16, 64, 16, splits=2, slice_v=100)
  assert tiles.slice_v == 128  # rounded up to whole blocks of 64
  assert pallas_gpu.plan_grids(37, 72, 300, tiles) == ((3, 2), 3, (3, 2), 3)


def test_pallas_gpu_layout_lowers_to_triton():
  # Lowering (not compiling) for CUDA runs on any machine: the Pallas-to-Triton lowering accepts
  # the kernels only if every tile is a power of two and every op has a Triton rule (the loops
  # with per-program bounds included). The benchmark's shape (bf16 and f32), the default
  # model's (D = 64, V = 14), and a D = 2048 in f32 that the previous whole-D tiles could not
  # hold in shared memory (they ran `xla` instead); value and gradient.
  def lowered(n, d, v, dtype):
    def loss(h, w, targets, t):
      logp, entropy = pallas_fused_logprob(h, w, targets, t, with_entropy=True,
                                           layout="gpu", interpret=False)
      return jnp.sum(logp) + jnp.sum(entropy)

    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in
            (((n, d), dtype), ((d, v), dtype), ((n,), jnp.int32), ((n,), jnp.float32))]
    exported = jax.export.export(
        jax.jit(jax.value_and_grad(loss, (0, 1))), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    return exported.mlir_module()

  for n, d, v, dtype in ((8192, 896, 151936, jnp.bfloat16), (8192, 896, 151936, jnp.float32),
                         (640, 64, 14, jnp.float32), (64, 2048, 1000, jnp.float32)):
    text = lowered(n, d, v, dtype)
    for name in ("fused_logprob_fwd_gpu", "fused_logprob_dl_gpu"):
      assert f'name = "{name}"' in text, name


@pytest.mark.slow
def test_pallas_gpu_layout_wide_hidden():
  # D = 2048 in f32: 64 K steps of 32. The kernel's tiles do not grow with D, so it runs the
  # kernel itself (no fallback, no warning) and matches the reference.
  h, w, targets, temperature, *_ = make_inputs(n=8, d=2048, v=64)
  h = h / np.sqrt(2048)  # logits of order 1, as in a model (entropy is not cancellation-bound)
  t = effective_temperature(temperature, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    logp, entropy = pallas_gpu.fused_logprob(h, w, targets, t, with_entropy=True,
                                             interpret=True)
  ref_logp, ref_entropy = reference_impl.fused_logprob(h, w, targets, t, with_entropy=True)
  assert rel_err(logp, ref_logp) < 1e-5 and rel_err(entropy, ref_entropy) < 1e-5


def test_pallas_layout_is_checked():
  h, w, targets, temperature, _, _, _ = make_inputs()
  with pytest.raises(ValueError, match="unknown pallas fused_logprob layout 'cuda'"):
    pallas_fused_logprob(h, w, targets, effective_temperature(temperature, N),
                         layout="cuda", interpret=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs(impl):
  # bf16 matmuls (f32 accumulation) in every impl; the backward rounds dl to bf16 before its
  # matmuls and the gradients come back in bf16 (8 mantissa bits, ~4e-3 relative), so they
  # agree to a few bf16 ulps while the f32 values agree much more closely.
  args = make_inputs(dtype=jnp.bfloat16)
  (_, ref), ref_g = grad_fn("reference")(*args)
  (_, out), g = grad_fn(impl)(*args)
  assert out["logp"].dtype == jnp.float32
  assert rel_err(out["logp"], ref["logp"]) < 1e-4
  assert rel_err(out["entropy"], ref["entropy"]) < 1e-4
  assert g[0].dtype == jnp.bfloat16 and g[1].dtype == jnp.bfloat16
  assert rel_err(g[0], ref_g[0]) < 2e-2 and rel_err(g[1], ref_g[1]) < 2e-2


@functools.lru_cache(maxsize=None)
def vmapped_fn(impl):
  """Batched values and the gradient w.r.t. the shared unembedding, over hidden [B, N, D]."""
  def per_example(h, w, targets, temperature, rollout, mask):
    o = fused_logprob(h, w, targets, temperature=temperature, rollout_logprobs=rollout,
                      mask=mask, with_entropy=True, impl=impl, chunk_size=CHUNK)
    return o.logp, o.entropy, o.rollout_kl

  def loss(w, hb, *rest):
    logp, ent, kl = jax.vmap(per_example, in_axes=(0, None, 0, None, None, None))(hb, w, *rest)
    return jnp.sum(logp) + jnp.sum(ent) + jnp.sum(kl), (logp, ent, kl)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_a_batch_axis(impl):
  # [B=2, N, D] hidden states and [B, N] targets against one shared unembedding; the
  # unembedding gradient sums the per-example gradients. Example 1 differs from example 0
  # (negated hidden states, shifted targets), so a batching rule that mixed examples shows.
  h, w, targets, temperature, rollout, mask, _ = make_inputs(n=12)
  hb, tb = jnp.stack([h, -h]), jnp.stack([targets, (targets + 7) % V])
  (v_ref, outs_ref), g_ref = vmapped_fn("reference")(w, hb, tb, temperature, rollout, mask)
  (v, outs), g = vmapped_fn(impl)(w, hb, tb, temperature, rollout, mask)
  assert outs[0].shape == (2, 12)
  assert rel_err(v, v_ref) < 1e-5 and rel_err(g, g_ref) < 1e-5
  for a, b in zip(outs, outs_ref):
    assert rel_err(a, b) < 1e-5
  assert rel_err(outs[0][1], outs[0][0]) > 1e-2  # the two examples really differ


@functools.lru_cache(maxsize=None)
def token_sharded_fn(impl, mesh=None):
  """value_and_grad of a weighted logp + k3 KL loss; a shard_map over tokens when `mesh`."""
  def local(h, w, targets, temperature, rollout, mask):
    o = fused_logprob(h, w, targets, temperature=temperature, rollout_logprobs=rollout,
                      mask=mask, estimator="k3", impl=impl, chunk_size=CHUNK)
    return o.logp, o.rollout_kl

  if mesh is not None:
    tok = P("d")
    local = jax.shard_map(local, mesh=mesh, in_specs=(tok, P(), tok, tok, tok, tok),
                          out_specs=(tok, tok))

  def loss(h, w, targets, temperature, rollout, mask, weights):
    logp, kl = local(h, w, targets, temperature, rollout, mask)
    total = jnp.sum(weights[0] * jnp.where(mask, logp, 0.0)) + jnp.sum(weights[1] * kl)
    return total, logp

  return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_shard_map_over_tokens(devices, impl):
  # N = 64 tokens, 8 per device; unembedding replicated. Values and gradients equal the
  # unsharded result (the unembedding gradient is the sum of the 8 shards' contributions; a
  # missing reduction would give roughly 1/8 of it).
  args = make_inputs(n=64)
  mesh = Mesh(np.asarray(devices), ("d",))
  (v_s, logp_s), g_s = token_sharded_fn(impl, mesh)(*args)
  (v_u, logp_u), g_u = token_sharded_fn("reference")(*args)
  assert len(logp_s.sharding.device_set) == 8
  assert rel_err(v_s, v_u) < 1e-5 and rel_err(logp_s, logp_u) < 1e-5
  assert rel_err(g_s[0], g_u[0]) < 1e-5 and rel_err(g_s[1], g_u[1]) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_nan_rollout_logprobs_and_padding_rows(impl):
  # Masked rows carry NaN / +-inf rollout log-probs, a padding target -1 and zero hidden
  # states. Without the where() sanitising, k3's exp(NaN) and d**2 at inf put NaN into the KL
  # and, through the shared unembedding, into every gradient. The estimator only matters
  # outside the kernel, so the (slower to compile) pallas run checks k3 alone.
  estimators = KL_ESTIMATORS if impl == "xla" else ("k3",)
  h, w, targets, _, rollout, mask, weights = make_inputs()
  bad = jnp.array([np.nan, np.inf, -np.inf])[jnp.arange(N) % 3]
  rollout_bad = jnp.where(mask, rollout, bad)
  h = jnp.where(mask[:, None], h, 0.0)
  targets = jnp.where(mask, targets, -1)

  @jax.jit
  def run(ro, hh, ww):
    def loss(hh, ww):
      total = 0.0
      for e_i, est in enumerate(estimators):
        o = fused_logprob(hh, ww, targets, rollout_logprobs=ro, mask=mask, estimator=est,
                          with_entropy=True, impl=impl, chunk_size=CHUNK)
        total += jnp.sum(weights[e_i] * o.rollout_kl)
      return total + jnp.sum(jnp.where(mask, o.entropy, 0.0)), o
    return jax.value_and_grad(loss, (0, 1), has_aux=True)(hh, ww)

  (v_bad, o), g_bad = run(rollout_bad, h, w)
  (v_ok, _), g_ok = run(jnp.where(mask, rollout, 0.0), h, w)
  assert np.isfinite(v_bad) and v_bad == v_ok
  assert np.all(np.isfinite(o.logp)) and np.all(np.isfinite(o.entropy))
  assert np.all(np.asarray(o.rollout_kl)[~np.asarray(mask)] == 0.0)
  for gb, go in zip(g_bad, g_ok):
    assert np.all(np.isfinite(gb))
    np.testing.assert_array_equal(gb, go)
  assert np.all(np.asarray(g_bad[0])[~np.asarray(mask)] == 0.0)


def test_xla_never_materialises_logits():
  # Compile only. N * V * 4 = 2048 * 50000 * 4 = 410 MB of f32 logits; the chunked value+grad
  # keeps ~2 [N, chunk] buffers (2 * 8 MB at the default 1024) plus dh. The dense reference's
  # temp holds at least one full [N, V] buffer, which is what the bound would catch.
  n, d, v = 2048, 64, 50000
  spec = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))

  def temp(impl):
    def loss(h, w, tg, ro):
      o = fused_logprob(h, w, tg, rollout_logprobs=ro, with_entropy=True, impl=impl)
      return jnp.sum(o.logp) + jnp.sum(o.entropy) + jnp.sum(o.rollout_kl)
    f = jax.jit(jax.value_and_grad(loss, (0, 1)))
    return f.lower(*spec).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = n * v * 4
  assert temp("reference") >= logits_bytes
  assert temp("xla") < logits_bytes / 8


def test_api_defaults_and_errors():
  h, w, targets, *_ = make_inputs(n=4)
  assert default_impl() == "xla"  # CPU
  o = fused_logprob(h, w, targets)
  assert isinstance(o, FusedLogprob) and o.logp.shape == (4,) and o.logp.dtype == jnp.float32
  assert o.entropy is None and o.rollout_kl is None
  with pytest.raises(ValueError, match="impl"):
    fused_logprob(h, w, targets, impl="cuda")
  with pytest.raises(ValueError, match="estimator"):
    fused_logprob(h, w, targets, rollout_logprobs=jnp.zeros(4), estimator="k4")
  with pytest.raises(ValueError, match="targets"):
    fused_logprob(h, w, targets[:3])


def test_pallas_falls_back_to_xla_where_it_does_not_lower():
  # CPU has no compiled Pallas backend: asking for the compiled kernels (interpret=False) is the
  # case of a GPU/TPU where they fail to lower. The call runs `xla` (same numbers) and says so
  # once, also when the request comes from inside a jitted function.
  reason = pallas_unavailable("cpu")
  assert reason is not None and "cpu" in reason
  h, w, targets, temperature, *_ = make_inputs(n=8)
  want = fused_logprob(h, w, targets, temperature=temperature, impl="xla", chunk_size=CHUNK)
  with pytest.warns(RuntimeWarning, match="pallas fused_logprob kernels do not lower on cpu"):
    got = jax.jit(lambda h: fused_logprob(h, w, targets, temperature=temperature, impl="pallas",
                                          chunk_size=CHUNK, interpret=False).logp)(h)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want.logp))
  # Interpret mode is not a fallback case: it runs the Pallas kernels themselves.
  interp = fused_logprob(h, w, targets, temperature=temperature, impl="pallas",
                         chunk_size=CHUNK, interpret=True)
  assert rel_err(interp.logp, want.logp) < 1e-5
