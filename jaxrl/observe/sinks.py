"""Metric sinks: every row of `metrics.jsonl` also goes to TensorBoard and Weights & Biases.

`config.logging.backends` is a comma list of registered backend names (`jsonl`, always on, is
`jaxrl.observe.metrics.MetricsWriter` itself; `tensorboard`; `wandb`). `MetricsWriter` builds one `Sink`
per other backend on process 0 only and passes every row to each, after its line is in
metrics.jsonl; a sink that raises is reported in one line and dropped (the run and metrics.jsonl
go on). No jax here, and no backend package is imported before its sink is built: config
validation (`jaxrl.config`) asks this registry for the names (`backend_names`) and
`jaxrl.config.preflight` for missing packages (`missing_packages`).

What a sink receives (`scalars`): the row's numbers under per-phase tags, so sft step 10 and rl
step 10 never share a series: `tag(phase, key)` is `key` when it already starts with
`<phase>/` (`sft/loss`, `val/accuracy`) and `<phase>/<key>` otherwise (`rl/reward`,
`rl/train/loss`, `summary/val/rl_gain`). Ints and floats are kept, bools become 0/1; strings,
None (metrics.jsonl's NaN/inf), lists and dicts are skipped. The step is the row's `step`; a row
without one (the `summary` row) is logged at the last RL step written.

Resume (`SinkContext.kept` is the list of metrics.jsonl rows the resumed run keeps):
- TensorBoard writes each phase into its own directory, `<run_dir>/tensorboard/<phase>/` (one
  "run" per phase in TensorBoard's run list), because the purge that drops what a killed run
  wrote after its checkpoint is by step for a whole directory: a resumed run opens each phase's
  directory with a new event file that starts with TensorBoard's purge event (`SessionLog.START`
  at the phase's first step not kept), so the old events from that step on are hidden.
- W&B logs line i of metrics.jsonl as the W&B run's `_step` i (monotonic whatever order the rows
  come in; each phase has its own x-axis, `<phase>/step`, set with `define_metric`, so validation
  rows logged after later RL rows land at their own step). The run id is kept in
  `<run_dir>/wandb/jaxrl-run-id`; a resumed run continues that run with `resume_from=
  "<id>?_step=<kept lines - 1>"` (W&B's rewind: the history after the kept lines is dropped, and
  offline runs record it for `wandb sync`). Where the W&B server refuses a rewind (it is a preview
  feature of W&B's cloud), the run is resumed plainly (`resume="allow"`): W&B then ignores the
  re-logged lines up to its last `_step`, so no step is duplicated, and those lines keep the
  values the first attempt logged.
- A backend turned on only when resuming gets the kept rows first (backfill).

A user backend: `register_backend("mine", lambda ctx: MySink(ctx.run_dir))`, then
`--config.logging.backends=jsonl,mine` (from a recipe file, which runs before validation).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

# The key of `jaxrl.recipes.default` that picks the backends.
KEY = "logging.backends"


class Sink(Protocol):
  """Where metric rows go besides metrics.jsonl. `write` gets every row, in the order rows are
  written (validation rows may come after later RL rows); `close` ends the run."""

  def write(self, phase: str, step: int, scalars: Mapping[str, float]) -> None: ...

  def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class SinkContext:
  """What a backend's factory gets: the run directory, the resolved run config (a ConfigDict)
  and, on resume, the metrics.jsonl rows kept (None: a fresh run)."""
  run_dir: str
  config: Any
  kept: list[dict] | None = None


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered backend: `factory(ctx) -> Sink` (None for `jsonl`, which `MetricsWriter` is
  itself); `module`, the package it needs, installed by pip extra `extra`."""
  name: str
  factory: Callable[[SinkContext], Sink] | None
  module: str = ""
  extra: str = ""


BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[SinkContext], Sink] | None, *,
                     module: str = "", extra: str = "") -> None:
  """Makes `name` a choice of `config.logging.backends` (a later registration replaces it)."""
  BACKENDS[name] = Backend(name, factory, module, extra)


def backend_names() -> list[str]:
  return sorted(BACKENDS)


def parse_backends(text: str) -> list[str]:
  """The backend names of a `logging.backends` value, in order, without repeats or blanks."""
  return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def missing_packages(text: str) -> list[str]:
  """One config problem line for each chosen backend whose package is not installed."""
  out = []
  for name in parse_backends(text):
    b = BACKENDS.get(name)
    if b is not None and b.module and importlib.util.find_spec(b.module) is None:
      how = f'pip install -e ".[{b.extra}]"' if b.extra else f"pip install {b.module}"
      out.append(f"config.{KEY}: backend {name!r} needs the {b.module} package, which is not "
                 f"installed ({how})")
  return out


def tag(phase: str, key: str) -> str:
  """The sink name of metric `key` of a `phase` row (see the module docstring)."""
  if not phase or key.startswith(phase + "/"):
    return key
  return f"{phase}/{key}"


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
  """The numbers of a metrics row by tag; `phase` and `step` are not metrics."""
  phase = str(row.get("phase") or "")
  out = {}
  for k, v in row.items():
    if k in ("phase", "step"):
      continue
    if isinstance(v, bool):
      v = float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
      out[tag(phase, k)] = v
  return out


def _step(row: Mapping[str, Any]) -> int | None:
  step = row.get("step")
  return step if isinstance(step, int) and not isinstance(step, bool) else None


