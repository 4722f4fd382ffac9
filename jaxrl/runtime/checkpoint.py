"""Checkpoints of a run: the device state and the host state, saved together, restored anywhere.

Layout: one directory per run (`checkpoint_dir(run_dir)` = `<run_dir>/checkpoints`), one
subdirectory per saved step (`<dir>/<step>/`), each holding two items written by one Orbax
`CheckpointManager` save:

- `state`: the pytree of `jax.Array`s (`TrainState`: params, optimizer state, step, reference
  params), through Orbax's standard PyTree handler. Every process writes its own shards.
- `host`: a JSON dict of everything else resume needs (numpy RNG states, data cursor, counters,
  the lag ring's batch metadata, the validation schedule, ...), written by process 0.
- `digest`: a CRC-32 of every array, computed off the training thread and checked by every
  restore (`jaxrl.runtime.digest`): bytes damaged after the save make the step unreadable.

Contract:

- Atomic steps. Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
  only after every item is written (`commit_success.txt` is written just before the rename). A run
  killed at any moment leaves either a finished step or a tmp directory, and nothing here reads a
  tmp directory as a step: `latest_step`, `restore(None)` and `resolve_resume` only see finalized
  steps. `latest_step` also hides the step of a save still in flight in this process (Orbax's own
  step list already counts it). Opening a writable `Checkpointer` deletes stale tmp directories.
- Asynchronous saves. `save` returns once the arrays have been copied to host memory; writing
  and the rename happen in a background thread. The caller may then donate or overwrite the state
  and mutate `host` (the dict is snapshotted through JSON before `save` returns). `wait` blocks
  until the last save is durable; the next `save`, `restore` and `close` wait on their own.
- One history per directory. Saving a step that is already there (on disk or in flight) is
  skipped and returns False, never overwritten: a step number names one state of the run (the
  count of applied updates), so a second save of it - e.g. the SIGTERM save right after a periodic
  one - holds the same state. Saving a step older than the latest means the run went back (it
  resumed from an older checkpoint into this directory): without `force` that raises, since
  interleaving two histories would make `auto` resume pick the abandoned one; `force=True` deletes
  the newer steps first (with a warning) and saves. `replace=True` also deletes a step of the
  same number: a run that resumed from an older checkpoint because the newer ones could not be
  restored replaces them with its own.
- `keep` newest steps are kept; older ones are deleted once the new step is durable, so a crash
  mid-save still leaves `keep` finished checkpoints.
- Restore always takes an *abstract* target (`jax.ShapeDtypeStruct` with a sharding per leaf)
  describing the state on the current mesh: Orbax then reads each shard straight onto its device,
  so a checkpoint written on 1 device restores onto 8 or onto a different mesh. Without a target
  Orbax would rebuild the saving run's shardings, which fails on another topology.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import re
import shutil
import threading
import warnings

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxrl.core.errors import UserError
from jaxrl.runtime import digest, quiet
from jaxrl.runtime.host_json import (  # noqa: F401  (the names checkpoint users import from here)
    check_json, from_json_num, json_num, numpy_rng_state, restore_numpy_rng)

CHECKPOINT_SUBDIR = "checkpoints"
_ITEMS = ("state", "host", digest.ITEM)
# Files every finalized step holds: Orbax's step metadata, the host JSON, the state's tree
# metadata and its OCDBT manifest.
_STEP_FILES = ("_CHECKPOINT_METADATA", "host/metadata", "state/_METADATA", "state/manifest.ocdbt")


class CheckpointError(UserError):
  """A checkpoint that cannot be used (unreadable, or none left to resume from), or a save that
  failed; the message names the path and the cause."""


def _os_cause(e: BaseException) -> BaseException:
  """The innermost OSError in `e`'s chain (the disk's own words), else `e`."""
  seen = e
  while seen is not None:
    if isinstance(seen, OSError):
      return seen
    seen = seen.__cause__ or seen.__context__
  return e


def _errno_of(e: BaseException) -> int | None:
  """The OS error number behind a failed write: an OSError's, or the one TensorStore writes into
  its message (`[os_error_code='28']`, raised by Orbax as a ValueError)."""
  seen = e
  while seen is not None:
    if isinstance(seen, OSError) and seen.errno is not None:
      return seen.errno
    found = re.search(r"os_error_code='(\d+)'", str(seen))
    if found:
      return int(found.group(1))
    seen = seen.__cause__ or seen.__context__
  return None


def _mib(n: float) -> str:
  return f"{n / 2**20:.1f} MiB"


def step_problem(directory: str, step: int) -> str | None:
  """What makes finalized checkpoint `step` of `directory` unusable, or None.

  Checked without reading the arrays: every file a step holds is there (`_STEP_FILES`), the host
  JSON, the state metadata and the digests (of a step saved with them) parse, and no array data
  file is empty. Anything else (truncated, corrupt or damaged array data) is found by the
  restore itself, which reads and hashes every array (`Checkpointer.restore` raises
  `UnreadableStep` for any failure).
  """
  root = os.path.join(_abs(directory), str(step))
  hashed = (f"{digest.ITEM}/metadata",) if digest.required(root) else ()
  for rel in _STEP_FILES + hashed:
    if not os.path.isfile(os.path.join(root, rel)):
      return f"{rel} is missing"
  for rel in ("host/metadata", "state/_METADATA") + hashed:
    try:
      with open(os.path.join(root, rel), "rb") as f:
        got = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
      return f"{rel} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(got, dict):
      return f"{rel} is not a JSON object"
  for top, _, files in os.walk(os.path.join(root, "state")):
    for name in files:
      path = os.path.join(top, name)
      if os.path.basename(top) == "d" and os.path.getsize(path) == 0:
        return f"{os.path.relpath(path, root)} is empty"
  return None


def checkpoint_dir(run_dir: str) -> str:
  """Where a run keeps its checkpoints (what `resolve_resume("auto", run_dir)` looks at)."""
  return str(epath.Path(run_dir) / CHECKPOINT_SUBDIR)


def _abs(path: str) -> str:
  # Orbax wants absolute paths; remote paths (gs://...) already are and must not be touched.
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def complete_steps(directory: str) -> list[int]:
  """Finalized steps in `directory` (sorted; tmp directories of interrupted saves excluded)."""
  return sorted(ocp.path.step.checkpoint_steps(_abs(directory)))


class Checkpointer:
  """Orbax CheckpointManager wrapper: one directory, steps as subdirectories.

  Every process of a multi-process run must make the same calls in the same order (Orbax
  synchronises them); see the module docstring for the contract.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False, processes: tuple[int, ...] | None = None, say=print):
    """`processes`: the processes that save and restore (None: all); the others make no calls.
    `say`: where the one line about a step restored without digests goes."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
      raise ValueError(f"checkpoint keep must be an int >= 1, got {keep!r}")
    self.directory = _abs(directory)
    self.keep = keep
    self.read_only = read_only
    self._async = async_save
    self.save_bytes = 0  # the arrays and host JSON of the last save: what a save needs on disk
    self.say = say
    # Digests: one thread per save waits on the hashers (zlib releases the GIL: arrays hash in
    # parallel); Orbax's commit of the `digest` item waits on that thread's result.
    self._digests = concurrent.futures.ThreadPoolExecutor(1, "jaxrl-digest")
    self._hashers = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1),
                                                          "jaxrl-digest-crc")
    quiet.install()  # Orbax's threads repeat a failure this class reports (jaxrl.runtime.quiet)
    some = {}
    # Process 0 saving alone among several holds every array whole, which Orbax refuses to write
    # as a jax.Array: it saves their host copies (Orbax writes numpy arrays from process 0 only).
    self._host_copies = processes is not None and jax.process_count() > 1 and len(processes) == 1
    if self._host_copies and tuple(processes) != (0,):
      raise ValueError(f"process {processes[0]} cannot save alone: only process 0 can")
    if processes is not None:
      os.makedirs(self.directory, exist_ok=True)  # Orbax does not, for some of the processes
      some = {"multiprocessing_options": ocp.options.MultiprocessingOptions(
          primary_host=min(processes), active_processes=set(processes))}
    if read_only:
      # Reading another run's checkpoints: no tmp cleanup (its save may be in flight), no pruning.
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                             save_interval_steps=0, **some)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1,
                                             create=processes is None,
                                             cleanup_tmp_directories=True,
                                             enable_async_checkpointing=async_save, **some)
    self._mngr = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def save(self, step: int, state, host: dict, *, force: bool = False,
           replace: bool = False) -> bool:
    """Starts saving `state` (pytree of jax.Arrays) and `host` (JSON dict) as checkpoint `step`.

    Returns whether a save was started: False when `step` already exists (or is in flight),
    unless `replace`. A step older than the latest raises ValueError unless `force` (or
    `replace`), which first deletes the newer steps (`replace`: and `step`; see the module
    docstring). Also raises, before anything is written, if `host` would not
    come back from JSON unchanged.
    """
    if self.read_only:
      raise ValueError(f"checkpoint directory {self.directory} was opened read-only")
    step = int(step)
    check_json(host, "host")
    host = json.loads(json.dumps(host))  # a snapshot: the caller may mutate host right away
    steps = self._mngr.all_steps()  # includes a save in flight
    force = force or replace
    if step in steps and not replace:
      return False
    newer = sorted(s for s in steps if s > step or (replace and s == step))
    if newer and not force:
      raise ValueError(f"checkpoint step {step} is older than step {newer[-1]} already in "
                       f"{self.directory}; save with force=True to delete steps {newer}, or save "
                       "into another directory")
    if newer:
      self.wait()
      warnings.warn(f"deleting checkpoint steps {newer} of {self.directory}: the run went back "
                    f"(it resumed from an older step) and saves step {step}", stacklevel=2)
      for s in newer:
        self._mngr.delete(s)
    self.save_bytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state)) + \
        len(json.dumps(host))
    hashed = digest.verifiable(state)
    # The digests hash a host copy taken now (the caller may donate the arrays next; on a CPU it
    # shares their memory). Orbax gets the jax.Arrays, its numpy path being slower
    # (benchmarks/README.md, "Checkpoint array digests"), unless only process 0 writes.
    copy = jax.device_get(state) if self._host_copies or hashed else None
    state = copy if self._host_copies else state
    items = {"state": ocp.args.StandardSave(state), "host": ocp.args.JsonSave(host)}
    # An async save hashes once `save` returned: sooner, it competed with Orbax's own copy.
    gate = threading.Event()
    if not self._async:
      gate.set()  # a synchronous save writes the digests inside `save`
    if hashed:
      items[digest.ITEM] = digest.DigestSave(self._digests.submit(digest.compute, copy,
                                                                  self._hashers, gate))
    # force: Orbax's own save-interval rule must not skip what the caller decided to save.
    try:
      return bool(self._mngr.save(
          step, force=True, args=ocp.args.Composite(**items),
          custom_metadata={digest.MARK: digest.ALGORITHM} if hashed else None))
    except Exception as e:  # noqa: BLE001  a full disk, a read-only or vanished directory; also
      # the previous save's failure, which Orbax raises here (a ValueError for TensorStore's)
      raise self._save_failed(e) from e
    finally:
      gate.set()

  def wait(self) -> None:
    """Blocks until pending async saves are durable (renamed to their step); a failed one raises
    `CheckpointError` naming the directory and the OS error."""
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (Orbax wraps the writer's error)
      raise self._save_failed(e) from e

  def check(self) -> None:
    """Raises `CheckpointError` if a background save has failed (without waiting for one in
    flight): called every step, so a full disk stops the run at once, not at the next save."""
    try:
      self._mngr.check_for_errors()
    except Exception as e:  # noqa: BLE001
      raise self._save_failed(e) from e

  def _save_failed(self, e: BaseException) -> CheckpointError:
    """One line: the directory, and for a full disk the space a checkpoint needs and the space
    left; else the OS error (or the innermost error's first line)."""
    code = _errno_of(e)
    if code in (errno.ENOSPC, errno.EDQUOT):
      try:
        free = _mib(shutil.disk_usage(self.directory).free)
      except OSError:
        free = "unknown"
      return CheckpointError(
          f"saving a checkpoint in {self.directory} failed: {os.strerror(code)} (a "
          f"checkpoint of this run needs about {_mib(self.save_bytes)}, {free} free there); "
          "free space or point --config.run_dir elsewhere, then rerun the same command to "
          "resume; the checkpoints already there are intact")
    cause = _os_cause(e)
    text = f"{type(cause).__name__}: {cause}" if cause is not e or isinstance(e, OSError) \
        else restore_cause(e)
    return CheckpointError(f"saving a checkpoint in {self.directory} failed: "
                           f"{text.splitlines()[0][:400]}; the checkpoints already there are "
                           "intact")

  def all_steps(self) -> list[int]:
    """Finalized steps, oldest first (an in-flight save is not listed)."""
    return sorted(s for s in self._mngr.all_steps() if self._finalized(s))

  def latest_step(self) -> int | None:
    """The newest finalized step, or None. Never an interrupted or still-in-flight save."""
    for step in sorted(self._mngr.all_steps(), reverse=True):
      if self._finalized(step):
        return step
    return None

  def _finalized(self, step: int) -> bool:
    # Orbax lists a step as soon as its save starts; its directory exists (locally: is renamed
    # from the tmp name; remotely: has commit_success.txt) only once it is complete.
    return ocp.path.step.is_path_finalized(epath.Path(self.directory) / str(step))

  def restore(self, step: int | None, target) -> tuple[object, dict]:
    """Returns `(state, host)` of `step` (None: the latest), laid out as `target` says.

    `target` describes the state on the current mesh: ShapeDtypeStructs with shardings (e.g.
    `abstract_like(fresh_state)`), or concrete arrays, which are reduced to that first. Pending
    saves are waited for, so a step saved by this process is readable.
    """
    step = self._existing(step)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_like(target)), host=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001  truncated or corrupt files: Orbax raises ValueError,
      # OSError, or a bare Exception wrapping TensorStore's error for an array's bytes
      raise UnreadableStep(self.directory, step, restore_cause(e)) from e
    self._verify(step, out.state)
    return out.state, out.host

  def _verify(self, step: int, tree) -> None:
    """Raises `UnreadableStep` naming the first array of restored `tree` whose bytes differ
    from the digest saved with step `step`; a step saved without digests is restored (one
    line through `say`)."""
    root = os.path.join(self.directory, str(step))
    if not digest.required(root) or not digest.verifiable(tree):
      why = "saved without them" if digest.verifiable(tree) else "arrays span processes"
      self.say(f"jaxrl: checkpoint {root} restored without verifying its array digests ({why})")
      return
    try:
      problem = digest.mismatch(digest.read(root), tree, self._hashers)
    except (OSError, ValueError) as e:
      problem = f"{digest.ITEM}/metadata is unreadable ({type(e).__name__}: {e})"
    if problem is not None:
      raise UnreadableStep(self.directory, step, problem)

  def restore_params(self, step: int | None, target) -> tuple[int, object]:
    """`(step, params)`: only the policy parameters of a training checkpoint (the optimizer
    state, reference and saved rollouts are not read), laid out as `target` (abstract params
    with shardings) says. For exporting a model without building the train step."""
    step = self._existing(step)
    tgt = {"train": {"params": abstract_like(target)}}
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), tgt)
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=tgt, restore_args=args, partial_restore=True)))
    self._verify(step, out.state)
    return step, out.state["train"]["params"]

  def restore_fields(self, step: int | None, targets: dict) -> tuple[int, dict]:
    """`(step, {field: value})`: only the named fields of a checkpoint's train state (e.g.
    `{"params": adapters, "frozen": base}` for a LoRA run, whose `params` are its adapters and
    `frozen` its base model), each laid out as its target (abstract, with shardings) says;
    nothing else is read. A target that does not fit the checkpoint (a missing field, another
    tree or shape) raises Orbax's `ValueError` or `TypeError`."""
    step = self._existing(step)
    tgt = {"train": {k: abstract_like(v) for k, v in targets.items()}}
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), tgt)
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=tgt, restore_args=args, partial_restore=True)))
    self._verify(step, out.state)
    return step, {k: out.state["train"][k] for k in targets}

  def _existing(self, step: int | None) -> int:
    """`step`, or the latest complete one for None; an error naming the directory otherwise."""
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    elif int(step) not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory} "
                              f"(steps: {self.all_steps()})")
    return int(step)

  def read_host(self, step: int | None = None) -> tuple[int, dict]:
    """`(step, host)` of `step` (None: the latest) without reading the arrays: the host dict
    says what the state holds (e.g. the shapes of saved rollout batches), which the caller
    needs to build the abstract target of `restore`."""
    step = self._existing(step)
    out = self._mngr.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
    return int(step), out.host

  def close(self) -> None:
    """Waits for pending saves, then releases Orbax's threads. A pending save that failed (a
    full disk found by another write first, e.g. metrics.jsonl's) raises `CheckpointError`, one
    line like `wait`'s, not Orbax's own error."""
    try:
      self._mngr.close()
    except Exception as e:  # noqa: BLE001  (Orbax wraps the writer's error)
      raise self._save_failed(e) from e
    finally:
      self._digests.shutdown()
      self._hashers.shutdown()


