"""A run directory has one owner and one run.

- `RunDirLock`: an OS lock (`flock`) on `<run_dir>/.jaxrl.lock`, held for the run's life, so a
  dead owner holds nothing whatever its pid; the file holds the owner's host, pid and start time,
  named when a second run in the same directory is refused. On a filesystem without locks the
  owner line alone decides (a lock whose pid is not alive on the same host is taken over).
- `existing_run` / `move_aside`: the files a run writes. A run that starts over in a directory
  holding another run's files (killed before its first checkpoint, or `--config.overwrite=true`)
  first moves them to `<run_dir>/previous-<n>/`, named on the console: nothing is appended to an
  old `metrics.jsonl` and nothing is deleted.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import time

try:
  import fcntl
except ImportError:  # not a POSIX system: the owner line alone (`RunDirLock`)
  fcntl = None

from jaxrl.runtime import checkpoint
from jaxrl.core.errors import UserError

LOCK_FILE = ".jaxrl.lock"
# What a run writes into its directory (jaxrl.run.driver.run, jaxrl.export.METADATA_DIR aside; the
# metrics sinks of jaxrl.observe.sinks).
RUN_FILES = ("metrics.jsonl", "summary.json", "config.json", "curves.png", "checkpoints",
             "hf_base", "tensorboard", "wandb")


# A run started from a Hugging Face model keeps that model's files besides the weights here
# (`python -m jaxrl.export` writes them next to the exported weights).
METADATA_DIR = "hf_base"
# Everything of a Hugging Face model directory except the weights.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json", "added_tokens.json")


def copy_metadata(src: str, dst: str) -> list[str]:
  """Copies the metadata files present in `src` to `dst`; returns their names."""
  os.makedirs(dst, exist_ok=True)
  copied = []
  for name in METADATA_FILES:
    path = os.path.join(src, name)
    if os.path.isfile(path):
      shutil.copyfile(path, os.path.join(dst, name))
      copied.append(name)
  return copied


class RunDirError(UserError):
  """The run directory cannot be used as asked (in use, or holding another run)."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process: alive
    return True
  return True


# The errors of `flock` on a filesystem that has no locks (some NFS mounts, some FUSE ones): the
# lock falls back to the owner line's pid.
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
# The locks this process holds, by the lock file's real path: a second `RunDirLock` on one
# directory in one process is refused even where the kernel emulates `flock` with per-process
# POSIX locks (NFS), and a forked child closes its copies (it neither keeps a lock past its
# parent's death nor releases the parent's).
_HELD: dict[str, "RunDirLock"] = {}


def _close_in_child() -> None:
  for lock in list(_HELD.values()):
    lock.forget()


if hasattr(os, "register_at_fork"):  # POSIX
  os.register_at_fork(after_in_child=_close_in_child)


