"""The train step's compiled temporaries grow linearly with the positions of a row.

Measured at the Qwen2.5-0.5B shape (24 layers, d 896, 14 heads, 2 kv heads, head_dim 64,
mlp 4864) with a 4,096 vocabulary, bf16 compute, f32 master weights, `remat=full`, the group's
prompt shared (8 samples per prompt) and the attention `auto` picks. The per-row cost is
`(temp(16 rows) - temp(8 rows)) / 8` of `memory_analysis().temp_size_in_bytes`: everything
that does not scale with rows (weights' f32 copies, Adam's update temporaries) cancels.

What a row must cost, if a layer keeps only its input: 24 layers x (Lp + N) positions x 896 x
(2 bytes bf16 + 4 bytes for CPU's f32 upcast of it) = 99 MB at 768 positions, plus one layer's
recomputed activations (the MLP's [positions, 4864] f32 products: ~15 MB each) and the
attention's key blocks. Measured on this CPU (`benchmarks/row_cost.py`): 114 MB at 768 positions
and 235 MB at 1,536 (2.07x). Dense attention (what `auto` picked on CPU before, whatever the
length) keeps `[rows, heads, T, S]` scores: 164 and 440 MB (2.69x). The blockwise kernel before
its masks were recomputed per key block kept every block's `[B, Hkv, G, T, c]` bool mask for the
backward pass: 135 and 403 MB (2.98x).
"""

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "row_cost.py"
_spec = importlib.util.spec_from_file_location("row_cost", _PATH)
row_cost = importlib.util.module_from_spec(_spec)
sys.modules["row_cost"] = row_cost
_spec.loader.exec_module(row_cost)


def test_per_row_temporaries_are_linear_in_positions(devices):
  # The step as it runs by default on one shard: groups' prompts shared, each group packed into
  # one row (`StepConfig.pack_prompts` auto), the attention `auto` picks for such long rows.
  out = row_cost.case("auto", "packed", layers=24, vocab=4096,
                      lengths=((256, 512), (512, 1024)))
  per_row = out["per_row_mb"]
  assert per_row[1536] <= 300, out
  assert per_row[1536] <= 2.1 * per_row[768], out
