"""Where an RL step's time goes: a per-step breakdown in every metrics row, an MFU estimate, and
a `jax.profiler` trace of chosen steps.

The RL loop holds one `StepPerf` and calls it once per step: `begin(step)` at the top, `lap(name)`
after each phase, `metrics(item)` for the row, and `close()` when the loop ends. Metrics (seconds
unless named otherwise):

- `perf/wait_s`: the trainer waiting in the lag pipeline's pull for its batch (with several
  processes the batch is produced inline inside the pull, so this is then the rollout time);
- `perf/train_s`: reading the batch from the data plane and the jitted train step including the
  fetch of its metrics (the first step's also waits for the step's compilation);
- `perf/publish_s`: freeing the batch's rows and publishing the new params to the rollout side;
- `perf/val_s`: the trainer's share of validation: submitting a pass (which waits for the
  previous one; inline with several processes, the whole pass) and polling for results;
- `perf/step_time_s` = wait + train + publish + val exactly (logging and checkpoint saves come
  after it); `perf/rollout_s`: the time producing this batch took (`perf/sample_time_s`, its
  former name, is kept), on the rollout thread, overlapped with training when `rollout.lag` > 0;
- `perf/train_tokens_per_s`: tokens the train step ran through (below) / `train_s`;
  `perf/gen_tokens_per_s`: generation throughput, the batch's completion tokens / `rollout_s`
  (the time producing it; with its environment calls and any regenerated groups);
- `perf/mfu`: model FLOPs of the step / (`train_s` x peak FLOP/s per device x train devices),
  null where the peak is unknown (CPU; set `profile.peak_flops`).

Model FLOPs (`step_flops`) count the fixed-shape batch the step computes, padding included: R rows
of S = P + C tokens (P = `rollout.max_prompt_len`, C = the completion budget), or with
`train.share_prompts` one prompt per group of G rows. A forward pass costs

    2 N T  +  4 L H Dh A

with N the matmul parameters (all parameters less the input embedding table when it is not tied
to the output layer: a lookup is no FLOP), T the tokens run, L layers, H query heads of Dh dims,
and A the causal (query, key) pairs: S^2 / 2 per row, or per group P^2 / 2 + G (C P + C^2 / 2)
with shared prompts. Training is 3 forward passes (forward + backward), 4 with a reference model
(`ref_kl.coef` != 0): the familiar 6 N T + attention. Recomputation (`model.remat`) is not model
FLOPs and is not counted.

Profiling (`profile.steps = "A:B"`): `jax.profiler` traces RL steps A to B into
`<run_dir>/profile/` (`plugins/profile/<time>/<host>.xplane.pb` for TensorBoard's profile
plugin, and `.trace.json.gz` for Perfetto), each step inside a `StepTraceAnnotation`. A resumed
run that starts inside the window traces the rest of it. Only process 0 traces (the others
write nothing into the run directory).
"""

from __future__ import annotations

import math
import os
import time

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl.config.schema import parse_profile_steps

PROFILE_SUBDIR = "profile"
PHASES = ("wait", "train", "publish", "val")

# Dense bf16 peak FLOP/s of one JAX device, by `device_kind` substring (first match wins, so the
# more specific names come first). TPU v2/v3 devices are single cores (half a chip).
PEAK_FLOPS = (
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v5p", 459e12), ("TPU v5", 459e12), ("TPU v4", 275e12), ("TPU v3", 61.5e12),
    ("TPU v2", 22.5e12), ("B200", 2250e12), ("H200", 989e12), ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_kind: str) -> float:
  """Dense bf16 peak FLOP/s of a device of `device_kind` (`PEAK_FLOPS`), NaN when unknown."""
  for name, flops in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return math.nan


