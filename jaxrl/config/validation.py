"""Validation of run configs against the schema in `jaxrl.recipes.default`.

`validate` runs before anything is compiled or written and reports every problem at once: schema
(unknown and missing keys), types and value ranges (`jaxrl.config.schema`), the device mesh
(`jaxrl.config.mesh`), cross-key divisibility, incompatible loss combinations, what the chosen
tasks need (prompt and answer lengths, split sizes, a readable data file, demonstrations for the
warm-up), and what the run will touch on disk and in memory (`jaxrl.config.preflight`): a run
directory it can create, a resume path that holds a checkpoint, a complete model directory, and
a rollout batch that can fit in memory. It never imports jax; the caller passes the device
count.

Each `_check_*` reads only the keys that passed their own checks (`good`), so one bad value is
one problem line, never a cascade. The order of the checks is the order of the problem lines.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from ml_collections import ConfigDict

from jaxrl.config import memory, preflight
from jaxrl.config.mesh import MeshShape, resolve_mesh_shape
from jaxrl.config.schema import (DISTRIBUTED_RULES, PREFIX, RULES, ConfigError, Rule,
                                 check_schema, describe, flatten, parse_profile_steps, type_ok)
from jaxrl.core.names import AUTO_LAG, CORRECTIONS, INTERVAL_BANDS, WEIGHTING, lag_bound
from jaxrl.envs import registry  # registers the built-in tasks (no jax)
from jaxrl.observe import sinks
from jaxrl.recipes import default as default_config
from jaxrl.runtime import compile_cache


def validate(cfg: ConfigDict, num_devices: int,
             task_names: Collection[str] | None = None,
             problems: Collection[str] = (), *,
             num_processes: int | None = None,
             device_memory: int | None = None,
             device_limit: int | None = None, backend: str = "cpu",
             notes: list[str] | None = None, files: bool = True) -> MeshShape:
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
    device_limit: bytes of one device's memory, for the memory plan (`jaxrl.config.memory`:
      train step and sampler together); None: unknown (CPU), not checked.
    backend: the devices' platform ("cpu", "gpu", "tpu"): it decides `model.attention = auto`.
    notes: where a warning goes (a plan near the device's limit), one line each.
    files: False checks the values alone, for a config that is planned and compiled but not
      run (`jaxrl.aot`): the files and directories it names (model, task data, run directory,
      resume, teacher, caches, sinks) and the host's and device's memory are not checked.

  Returns:
    The mesh shape with a -1 axis resolved against `num_devices`.

  Raises:
    ConfigError: listing every problem found, one per line.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  ref = default_config.get_config()
  problems = list(problems)
  good = _check_values(cfg, ref, task_names, problems)
  _check_model(good, problems)
  _check_attention(good, backend, problems)
  processes = num_processes or good.get("distributed.num_processes") or 1
  mesh = resolve_mesh_shape(good, num_devices, processes, problems)
  _check_batch(good, mesh, problems)
  _check_sampling(good, problems)
  _check_profile(good, problems)
  _check_loss(good, problems)
  _check_distributed(good, problems, num_processes)
  if files:
    preflight.check_hf(good, flatten(ref), problems)
    _check_task(good, problems)
    preflight.check_run_dir(good, problems)
    _check_teacher(good, problems)
    _check_caches(good, problems)
    preflight.check_logging(good, problems)
    preflight.check_resume(good, problems)
    preflight.check_memory(good, problems, processes, device_memory,
                           preflight.host_memory_bytes())
    memory.check_device(good, mesh, device_limit, problems, [] if notes is None else notes,
                        backend, processes)
  if problems:
    raise ConfigError(problems)
  assert mesh is not None
  return mesh


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


def _have(good: dict[str, Any], *keys: str) -> bool:
  """Whether every one of `keys` passed its own checks (a cross-key check needs them all)."""
  return all(k in good for k in keys)


def _check_values(cfg: ConfigDict, ref: ConfigDict, task_names: Collection[str] | None,
                  problems: list[str]) -> dict[str, Any]:
  """Keys and types against the default `ref`, then each value against its rule (`RULES`, the
  task names, the metrics backends). Returns the keys that passed, by dotted path: a bad value
  takes no part in the cross-key checks that follow."""
  good: dict[str, Any] = {}
  check_schema(cfg, ref, flatten(ref).keys(), "", problems, good)
  rules = [*RULES, _task_rule(good, task_names, problems)]
  backends = sinks.backend_names()  # a recipe file may register more (jaxrl.observe.sinks)
  rules.append((sinks.KEY, (lambda v: all(n in backends for n in sinks.parse_backends(v)),
                            f"a comma list of {backends}")))
  for key, (pred, requirement) in rules:
    if key in good and not pred(good[key]):
      problems.append(f"{PREFIX}{key}: must be {requirement}, got {good[key]!r}")
      del good[key]
  return good


def _task_rule(good: dict[str, Any], task_names: Collection[str] | None,
               problems: list[str]) -> tuple[str, Rule]:
  """The rule of `task.name`: names of `task_names` (None: every registered task, and any of a
  task family, registered here as they are met), each once, joined by '+'."""
  known = sorted(registry.task_names() if task_names is None else task_names)
  families = ""
  if task_names is None:
    known_here = set(known) | _resolve_tasks(good, problems)
    families = "".join(f" or '{f.pattern}'" for f in registry.FAMILIES.values())
  else:
    known_here = set(known)
  return ("task.name", (
      lambda v: all(n in known_here for n in v.split("+")) and len(set(v.split("+"))) ==
      len(v.split("+")),
      f"one of {known}{families}, or several distinct ones joined by '+' (mixed per row)"))


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



def _check_model(good: dict[str, Any], problems: list[str]) -> None:
  """The model's shape: query heads share key/value heads in equal groups."""
  if _have(good, "model.num_heads", "model.num_kv_heads") and \
      good["model.num_heads"] % good["model.num_kv_heads"]:
    problems.append(
        f"{PREFIX}model.num_heads: must be divisible by {PREFIX}model.num_kv_heads, got "
        f"{good['model.num_heads']} and {good['model.num_kv_heads']}")
  if good.get("moe.routing_replay") == "rollout" and good.get("model.num_experts") == 0 \
      and not good.get("model.hf_path"):
    problems.append(f"{PREFIX}moe.routing_replay: 'rollout' needs a mixture-of-experts model "
                    "(model.num_experts > 0); this one is dense")


