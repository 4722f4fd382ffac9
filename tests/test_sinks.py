"""Metric sinks (`jaxrl.observe.sinks`): every number of metrics.jsonl reaches TensorBoard and W&B
(offline) at its phase's step, including validation rows written after later RL rows; a resumed
run continues both without a duplicated step; a sink that fails is reported once and dropped;
a bad `logging.backends` is one config line.

The event files and the offline W&B run are read back from disk with the readers below, which
apply what TensorBoard and W&B do with them: TensorBoard's purge (a `SessionLog.START` event at
step s hides the directory's earlier events at steps >= s, as its EventAccumulator does), and W&B's
rewind (a resumed segment's `branch_point` step s keeps the earlier history up to `_step` s)."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import shutil
import struct
import time

import jax
import pytest

from jaxrl import config as config_lib

from jaxrl.observe import metrics as metrics_lib, sinks

from jaxrl.run import driver
from jaxrl.recipes.default import get_config

pytest.importorskip("tensorboardX")
pytest.importorskip("wandb")
from tensorboardX.proto import event_pb2  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402


# --- readers -------------------------------------------------------------------------------------

def _tfrecords(path):
  """The records of a TFRecord file: u64 length, u32 CRC, data, u32 CRC (CRCs not checked)."""
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos + 12 <= len(data):
    (n,) = struct.unpack("<Q", data[pos:pos + 8])
    yield data[pos + 12:pos + 12 + n]
    pos += 12 + n + 4


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] as TensorBoard shows them, over every phase directory."""
  out: dict[str, list[tuple[int, float]]] = {}
  for phase_dir in sorted(glob.glob(os.path.join(run_dir, "tensorboard", "*"))):
    series: dict[str, list[tuple[int, float]]] = {}
    # TensorBoard reads a directory's event files in name order (the name starts with the time).
    for path in sorted(glob.glob(os.path.join(phase_dir, "events.out.tfevents.*"))):
      for record in _tfrecords(path):
        event = event_pb2.Event.FromString(record)
        if event.HasField("session_log") and \
            event.session_log.status == event_pb2.SessionLog.START:
          series = {t: [(s, v) for s, v in pts if s < event.step] for t, pts in series.items()}
          series = {t: pts for t, pts in series.items() if pts}
        for value in event.summary.value:
          series.setdefault(value.tag, []).append((event.step, value.simple_value))
    for t, pts in series.items():
      assert t not in out, f"tag {t} in two phase directories"
      out[t] = pts
  return out


def _wandb_records(path):
  """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header, then
  LevelDB-log records (u32 CRC, u16 length, u8 type: full, first, middle, last) in 32 KiB blocks."""
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", path
  pos, block, pending = 7, 32768, b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0 or pos + 7 + n > len(data):  # the end, or a record still being written
      break
    chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record


def _finished_records(path, timeout_s=60.0):
  """The records of a finished W&B run segment. `run.finish()` can return before W&B's service
  has written the segment out (offline), so this waits for its closing `exit` record."""
  deadline = time.monotonic() + timeout_s
  while True:
    records = list(_wandb_records(path))
    if records and records[-1].WhichOneof("record_type") == "exit":
      return records
    assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
    time.sleep(0.2)


