"""The `Sampler` protocol the multi-turn loop generates through, and the run's samplers built from
a config: the static sampler (its rows split over the rollout mesh) or the continuous engine
(with partial rollouts when the run asks for them).

A sampler is a callable

    sample(params, prompts [P, Lp], prompt_valid [P, Lp], key, request_ids [P*G], temperature,
           top_k=0, top_p=1.0, version=0) -> SampleOutput

returning P*G rows prompt-major (row = p*G + g), each token stamped with the params version that
produced it. `build_samplers` makes the three a run needs: G samples per prompt for training, one
per row for later turns, and `val.samples_per_prompt` for evaluation. The newest-params source of
partial rollouts is given when they are built (`newest`), never attached later. The continuous
engine runs only on a mesh of this process's own devices (on several processes, the one each
process's rollout thread generates on); see `build_samplers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np

from jaxrl.rollout.engine import Engine
from jaxrl.rollout.static_sampler import SampleOutput, make_sampler

# `newest() -> (version, params) | None`: the newest published params (partial rollouts).
NewestParams = Callable[[], "tuple[int, object] | None"]


class Sampler(Protocol):
  def __call__(self, params, prompts, prompt_valid, key, request_ids, temperature, top_k=0,
               top_p=1.0, version=0) -> SampleOutput: ...


@dataclasses.dataclass(frozen=True)
class EngineSampler:
  """The continuous engine as a `Sampler`: left-padded prompt rows become token lists, and
  `group_size` samples of each come back prompt-major, with the same tokens as the static
  sampler for the same keys. `engine` is the `Engine` itself (its slots, programs, `warmup`).

  `newest` turns on partial rollouts: the batch starts on the params it was given (so its first
  tokens are exactly as stale as the forced lag says) and, between decode dispatches, switches to
  any newer published version; every token is stamped with the version that produced it
  (`EngineOutput.versions`).
  """
  engine: Engine
  group_size: int
  newest: NewestParams | None = None

  def __call__(self, params, prompts, prompt_valid, key, request_ids, temperature, top_k=0,
               top_p=1.0, version=0):
    prompts, valid = np.asarray(prompts), np.asarray(prompt_valid)
    rows = [p[v].tolist() for p, v in zip(prompts, valid)]
    source = None if self.newest is None else partial_source(self.newest, version, params)
    return self.engine.run(params, rows, np.asarray(request_ids), key, temperature, top_k,
                           top_p, group_size=self.group_size, version=version,
                           params_source=source)


def rows_over(mesh, sample: Sampler) -> Sampler:
  """`sample` with its row inputs split over the 'data' axis of `mesh` (the rollout mesh), so
  each data shard decodes its own rows (on several processes the rollout mesh is the process's
  own devices, `ProcessShare.mesh`, and the rows its share of the batch); rows that
  'data' does not divide stay replicated. 'fsdp' is left out on purpose: splitting rows over the
  axis that splits the weights would all-gather every layer's weights at every decode step."""
  shards = mesh.shape["data"]
  by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def put(x):
    x = np.asarray(x)  # a global mesh: the same rows on every process, each places its shards
    return x if len(x) % shards else jax.make_array_from_callback(x.shape, by_rows,
                                                                  lambda i: x[i])

  def split_rows(params, prompts, prompt_valid, key, request_ids, *args, **kwargs):
    if shards > 1:
      prompts, prompt_valid, request_ids = put(prompts), put(prompt_valid), put(request_ids)
    return sample(params, prompts, prompt_valid, key, request_ids, *args, **kwargs)

  return split_rows


def partial_source(newest: NewestParams, version: int, params):
  """The engine's `params_source` for one batch: its own `(version, params)` at the first call
  (the batch's first tokens keep the forced lag), then whichever is newer of those and
  `newest()`.

  Looked up on this module at every batch, so a test or a debugging session may replace it (e.g.
  with a source that waits for the next version at a chosen call, to make a partial rollout's
  switch deterministic)."""
  started = []

  def source():
    got = newest() if started else None
    started.append(True)
    return got if got is not None and got[0] > version else (version, params)

  return source


def is_process_local(mesh) -> bool:
  """Whether every device of `mesh` (None: the default device) is this process's own, so every
  array on it is fully addressable and reading one launches nothing on another process."""
  return mesh is None or all(d.process_index == jax.process_index() for d in mesh.devices.flat)


@dataclasses.dataclass(frozen=True)
class Samplers:
  """A run's samplers: `train` (G samples per prompt), `next_turn` (one per row: later turns,
  every row its own context; compiled only if a task has them) and `val` (k per prompt)."""
  train: Sampler
  next_turn: Sampler
  val: Sampler


def build_samplers(cfg, graphdef, tokenizer, rollout_mesh, newest: NewestParams | None = None
                   ) -> Samplers:
  """The samplers of run config `cfg` (`rollout.engine`, `rollout.*` lengths, `val.*`).

  `newest` is the newest-params source of partial rollouts (`rollout.partial_rollouts`, the
  continuous engine only); evaluation measures the params of one step and never uses it.

  The continuous engine runs on the mesh of the params it is given (`rollout_mesh` itself, or on
  several processes this process's own devices, `ProcessShare.mesh`, with the params published
  there): its host driver reads every slot's state after each dispatch, so every array must be
  the process's own. On a `rollout_mesh` that spans processes (evaluation on several processes,
  inline on the global params; training there is refused by `process_share`) the static sampler
  is built instead: the same tokens for the same keys.
  """
  r = cfg.rollout
  common = dict(max_new_tokens=r.max_new_tokens, eos_id=tokenizer.eos_ids,
                pad_id=tokenizer.pad_id)
  k = cfg.val.samples_per_prompt
  if r.engine == "continuous" and is_process_local(rollout_mesh):
    def engine(group_size, prompt_len, rows, newest=None):
      return EngineSampler(Engine(graphdef, num_slots=r.engine_slots or rows,
                                   max_prompt_len=prompt_len, steps_per_dispatch=r.engine_steps,
                                   compact=r.engine_compact, **common), group_size, newest)
    P, G = r.num_prompts, r.group_size
    partial = newest if r.partial_rollouts else None
    return Samplers(
        train=engine(G, r.max_prompt_len, P * G, partial),
        next_turn=engine(1, r.max_prompt_len + (r.max_total_tokens or r.max_new_tokens), P * G,
                         partial),
        val=engine(k, r.max_prompt_len, cfg.val.batch_size * k))
  rows = lambda f: rows_over(rollout_mesh, f)
  return Samplers(train=rows(make_sampler(graphdef, num_samples=r.group_size, **common)),
                  next_turn=rows(make_sampler(graphdef, num_samples=1, **common)),
                  val=rows(make_sampler(graphdef, num_samples=k, **common)))