def step_flops(cfg, model_cfg, n_params: int) -> tuple[float, int]:
  """`(model FLOPs, tokens)` of one RL train step of run config `cfg` on a model of
  `model_cfg` with `n_params` parameters (the formula is in the module docstring)."""
  r = cfg.rollout
  p, c = r.max_prompt_len, r.max_total_tokens or r.max_new_tokens
  groups, g = r.num_prompts, r.group_size
  if config_lib.shared_prompts(cfg):
    tokens = groups * (p + g * c)
    pairs = groups * (p * p / 2 + g * (c * p + c * c / 2))
  else:
    tokens = groups * g * (p + c)
    pairs = groups * g * (p + c) ** 2 / 2
  m = model_cfg
  matmul = n_params - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
  forward = 2 * matmul * tokens + 4 * m.num_layers * m.num_heads * m.head_dim * pairs
  passes = 3 + (cfg.ref_kl.coef != 0)
  return float(passes * forward), int(tokens)


class StepProfiler:
  """A `jax.profiler` trace of RL steps `first..last` into `directory` (None: off). `step(n)` is
  called at the top of every step; `close()` ends a trace still running."""

  def __init__(self, window: tuple[int, int] | None, directory: str | None):
    self.window = window if directory is not None else None
    self.directory = directory
    self.tracing = False
    self._annotation = None

  def step(self, step: int) -> None:
    self._end_annotation()
    if self.window is None:
      return
    first, last = self.window
    if not self.tracing and first <= step <= last:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.tracing = True
    elif self.tracing and step > last:
      self.close()
    if self.tracing:
      self._annotation = jax.profiler.StepTraceAnnotation("rl_step", step_num=step)
      self._annotation.__enter__()

  def _end_annotation(self) -> None:
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None

  def close(self) -> None:
    self._end_annotation()
    if self.tracing:
      self.tracing = False
      self.window = None  # one trace per run
      jax.profiler.stop_trace()


class StepPerf:
  """The per-step time breakdown, throughput and MFU of the RL loop, and its profiler trace (see
  the module docstring). `run_dir` None: no trace (processes other than 0, tests)."""

  def __init__(self, parts, params, run_dir: str | None = None):
    cfg = parts.cfg
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    self.flops, self.tokens = step_flops(cfg, parts.model_cfg, n_params)
    peak = cfg.profile.peak_flops or peak_flops(parts.mesh.devices.flat[0].device_kind)
    self.peak = peak * parts.mesh.devices.size
    directory = None if run_dir is None else os.path.join(run_dir, PROFILE_SUBDIR)
    self.profiler = StepProfiler(parse_profile_steps(cfg.profile.steps), directory)
    self.t0 = self.mark = time.perf_counter()
    self.times = dict.fromkeys(PHASES, 0.0)

  def begin(self, step: int) -> None:
    """The top of RL step `step`: starts its clock (and the trace, in the profile window)."""
    self.profiler.step(step)
    self.t0 = self.mark = time.perf_counter()
    self.times = dict.fromkeys(PHASES, 0.0)

  def lap(self, phase: str) -> float:
    """Adds the time since the last lap (or `begin`) to `phase`; returns the step's time so
    far."""
    now = time.perf_counter()
    self.times[phase] += now - self.mark
    self.mark = now
    return now - self.t0

  def metrics(self, item) -> dict:
    """The `perf/*` metrics of the step that trained on `item` (a `RingItem`)."""
    t = self.times
    step_s = self.mark - self.t0
    train_s = max(t["train"], 1e-9)
    return {**{f"perf/{k}_s": v for k, v in t.items()}, "perf/step_time_s": step_s,
            "perf/rollout_s": item.sample_time_s, "perf/sample_time_s": item.sample_time_s,
            "perf/train_tokens_per_s": self.tokens / train_s,
            "perf/gen_tokens_per_s": float(item.meta.lengths.sum()) /
                                     max(item.sample_time_s, 1e-9),
            "perf/mfu": self.flops / train_s / self.peak}

  def close(self) -> None:
    self.profiler.close()