def wandb_history(run_dir) -> tuple[list[dict], list[dict]]:
  """(the W&B run's history as W&B would hold it after `wandb sync` of every offline segment,
  each segment's run config), segments in the order they started."""
  segments = []
  for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")):
    records = _finished_records(path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    segments.append(((run.start_time.seconds, run.start_time.nanos), run, records))
  assert len({run.run_id for _, run, _ in segments}) == 1, "one W&B run id expected"
  history: list[dict] = []
  configs = []
  for _, run, records in sorted(segments, key=lambda s: s[0]):
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    configs.append(config)
    branch = config.get("_wandb", {}).get("branch_point")
    if branch is not None:  # rewind: keep the history up to the branch step
      history = [h for h in history if h["_step"] <= branch["step"]]
    history += [{i.key or "/".join(i.nested_key): json.loads(i.value_json)
                 for i in r.history.item}
                for r in records if r.WhichOneof("record_type") == "history"]
  return history, configs


def _rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _numbers(rows):
  """[(phase, step, {tag: value})] for each row, written out here rather than taken from
  `jaxrl.observe.sinks`: every int and float (bools as 0/1) but `step`, tagged `<phase>/<key>` unless the
  key already starts with `<phase>/`; the summary row (no step) at the last RL step."""
  out, last_rl = [], 0
  for r in rows:
    phase = r["phase"]
    last_rl = r["step"] if phase == "rl" else last_rl
    values = {(k if k.startswith(phase + "/") else f"{phase}/{k}"): float(v) if isinstance(v, bool)
              else v for k, v in r.items()
              if k not in ("phase", "step") and isinstance(v, (int, float))}
    out.append((phase, r.get("step", last_rl), values))
  return out


def _expected(rows) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] of every number in metrics.jsonl, in the order rows were written."""
  out: dict[str, list[tuple[int, float]]] = {}
  for _, step, values in _numbers(rows):
    for t, v in values.items():
      out.setdefault(t, []).append((step, v))
  return out


def _assert_sinks_match(run_dir):
  rows = _rows(run_dir)
  want = _expected(rows)
  # Every phase and some numbers of each, so a reader that found nothing cannot pass.
  assert {t.split("/")[0] for t in want} >= {"sft", "rl", "val", "summary"}, sorted(want)
  assert "val/accuracy" in want and "rl/reward" in want and "sft/loss" in want

  tb = tensorboard_scalars(run_dir)
  assert sorted(tb) == sorted(want)
  for t, pts in want.items():
    got = tb[t]
    assert [s for s, _ in got] == [s for s, _ in pts], t
    for (_, a), (_, b) in zip(got, pts):  # event files hold float32
      assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30), (t, a, b)

  history, configs = wandb_history(run_dir)
  # Line i of metrics.jsonl is the W&B run's _step i: all of them, each once, same numbers.
  assert [h["_step"] for h in history] == list(range(len(rows)))
  for h, (phase, step, values) in zip(history, _numbers(rows)):
    assert h[f"{phase}/step"] == step
    got = {k: v for k, v in h.items() if not k.startswith("_") and k != f"{phase}/step"}
    assert got == values, (phase, step)
  return rows, configs


# --- runs ----------------------------------------------------------------------------------------

def _cfg(run_dir, **over):
  """The default recipe at a tiny size: a short warm-up, a few RL steps, validation every 2 steps
  written asynchronously (so val rows come after later RL rows)."""
  cfg = get_config()
  cfg.run_dir = str(run_dir)
  cfg.model.d_model, cfg.model.head_dim, cfg.model.mlp_dim = 32, 16, 64
  cfg.sft.max_steps, cfg.sft.eval_every = 10, 5
  cfg.sft.batch_size = 32
  cfg.train.steps = 4
  cfg.rollout.num_prompts = 4
  cfg.task.dev_size = cfg.task.val_size = 16
  cfg.val.batch_size = 16
  cfg.val.every = 2
  cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.async_save = 2, 5, False
  cfg.logging.backends = "jsonl,tensorboard,wandb"
  cfg.logging.wandb.mode = "offline"
  cfg.logging.wandb.tags = "test,tiny"
  for k, v in over.items():
    section, key = k.split("__")
    cfg[section][key] = v
  return cfg


def _run(cfg):
  return driver.run(cfg, cfg.run_dir, config_lib.validate(cfg, jax.device_count()))


class _Broken:
  """A sink whose writes fail from its third row on (a lost connection, a full disk)."""

  def __init__(self, ctx):
    self.rows = 0

  def write(self, phase, step, scalars):
    self.rows += 1
    if self.rows >= 3:
      raise OSError(28, "No space left on device")

  def close(self):
    pass


BROKEN_WARNING = ("jaxrl: warning: metrics backend 'test_broken' failed and is turned off for "
                  "the rest of the run (metrics.jsonl has every row): OSError: [Errno 28] No "
                  "space left on device")


@pytest.fixture
def broken_backend():
  sinks.register_backend("test_broken", _Broken)
  yield "test_broken"
  del sinks.BACKENDS["test_broken"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """One whole run of the tiny recipe with every sink, W&B offline, and a backend that fails on
  its third row: (its config, its stderr's `jaxrl: warning` lines). Shared by the two tests below
  (the second resumes a copy of it), since a run takes most of these tests' time."""
  cfg = _cfg(tmp_path_factory.mktemp("first") / "run",
             logging__backends="jsonl,tensorboard,test_broken,wandb")
  sinks.register_backend("test_broken", _Broken)
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      assert _run(cfg)["rl/steps"] == 4
  finally:
    del sinks.BACKENDS["test_broken"]
  return cfg, [line for line in err.getvalue().splitlines() if line.startswith("jaxrl: warning")]


@pytest.mark.slow  # its fixture is a whole run with W&B (50-70 s on 2 busy cores)
def test_every_number_reaches_tensorboard_and_wandb_at_its_step(first_run):
  cfg, warnings = first_run
  # The failing backend is reported once; the run and the other sinks go on.
  assert warnings == [BROKEN_WARNING]
  rows, configs = _assert_sinks_match(cfg.run_dir)
  # Validation at 0, 2, 4, and at least one of them logged after a later RL step.
  val_steps = [r["step"] for r in rows if r["phase"] == "val"]
  assert val_steps == [0, 2, 4]
  order = [(r["phase"], r.get("step")) for r in rows]
  assert any(p == "val" and any(q == "rl" and t > s for q, t in order[:i])
             for i, (p, s) in enumerate(order)), order
  # The W&B run's config is the resolved run config.
  assert len(configs) == 1 and configs[0]["train"] == cfg.train.to_dict()
  assert configs[0]["logging"]["backends"] == "jsonl,tensorboard,test_broken,wandb"


@pytest.mark.slow  # the first run's copy resumed (30-40 s on 2 busy cores)
def test_a_resumed_run_continues_both_without_duplicated_steps(first_run, tmp_path):
  cfg = _cfg(tmp_path / "run")
  shutil.copytree(first_run[0].run_dir, cfg.run_dir, symlinks=True)
  first = _rows(cfg.run_dir)
  # As if killed right after step 2's checkpoint (saved at 2 and 4): steps 3-4, their validation
  # and the summary are in every sink but not in what the directory resumes from.
  shutil.rmtree(os.path.join(cfg.run_dir, "checkpoints", "4"))
  _run(cfg)
  rows, configs = _assert_sinks_match(cfg.run_dir)
  keyed = [(r["phase"], r.get("step")) for r in rows]
  assert sorted(keyed, key=str) == sorted([(r["phase"], r.get("step")) for r in first], key=str)
  assert len(set(keyed)) == len(keyed)
  assert len(configs) == 2  # two W&B segments of one run id (wandb_history asserts one id)
  # The rewind point is the checkpoint's last line: the one before step 3's.
  branch = configs[1]["_wandb"]["branch_point"]
  assert branch["step"] == keyed.index(("rl", 3)) - 1


def test_a_failing_sink_is_reported_once_and_dropped(tmp_path, capfd, broken_backend):
  cfg = _cfg(tmp_path, logging__backends=f"jsonl,{broken_backend},tensorboard")
  out = metrics_lib.MetricsWriter(str(tmp_path), cfg=cfg)
  for step in range(1, 6):
    out.write({"phase": "rl", "step": step, "reward": step / 8})
  out.close()
  assert capfd.readouterr().err.splitlines() == [BROKEN_WARNING]
  assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4, 5]
  assert [s for s, _ in tensorboard_scalars(tmp_path)["rl/reward"]] == [1, 2, 3, 4, 5]


