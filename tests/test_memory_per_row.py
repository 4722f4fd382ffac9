"""The train step's compiled temporaries grow linearly with the positions of a row.

Measured at the Qwen2.5-0.5B shape (24 layers, d 896, 14 heads, 2 kv heads, head_dim 64,
mlp 4864) with a 4,096 vocabulary, bf16 compute, f32 master weights, `remat=full`, the group's
prompt shared (8 samples per prompt) and the attention `auto` picks. The per-row cost is
`(temp(16 rows) - temp(8 rows)) / 8` of `memory_analysis().temp_size_in_bytes`: everything
that does not scale with rows (weights' f32 copies, Adam's update temporaries) cancels.

What a row must cost, if a layer keeps only its input: 24 layers x (Lp + N) positions x 896 x
(2 bytes bf16 + 4 bytes for CPU's f32 upcast of it) = 99 MB at 768 positions, plus one layer's
recomputed activations (the MLP's [positions, 4864] f32 products: ~15 MB each) and the
attention's key blocks. Measured on this CPU: 114 MB at 768 positions and 235 MB at 1,536
(2.07x). Before the blockwise attention kept its masks per block, the backward pass held every
key block's `[B, Hkv, G, T, c]` bool mask at once (1.06 GB at 8 rows x 1,536 positions): 164 and
440 MB a row, 2.68x. With dense attention's `[rows, heads, T, S]` scores the growth is ~4x.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrl.core.types import TrainBatch
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer
from jaxrl.models import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.parallel.sharding import make_mesh

pytestmark = pytest.mark.slow

# The compiled programs are never run: skip LLVM's optimisation (buffer assignment, all that
# memory_analysis() reports, happens before it).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _temp_bytes(step, init_state, params, rows: int, lp: int, n: int) -> int:
  S = jax.ShapeDtypeStruct
  batch = TrainBatch(prompt_tokens=S((rows, lp), jnp.int32), prompt_valid=S((rows, lp), bool),
                     tokens=S((rows, n), jnp.int32), mask=S((rows, n), bool),
                     rollout_logprobs=S((rows, n), jnp.float32), rewards=S((rows,), jnp.float32),
                     group_id=S((rows,), jnp.int32), temperature=S((rows,), jnp.float32))
  spec = lambda a, sharding: S(a.shape, a.dtype, sharding=sharding)
  state = jax.tree.map(spec, jax.eval_shape(init_state, params), step.state_shardings)
  batch = jax.tree.map(lambda a: spec(a, step.batch_sharding), batch)
  compiled = step.jitted.lower(state, batch).compile(FAST_COMPILE)
  return compiled.memory_analysis().temp_size_in_bytes


def test_per_row_temporaries_are_linear_in_positions(devices):
  cfg = ModelConfig(vocab_size=4096, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    head_dim=64, mlp_dim=4864, rope_theta=1e6, qkv_bias=True,
                    tie_embeddings=True, param_dtype="float32", dtype="bfloat16",
                    scan_layers=True, remat="full")
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  step, init_state = build_train_step(graphdef, make_optimizer(1e-6),
                                      StepConfig(shared_prompts=8),
                                      make_mesh(1, 1, 1, devices=devices[:1]), params)
  per_row = {}
  for lp, n in ((256, 512), (512, 1024)):
    t8, t16 = (_temp_bytes(step, init_state, params, rows, lp, n) for rows in (8, 16))
    per_row[lp + n] = (t16 - t8) / 8
  assert per_row[1536] <= 300e6, per_row
  assert per_row[1536] <= 2.1 * per_row[768], per_row
