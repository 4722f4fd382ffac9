"""`LoopState`: what the RL loop carries from step to step besides the train state and the lag
pipeline, as one record saved and restored with one call each.

A checkpoint holds the train state, the lag pipeline's state (the batches already made for later
steps, the gate's counters, the rollout RNG and group counter) and this record (step, skipped
updates, the evaluation results so far, the metrics line count, the warm-up summary), so a resumed
run continues exactly as if it had not stopped.
"""

from __future__ import annotations

import dataclasses

from jaxrl.runtime.checkpoint import UnreadableStep, from_json_num, json_num, restore_cause


@dataclasses.dataclass
class LoopState:
  step: int = 0  # updates done
  skipped_updates: int = 0  # updates skipped for non-finite gradients
  consecutive_skipped: int = 0  # of which the last ones in a row
  val_accuracy: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> accuracy
  metrics_lines: int = 0  # lines in metrics.jsonl when saved
  warmup: dict = dataclasses.field(default_factory=dict)  # the warm-up's summary
  config: dict = dataclasses.field(default_factory=dict)  # the config keys the state depends on
  # Not saved: the run resumed from a step older than its directory's newest (those were passed
  # over as unusable), so its next save replaces them (`Checkpointer.save(replace=True)`).
  went_back: bool = False

  def count_skipped(self, skipped: int) -> None:
    """Counts an update skipped (1) or applied (0) for non-finite gradients."""
    self.skipped_updates += skipped
    self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0

  def halt_reason(self, t) -> str | None:
    """Why the run must stop after this step by `train.max_skipped_updates` or
    `train.max_consecutive_skipped` (`t`: the config's `train` section), or None."""
    if t.max_skipped_updates and self.skipped_updates > t.max_skipped_updates:
      return (f"{self.skipped_updates} updates were skipped for non-finite gradients, more "
              f"than train.max_skipped_updates={t.max_skipped_updates}")
    if t.max_consecutive_skipped and self.consecutive_skipped >= t.max_consecutive_skipped:
      return (f"the last {self.consecutive_skipped} updates (to step {self.step}) were all "
              f"skipped for non-finite gradients (train.max_consecutive_skipped="
              f"{t.max_consecutive_skipped})")
    return None

  def save(self, ckpt, train_state, pipeline, partial: bool = False) -> bool:
    """Saves a checkpoint of step `self.step`: this record, `train_state` and the pipeline
    (`partial`: its ring as it is, `LagPipeline.state_dict`). True when step `self.step` is
    checkpointed then (saved now, or already); False when a partial ring cannot be saved."""
    got = pipeline.state_dict(partial=True) if partial else pipeline.state_dict()
    if got is None:
      return False
    ring, host = got
    replace, self.went_back = self.went_back, False
    ckpt.save(self.step, {"train": train_state, "ring": ring},
              {**host, "step": self.step, "metrics_lines": self.metrics_lines,
               "val_accuracy": {str(k): json_num(a) for k, a in self.val_accuracy.items()},
               "skipped_updates": self.skipped_updates,
               "consecutive_skipped": self.consecutive_skipped,
               "warmup": {k: json_num(x) for k, x in self.warmup.items()},
               "config": self.config}, replace=replace)
    return True

  @staticmethod
  def restore_warmup(host: dict) -> dict:
    """The warm-up summary a checkpoint's JSON `host` holds."""
    return {k: from_json_num(x) for k, x in host["warmup"].items()}

  @classmethod
  def restore(cls, reader, step: int, host: dict, train_target, pipeline):
    """Restores checkpoint `step` (its JSON `host`, from `reader.read_host()`): the pipeline is
    loaded in place; returns `(train_state, loop_state)`.

    Every array is read here, so a checkpoint that cannot be restored for any reason (truncated
    or corrupt array data, a host record that does not fit) raises `UnreadableStep`, which the
    caller answers with the checkpoint before it."""
    try:
      restored, _ = reader.restore(step, {"train": train_target, "ring": pipeline.target(host)})
      pipeline.load_state_dict(restored["ring"], host)
      loop = cls(
          step=step, skipped_updates=host["skipped_updates"],
          consecutive_skipped=host.get("consecutive_skipped", 0),
          val_accuracy={int(k): from_json_num(a) for k, a in host["val_accuracy"].items()},
          metrics_lines=host["metrics_lines"],
          warmup=cls.restore_warmup(host), config=host.get("config", {}))
    except UnreadableStep:
      raise
    except Exception as e:  # noqa: BLE001  a host record that does not fit its arrays
      raise UnreadableStep(reader.directory, step, restore_cause(e)) from e
    loop.went_back = not reader.read_only and any(s > step for s in reader.all_steps())
    return restored["train"], loop