def test_rows_of_every_kind_reach_the_sinks_out_of_order(tmp_path):
  # MetricsWriter alone: numbers only, per-phase tags, a val row after later RL rows, the
  # summary at the last RL step; bools as 0/1; None (a NaN), strings and lists skipped.
  cfg = _cfg(tmp_path, logging__backends="tensorboard,wandb")
  out = metrics_lib.MetricsWriter(str(tmp_path), cfg=cfg)
  out.write({"phase": "sft", "step": 10, "sft/loss": 1.5})
  out.write({"phase": "rl", "step": 10, "loss": 0.25, "note": "x", "ids": [1, 2],
             "nan": float("nan"), "done": True, "batch_id": 7})
  out.write({"phase": "rl", "step": 11, "loss": 0.5})
  out.write({"phase": "val", "step": 10, "val/accuracy": 0.75})
  out.write({"phase": "summary", "val/rl_gain": 0.125})
  out.close()
  tb = tensorboard_scalars(tmp_path)
  assert tb == {"sft/loss": [(10, 1.5)], "rl/loss": [(10, 0.25), (11, 0.5)],
                "rl/done": [(10, 1.0)], "rl/batch_id": [(10, 7.0)],
                "val/accuracy": [(10, 0.75)], "summary/val/rl_gain": [(11, 0.125)]}
  history, _ = wandb_history(tmp_path)
  assert [{k: v for k, v in h.items() if not k.startswith("_")} for h in history] == [
      {"sft/step": 10, "sft/loss": 1.5},
      {"rl/step": 10, "rl/loss": 0.25, "rl/done": 1.0, "rl/batch_id": 7},
      {"rl/step": 11, "rl/loss": 0.5},
      {"val/step": 10, "val/accuracy": 0.75},
      {"summary/step": 11, "summary/val/rl_gain": 0.125}]


