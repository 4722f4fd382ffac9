"""The supervised warm-up before RL: task demonstrations until the `dev` split's greedy accuracy
reaches `sft.stop_accuracy` (so RL starts with headroom; the stop is on a split never reported),
or loaded from the warm-up cache when this machine has computed the same warm-up before.

The warm-up cache: a second run whose supervised warm-up would compute the same parameters loads
them from disk instead of training them again.

The warm-up (`warmup`) is a deterministic function of the model and its
initialisation, the warm-up's data, its optimiser and stopping rule, the code and the backend. A
run keys its result by a fingerprint of all of those (`fingerprint`): every config key except the
ones only the RL phase or the bookkeeping read (`RL_ONLY`), the warm-up task's `dev` split and first
batch, the source of the task's classes, jaxrl's own source files, the JAX/jaxlib/Flax/Optax
versions, the platform, device kinds and counts, the process count, `XLA_FLAGS` (the instruction
set and the CPU flags the CLI sets), the CPU model, and the model directory's files (names, sizes,
modification times). A hit replays the warm-up's metrics rows into the run's metrics.jsonl and
starts RL from the stored parameters: the same parameters, bit for bit, that the warm-up computes
(tested), so everything after it is the run it would have been. RL keys are left out on purpose:
a sweep over RL settings (learning rate, loss, lag, ...) warms up once.

On by default (`sft.cache = "auto"`): `$JAXRL_WARMUP_CACHE_DIR` when set (set and empty: off),
else `$XDG_CACHE_HOME/jaxrl/warmup` (`~/.cache/jaxrl/warmup`). A path puts it there; `""` turns it
off. It keeps the `KEEP` newest entries and stores none whose parameters exceed `MAX_ENTRY_BYTES`.
An entry is written to a temporary directory and renamed into place, so a crash leaves no partial
entry; an unreadable or mismatched one is a miss, never an error, and is removed so that the run
stores a good one in its place.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Mapping

import jax
import numpy as np

from jaxrl import parallel
from jaxrl.learner.rl import logprob_impl
from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer, to_rows
from jaxrl.observe import metrics as metrics_lib
from jaxrl.run.validation import Evaluator
from jaxrl.runtime import compile_cache

def warmup(parts, params, out: metrics_lib.MetricsWriter, progress: metrics_lib.Progress,
           stop=None) -> tuple[object, dict]:
  """Supervised warm-up from `params`; returns `(params, summary)`. A stop signal ends it early
  (it is not checkpointed: a resumed run starts from the first RL checkpoint, and a run stopped
  before one starts over). With `sft.cache` a warm-up this machine has computed before is loaded
  instead of run (`jaxrl.run.warmup`): the same parameters and metrics rows."""
  cfg = parts.cfg.sft
  if not cfg.enabled or cfg.max_steps == 0:
    return params, {"sft/steps": 0}
  rng = np.random.default_rng([parts.cfg.seed, 1])
  first = parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
  cache = _WarmupCache(parts, params, first)
  hit = cache.load(params, out, progress)
  if hit is not None:
    return hit
  opt = make_optimizer(cfg.learning_rate, b1=parts.cfg.train.b1, b2=parts.cfg.train.b2,
                       eps=parts.cfg.train.adam_eps,
                       grad_clip=parts.cfg.train.grad_clip)
  step_cfg = StepConfig(loss="sft", logprob_impl=logprob_impl(parts.cfg),
                        moe_aux_coef=parts.cfg.loss.moe_aux_coef)
  step_fn, init_state = build_train_step(parts.graphdef, opt, step_cfg, parts.mesh, params)
  state = init_state(params)
  evaluator = Evaluator(parts, asynchronous=False)
  timer = metrics_lib.Timer()
  acc, steps, rows = 0.0, 0, []
  progress.say(f"warm-up: supervised steps until dev accuracy >= {cfg.stop_accuracy}")
  for steps in range(1, cfg.max_steps + 1):
    batch = first if steps == 1 else parts.sft_batch(parts.task.sample(rng, cfg.batch_size))
    state, m = step_fn(state, to_rows(batch, parts.mesh))
    row = {"phase": "sft", "step": steps, "sft/loss": m["loss"]}
    if steps % cfg.eval_every == 0:
      acc = evaluator.evaluate(state.params, "dev")["val/accuracy"]
      row["sft/dev_accuracy"] = acc
      progress.update(steps, cfg.max_steps, f"loss {float(m['loss']):.3f} | dev accuracy {acc:.3f}"
                      f" | {timer():.0f} s", force=False)
    out.write(row)
    if cache.enabled:
      rows.append(out.rows[-1])  # the row as written (host values), for the cache to replay
    if steps % cfg.eval_every == 0 and acc >= cfg.stop_accuracy:
      break
    # Every process decides together: a signal may have reached only one of them.
    if stop is not None and parallel.distributed.any_process(stop()):
      progress.newline()
      progress.say(f"warm-up: stopped by signal at step {steps}; nothing saved (warm-up is "
                   "not checkpointed)")
      return state.params, {"sft/steps": steps, "sft/stopped": True}
  progress.newline()
  stopped = "reached" if acc >= cfg.stop_accuracy else "hit sft.max_steps before reaching"
  progress.say(f"warm-up: {steps} steps, {timer():.1f} s, dev accuracy {acc:.3f} ({stopped} "
               f"{cfg.stop_accuracy})")
  summary = {"sft/steps": steps, "sft/dev_accuracy": acc, "sft/time_s": timer()}
  cache.store(state.params, rows, summary, progress)
  return state.params, summary


class _WarmupCache:
  """`jaxrl.run.warmup` for one run's warm-up. Every process takes the same branch: whether the
  cache is used at all is the config's (`sft.cache` empty or not, the same everywhere), a hit
  needs the entry on every process (each reads its own copy), and every process takes part in
  gathering the parameters to store (a process whose "auto" resolves to no directory counts as a
  miss and writes nothing)."""

  def __init__(self, parts, params, first_batch):
    self.enabled = bool(parts.cfg.sft.cache.strip())
    self.directory = resolve(parts.cfg.sft.cache) if self.enabled else None
    self.key = self.inputs = None
    if self.directory is not None:
      self.key, self.inputs = fingerprint(parts.cfg, parts.task, first_batch)

  def load(self, params, out, progress):
    if not self.enabled:
      return None
    timer = metrics_lib.Timer()
    got = None
    if self.directory is not None:
      got = load(self.directory, self.key, params)
    if parallel.distributed.any_process(got is None):
      return None
    arrays, rows, summary = got
    loaded = place(arrays, params)
    for row in rows:
      out.write(row)
    computed = summary.get("sft/time_s", float("nan"))
    progress.say(f"warm-up: loaded from the warm-up cache {os.path.join(self.directory, self.key)}"
                 f" ({summary['sft/steps']} steps, dev accuracy {summary['sft/dev_accuracy']:.3f};"
                 f" computed in {computed:.1f} s; sft.cache=\"\" runs it again)")
    return loaded, {**summary, "sft/time_s": timer(), "sft/from_cache": 1.0}

  def store(self, params, rows, summary, progress):
    if not self.enabled or nbytes(params) > MAX_ENTRY_BYTES:
      return
    if self.directory is None and jax.process_count() == 1:
      return
    host = parallel.distributed.fetch(params)  # every process takes part
    if self.directory is None:
      return
    path = store(self.directory, self.key, host, rows, summary, self.inputs)
    if path is not None:
      progress.say(f"warm-up: cached in {path} (a run with the same warm-up settings loads it)")


# --- the warm-up cache ----------------------------------------------------------------------------

KEEP = 8  # newest entries kept
MAX_ENTRY_BYTES = 1 << 30  # parameters larger than this are not stored
FORMAT = 1  # the entry layout; a new layout never reads an old one

# Config keys the warm-up never reads: leaving them out of the fingerprint lets runs that differ
# only there share a warm-up. A key missing here is in the fingerprint (a miss, never a wrong hit).
RL_ONLY = (
    "name", "run_dir", "log_every", "resume", "overwrite", "debug", "compile_cache",
    "host_malloc_tuning", "checkpoint", "logging", "dynamic_sampling", "advantage", "loss",
    "rollout_kl", "ref_kl", "distill", "profile", "distributed", "sft.cache", "moe",
    "train.steps", "train.learning_rate", "train.warmup_steps", "train.lr_schedule",
    "train.final_lr_frac", "train.weight_decay", "train.max_skipped_updates",
    "train.max_consecutive_skipped",
    "rollout.lag", "rollout.num_prompts", "rollout.group_size", "rollout.temperature",
    "rollout.top_k", "rollout.top_p", "rollout.logprobs", "rollout.max_regenerations",
    "rollout.stall_timeout_s", "rollout.partial_rollouts",
    "val.every", "val.at_start", "val.at_end", "val.asynchronous", "val.max_wait_s",
)
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")


def resolve(setting: str, env: Mapping[str, str] | None = None) -> str | None:
  """The warm-up cache directory `setting` means (None: no cache)."""
  return compile_cache.cache_dir(setting, "JAXRL_WARMUP_CACHE_DIR", "warmup", env,
                                 empty_variable_is_off=True)


def warmup_config(cfg: Mapping) -> dict:
  """The config as a nested dict without the `RL_ONLY` keys: the part the warm-up reads."""
  out = json.loads(json.dumps(_plain(cfg)))
  for key in RL_ONLY:
    *path, last = key.split(".")
    node = out
    for part in path:
      node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
      node.pop(last, None)
  return out


def _plain(cfg) -> dict:
  to_dict = getattr(cfg, "to_dict", None)
  return to_dict() if to_dict is not None else dict(cfg)


def _package_versions() -> dict:
  out = {}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
    return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()
  except OSError:
    import platform
    return platform.processor() or platform.machine()


def source_digest() -> str:
  """sha256 over jaxrl's own source files (names and bytes): any change to the code is a miss."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the jaxrl package
  h = hashlib.sha256()
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
    for name in sorted(filenames):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
          h.update(f.read())
  return h.hexdigest()