class RunDirLock:
  """Exclusive ownership of a run directory, held for the run's life; a context manager.

  The lock is the kernel's (`fcntl.flock` on `<run_dir>/.jaxrl.lock`, its file descriptor kept
  open until `release`), so a run that dies, even by SIGKILL, holds nothing, whatever pid its
  restart gets (in a container the run is pid 1 every time). The file also holds the owner line
  (host, pid, start), which a refused run names. On a filesystem without locks (`flock` raises
  ENOLCK or EOPNOTSUPP: some NFS) it falls back to the owner line alone: the file is created
  exclusively and a lock whose pid is not alive on the same host is taken over, so there a lock
  that names a live pid (the restarted run's own, in a container) is removed by hand.
  """

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, LOCK_FILE)
    self.owner = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    self.held = self.created = False
    self.fd: int | None = None  # the flock's descriptor while held (None: the fallback)
    self.key: str | None = None  # its key in `_HELD`

  def acquire(self) -> RunDirLock:
    self.created = not os.path.exists(self.run_dir)  # removed again if the run writes nothing
    os.makedirs(self.run_dir, exist_ok=True)
    key = os.path.realpath(self.path)
    if key in _HELD:
      raise self.in_use(_HELD[key].owner)
    if fcntl is None or not self._acquire_flock():
      self._acquire_by_pid()
    self.key = key
    _HELD[key] = self
    return self

  def _acquire_flock(self) -> bool:
    """Takes the kernel lock and writes the owner line; False on a filesystem without locks."""
    for _ in range(100):  # a retry when the owner removed the file between our open and flock
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        raise self.in_use(self._read()) from None
      except OSError as e:
        os.close(fd)
        if e.errno in NO_LOCKS:
          return False
        raise
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # we locked a file its owner has just removed: lock the one there now
        os.close(fd)
        continue
      os.ftruncate(fd, 0)
      os.write(fd, json.dumps(self.owner).encode())
      self.fd, self.held = fd, True
      return True
    raise RunDirError(f"could not take the lock {self.path}; it was removed and recreated "
                      "100 times while this run tried")

  def _acquire_by_pid(self) -> None:
    """The fallback: an exclusively created file; a stale one (its pid gone) is taken over."""
    for _ in range(2):  # a second try after taking over a stale lock
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        other = self._read()
        if other is not None and (other.get("host") != self.owner["host"] or
                                  _alive(int(other.get("pid", -1)))):
          raise self.in_use(other, stale=True) from None
        try:  # its owner is gone (or the file is unreadable garbage): take it over
          os.remove(self.path)
        except FileNotFoundError:
          pass
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(self.owner, f)
      self.held = True
      return
    raise RunDirError(f"could not take the lock {self.path}; another run took it first")

  def in_use(self, other: dict | None, stale: bool = False) -> RunDirError:
    """The refusal naming the owner line `other` (None: unreadable, being written)."""
    who = ("another process (its owner line is being written)" if other is None else
           f"pid {other.get('pid')} on {other.get('host')} (since {other.get('started')})")
    hint = f" (a stale lock is {self.path})" if stale else ""
    return RunDirError(f"run directory {self.run_dir} is in use by {who}; wait for it, stop it, "
                       f"or pick another --config.run_dir{hint}")

  def _read(self) -> dict | None:
    try:
      with open(self.path) as f:
        got = json.load(f)
      return got if isinstance(got, dict) else None
    except (OSError, ValueError):
      return None

  def forget(self) -> None:
    """Drops this process's hold without touching the file (a forked child's copy)."""
    _HELD.pop(self.key, None)
    if self.fd is not None:
      os.close(self.fd)
    self.fd, self.held = None, False

  def release(self) -> None:
    if self.held:
      _HELD.pop(self.key, None)
      if self.fd is not None:  # ours while the flock is held: removed, then unlocked
        try:
          os.remove(self.path)
        except FileNotFoundError:
          pass
        os.close(self.fd)
        self.fd = None
      elif self._read() == self.owner:
        os.remove(self.path)
      self.held = False
      if self.created and not os.listdir(self.run_dir):  # a run refused before writing anything
        os.rmdir(self.run_dir)

  def __enter__(self) -> RunDirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def existing_run(run_dir: str) -> list[str]:
  """The run files (`RUN_FILES`) already in `run_dir`."""
  return [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]


def move_aside(run_dir: str) -> str | None:
  """Moves the run files of `run_dir` into a new `<run_dir>/previous-<n>/`; returns it (None when
  there were none)."""
  files = existing_run(run_dir)
  if not files:
    return None
  n = 1
  while os.path.exists(os.path.join(run_dir, f"previous-{n}")):
    n += 1
  dest = os.path.join(run_dir, f"previous-{n}")
  os.makedirs(dest)
  for f in files:
    os.rename(os.path.join(run_dir, f), os.path.join(dest, f))
  return dest


# Keys whose value a checkpoint depends on: the lag ring's batches (lag, batch shape), the train
# state (model architecture) and the prompt stream (task, seed). Others (steps, learning rate, the
# mesh, evaluation) may change on resume.
CHECKPOINT_KEYS = (
    "seed", "task.name", "task.weights", "task.num_digits", "task.path", "rollout.lag",
    "rollout.max_lag",
    "rollout.num_prompts", "rollout.group_size", "rollout.max_prompt_len",
    "rollout.max_new_tokens", "rollout.max_total_tokens", "rollout.logprobs", "model.hf_path",
    "model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads",
    "model.num_kv_heads", "model.head_dim", "model.mlp_dim", "model.qkv_bias", "model.qk_norm",
    "model.tie_embeddings", "model.param_dtype", "model.scan_layers", "model.lora.rank",
    "model.lora.targets")


