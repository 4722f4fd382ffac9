"""Micro-batch planning: how many micro-batches the RL train step splits its batch into.

The gradient is the whole batch's however it is split; the count sizes activation memory (and,
on CPU, speed). `train.num_microbatches = 0` asks for the fewest that keep a device's
micro-batch within `train.microbatch_tokens`. No jax is imported here.
"""

from __future__ import annotations


def resolve_microbatches(num_microbatches: int, rows: int, seq_len: int, shards: int,
                         token_budget: int, group: int = 1, prompt_len: int = 0) -> int:
  """`train.num_microbatches` as the train step runs it.

  `>= 1` is itself. `0` (auto) is the fewest micro-batches `m` that divide the rows each batch
  shard holds (`rows / shards`) and keep one device's micro-batch, `rows / shards / m` rows of
  `seq_len` tokens, within `token_budget` (`train.microbatch_tokens`); one row per shard when a
  single row is over it. The gradient is the whole batch's for any `m`; what `m` changes is the
  activation memory and, on CPU, speed: XLA's scratch for a large step is mapped and page-faulted
  in afresh on every call, a small one stays in the heap and in cache (the default's 1,024 rows
  of 10 tokens run ~2x faster as 8 micro-batches; benchmarks/README.md).

  `group` > 1: the step runs each group of `group` rows' prompt (`prompt_len` of the `seq_len`
  tokens) once (`train.share_prompts`), so micro-batches hold whole groups and a group counts
  `prompt_len + group * (seq_len - prompt_len)` tokens.

  >>> resolve_microbatches(0, rows=1024, seq_len=10, shards=1, token_budget=2048)
  8
  >>> resolve_microbatches(0, rows=16, seq_len=10, shards=1, token_budget=2048)
  1
  >>> resolve_microbatches(0, rows=1024, seq_len=10, shards=1, token_budget=2048, group=8,
  ...                      prompt_len=6)  # 128 groups of 6 + 8 x 4 = 38 tokens: 4 x 32 groups
  4
  """
  if num_microbatches > 0:
    return num_microbatches
  group = max(group, 1)
  per_shard = max(rows // max(shards, 1) // group, 1)
  unit = seq_len if group == 1 else prompt_len + group * (seq_len - prompt_len)
  for m in range(1, per_shard + 1):
    if per_shard % m == 0 and (per_shard // m) * unit <= token_budget:
      return m
  return per_shard


def run_microbatches(cfg, shards: int) -> int:
  """`resolve_microbatches` for a run config whose RL batch is split over `shards` devices."""
  r, t = cfg.rollout, cfg.train
  return resolve_microbatches(t.num_microbatches, r.num_prompts * r.group_size,
                              r.max_prompt_len + (r.max_total_tokens or r.max_new_tokens),
                              shards, t.microbatch_tokens, group=shared_prompts(cfg),
                              prompt_len=r.max_prompt_len)


def shared_prompts(cfg) -> int:
  """The train step's prompt-sharing group (`train.share_prompts`): G, or 0 when off or G = 1."""
  g = cfg.rollout.group_size
  return g if cfg.train.share_prompts and g > 1 else 0