def _class_source(obj) -> str:
  """The source of `obj`'s class (and its module's name), or its qualified name when Python
  cannot read it: a custom task's code is part of what the warm-up computes."""
  cls = obj if isinstance(obj, type) else type(obj)
  name = f"{cls.__module__}.{cls.__qualname__}"
  try:
    return name + "\n" + inspect.getsource(inspect.getmodule(cls) or cls)
  except (OSError, TypeError):
    return name


def _files(path: str) -> list:
  """(name, size, mtime_ns) of every file under a model directory."""
  if not path:
    return []
  out = []
  for dirpath, dirnames, filenames in os.walk(path):
    dirnames.sort()
    for name in sorted(filenames):
      st = os.stat(os.path.join(dirpath, name))
      out.append([os.path.relpath(os.path.join(dirpath, name), path), st.st_size, st.st_mtime_ns])
  return out


def data_digest(task, first_batch) -> str:
  """sha256 of the warm-up task's `dev` split (what the stopping rule scores) and the arrays of
  its first batch (the demonstrations and their tokenization)."""
  h = hashlib.sha256()
  for problem in task.split("dev"):
    h.update(repr(problem).encode() + b"\n")
  for field in first_batch:
    a = np.ascontiguousarray(np.asarray(field))
    h.update(f"{a.dtype}{a.shape}".encode())
    # Objects (an absent field is None) by their repr: their bytes would be addresses.
    h.update(repr(a.tolist()).encode() if a.dtype == object else a.tobytes())
  return h.hexdigest()