def restore_cause(e: BaseException) -> str:
  """One line saying why a restore failed: the innermost error's type and first line (Orbax wraps
  TensorStore's `OUT_OF_RANGE` reading a truncated array in a bare Exception)."""
  inner = e
  while inner.__cause__ is not None and inner.__cause__ is not inner:
    inner = inner.__cause__
  text = str(inner).strip()
  first = text.splitlines()[0][:300] if text else ""
  return f"{type(inner).__name__}: {first}" if first else type(inner).__name__


class UnreadableStep(CheckpointError):
  """Checkpoint `step` of `directory` could not be read (`reason`)."""

  def __init__(self, directory: str, step: int, reason: str):
    self.directory, self.step, self.reason = directory, step, reason
    super().__init__(f"checkpoint {os.path.join(directory, str(step))} is unreadable: {reason}")


def choose_step(directory: str, step: int | None = None, *, exclude=(), say=print
                ) -> tuple[int, dict]:
  """`(step, host)`: checkpoint `step` of `directory` if given, else the newest usable one.

  An unusable step (`step_problem`) is reported through `say` in one line and the next older one
  is tried; steps in `exclude` (found unreadable by a restore, reported then) are skipped. A named
  `step` that is unusable, or no usable step at all, raises `CheckpointError`.
  """
  steps = complete_steps(directory)
  if step is not None:
    if step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {directory} (steps: {steps})")
    steps = [step]
  for s in sorted(steps, reverse=True):
    if s in exclude and step is None:
      continue
    problem = "its arrays could not be read" if s in exclude else step_problem(directory, s)
    if problem is None:
      with open(os.path.join(_abs(directory), str(s), "host", "metadata"), "rb") as f:
        return s, json.loads(f.read().decode("utf-8"))
    where = os.path.join(directory, str(s))
    if step is not None:
      raise CheckpointError(f"checkpoint {where} is unusable: {problem}")
    say(f"jaxrl: checkpoint {where} is unusable ({problem}); trying the one before it")
  raise CheckpointError(f"no usable checkpoint in {directory} (steps {steps}); start over with "
                        "--config.resume=none --config.overwrite=true, or resume from another "
                        "directory")