def _check_attention(good: dict[str, Any], backend: str, problems: list[str]) -> None:
  """Attention implementations that exist on one backend only are refused elsewhere."""
  if not _have(good, "model.attention", "model.dtype"):
    return
  impl, dtype = good["model.attention"], good["model.dtype"]
  if impl == "cudnn" and backend != "gpu":
    problems.append(f"{PREFIX}model.attention: cudnn runs on a CUDA GPU; this run's devices are "
                    f"{backend} (use auto, xla or dense)")
  elif impl == "cudnn" and dtype not in ("bfloat16", "float16"):
    problems.append(f"{PREFIX}model.attention: cudnn computes in bfloat16 or float16; "
                    f"{PREFIX}model.dtype is {dtype} (use xla, or a 16-bit model.dtype)")
  if impl == "pallas_tpu" and backend == "gpu":
    problems.append(f"{PREFIX}model.attention: pallas_tpu is the TPU kernel (interpreted on CPU "
                    "for tests); on a GPU use cudnn or xla")
  decode = good.get("model.decode_attention")
  other = {"pallas_tpu": "gpu", "pallas_gpu": "tpu"}.get(decode)
  if other and backend == other:
    problems.append(f"{PREFIX}model.decode_attention: {decode} is not a {other.upper()} kernel "
                    "(interpreted on CPU for tests); use auto or xla")


def _check_packing(good: dict[str, Any], problems: list[str]) -> None:
  """Token-budget packing: a packed row holds at least one whole row; micro-batches are counted
  by tokens, so a fixed count contradicts it."""
  if not _have(good, "train.packing", "train.num_microbatches", "train.microbatch_tokens",
               "rollout.max_prompt_len", "rollout.max_new_tokens", "rollout.max_total_tokens"):
    return
  if not good["train.packing"]:
    return
  budget = "rollout.max_total_tokens" if good["rollout.max_total_tokens"] else \
      "rollout.max_new_tokens"
  row = good["rollout.max_prompt_len"] + good[budget]
  if good["train.microbatch_tokens"] < row:
    problems.append(
        f"{PREFIX}train.microbatch_tokens: with {PREFIX}train.packing a packed row must hold "
        f"one whole row, {PREFIX}rollout.max_prompt_len + {PREFIX}{budget} = {row} positions; "
        f"got {good['train.microbatch_tokens']}")
  if good["train.num_microbatches"]:
    problems.append(
        f"{PREFIX}train.num_microbatches: with {PREFIX}train.packing micro-batches are counted "
        f"by tokens ({PREFIX}train.microbatch_tokens per batch shard); set it to 0, got "
        f"{good['train.num_microbatches']}")