class Steps:
  """The step each row is logged at: its own `step`, else (the summary row) the last RL step
  seen so far (0 before any)."""

  def __init__(self):
    self.last_rl = 0

  def __call__(self, row: Mapping[str, Any]) -> int:
    step = _step(row)
    if step is not None and row.get("phase") == "rl":
      self.last_rl = step
    return self.last_rl if step is None else step


def entries(rows: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, int, dict[str, float]]]:
  """`(phase, step, scalars)` of each row, as `MetricsWriter` passes them to a sink."""
  steps = Steps()
  for row in rows:
    yield str(row.get("phase") or ""), steps(row), scalars(row)


class TensorBoardSink:
  """Event files under `<run_dir>/tensorboard/<phase>/`, one `Summary` event per row, flushed at
  once (a live TensorBoard sees every step; a killed run loses nothing written). Written
  synchronously with tensorboardX's record writer: an error (a full disk) reaches `write`."""

  def __init__(self, ctx: SinkContext):
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2

    self._events_writer, self._event_pb2, self._summary_pb2 = EventsWriter, event_pb2, summary_pb2
    self.root = os.path.join(ctx.run_dir, "tensorboard")
    self._writers: dict[str, Any] = {}
    if ctx.kept is None:
      return
    last: dict[str, int] = {}  # phase directory -> its largest kept step
    for phase, step, _ in entries(ctx.kept):
      last[_dir_name(phase)] = max(last.get(_dir_name(phase), step), step)
    on_disk = os.listdir(self.root) if os.path.isdir(self.root) else []
    for phase in on_disk:
      if os.path.isdir(os.path.join(self.root, phase)):
        # The phase's first step not kept: 0 drops all of a phase with no kept rows.
        first_dropped = last[phase] + 1 if phase in last else 0
        self._open(phase).write_event(self._event_pb2.Event(
            wall_time=time.time(), step=first_dropped,
            session_log=self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)))
    for phase, step, values in entries(ctx.kept):  # a phase not on disk: new to the run
      if _dir_name(phase) not in on_disk:
        self.write(phase, step, values)

  def _open(self, phase: str):
    w = self._writers.get(phase)
    if w is None:
      path = os.path.join(self.root, phase)
      os.makedirs(path, exist_ok=True)
      # TensorBoard reads a directory's files in name order, and the name's own time is in whole
      # seconds: the suffix keeps two files of one second (a resume) unique and in order.
      w = self._writers[phase] = self._events_writer(os.path.join(path, "events"),
                                                     f".{time.time_ns()}.{os.getpid()}")
    return w

  def write(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
    if not scalars:
      return
    s = self._summary_pb2
    summary = s.Summary(value=[s.Summary.Value(tag=k, simple_value=float(v))
                               for k, v in scalars.items()])
    w = self._open(_dir_name(phase))
    w.write_event(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    w.flush()

  def close(self) -> None:
    writers, self._writers = self._writers, {}
    for w in writers.values():
      w.close()


def _dir_name(phase: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in phase) or "run"


WANDB_ID_FILE = "jaxrl-run-id"  # in <run_dir>/wandb/


class WandbSink:
  """A W&B run (`config.logging.wandb.*`) whose config is the resolved run config, with its
  files under `<run_dir>/wandb/`; resumed as the module docstring says."""

  def __init__(self, ctx: SinkContext):
    import wandb

    w = ctx.config.logging.wandb
    directory = os.path.join(ctx.run_dir, "wandb")
    os.makedirs(directory, exist_ok=True)
    id_path = os.path.join(directory, WANDB_ID_FILE)
    run_id = None
    if ctx.kept is not None and os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip() or None
    kept = ctx.kept or []
    args = dict(
        project=w.project or None, entity=w.entity or None, mode=w.mode or None,
        tags=[t.strip() for t in w.tags.split(",") if t.strip()] or None,
        name=os.path.basename(os.path.normpath(ctx.run_dir)), dir=ctx.run_dir,
        config=ctx.config.to_dict(),
        # console="off": W&B would otherwise wrap sys.stdout, which the progress line rewrites.
        settings=wandb.Settings(console="off", quiet=True))
    self._defined: set[str] = set()
    if run_id is None:
      run_id = uuid.uuid4().hex[:10]  # lowercase letters and digits, like W&B's own ids
      self.run = wandb.init(id=run_id, **args)
      with open(id_path, "w") as f:
        f.write(run_id + "\n")
      self.index = 0
      for entry in entries(kept):  # a backend new to a resumed run: the kept rows first
        self.write(*entry)
      return
    if kept:
      try:
        self.run = wandb.init(resume_from=f"{run_id}?_step={len(kept) - 1}", **args)
      except Exception:  # noqa: BLE001  a server without rewind: resume plainly (docstring)
        self.run = wandb.init(id=run_id, resume="allow", **args)
    else:
      self.run = wandb.init(id=run_id, resume="allow", **args)
    self.index = len(kept)

  def write(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
    axis = f"{phase}/step" if phase else "step"
    if phase not in self._defined:
      self.run.define_metric(axis, hidden=True)
      if phase:
        self.run.define_metric(f"{phase}/*", step_metric=axis)
      self._defined.add(phase)
    self.run.log({axis: int(step), **scalars}, step=self.index)
    self.index += 1

  def close(self) -> None:
    self.run.finish()


register_backend("jsonl", None)
register_backend("tensorboard", TensorBoardSink, module="tensorboardX", extra="tensorboard")
register_backend("wandb", WandbSink, module="wandb", extra="wandb")