def abstract_like(state):
  """`jax.ShapeDtypeStruct(shape, dtype, sharding)` per leaf: a restore target without memory.

  Leaves that are already ShapeDtypeStructs pass through; each needs a sharding, since a restore
  without one would not know which devices to put the array on.
  """

  def leaf(x):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(f"restore target leaf {type(x).__name__}{getattr(x, 'shape', '')} has no "
                       "sharding; build the target from arrays on the current mesh")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(leaf, state)


def resolve_resume(resume: str, run_dir: str) -> tuple[str, int | None] | None:
  """`(checkpoint directory, step or None for its newest usable)` a run resumes from, or None to
  start fresh.

  - "none": start fresh (even if the run directory holds checkpoints).
  - "auto": the run's own checkpoint directory if it holds a finished checkpoint, else None, so
    a restarted (e.g. preempted) run continues where it was and a new run starts.
  - anything else: a checkpoint directory, a run directory holding one, or one step of it
    (`<run_dir>/checkpoints/<step>`); it must exist and hold a finished checkpoint
    (`CheckpointError` naming the path otherwise): asking to resume from something that is not
    there is a mistake, not a fresh start.
  """
  if resume == "none":
    return None
  if resume == "auto":
    own = _abs(checkpoint_dir(run_dir))
    return (own, None) if epath.Path(own).exists() and complete_steps(own) else None
  path = _abs(resume).rstrip("/")
  if not epath.Path(path).exists():
    raise CheckpointError(f"resume path {resume!r} does not exist")
  if not epath.Path(path).is_dir():
    raise CheckpointError(f"resume path {resume!r} is not a directory")
  if complete_steps(path):
    return path, None
  nested = _abs(checkpoint_dir(path))
  if epath.Path(nested).exists() and complete_steps(nested):
    return nested, None
  parent, name = os.path.dirname(path), os.path.basename(path)
  if name.isdigit() and int(name) in complete_steps(parent):
    return parent, int(name)
  raise CheckpointError(f"resume path {resume!r} holds no complete checkpoint")
