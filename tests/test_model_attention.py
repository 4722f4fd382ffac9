"""`model.attention`: the blockwise kernel ("xla") in the model's forward passes without a KV
cache gives the dense path's logits and gradients; "auto" is the dense path on CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_config
from jaxrl.models import abstract_model, init_model
from jaxrl.models.logprobs import left_positions
from jaxrl.models.model_config import resolve_attention

TOL = 1e-5


def _model_pair(**overrides):
  """(graphdefs by attention choice, shared params) of a tiny model with sharp attention (a
  larger init scale, so a wrong mask moves the logits well past the tolerance)."""
  cfg = tiny_model_config(init_std=0.3, qkv_bias=True, **overrides)
  graphdef, params = init_model(cfg, seed=0)
  # Non-zero biases: zero ones would hide a bias applied in the wrong place.
  rng = np.random.default_rng(1)
  params = jax.tree.map(
      lambda x: (np.asarray(x) + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype), params)
  # The config is static in the graphdef: the same params under each choice.
  graphdefs = {a: abstract_model(dataclasses.replace(cfg, attention=a))[0]
               for a in ("dense", "xla", "auto")}
  return graphdefs, params


def _batch(vocab):
  # Row 0 left-padded by 3, row 1 full, row 2 left- and right-padded.
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, vocab, (3, 9)).astype(np.int32)
  valid = np.ones((3, 9), bool)
  valid[0, :3] = False
  valid[2, :2] = False
  valid[2, 7:] = False
  return tokens, valid


def _loss_and_logits(graphdef, tokens, valid):
  """Masked next-token loss (targets: the row's next token) and its logits, as a function of
  the params."""
  def loss(params):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, left_positions(valid), valid)
    logits = model.logits(hidden)
    logp = jax.nn.log_softmax(logits[:, :-1])
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = valid[:, :-1] & valid[:, 1:]
    return -jnp.sum(jnp.where(mask, picked, 0.0)) / mask.sum(), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _assert_grads_close(got, want):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=TOL, rtol=TOL,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("overrides", [
    {"scan_layers": False}, pytest.param({"scan_layers": True}, marks=pytest.mark.slow),
    pytest.param({"scan_layers": True, "remat": "full"}, marks=pytest.mark.slow)],
    ids=["unrolled", "scan", "scan_remat_full"])  # slow: the fast suite's budget (2026-12-07)
def test_xla_attention_matches_dense_in_the_no_cache_forward(overrides):
  graphdefs, params = _model_pair(**overrides)
  tokens, valid = _batch(32)
  out = {a: _loss_and_logits(graphdefs[a], tokens, valid)(params) for a in ("dense", "xla")}
  (loss_d, logits_d), grads_d = out["dense"]
  (loss_x, logits_x), grads_x = out["xla"]
  assert np.ptp(np.asarray(logits_d)[valid]) > 0.5  # the logits move with the context
  np.testing.assert_allclose(np.asarray(logits_x)[valid], np.asarray(logits_d)[valid],
                             atol=TOL, rtol=TOL)
  np.testing.assert_allclose(loss_x, loss_d, atol=TOL, rtol=TOL)
  _assert_grads_close(grads_x, grads_d)


@pytest.mark.slow  # the fast suite's 10-minute budget (2026-12-07)
def test_xla_attention_matches_dense_in_grouped_forward():
  # As the train step calls it: 2 left-padded prompts, 3 continuations each, some with holes
  # and right padding; a loss over the real continuation tokens and the prompts' real tokens.
  graphdefs, params = _model_pair(scan_layers=False)
  prompts = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], np.int32)
  prompt_valid = prompts > 0
  tokens = np.random.default_rng(0).integers(1, 32, (6, 4)).astype(np.int32)
  valid = np.ones((6, 4), bool)
  valid[1, 2:] = False
  valid[4, 1] = False

  def run(graphdef):
    def loss(params):
      model = nnx.merge(graphdef, params)
      hp, hc = model.grouped_forward(prompts, prompt_valid, tokens, valid)
      lp, lc = model.logits(hp), model.logits(hc)
      # Mean log-probs of a fixed next token at the real positions (gradients of order 1).
      value = (jnp.mean(jnp.where(valid, jax.nn.log_softmax(lc)[..., 3], 0.0))
               + jnp.mean(jnp.where(prompt_valid, jax.nn.log_softmax(lp)[..., 7], 0.0)))
      return value, (hp, hc)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (loss_d, (hp_d, hc_d)), grads_d = run(graphdefs["dense"])
  (loss_x, (hp_x, hc_x)), grads_x = run(graphdefs["xla"])
  np.testing.assert_allclose(np.asarray(hc_x)[valid], np.asarray(hc_d)[valid], atol=TOL,
                             rtol=TOL)
  np.testing.assert_allclose(np.asarray(hp_x)[prompt_valid], np.asarray(hp_d)[prompt_valid],
                             atol=TOL, rtol=TOL)
  np.testing.assert_allclose(loss_x, loss_d, rtol=TOL)
  _assert_grads_close(grads_x, grads_d)


def test_auto_is_dense_on_cpu_and_xla_elsewhere():
  assert jax.default_backend() == "cpu"
  assert resolve_attention("auto", "cpu") == "dense"
  # Long rows on CPU go blockwise: a dense [rows, heads, T, T] score tensor grows with T^2.
  assert resolve_attention("auto", "cpu", length=1024) == "dense"
  assert resolve_attention("auto", "cpu", length=1025) == "xla"
  assert resolve_attention("dense", "cpu", length=4096) == "dense"
  assert resolve_attention("auto", "gpu") == resolve_attention("auto", "tpu") == "xla"
  assert resolve_attention("dense", "gpu") == "dense" and resolve_attention("xla", "cpu") == "xla"
  with pytest.raises(ValueError, match="flash"):
    resolve_attention("flash")
  with pytest.raises(ValueError, match="attention='flash'"):
    tiny_model_config(attention="flash")
  # The default's traced program is the dense one's, op for op (and not the kernel's).
  graphdefs, params = _model_pair(scan_layers=False)
  tokens, valid = _batch(32)
  jaxpr = {a: str(jax.make_jaxpr(
      lambda p, a=a: nnx.merge(graphdefs[a], p)(tokens, left_positions(valid), valid)[0])(
          params)) for a in ("auto", "dense", "xla")}
  assert jaxpr["auto"] == jaxpr["dense"] != jaxpr["xla"]
  assert tiny_model_config().attention == "auto"