def _check_batch(good: dict[str, Any], mesh: MeshShape | None, problems: list[str]) -> None:
  """Batch sizes against the mesh: every batch (and RL micro-batch) is split over the batch
  shards, `mesh.data * mesh.fsdp` (1 when the mesh itself is bad)."""
  batch_shards = f"{PREFIX}mesh.data * {PREFIX}mesh.fsdp"
  if _have(good, "rollout.num_prompts", "rollout.group_size", "train.num_microbatches",
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
  _check_packing(good, problems)
  for key in ("sft.batch_size", "val.batch_size"):
    if mesh and _have(good, key) and good[key] % (mesh.data * mesh.fsdp):
      problems.append(
          f"{PREFIX}{key}: must be divisible by {batch_shards} = {mesh.data * mesh.fsdp} "
          f"(the batch axis is sharded over both), got {good[key]}")


def _check_sampling(good: dict[str, Any], problems: list[str]) -> None:
  """How samples are drawn: several validation samples of a prompt need a temperature, partial
  rollouts the continuous engine, and a total-token budget room for one reply."""
  if _have(good, "val.samples_per_prompt", "val.temperature") and \
      good["val.samples_per_prompt"] > 1 and good["val.temperature"] == 0:
    problems.append(
        f"{PREFIX}val.temperature: must be > 0 with {PREFIX}val.samples_per_prompt = "
        f"{good['val.samples_per_prompt']} (greedy samples of one prompt are all the same)")
  if good.get("rollout.partial_rollouts") and good.get("rollout.engine", "static") != "continuous":
    problems.append(
        f"{PREFIX}rollout.partial_rollouts: needs {PREFIX}rollout.engine = 'continuous' (the "
        "static sampler decodes a whole batch on one params version), got "
        f"{good.get('rollout.engine')!r}")
  if good.get("rollout.sync") == "delta" and "mesh.rollout_processes" in good and \
      not str(good["mesh.rollout_processes"]).strip():
    problems.append(
        f"{PREFIX}rollout.sync: 'delta' needs {PREFIX}mesh.rollout_processes (only versions that "
        "cross to other processes are sent; in one process the samplers' copy is made on the "
        "devices)")
  if _have(good, "rollout.max_total_tokens", "rollout.max_new_tokens") and \
      0 < good["rollout.max_total_tokens"] < good["rollout.max_new_tokens"]:
    problems.append(
        f"{PREFIX}rollout.max_total_tokens: must be 0 or >= {PREFIX}rollout.max_new_tokens = "
        f"{good['rollout.max_new_tokens']}, got {good['rollout.max_total_tokens']}")


def _lag_bound(good: dict[str, Any]) -> int:
  """`lag_bound` of the well-typed keys (0 where they did not pass their checks)."""
  return lag_bound({"lag": good.get("rollout.lag", 0), "max_lag": good.get("rollout.max_lag", 0)})


def _check_lag(good: dict[str, Any], problems: list[str], several: str) -> None:
  """`rollout.lag = "auto"` tunes the lag of one process's rollout worker: it needs a lag to
  choose from, and one process (each process's worker would time and tune its own lag, and the
  processes' shares of a batch would not agree on its params version)."""
  if good.get("rollout.lag") != AUTO_LAG:
    return
  p = PREFIX
  if good.get("rollout.max_lag") == 0:
    problems.append(f"{p}rollout.max_lag: must be >= 1 with {p}rollout.lag = {AUTO_LAG!r} (0 "
                    "leaves no lag to choose)")
  if several:
    problems.append(f"{p}rollout.lag: {AUTO_LAG!r} tunes one process's rollout worker; with "
                    f"{several} set a fixed lag (an int >= 0)")


def _check_profile(good: dict[str, Any], problems: list[str]) -> None:
  """A trace window that the run reaches."""
  if _have(good, "profile.steps", "train.steps") and good["profile.steps"] and \
      parse_profile_steps(good["profile.steps"])[0] > good["train.steps"]:
    problems.append(
        f"{PREFIX}profile.steps: {good['profile.steps']!r} starts after the last RL step "
        f"({PREFIX}train.steps = {good['train.steps']}), so nothing would be traced")


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
  for band in INTERVAL_BANDS:
    lo, hi = f"loss.{band}_low", f"loss.{band}_high"
    if lo in good and hi in good and good[lo] >= good[hi]:
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
      good.get("loss.ratio_base") == "auto" and _lag_bound(good) > 0):
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
                                   and _lag_bound(good) > 0)),
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
    _check_lag(good, problems, "")
    return
  _check_lag(good, problems, several)
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
  agents = [n for n in names if n.startswith("agent:")]
  if agents and len(names) > 1:
    problems.append(f"{p}task.name: the agent task {agents[0]!r} runs alone (its loop plays "
                    f"every episode of the run); drop the other tasks of {name!r}")
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


def _check_teacher(good: dict[str, Any], problems: list[str]) -> None:
  """A distillation teacher that can be loaded and has a say."""
  teacher = good.get("distill.teacher", "")
  if teacher:
    if not os.path.isfile(os.path.join(teacher, "config.json")):
      problems.append(f"{PREFIX}distill.teacher: {teacher!r} has no config.json: give a jaxrl "
                      "run directory or a Hugging Face model directory")
    elif good.get("distill.coef") == 0:
      problems.append(f"{PREFIX}distill.coef: 0 with {PREFIX}distill.teacher set gives the "
                      "teacher no say; set a coefficient or leave distill.teacher empty")


def _check_caches(good: dict[str, Any], problems: list[str]) -> None:
  """Compile and warm-up cache directories that can be written."""
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
