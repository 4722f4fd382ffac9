"""`LagPipeline`: the forced-lag pipeline as one object, driven the same way by the trainer and
by the tests.

It owns the submission gate (`LagGate`, L+1 slots), the params handoff (`ParamsHandoff`), the
rollout worker (a supervised thread, or inline in the caller's thread), publishing, pruning and
checkpoint state. A training loop is

    with LagPipeline(producer, lag) as pipe:
      pipe.publish(0, params)
      for step in range(1, steps + 1):
        batch_id, item = pipe.pull()      # the batch started L steps earlier (after warm-up)
        params = train(params, item)
        pipe.publish(step, params)

Publishing version t before pulling batch t + 1 is the trainer's only duty; the pipeline then
gives batch b exactly params version max(0, b - L) (`params_version`), so first-token staleness
at consumption is exactly min(t, L) whatever the timing. `pull` prunes the published versions no
batch can still ask for.

`producer` makes the batches: `produce(batch_id, params, version) -> item`; for checkpoints it
also has `state_dict()`/`load_state_dict(host)` (its RNG and counters) and is the ring's codec:
`encode(item) -> (arrays, json)`, `target(json) -> abstract arrays`, `decode(arrays, json) ->
item`. `state_dict()` first waits until the ring is full and the worker idle (`LagGate.quiesce`),
so a checkpoint holds every batch already made for later steps and nothing is produced twice
after a resume.

Several processes: a producer with `globalize(item) -> item` makes process-local items (each
process its share of the batch, on its own devices; `jaxrl.pipeline.producer`). The worker thread
then never launches a program that spans processes; everything global is the caller's thread's,
in the same order on every process: `publish` (the publisher's copy onto each process's rollout
mesh), and `globalize` of each batch when it is pulled (or, for a checkpoint, in `state_dict`,
in batch order). Counters a globalized item carries are added when it is globalized.

A lag that tunes itself: pass a `LagTuner` (`jaxrl.pipeline.tuner`) as `lag`. The pipeline times
each batch's `produce` and the trainer's time between pulls, asks the tuner at each of its
decision points (the start of a pull) and sets the lag it chooses on the gate from the first
batch no lag can have started (`LagGate.set_lag`), saying each change with its reason. The
version of every batch is then `gate.version_of(b)`, its staleness at consumption exactly the
lag recorded for it (`stats()["lag"]`, the metric `pipeline/lag`), and checkpoints hold the
gate's lag schedule and the tuner's measurements.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from jaxrl.pipeline.gate import LagGate
from jaxrl.pipeline.handoff import ParamsHandoff
from jaxrl.pipeline.tuner import LagTuner
from jaxrl.pipeline.turns import SamplerFirst
from jaxrl.pipeline.worker import InlineWorker, RolloutWorker


class LagPipeline:

  def __init__(self, producer, lag: int | LagTuner, *, stall_timeout_s: float = 600.0,
               inline: bool = False, publisher: Callable | None = None,
               handoff: ParamsHandoff | None = None, name: str = "rollout-worker",
               say: Callable[[str], None] = lambda line: None,
               turns: SamplerFirst | None = None):
    """`producer`: see the module docstring (a bare `produce` callable works without
    checkpoints). An item with a `counts` mapping adds it to the cumulative counters of
    `stats()` when delivered. `inline`: produce in the caller's thread just before each pull
    (same batches, versions and staleness; no overlap). `publisher(version, params)`: what is
    published for `params` (a copy the train step cannot donate, a reshard onto the rollout
    mesh, or nothing here: `jaxrl.run.topology`'s publishers); default `params` as given.
    `handoff`: the params handoff to publish to, when the producer was built reading it
    (partial rollouts read `handoff.latest`); default a new one.
    A producer with `bind_stop(should_stop)` is given the worker's stop test, which its waits
    poll (a producer that waits on other processes).
    `lag`: an int, or a `LagTuner` (the lag tunes itself; module docstring) whose changes are
    told to `say`, one line each.
    `turns`: a `SamplerFirst` the producer's device sections mark (`jaxrl.pipeline.turns`):
    a pull that had to wait for its batch (the worker is the slower side) then returns once
    the first device section of the batch the worker makes next has run (the trainer lets it
    go first on devices the two share)."""
    self.producer = producer
    make = getattr(producer, "produce", producer)

    self.turns = turns if not inline else None  # inline: the worker is the trainer's thread
    making = contextlib.nullcontext if self.turns is None else self.turns.making
    self.tuner = lag if isinstance(lag, LagTuner) else None
    lag = lag.start if self.tuner else lag

    def produce(batch_id: int, params, version: int):
      began = time.monotonic()
      with making(batch_id):
        item = make(batch_id, params, version)
      if self.tuner is not None and self._made:  # the first batch made here compiles
        self.tuner.observe_generation(batch_id, time.monotonic() - began)
      self._made += 1
      for name, n in (getattr(item, "counts", None) or {}).items():
        self.gate.add(name, n)
      return item

    self.lag = lag  # of batch 0; `gate.lag_of(b)` of any batch
    self.say = say
    self.gate = LagGate(lag, stall_timeout_s, max_lag=self.tuner.max_lag if self.tuner else lag)
    self._pulled_at: float | None = None  # when the last pull returned (the trainer's time)
    self._told = False  # a decision was said (the first always is)
    # Batches made and steps timed by this pipeline: the first of each compiles (after a resume
    # too), so neither is measured.
    self._made = self._timed = 0
    self.handoff = handoff or ParamsHandoff()
    self.inline = inline
    self.publisher = publisher or (lambda version, params: params)
    self.worker = InlineWorker(self.gate, self.handoff, produce, lag) if inline else \
        RolloutWorker(self.gate, self.handoff, produce, lag, name=name)
    if hasattr(producer, "bind_stop"):
      producer.bind_stop(self.worker.should_stop)
    self._globalized: dict[int, object] = {}  # by batch id: made global before their pull
    self._replay: dict[int, object] = {}  # params versions a partial checkpoint kept (restore)

  # ---- running -------------------------------------------------------------------------------

  def __enter__(self) -> "LagPipeline":
    self.worker.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    return self.worker.__exit__(exc_type, exc, tb)

  def close(self) -> None:
    """Stops the worker (idempotent); every wait in the pipeline wakes."""
    self.worker.stop()

  def publish(self, version: int, params):
    """Publishes `publisher(version, params)` as `version`; returns what was published."""
    published = self.publisher(version, params)
    self.handoff.publish(version, published)
    return published

  def pull(self) -> tuple[int, object]:
    """The next batch in order, `(batch_id, item)`, waiting for it (inline: producing first)."""
    if self.tuner is not None:
      self._tune()
    if self.inline:
      self.worker.catch_up()
    batch_id, item = self.gate.pull()
    # A pull that waited: the worker is the slower side, its next device section goes first.
    waited = self.turns is not None and self.gate.last_pull_waited
    nxt = self.gate.next_to_make() if waited else None
    if nxt is not None:
      self.turns.wait(nxt + 1, lambda: self.gate.ended, self.gate.stall_timeout_s)
    item = self._globalize(batch_id, item)
    # The next batch to start is >= batch_id + 1 (version >= batch_id + 1 - L at a fixed lag).
    self.handoff.prune_below(self.gate.version_floor(batch_id + 1))
    self._pulled_at = time.monotonic()
    return batch_id, item

  def _tune(self) -> None:
    """The tuner's measurement of the trainer's last step and, at its decision points, the lag
    of the first batch no lag can have started (`LagTuner`)."""
    nxt = self.gate.checkpoint_state()["consumed"]  # the batch this pull returns
    if self._pulled_at is not None:
      if self._timed:
        self.tuner.observe_train(nxt - 1, time.monotonic() - self._pulled_at)
      self._timed += 1
    choice = self.tuner.decide(nxt)
    if choice is None:
      return
    first = nxt + self.gate.max_lag + 1
    before = self.gate.lag_of(first)
    self.gate.set_lag(first, choice.lag)
    # Each change is said, and the first decision even when it keeps the starting lag.
    if choice.lag != before or not self._told:
      change = f"{before} -> {choice.lag}" if choice.lag != before else f"{before} kept"
      self.say(f"lag {change} from step {first + 1} (decided at step {nxt + 1}, "
               f"rollout.lag_every={self.tuner.every}): {choice.reason}")
      self._told = True

  def _globalize(self, batch_id: int, item):
    """`producer.globalize(item)` once per batch (caller's thread); its counters are added."""
    done = self._globalized.pop(batch_id, None)
    if done is not None:
      return done
    globalize = getattr(self.producer, "globalize", None)
    if globalize is None:
      return item
    out = globalize(item)
    if out is not item:
      for name, n in (getattr(out, "counts", None) or {}).items():
        self.gate.add(name, n)
    return out

  def next_batch(self) -> int:
    """The first batch not yet submitted (after a restore: the first the ring does not hold)."""
    return self.gate.checkpoint_state()["submitted"]

  def newest(self) -> tuple[int, object] | None:
    """The newest published `(version, params)`: the source of partial rollouts."""
    return self.handoff.latest()

  def stats(self) -> dict:
    """The gate's snapshot (`LagGate.stats`): slots, waits, counters; with `turns`, the
    trainer's total wait for the worker's device sections (`turn_wait_s`)."""
    out = self.gate.stats()
    if self.turns is not None:
      out["turn_wait_s"] = self.turns.waited_s
    return out

  # ---- checkpoints ---------------------------------------------------------------------------

  def state_dict(self, partial: bool = False) -> tuple[dict, dict] | None:
    """`(arrays, host)`: the delivered, unpulled batches' arrays by batch id, and the JSON the
    rest needs (gate counters, the batches' metadata, the producer's state). Waits (at most
    `rollout.stall_timeout_s`) for the ring to fill first.

    `partial`: the ring as it is, not full (its worker failed or waits on rollouts that will not
    come; `LagGate.delivered`): the undelivered batches are made again after a resume, from the
    params versions the forced lag gives them, older than the newest (b - L for an undelivered
    batch b), so those versions are saved too (`kept`, the publisher's copies of what it published). None when the
    publisher keeps no such copies (the caller saves nothing)."""
    if not partial:
      items, gate = self.gate.quiesce(self.gate.stall_timeout_s), None
    else:
      items, gate = self.gate.delivered()
    arrays, ring = {}, {}
    host = {"gate": gate or self.gate.checkpoint_state(), "ring": ring}
    if partial:
      newest = self.handoff.latest_version
      need = range(self.gate.version_floor(gate["submitted"]), newest)
      kept = getattr(self.publisher, "kept", lambda versions: None)(need)
      if kept is None:
        return None
      arrays["versions"] = {str(v): a for v, a in kept.items()}
      host["versions"] = {str(v): [list(a.shape), a.dtype.str] for v, a in kept.items()}
    for bid in sorted(items):  # globalize: the same order on every process
      item = self._globalized[bid] = self._globalize(bid, items[bid])
      arrays[str(bid)], ring[str(bid)] = self.producer.encode(item)
    if self.tuner is not None:
      host["tuner"] = self.tuner.state_dict()
    return arrays, {**self.producer.state_dict(), **host}

  def target(self, host: dict) -> dict:
    """The abstract arrays `state_dict()`'s arrays restore into, from its `host`."""
    out = {bid: self.producer.target(h) for bid, h in host["ring"].items()}
    if "versions" in host:
      out["versions"] = self.publisher.kept_target(host["versions"])
    return out

  def load_state_dict(self, arrays: dict, host: dict) -> None:
    """Puts a fresh pipeline (before `__enter__`) where the checkpointed one was."""
    ready = {int(bid): self.producer.decode(arrays[bid], h) for bid, h in host["ring"].items()}
    self.gate.restore(host["gate"], ready)
    if self.tuner is not None:
      self.tuner.load_state_dict(host.get("tuner", {}))
    self.producer.load_state_dict(host)
    self._replay = {int(v): a for v, a in arrays.get("versions", {}).items()}

  def republish(self) -> None:
    """Publishes again the params versions a partial checkpoint kept (`state_dict(partial=True)`;
    nothing otherwise), oldest first, before the run publishes its newest: the undelivered
    batches that need them start from them as they would have."""
    for version in sorted(self._replay):
      self.handoff.publish(version, self.publisher.replay(version, self._replay[version]))
    self._replay = {}
