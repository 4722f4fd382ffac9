"""The Pallas TPU kernels compiled by the real TPU compiler (Mosaic), for v5e, v5p and v6e, on a
machine without a TPU: flash attention forward and backward, ragged decode attention, the fused
log-prob's value and gradient, at Qwen2.5-0.5B and Qwen2.5-7B shapes.

Each program is traced inside `platform.building_for(<the target's devices>)`, so the kernels
take their compiled (not interpreted) path, and compiled for a single device of a deviceless
topology (`jax.experimental.topologies`). A case passes when Mosaic accepts every kernel (block
shapes, ops, dtypes, VMEM), the compiled HLO holds one `tpu_custom_call` per kernel (an
interpreted kernel would leave none), and the program's temporary HBM stays below a bound that
a non-blockwise implementation would break.

Needs libtpu (the `tpu` extra); skipped without it.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (the tpu extra)")

# Set before libtpu initialises (the first topology below). No metadata server to ask on a
# machine that is not a TPU VM; and another process (an xdist worker, another compile) may hold
# libtpu's lockfile, which only guards the chips this compile never touches.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl.core import platform  # noqa: E402
from jaxrl.kernels.attention.api import attention  # noqa: E402
from jaxrl.kernels.decode_attention.api import decode_attention  # noqa: E402
from jaxrl.kernels.fused_logprob.api import fused_logprob  # noqa: E402

pytestmark = pytest.mark.aot

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MODELS = {
    "qwen2.5-0.5b": dict(d_model=896, heads=14, kv_heads=2, head_dim=64, vocab=151936,
                         cache=768),
    "qwen2.5-7b": dict(d_model=3584, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                       cache=1536),
}
CASES = [pytest.param(gen, model, id=f"{gen}-{model}") for model in MODELS
         for gen in TOPOLOGIES]
MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_cache():
  """conftest's persistent compilation cache off here: a deviceless TPU executable is written to
  it but cannot be read back (no TPU client to load it), only warned about."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", before)


@functools.cache
def _devices(gen: str):
  from jax.experimental import topologies
  return topologies.get_topology_desc(topology_name=TOPOLOGIES[gen], platform="tpu").devices


def _compile(gen: str, fn, *shapes):
  """`(compiled, HLO text)` of `jit(fn)` for one device of `gen`; `shapes` are
  `(shape, dtype)` pairs of the arguments."""
  devices = _devices(gen)
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
  with platform.building_for(devices):
    assert platform.current() == "tpu"
    lowered = jax.jit(fn).lower(*args)
  compiled = lowered.compile()
  return compiled, compiled.as_text()


def _assert_kernels(hlo: str, names: tuple[str, ...]):
  """One Mosaic custom call per kernel, each under its `pallas_call` name."""
  assert hlo.count('custom_call_target="tpu_custom_call"') == len(names), names
  for name in names:
    assert name in hlo, name


@pytest.mark.parametrize("layout", [(1, 8192), (8, 768)], ids=["packed-1x8192", "batch-8x768"])
@pytest.mark.parametrize("gen, model", CASES)
def test_flash_attention_value_and_grad_compiles(gen, model, layout):
  m = MODELS[model]
  (b, t), h, kh, dh = layout, m["heads"], m["kv_heads"], m["head_dim"]

  def step(q, k, v, segment, position):
    def loss(q, k, v):
      out = attention(q, k, v, segment, position, segment, position,
                      implementation="pallas_tpu")
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

  bf16 = jnp.bfloat16
  compiled, hlo = _compile(gen, step, ((b, t, h, dh), bf16), ((b, t, kh, dh), bf16),
                           ((b, t, kh, dh), bf16), ((b, t), jnp.int32), ((b, t), jnp.int32))
  _assert_kernels(hlo, ("attention_fwd", "attention_dq", "attention_dkv"))
  temp = compiled.memory_analysis().temp_size_in_bytes
  # Nothing quadratic: one float32 score matrix [B, H, T, S] is 3.5 GiB (0.5B) / 7 GiB (7B)
  # packed. What the kernels' wrapper does hold is linear in the tokens: the per-query `[.., T,
  # 1]` columns a TPU pads to 128 lanes (512 bytes each): 2 token integers in each pass, and the
  # backward's m, l, delta per head; and the heads-major, padded copies of q, k, v, do, out and
  # the cotangents, at most 8 times q + k + v. Measured: 87-400 MiB, 0.4-0.7 of this bound.
  qkv_bytes = b * t * (h + 2 * kh) * dh * 2
  bound = min(b * h * t * t * 4, b * t * (4 + 3 * h) * 512 + 8 * qkv_bytes)
  assert 0 < temp < bound, (temp / MiB, bound / MiB)


@pytest.mark.parametrize("gen, model", CASES)
def test_decode_attention_compiles(gen, model):
  m = MODELS[model]
  b, kh, dh, s = 64, m["kv_heads"], m["head_dim"], m["cache"]
  g = m["heads"] // kh

  def step(q, k_t, v, valid, lengths):
    return decode_attention(q, k_t, v, valid, lengths, implementation="pallas_tpu")

  bf16 = jnp.bfloat16
  compiled, hlo = _compile(gen, step, ((b, kh, g, dh), bf16), ((b, kh, dh, s), bf16),
                           ((b, kh, s, dh), bf16), ((b, s), jnp.bool_), ((b,), jnp.int32))
  _assert_kernels(hlo, ("decode_attention_tpu",))
  # At most one copy of the cache, never a padded one (a block that does not divide S pads k_t
  # and v on every call: 768 slots with 512-slot blocks measured 56 MiB on v5p at 0.5B, 2.3x the
  # 24 MiB cache). The one copy: v5p keeps v's Dh = 64 minor dim transposed in HBM, so at 0.5B
  # XLA relayouts v (12 MiB) and stages k_t (12 MiB) ahead of the kernel: 24.5 MiB measured;
  # 0 on v5e and v6e. The 2 MiB: q, the slot flags as int32 rows.
  cache_bytes = 2 * b * kh * s * dh * 2
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < cache_bytes + 2 * MiB, (temp / MiB, cache_bytes / MiB)


@pytest.mark.parametrize("gen, model", CASES)
def test_fused_logprob_value_and_grad_compiles(gen, model):
  m = MODELS[model]
  n, d, v = 8192, m["d_model"], m["vocab"]

  def step(hidden, unembedding, targets):
    def loss(hidden, unembedding):
      return jnp.sum(fused_logprob(hidden, unembedding, targets, impl="pallas").logp)
    return jax.value_and_grad(loss, (0, 1))(hidden, unembedding)

  compiled, hlo = _compile(gen, step, ((n, d), jnp.bfloat16), ((d, v), jnp.bfloat16),
                           ((n,), jnp.int32))
  _assert_kernels(hlo, ("fused_logprob_fwd", "fused_logprob_dh", "fused_logprob_dw"))
  # Never the [N, V] float32 logits (4.6 GiB at 0.5B, 4.6 GiB at 7B): what it holds is the f32
  # gradient of W ([D, V]: 0.5 GiB at 0.5B, 2 GiB at 7B) and its one-hot scatter's copy, and
  # [N, D] f32 tiles. Measured: 1.0 GiB (0.5B), 4.2 GiB (7B).
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert 0 < temp < n * v * 4, (temp / MiB, n * v * 4 / MiB)
