"""Validation of run configs against the schema in `jaxrl.recipes.default`.

`validate` runs before anything is compiled or written and reports every problem at once: schema
(unknown and missing keys), types and value ranges (`jaxrl.config.schema`), the device mesh,
cross-key divisibility, incompatible loss combinations, what the chosen tasks need (prompt and
answer lengths, split sizes, a readable data file, demonstrations for the warm-up), and what the
run will touch on disk and in memory: a run directory it can create, a resume path that holds a
checkpoint, a complete model directory, and a rollout batch that can fit in memory. It never
imports jax; the caller passes the device count.

What the run touches outside the config is checked by `jaxrl.config.preflight`. `load_recipe`
(`jaxrl.config.recipe`) reads a recipe file (`--config path.py`); `parse_overrides` (`jaxrl.config.overrides`)
applies `--config.a.b=value` command-line overrides, naming every bad one; both re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection
from typing import Any

from ml_collections import ConfigDict

from jaxrl.runtime import compile_cache

from jaxrl.config import schema as config_schema, preflight

from jaxrl.observe import sinks
from jaxrl.config.schema import (DISTRIBUTED_RULES, MESH_AXES, PREFIX, RULES, ConfigError,
                                 check_schema, describe, flatten, parse_profile_steps, type_ok)
from jaxrl.recipes import default as default_config
from jaxrl.envs import registry  # registers the built-in tasks (no jax)
from jaxrl.core.names import CORRECTIONS, WEIGHTING
# Re-exported: the command line's other halves.
from jaxrl.config.overrides import parse_overrides  # noqa: F401
from jaxrl.config.preflight import RUN_ROOT, default_run_dir  # noqa: F401
from jaxrl.config.recipe import RecipeError, load_recipe  # noqa: F401


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """The resolved train mesh, and the rollout mesh's devices when disaggregated.

  `rollout_devices == 0`: colocated, rollouts are generated on the train mesh (on several
  processes: on each process's own devices, `rollout_tensor` its 'tensor' axis). Otherwise the
  first `train_devices` devices hold the train mesh (its first `size` of them) and the next
  `rollout_devices` a rollout mesh of shape (rollout_devices / rollout_tensor, 1,
  rollout_tensor).
  """
  data: int
  fsdp: int
  tensor: int
  train_devices: int = 0
  rollout_devices: int = 0
  rollout_tensor: int = 1
  # Disaggregated across processes (`mesh.rollout_processes`): the processes whose devices only
  # generate (the rollout mesh, on their own devices); the train mesh is the other processes'.
  rollout_processes: tuple[int, ...] = ()

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def disaggregated(self) -> bool:
    return self.rollout_devices > 0

  @property
  def rollout_shape(self) -> tuple[int, int, int]:
    """The rollout mesh's shape: across processes (`rollout_processes`), each rollout process's
    own mesh over its devices."""
    n = self.rollout_devices // max(1, len(self.rollout_processes))
    return (n // self.rollout_tensor, 1, self.rollout_tensor)


def _device_count(key: str, value: float, num_devices: int, problems: list[str]) -> int | None:
  """`mesh.rollout` / `mesh.train` as a device count (a fraction is of all devices)."""
  n = int(round(value * num_devices)) if value < 1 else int(value)
  if n < 1:
    problems.append(f"{PREFIX}{key}: {value!r} of {num_devices} devices is no device")
    return None
  return n


def _resolve_split(good: dict[str, Any], num_devices: int, problems: list[str],
                   num_processes: int = 1) -> tuple[int, int] | None:
  """(train devices, rollout devices); rollout 0 = colocated. None when the split is bad.

  Colocated on several processes, `mesh.rollout_tensor` is the 'tensor' axis of each process's
  own rollout mesh (`jaxrl.parallel.distributed.local_mesh`): it must divide a process's
  devices."""
  rollout, train, rt = good["mesh.rollout"], good["mesh.train"], good["mesh.rollout_tensor"]
  if rollout == 0:
    if train:
      problems.append(f"{PREFIX}mesh.train: only with {PREFIX}mesh.rollout > 0 (disaggregated "
                      f"rollout and train devices), got {train!r}")
      return None
    if rt != 1 and num_processes == 1:
      problems.append(f"{PREFIX}mesh.rollout_tensor: only with {PREFIX}mesh.rollout > 0 or "
                      "several processes (each generating on its own devices); colocated on "
                      f"one process rollouts use the train mesh, got {rt}")
      return None
    local = num_devices // num_processes
    if rt != 1 and local % rt:
      problems.append(f"{PREFIX}mesh.rollout_tensor: must divide each process's {local} "
                      "devices (its own rollout mesh is (devices / rollout_tensor, 1, "
                      f"rollout_tensor)), got {rt}")
      return None
    return num_devices, 0
  n_r = _device_count("mesh.rollout", rollout, num_devices, problems)
  n_t = num_devices - (n_r or 0) if train == 0 else \
      _device_count("mesh.train", train, num_devices, problems)
  if n_r is None or n_t is None:
    return None
  if n_t < 1 or n_r + n_t > num_devices:
    problems.append(
        f"{PREFIX}mesh.rollout: {n_r} rollout + {n_t} train devices need {n_r + n_t} disjoint "
        f"devices, but {num_devices} are available")
    return None
  if n_r % rt:
    problems.append(f"{PREFIX}mesh.rollout_tensor: must divide the {n_r} rollout devices, got "
                    f"{rt}")
    return None
  return n_t, n_r


def _resolve_process_split(good: dict[str, Any], num_devices: int, num_processes: int,
                           problems: list[str]) -> MeshShape | None:
  """The meshes of `mesh.rollout_processes`: those processes' devices generate, the others'
  train (the train mesh's axes resolved over them). None (problems named) when they cannot."""
  key = f"{PREFIX}mesh.rollout_processes"
  ids = config_schema.process_list(good["mesh.rollout_processes"])
  bad = []
  if num_processes == 1:
    bad.append(f"{key}: names processes that only generate, but the run has one process; join "
               "several (distributed.*) or set it to ''")
  elif any(i >= num_processes for i in ids):
    bad.append(f"{key}: process indices must be < the {num_processes} processes, got "
               f"{good['mesh.rollout_processes']!r}")
  elif len(ids) >= num_processes:
    bad.append(f"{key}: at least one process must train, got all {num_processes}")
  for other in ("mesh.rollout", "mesh.train"):
    if good[other]:
      bad.append(f"{PREFIX}{other}: must be 0 with {key} (whole processes decide the split), "
                 f"got {good[other]!r}")
  resume, run_dir = good.get("resume"), good.get("run_dir")
  if resume not in (None, "auto", "none") and run_dir:
    # Both sides take part in the restore of their own run's checkpoints (`pipeline.remote`).
    own = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    path = os.path.abspath(resume)
    if path not in (os.path.abspath(run_dir), own) and os.path.dirname(path) != own:
      bad.append(f"{PREFIX}resume: with {key} a run resumes from its own checkpoints only "
                 f"({own}), got {resume!r}")
  per = num_devices // num_processes
  if not bad and per % good["mesh.rollout_tensor"]:
    bad.append(f"{PREFIX}mesh.rollout_tensor: must divide the rollout process's {per} devices, "
               f"got {good['mesh.rollout_tensor']}")
  elif not bad and "rollout.num_prompts" in good and "rollout.group_size" in good:
    # Each rollout process makes an equal run of whole groups of every batch.
    prompts, k = good["rollout.num_prompts"], len(ids)
    rows = prompts // k * good["rollout.group_size"]
    shards = per // good["mesh.rollout_tensor"]
    if prompts % k:
      bad.append(f"{PREFIX}rollout.num_prompts: must split evenly over the {k} rollout "
                 f"processes (whole groups each), got {prompts}")
    elif rows % shards:
      each = " each" if k > 1 else ""
      bad.append(f"{PREFIX}rollout.num_prompts: the {rows} rows (rollout.num_prompts * "
                 f"rollout.group_size{' / ' + str(k) if k > 1 else ''}) a rollout process "
                 f"makes of a batch must split evenly over its {shards} row shards{each}")
  problems.extend(bad)
  if bad:
    return None
  n_r = len(ids) * per
  mesh = _resolve_mesh({a: good[f"mesh.{a}"] for a in MESH_AXES}, num_devices - n_r, problems,
                       " train")
  if mesh is None:
    return None
  if mirror_folds((mesh.data, mesh.fsdp, mesh.tensor), n_r, len(ids)) is None:
    # Checkpoints mirror the train mesh, folded, on rollout devices, at least one of each rollout
    # process (pipeline.remote.union_mesh).
    problems.append(f"{key}: no checkpoint layout: the train mesh ({mesh.data}x{mesh.fsdp}x"
                    f"{mesh.tensor}) folded to a size in [{len(ids)}, {n_r}] (at least one "
                    f"device per rollout process, at most the rollout processes' {n_r} devices) "
                    "by dividing its axes: each checkpoint lays the train state over both sides")
    return None
  return dataclasses.replace(mesh, train_devices=num_devices - n_r, rollout_devices=n_r,
                             rollout_tensor=good["mesh.rollout_tensor"], rollout_processes=ids)


def mirror_folds(shape: tuple[int, int, int], rollout_devices: int,
                 rollout_processes: int) -> tuple[int, int, int] | None:
  """How a checkpoint disaggregated across processes folds the train mesh (`shape`: data, fsdp,
  tensor) so that its rollout devices can mirror it (`jaxrl.pipeline.remote.union_mesh`): a
  factor of each axis, the folded mesh (each axis divided by its factor) as large as possible
  but at most `rollout_devices` and at least `rollout_processes` devices (one of each). (1, 1, 1)
  when the rollout devices are as many as the train mesh's; None when no fold fits. Folds 'data'
  first, then 'fsdp', then 'tensor'."""
  def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]

  best, size = None, 0
  for ft in divisors(shape[2]):
    for ff in divisors(shape[1]):
      for fd in divisors(shape[0]):
        m = shape[0] // fd * (shape[1] // ff) * (shape[2] // ft)
        if rollout_processes <= m <= rollout_devices and m > size:
          best, size = (fd, ff, ft), m
  return best


def _resolve_mesh(axes: dict[str, int], num_devices: int, problems: list[str],
                  what: str = "") -> MeshShape | None:
  wild = [a for a in MESH_AXES if axes[a] == -1]
  shape = ", ".join(f"{a}={axes[a]}" for a in MESH_AXES)
  if len(wild) > 1:
    problems.append(f"{PREFIX}mesh: at most one axis may be -1, got ({shape})")
    return None
  if wild:
    rest = math.prod(axes[a] for a in MESH_AXES if a != wild[0])
    if num_devices % rest:
      problems.append(
          f"{PREFIX}mesh.{wild[0]}: -1 cannot be resolved: {num_devices}{what} devices are not "
          f"divisible by the product of the other axes ({shape}, product {rest})")
      return None
    axes = {**axes, wild[0]: num_devices // rest}
  mesh = MeshShape(**axes)
  if num_devices % mesh.size:
    problems.append(
        f"{PREFIX}mesh: shape (data={mesh.data}, fsdp={mesh.fsdp}, tensor={mesh.tensor}) "
        f"uses {mesh.size} devices, which does not divide the {num_devices}"
        f"{what + ' devices' if what else ''} available")
    return None
  return mesh


_BANDS = ("icepop", "seq_mask", "geo_mask", "product_mask", "outlier", "dppo_delta")


def _check_loss(good: dict[str, Any], problems: list[str]) -> None:
  """Names inside `loss.correction` and combinations of loss keys that cannot work together."""
  p = PREFIX
  names: tuple[str, ...] = ()
  if "loss.correction" in good:
    text = good["loss.correction"]
    names = () if text in ("", "none") else tuple(x.strip() for x in text.split("+"))
    bad = [n for n in names if n not in CORRECTIONS]
    if bad:
      problems.append(f"{p}loss.correction: unknown correction(s) {bad} in {text!r}; expected "
                      f"'none' or names from {list(CORRECTIONS)} joined by '+'")
      names = ()
    elif len(set(names)) != len(names):
      problems.append(f"{p}loss.correction: a correction is listed twice in {text!r}")
    weighting = [n for n in names if n in WEIGHTING]
    if len(weighting) > 1:
      problems.append(f"{p}loss.correction: at most one importance weighting of {list(WEIGHTING)}"
                      f" (two would double count), got {weighting}")
  for band in _BANDS:
    lo, hi = f"loss.{band}_low", f"loss.{band}_high"
    if band != "dppo_delta" and lo in good and hi in good and good[lo] >= good[hi]:
      problems.append(f"{p}{lo}: must be < {p}{hi}, got {good[lo]} and {good[hi]}")

  def on(key, off=0):
    return key in good and good[key] != off

  policy = good.get("loss.policy")
  if policy == "cispo" and on("loss.dual_clip"):
    problems.append(f"{p}loss.dual_clip: cispo does not take a dual clip (it clips a detached "
                    f"weight); set it to 0 or choose another {p}loss.policy")
  if policy == "sapo" and on("loss.dual_clip"):
    problems.append(f"{p}loss.dual_clip: sapo does not take a dual clip (its soft gate replaces "
                    f"every clip); set it to 0 or choose another {p}loss.policy")
  if policy == "gspo":
    if "seq_mask_tis" in names:
      problems.append(f"{p}loss.correction: seq_mask_tis cannot be combined with the sequence-"
                      f"level ratio of {p}loss.policy='gspo'")
    if good.get("loss.reduction", "seq_mean_token_mean") != "seq_mean_token_mean":
      problems.append(f"{p}loss.reduction: {p}loss.policy='gspo' needs 'seq_mean_token_mean' "
                      f"(one ratio per sequence), got {good['loss.reduction']!r}")
  if good.get("loss.ratio_base") == "rollout" or (
      good.get("loss.ratio_base") == "auto" and good.get("rollout.lag", 0) > 0):
    weighting = [n for n in names if n in WEIGHTING]
    if weighting:
      problems.append(f"{p}loss.correction: {weighting[0]} re-weights by the sampler ratio, which "
                      f"the PPO ratio already includes when {p}loss.ratio_base is 'rollout' (or "
                      f"'auto' with {p}rollout.lag > 0); use a mask correction or "
                      f"{p}loss.ratio_base='trainer'")
  if good.get("rollout.logprobs") is False:
    needs = [k for k, used in (("loss.correction", bool(names)),
                               ("loss.ratio_base", good.get("loss.ratio_base") == "rollout" or (
                                   good.get("loss.ratio_base") == "auto"
                                   and good.get("rollout.lag", 0) > 0)),
                               ("rollout_kl.coef", on("rollout_kl.coef")),
                               ("loss.seq_logprob_error_threshold",
                                on("loss.seq_logprob_error_threshold"))) if used]
    for k in needs:
      problems.append(f"{p}{k}: needs the sampler's log-probs, but {p}rollout.logprobs is "
                      "false")


def _check_distributed(good: dict[str, Any], problems: list[str],
                       num_processes: int | None = None) -> None:
  """The `distributed.*` keys, and what several processes need of the rest of the config.

  `num_processes` is the count actually joined (explicit keys or `distributed.auto`); the
  multi-process checks use it when the explicit keys ask for a single process.
  """
  p = PREFIX
  n, pid = good.get("distributed.num_processes"), good.get("distributed.process_id")
  if n is not None and pid is not None and pid >= n:
    problems.append(f"{p}distributed.process_id: must be < {p}distributed.num_processes = {n}, "
                    f"got {pid}")
  if n is not None and n > 1:
    addr = good.get("distributed.coordinator_address")
    if addr is not None and (":" not in addr or not addr.rsplit(":", 1)[1].isdigit()):
      problems.append(f"{p}distributed.coordinator_address: {p}distributed.num_processes = {n} "
                      f"needs process 0's 'host:port', got {addr!r}")
    several = f"{p}distributed.num_processes > 1"
  elif num_processes is not None and num_processes > 1:
    several = f"{num_processes} processes joined by {p}distributed.auto"
  else:
    return
  # A lag is fine: each process makes its own groups on its rollout thread over its local devices
  # (dynamic sampling included: a group never spans processes), or inline (`InlineWorker`) where
  # the batch cannot be split by process. The continuous engine's host driver reads every slot's
  # state, so it runs only in the first case, where every array it touches is the process's own;
  # the config decides the cases `process_share` refuses for any device layout (a layout that
  # splits a group over processes is refused there).
  inline = [why for key, why in (
      ("mesh.rollout", f"{p}mesh.rollout > 0 (disaggregated)"),) if good.get(key)]
  if good.get("rollout.engine") == "continuous" and inline:
    problems.append(
        f"{p}rollout.engine: must be 'static' with {several} when {' and '.join(inline)}: the "
        "batch is then generated inline over every process's devices, and the continuous "
        "engine's host driver reads every slot's state, which no process holds alone")


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


def _resolve_tasks(good: dict[str, Any], problems: list[str]) -> set[str]:
  """Registers the names of `task.name` that belong to a task family (`reasoning_gym:<dataset>`,
  `jaxrl.envs.registry.register_family`) and returns them; a name the family refuses (an unknown
  dataset, a missing package) is one problem line, and `task.name` then takes no part in later
  checks."""
  if "task.name" not in good:
    return set()
  names = [n for n in good["task.name"].split("+") if registry.in_family(n)]
  refused = [why for why in map(registry.resolve, names) if why]
  if refused:
    problems.extend(f"{PREFIX}task.name: {why}" for why in refused)
    del good["task.name"]
    return set()
  return set(names)


def _check_task(good: dict[str, Any], problems: list[str]) -> None:
  """What the tasks of `task.name` need from the rest of the config: the generic rules here, each
  task's own through its registration (`jaxrl.envs.registry`).

  Without these a run fails only once it builds its task, after joining the processes (a bare
  traceback for a missing data file or splits that leave no training problems), or goes wrong
  silently: weights given for a single task are ignored.
  """
  p = PREFIX
  if "task.name" not in good:
    return
  name = good["task.name"]
  names = name.split("+")
  weights = good.get("task.weights", "")
  if weights and len(weights.split(",")) != len(names):
    problems.append(f"{p}task.weights: {len(weights.split(','))} weights for the {len(names)} "
                    f"task(s) of {p}task.name = {name!r}; give one per task")
  regs = [registry.TASKS.get(n) for n in names]
  if None in regs:  # names given by the caller (validate's task_names), not registered here
    return
  if good.get("sft.enabled") and good.get("sft.max_steps", 0) > 0 and \
      (len(names) > 1 or not regs[0].demonstrations):
    with_demos = [n for n, r in registry.TASKS.items() if r.demonstrations]
    problems.append(f"{p}sft.enabled: task {name!r} has no demonstrations for the supervised "
                    f"warm-up (only one of {with_demos}, alone, has); set it to false or "
                    f"{p}sft.max_steps to 0")
  problems.extend(registry.task_problems(names, good))


def distributed_settings(cfg: ConfigDict) -> tuple[str, int, int, int] | None:
  """`(coordinator_address, num_processes, process_id, init_timeout_s)`, checked on their own.

  Runs before JAX starts: joining the processes decides the device count that `validate` needs.
  Returns None when these keys (or `distributed.auto`) are bad; `validate` then reports them
  with every other problem. Only the explicit settings: with `num_processes == 1`, the caller
  may still join what `distributed.auto` detects (`jaxrl.parallel.distributed.join`).
  """
  problems: list[str] = []
  ref, flat = flatten(default_config.get_config()), flatten(cfg)
  good: dict[str, Any] = {}
  for key, (pred, requirement) in DISTRIBUTED_RULES:
    value = flat.get(key, ref[key])
    if not type_ok(value, ref[key]):
      problems.append(f"{PREFIX}{key}: must be {type(ref[key]).__name__}, got {describe(value)}")
    elif not pred(value):
      problems.append(f"{PREFIX}{key}: must be {requirement}, got {value!r}")
    else:
      good[key] = value
  _check_distributed(good, problems)
  if problems:
    return None
  return tuple(good[f"distributed.{k}"] for k in  # type: ignore[return-value]
               ("coordinator_address", "num_processes", "process_id", "init_timeout_s"))


def validate(cfg: ConfigDict, num_devices: int,
             task_names: Collection[str] | None = None,
             problems: Collection[str] = (), *,
             num_processes: int | None = None,
             device_memory: int | None = None) -> MeshShape:
  """Checks `cfg` completely and returns the resolved mesh shape.

  A config file must start from `jaxrl.recipes.default.get_config()` and change values: keys
  absent from the default are rejected as unknown, and keys of the default absent from `cfg`
  are reported as missing rather than filled in, so a run's saved config is always complete.

  Args:
    cfg: the config to check.
    num_devices: number of devices the run will use (`jax.device_count()` in the caller).
    task_names: the names `task.name` may use; None: every registered task
      (`jaxrl.envs.registry.task_names()`, the built-in ones and any a recipe registered).
    problems: problems already found (e.g. by `parse_overrides`), reported first.
    num_processes: processes actually joined (`jax.process_count()` in the caller), whether by
      the explicit `distributed.*` keys or detected by `distributed.auto`; the multi-process
      checks (`rollout.lag`, `rollout.engine`) apply to it. None: the explicit keys alone.
    device_memory: bytes of memory this process's devices hold, for the batch size check; None:
      the devices are the host's CPU (their arrays count against host memory); 0: unknown.

  Returns:
    The mesh shape with a -1 axis resolved against `num_devices`.

  Raises:
    ConfigError: listing every problem found, one per line.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  ref = default_config.get_config()
  problems = list(problems)
  good: dict[str, Any] = {}
  check_schema(cfg, ref, flatten(ref).keys(), "", problems, good)

  rules = list(RULES)
  known = sorted(registry.task_names() if task_names is None else task_names)
  families = ""
  if task_names is None:  # names of task families, registered as they are met
    known_here = set(known) | _resolve_tasks(good, problems)
    families = "".join(f" or '{f.pattern}'" for f in registry.FAMILIES.values())
  else:
    known_here = set(known)
  rules.append(("task.name", (
      lambda v: all(n in known_here for n in v.split("+")) and len(set(v.split("+"))) ==
      len(v.split("+")),
      f"one of {known}{families}, or several distinct ones joined by '+' (mixed per row)")))
  backends = sinks.backend_names()  # a recipe file may register more (jaxrl.observe.sinks)
  rules.append((sinks.KEY, (lambda v: all(n in backends for n in sinks.parse_backends(v)),
                            f"a comma list of {backends}")))
  for key, (pred, requirement) in rules:
    if key in good and not pred(good[key]):
      problems.append(f"{PREFIX}{key}: must be {requirement}, got {good[key]!r}")
      del good[key]  # a bad value takes no part in the cross-key checks below

  def have(*keys: str) -> bool:
    return all(k in good for k in keys)

  if have("model.num_heads", "model.num_kv_heads") and \
      good["model.num_heads"] % good["model.num_kv_heads"]:
    problems.append(
        f"{PREFIX}model.num_heads: must be divisible by {PREFIX}model.num_kv_heads, got "
        f"{good['model.num_heads']} and {good['model.num_kv_heads']}")

  mesh = None
  processes = num_processes or good.get("distributed.num_processes") or 1
  if have(*(f"mesh.{a}" for a in MESH_AXES), "mesh.rollout", "mesh.train", "mesh.rollout_tensor",
          "mesh.rollout_processes") and good["mesh.rollout_processes"].strip():
    mesh = _resolve_process_split(good, num_devices, processes, problems)
  elif have(*(f"mesh.{a}" for a in MESH_AXES), "mesh.rollout", "mesh.train",
            "mesh.rollout_tensor"):
    split = _resolve_split(good, num_devices, problems, processes)
    if split is not None:
      n_t, n_r = split
      mesh = _resolve_mesh({a: good[f"mesh.{a}"] for a in MESH_AXES}, n_t, problems,
                           " train" if n_r else "")
      if mesh is not None and n_r:
        mesh = dataclasses.replace(mesh, train_devices=n_t, rollout_devices=n_r,
                                   rollout_tensor=good["mesh.rollout_tensor"])
      elif mesh is not None:  # several processes: each one's own rollout mesh
        mesh = dataclasses.replace(mesh, rollout_tensor=good["mesh.rollout_tensor"])
  batch_shards = f"{PREFIX}mesh.data * {PREFIX}mesh.fsdp"

  if have("rollout.num_prompts", "rollout.group_size", "train.num_microbatches",
          "train.microbatch_tokens", "rollout.max_prompt_len", "rollout.max_new_tokens",
          "rollout.max_total_tokens"):
    p, g, m = (good[k] for k in
               ("rollout.num_prompts", "rollout.group_size", "train.num_microbatches"))
    rl_batch = f"{PREFIX}rollout.num_prompts * {PREFIX}rollout.group_size"
    shards = mesh.data * mesh.fsdp if mesh else 1
    if m == 0:  # auto: always a divisor of the rows each shard holds
      if (p * g) % shards:
        problems.append(
            f"{PREFIX}rollout.num_prompts: the RL batch {rl_batch} = {p} * {g} = {p * g} must "
            f"be divisible by {batch_shards} = {shards}, since the batch axis is sharded over "
            "both")
    elif (p * g) % m:
      problems.append(
          f"{PREFIX}train.num_microbatches: must divide the RL batch {rl_batch} "
          f"= {p} * {g} = {p * g}, got {m}")
    elif mesh and (p * g // m) % shards:
      problems.append(
          f"{PREFIX}train.num_microbatches: each micro-batch ({rl_batch} / "
          f"{PREFIX}train.num_microbatches = {p * g} / {m} = {p * g // m}) must be divisible "
          f"by {batch_shards} = {shards}, since the batch axis is sharded over both")
  for key in ("sft.batch_size", "val.batch_size"):
    if mesh and have(key) and good[key] % (mesh.data * mesh.fsdp):
      problems.append(
          f"{PREFIX}{key}: must be divisible by {batch_shards} = {mesh.data * mesh.fsdp} "
          f"(the batch axis is sharded over both), got {good[key]}")
  if have("val.samples_per_prompt", "val.temperature") and good["val.samples_per_prompt"] > 1 \
      and good["val.temperature"] == 0:
    problems.append(
        f"{PREFIX}val.temperature: must be > 0 with {PREFIX}val.samples_per_prompt = "
        f"{good['val.samples_per_prompt']} (greedy samples of one prompt are all the same)")
  if good.get("rollout.partial_rollouts") and good.get("rollout.engine", "static") != "continuous":
    problems.append(
        f"{PREFIX}rollout.partial_rollouts: needs {PREFIX}rollout.engine = 'continuous' (the "
        "static sampler decodes a whole batch on one params version), got "
        f"{good.get('rollout.engine')!r}")
  if have("rollout.max_total_tokens", "rollout.max_new_tokens") and \
      0 < good["rollout.max_total_tokens"] < good["rollout.max_new_tokens"]:
    problems.append(
        f"{PREFIX}rollout.max_total_tokens: must be 0 or >= {PREFIX}rollout.max_new_tokens = "
        f"{good['rollout.max_new_tokens']}, got {good['rollout.max_total_tokens']}")

  if have("profile.steps", "train.steps") and good["profile.steps"] and \
      parse_profile_steps(good["profile.steps"])[0] > good["train.steps"]:
    problems.append(
        f"{PREFIX}profile.steps: {good['profile.steps']!r} starts after the last RL step "
        f"({PREFIX}train.steps = {good['train.steps']}), so nothing would be traced")

  _check_loss(good, problems)
  _check_distributed(good, problems, num_processes)
  preflight.check_hf(good, flatten(ref), problems)
  _check_task(good, problems)
  preflight.check_run_dir(good, problems)
  teacher = good.get("distill.teacher", "")
  if teacher:
    if not os.path.isfile(os.path.join(teacher, "config.json")):
      problems.append(f"{PREFIX}distill.teacher: {teacher!r} has no config.json: give a jaxrl "
                      "run directory or a Hugging Face model directory")
    elif good.get("distill.coef") == 0:
      problems.append(f"{PREFIX}distill.coef: 0 with {PREFIX}distill.teacher set gives the "
                      "teacher no say; set a coefficient or leave distill.teacher empty")
  if "compile_cache" in good:
    why = compile_cache.problem(good["compile_cache"])
    if why:
      problems.append(f"{PREFIX}compile_cache: {why}; give a writable directory, \"auto\" or "
                      "\"\" (no cache)")
  if "sft.cache" in good:
    why = compile_cache.problem(good["sft.cache"])
    if why:
      problems.append(f"{PREFIX}sft.cache: {why}; give a writable directory, \"auto\" or \"\" "
                      "(no warm-up cache)")
  preflight.check_logging(good, problems)
  preflight.check_resume(good, problems)
  preflight.check_memory(good, problems, processes, device_memory,
                         preflight.host_memory_bytes())

  if problems:
    raise ConfigError(problems)
  assert mesh is not None
  return mesh


def merge_saved(ref: dict, saved: dict) -> dict:
  """`ref` (e.g. the default config as a dict) with the values `saved` (a run's config.json) has
  for its keys: a saved run's config, read by a jaxrl whose defaults have more keys."""
  out = {}
  for k, v in ref.items():
    if k not in saved:
      out[k] = v
    elif isinstance(v, dict) and isinstance(saved[k], dict):
      out[k] = merge_saved(v, saved[k])
    else:
      out[k] = saved[k]
  return out


def to_dict(cfg: ConfigDict) -> dict[str, Any]:
  """Plain nested dict (references resolved), e.g. for writing the resolved config as JSON."""
  return cfg.to_dict()