def fingerprint(cfg, task, first_batch, env: Mapping[str, str] | None = None) -> tuple[str, dict]:
  """(hex key, the inputs it hashes) of a warm-up: see the module docstring."""
  import jax

  env = os.environ if env is None else env
  devices = jax.devices()
  inputs = {
      "format": FORMAT,
      "config": warmup_config(cfg),
      "data": data_digest(task, first_batch),
      "task_code": hashlib.sha256(_class_source(task).encode()).hexdigest(),
      "jaxrl_code": source_digest(),
      "packages": _package_versions(),
      "backend": jax.default_backend(),
      "devices": sorted({d.device_kind for d in devices}),
      "device_count": len(devices),
      "process_count": jax.process_count(),
      "xla_flags": env.get("XLA_FLAGS", ""),
      "cpu": _cpu_model(),
      "model_files": _files(cfg.model.hf_path),
  }
  key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
  return key, inputs


def _leaves(params) -> tuple[list[str], list, object]:
  import jax

  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat], treedef


def nbytes(params) -> int:
  import jax
  return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def store(directory: str, key: str, params_host, rows: list[dict], summary: dict,
          inputs: dict) -> str | None:
  """Writes one entry (`params_host`: the parameters as host arrays, in the tree of the run's
  params); returns its path, or None when the parameters are over `MAX_ENTRY_BYTES` or the
  directory cannot be written (a cache never fails a run)."""
  names, leaves, _ = _leaves(params_host)
  if sum(a.nbytes for a in map(np.asarray, leaves)) > MAX_ENTRY_BYTES:
    return None
  final = os.path.join(directory, key)
  try:
    os.makedirs(directory, exist_ok=True)
    if os.path.isdir(final):
      return final
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=directory)
    try:
      arrays, manifest = {}, []
      for i, (name, x) in enumerate(zip(names, leaves)):
        a = np.ascontiguousarray(np.asarray(x))
        manifest.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape)})
        arrays[f"a{i}"] = a.view(np.uint8).reshape(-1)  # any dtype (bfloat16 too) as bytes
      np.savez(os.path.join(tmp, "params.npz"), **arrays)
      with open(os.path.join(tmp, "rows.jsonl"), "w") as f:
        for row in rows:
          f.write(json.dumps(row) + "\n")
      with open(os.path.join(tmp, "entry.json"), "w") as f:
        json.dump({"key": key, "leaves": manifest, "summary": summary, "inputs": inputs,
                   "created": time.time()}, f)
      os.rename(tmp, final)
    except OSError:
      shutil.rmtree(tmp, ignore_errors=True)
      return final if os.path.isdir(final) else None
    prune(directory)
    return final
  except OSError:
    return None