def _write(out, rows):
  for r in rows:
    out.write(r)
  out.close()


RL = [{"phase": "rl", "step": s, "reward": s / 8} for s in range(1, 6)]


def test_a_resumed_writer_drops_what_came_after_the_checkpoint(tmp_path):
  # Lines 0-4 are rl 1-5 with val 2 after rl 3; a resume from the checkpoint after line 2 (rl 3)
  # writes rl 4-5 and val 4 anew: TensorBoard hides the old rl 4-5 and val 2.. (none kept), W&B
  # rewinds to _step 2. Each step once, the resumed values.
  cfg = _cfg(tmp_path, logging__backends="tensorboard,wandb")
  _write(metrics_lib.MetricsWriter(str(tmp_path), cfg=cfg),
         [*RL[:3], {"phase": "val", "step": 2, "val/accuracy": 0.5}, *RL[3:]])
  redone = [{**r, "reward": -r["reward"]} for r in RL[3:]]
  _write(metrics_lib.MetricsWriter(str(tmp_path), keep_lines=3, cfg=cfg),
         [redone[0], {"phase": "val", "step": 4, "val/accuracy": 0.75}, redone[1]])
  assert tensorboard_scalars(tmp_path) == {
      "rl/reward": [(1, 0.125), (2, 0.25), (3, 0.375), (4, -0.5), (5, -0.625)],
      "val/accuracy": [(4, 0.75)]}
  history, configs = wandb_history(tmp_path)
  assert [(h["_step"], h.get("rl/reward", h.get("val/accuracy"))) for h in history] == \
      [(0, 0.125), (1, 0.25), (2, 0.375), (3, -0.5), (4, 0.75), (5, -0.625)]
  assert configs[1]["_wandb"]["branch_point"]["step"] == 2


def test_a_backend_turned_on_at_resume_gets_the_kept_rows_first(tmp_path):
  cfg = _cfg(tmp_path, logging__backends="jsonl")
  _write(metrics_lib.MetricsWriter(str(tmp_path), cfg=cfg), RL[:4])
  cfg.logging.backends = "tensorboard,wandb"
  _write(metrics_lib.MetricsWriter(str(tmp_path), keep_lines=3, cfg=cfg), RL[3:])
  assert tensorboard_scalars(tmp_path) == {"rl/reward": [(r["step"], r["reward"]) for r in RL]}
  history, _ = wandb_history(tmp_path)
  assert [(h["_step"], h["rl/step"], h["rl/reward"]) for h in history] == \
      [(i, r["step"], r["reward"]) for i, r in enumerate(RL)]


def test_unknown_backend_is_one_line_naming_the_key_and_choices():
  cfg = get_config()
  cfg.logging.backends = "jsonl,tensorbord"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 1)
  assert e.value.problems == [
      "config.logging.backends: must be a comma list of ['jsonl', 'tensorboard', 'wandb'], got "
      "'jsonl,tensorbord'"]


def test_a_missing_package_names_its_pip_extra(tmp_path):
  sinks.register_backend("test_missing", _Broken, module="jaxrl_no_such_package", extra="nope")
  try:
    cfg = get_config()
    cfg.run_dir = str(tmp_path / "run")
    cfg.logging.backends = "test_missing"
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.validate(cfg, 1)
  finally:
    del sinks.BACKENDS["test_missing"]
  assert e.value.problems == [
      "config.logging.backends: backend 'test_missing' needs the jaxrl_no_such_package package, "
      "which is not installed (pip install -e \".[nope]\")"]
  assert not (tmp_path / "run").exists()