def _value(cfg, key: str):
  """The value at dotted `key` of a config (or its dict)."""
  for part in key.split("."):
    cfg = cfg[part]
  return cfg


def checkpoint_config(cfg) -> dict:
  """The values of `CHECKPOINT_KEYS` in run config `cfg` (saved with every checkpoint)."""
  return {key: _value(cfg, key) for key in CHECKPOINT_KEYS}


def config_changes(cfg, host: dict, run_dir: str) -> list[str]:
  """`config.key: the checkpoint's value -> now` for every checkpoint key that changed. The
  checkpoint's values come from its host JSON, or (checkpoints made before they were saved there)
  from the run directory's config.json."""
  saved = host.get("config")
  if saved is None:
    try:
      with open(os.path.join(run_dir, "config.json")) as f:
        whole = json.load(f)
      saved = {}
      for k in CHECKPOINT_KEYS:
        try:
          saved[k] = _value(whole, k)
        except KeyError:  # a key newer than that run (e.g. model.lora.*): not compared
          pass
    except (OSError, ValueError, KeyError):
      return []
  now = checkpoint_config(cfg)
  return [f"config.{k} = {saved[k]!r} in the checkpoint, {now[k]!r} now"
          for k in CHECKPOINT_KEYS if k in saved and saved[k] != now[k]]


@dataclasses.dataclass(frozen=True)
class Start:
  """How a run starts: `resume = (checkpoint directory, step, host JSON)` or None (fresh), and
  `keep_lines`, the metrics.jsonl lines that stay (a resume from the run's own checkpoint)."""
  resume: tuple[str, int, dict] | None
  keep_lines: int | None


def decide(cfg, run_dir: str, say, exclude=(), write: bool = True) -> Start:
  """Where run config `cfg` starts in `run_dir` (`cfg.resume`, `cfg.overwrite`); reports in one
  line each through `say` what it skips or moves. Raises `RunDirError` / `CheckpointError`
  (one-line messages) before anything of the run is written. Only the process that writes the
  run's files (`write`: process 0) looks at them; every process makes the same resume decision.

  - A resumable checkpoint (the newest usable one; unusable ones are named and skipped, and steps
    in `exclude` were found unreadable) is checked against the config (`CHECKPOINT_KEYS`).
  - A fresh start in a directory holding another run: that run is moved aside
    (`move_aside`) when it has nothing to resume from (`resume=auto`: killed before its first
    checkpoint) or with `overwrite=true`; otherwise (`resume=none`, or a resume from another
    directory) the run is refused: two runs never share one metrics.jsonl.
  """
  resume = "none" if cfg.overwrite and cfg.resume == "auto" else cfg.resume
  found = checkpoint.resolve_resume(resume, run_dir)
  own = os.path.abspath(checkpoint.checkpoint_dir(run_dir))
  start = None
  if found is not None:
    directory, step = found
    step, host = checkpoint.choose_step(directory, step, exclude=exclude, say=say)
    changes = config_changes(cfg, host, run_dir if directory == own else
                             os.path.dirname(directory))
    if changes:
      raise RunDirError(
          f"cannot resume from {os.path.join(directory, str(step))}: {'; '.join(changes)}. Resume "
          "with the checkpoint's values, or start over (--config.resume=none "
          "--config.overwrite=true, or another --config.run_dir)")
    if os.path.abspath(directory) == own:
      return Start((directory, step, host), host["metrics_lines"])
    start = Start((directory, step, host), None)
  files = existing_run(run_dir) if write else []
  if files and not (cfg.overwrite or (resume == "auto" and found is None)):
    raise RunDirError(
        f"run directory {run_dir} already holds a run ({', '.join(files)}); pick another "
        "--config.run_dir, or --config.overwrite=true to move it aside and start over")
  moved = move_aside(run_dir) if files else None
  if moved is not None:
    say(f"moved the previous run's {', '.join(files)} aside to {moved}")
  return start or Start(None, None)