STALE_TMP_S = 3600.0  # a temporary entry this old was left by a process that died writing it


def prune(directory: str, keep: int = KEEP, now: float | None = None) -> None:
  """Removes all but the `keep` most recently used entries, and temporary ones older than
  `STALE_TMP_S` (a process killed while writing leaves one behind)."""
  now = time.time() if now is None else now
  try:
    entries, stale = [], []
    for d in os.listdir(directory):
      path = os.path.join(directory, d)
      if not os.path.isdir(path):
        continue
      if d.startswith("."):
        if now - os.path.getmtime(path) > STALE_TMP_S:
          stale.append(path)
      else:
        entries.append(path)
    entries.sort(key=os.path.getmtime, reverse=True)
    for old in entries[keep:] + stale:
      shutil.rmtree(old, ignore_errors=True)
  except OSError:
    pass


def load(directory: str, key: str, template) -> tuple[list, list[dict], dict] | None:
  """The entry `key` as (host arrays in the order of `template`'s leaves, its metrics rows, its
  summary), or None: absent, unreadable, or not the shapes, dtypes and leaf names of `template`
  (the run's initial parameters)."""
  path = os.path.join(directory, key)
  if not os.path.isdir(path):
    return None
  try:
    with open(os.path.join(path, "entry.json")) as f:
      entry = json.load(f)
    names, leaves, _ = _leaves(template)
    manifest = entry["leaves"]
    if entry.get("key") != key or [m["name"] for m in manifest] != names:
      raise ValueError("another tree")
    out = []
    with np.load(os.path.join(path, "params.npz")) as z:
      for i, (m, x) in enumerate(zip(manifest, leaves)):
        dtype = np.dtype(x.dtype)
        if m["dtype"] != str(dtype) or tuple(m["shape"]) != tuple(x.shape):
          raise ValueError("another shape or dtype")
        out.append(z[f"a{i}"].view(dtype).reshape(x.shape))
    with open(os.path.join(path, "rows.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    summary = dict(entry["summary"])
    os.utime(path)  # most recently used
    return out, rows, summary
  except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
    # Unusable: removed, so that this run's warm-up stores a good entry in its place.
    shutil.rmtree(path, ignore_errors=True)
    return None


def place(arrays: list, template):
  """Host arrays as device arrays with the shardings of `template`'s leaves (every process
  holds every array whole, so each places its own shards)."""
  import jax

  _, leaves, treedef = _leaves(template)
  placed = [jax.make_array_from_callback(a.shape, x.sharding, lambda idx, a=a: a[idx])
            for a, x in zip(arrays, leaves)]
  return jax.tree_util.tree_unflatten(treedef, placed)
