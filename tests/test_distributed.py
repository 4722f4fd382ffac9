"""Joining several processes: what `detect` reads from a launcher's environment (SLURM,
torchrun-style variables, multi-host TPU VM), explicit keys winning over it, the multi-process
checks applied to the joined count, and real two-process joins through torchrun-style variables
(a tiny script; `python -m jaxrl.train` in the slow suite; torchrun itself with the parity
extra's torch)."""

import os
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from jaxrl.config import ConfigError, distributed_settings, validate
from jaxrl.recipes.default import get_config
from jaxrl.parallel import distributed
from jaxrl.parallel.distributed import Detected, EnvError, detect
from processes import communicate, free_port

TORCHRUN = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_JOB_ID": "1234", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "node[001-004]"}
TPU = {"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1,t1k-w-2,t1k-w-3", "TPU_WORKER_ID": "1"}
# Variables of any launcher, removed from the environment of the processes these tests start.
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "JAX_COORDINATOR_PORT",
                 "JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS", "JAX_COMPILATION_CACHE_DIR")


# --- detect ---------------------------------------------------------------------------------

def test_torchrun_style():
  assert detect(TORCHRUN) == Detected(
      "torchrun", "10.0.0.1:29500", 4, 3, None,
      "torchrun-style env vars (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)")
  # Several processes per host: each one its host's device LOCAL_RANK (one GPU each) ...
  local = {**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
  assert detect(local).local_device_ids == (1,)
  # ... unless JAX_LOCAL_DEVICE_IDS says otherwise; one process per host: all its devices.
  assert detect({**local, "JAX_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids is None
  assert detect({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}).local_device_ids is None
  # Under torchrun itself its agent listens on MASTER_PORT: the coordinator takes the next port.
  agent = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"}
  assert detect(agent).coordinator_address == "10.0.0.1:29501"
  assert detect({**agent, "JAX_COORDINATOR_PORT": "7000"}).coordinator_address == "10.0.0.1:7000"
  assert detect({**TORCHRUN, "MASTER_ADDR": "fd00::1"}).coordinator_address == "[fd00::1]:29500"


def test_torchrun_style_wins_over_slurm():
  # torchrun started by srun: its workers are the processes, not srun's tasks.
  found = detect({**SLURM, **TORCHRUN})
  assert found.kind == "torchrun" and found.num_processes == 4 and found.process_id == 3
  assert detect({**SLURM, **TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None


def test_slurm():
  assert detect(SLURM) == Detected("slurm", None, 4, 2, None,
                                   "SLURM (SLURM_NTASKS, SLURM_PROCID, SLURM_STEP_NODELIST)")


def test_tpu():
  found = detect(TPU)
  assert (found.kind, found.coordinator_address, found.num_processes, found.process_id) == \
      ("tpu", None, 4, 1)
  assert "TPU_WORKER_HOSTNAMES" in found.source
  # JAX reads TPU_PROCESS_ADDRESSES first; several slices multiply the processes.
  found = detect({"TPU_PROCESS_ADDRESSES": "a:8476,b:8476", "TPU_WORKER_HOSTNAMES": "a",
                  "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"})
  assert (found.num_processes, found.process_id) == (4, 3)
  assert "TPU_PROCESS_ADDRESSES" in found.source
  # One host per slice, two slices: two processes.
  assert detect({"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "2",
                 "MEGASCALE_SLICE_ID": "1"}).process_id == 1


@pytest.mark.parametrize("env", [
    {},
    {"PATH": "/usr/bin", "HOME": "/root"},
    {**SLURM, "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_PROCID": "0"},
    {"SLURM_JOB_ID": "1234"},  # an allocation without a task count
    {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"},  # not a SLURM job (JAX agrees)
    {"WORLD_SIZE": "1", "RANK": "0"},
    {"WORLD_SIZE": "1"},
    {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"},
    {"TPU_WORKER_HOSTNAMES": "t1k-w-0"},
], ids=["empty", "unrelated", "slurm_one_task", "slurm_no_tasks", "slurm_no_job", "world_size_1",
        "world_size_1_alone", "tpu_one_host", "tpu_one_host_no_id"])
def test_single_process(env):
  assert detect(env) is None


@pytest.mark.parametrize("env, var, fragment", [
    ({**TORCHRUN, "WORLD_SIZE": "four"}, "WORLD_SIZE", "'four' is not an integer"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE", "must be >= 1"),
    ({**TORCHRUN, "RANK": "4"}, "RANK", "must be < WORLD_SIZE=4"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK", "must be >= 0"),
    ({k: v for k, v in TORCHRUN.items() if k != "RANK"}, "RANK", "not set"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT", "not set"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR", "not set"),
    ({**TORCHRUN, "MASTER_ADDR": " "}, "MASTER_ADDR", "not set"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT", "not an integer"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT", "must be < 65536"),
    ({**TORCHRUN, "JAX_COORDINATOR_PORT": "x"}, "JAX_COORDINATOR_PORT", "not an integer"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK", "not set"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK",
     "must be < LOCAL_WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE", "not an integer"),
    ({**SLURM, "SLURM_NTASKS": "4x"}, "SLURM_NTASKS", "'4x' is not an integer"),
    ({**SLURM, "SLURM_NTASKS": "0"}, "SLURM_NTASKS", "must be >= 1"),
    ({**{k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NPROCS": "n"},
     "SLURM_NPROCS", "not an integer"),
    # SLURM_NPROCS alone: JAX's SLURM detection needs SLURM_NTASKS.
    ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS", "not set"),
    ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID", "must be < SLURM_NTASKS=4"),
    ({**SLURM, "SLURM_PROCID": ""}, "SLURM_PROCID", "not set"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID", "not set"),
    ({**SLURM, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID", "not an integer"),
    # The batch script itself (no srun step): the other tasks are not running jaxrl.
    ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, "SLURM_STEP_NODELIST",
     "not started by srun"),
    ({**TPU, "TPU_WORKER_ID": "4"}, "TPU_WORKER_ID", "must be < the 4 hosts"),
    ({**TPU, "TPU_WORKER_ID": "w1"}, "TPU_WORKER_ID", "not an integer"),
    ({k: v for k, v in TPU.items() if k != "TPU_WORKER_ID"}, "TPU_WORKER_ID", "not set"),
    ({**TPU, "TPU_WORKER_HOSTNAMES": "a,,b"}, "TPU_WORKER_HOSTNAMES", "empty entry"),
    ({**TPU, "MEGASCALE_NUM_SLICES": "two"}, "MEGASCALE_NUM_SLICES", "not an integer"),
    ({**TPU, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID",
     "must be < MEGASCALE_NUM_SLICES=2"),
])
def test_garbage_names_the_variable(env, var, fragment):
  with pytest.raises(EnvError) as info:
    detect(env)
  assert isinstance(info.value, ValueError)
  msg = str(info.value)
  assert msg.startswith(var) or f" {var} " in msg, msg
  assert fragment in msg, msg


# --- join: explicit keys first, auto only when asked --------------------------------------------

@pytest.fixture
def calls(monkeypatch):
  """Records what `join` would start instead of starting it."""
  made = []
  monkeypatch.setattr(distributed, "initialize", lambda *a: made.append(("explicit", *a)))
  monkeypatch.setattr(distributed, "initialize_detected",
                      lambda found, timeout_s, peer_timeout_s=None:
                      made.append(("detected", found, timeout_s)))
  return made


def test_explicit_keys_beat_detection(calls):
  garbage = {**TORCHRUN, "RANK": "99"}  # would raise if detection ran
  how = distributed.join("10.0.0.2:8476", 2, 1, 60, auto=True, env=garbage, peer_timeout_s=30)
  assert calls == [("explicit", "10.0.0.2:8476", 2, 1, 60, 30)]
  assert "distributed.* keys" in how and "10.0.0.2:8476" in how


def test_detection_only_with_auto_and_no_explicit_address(calls):
  assert distributed.join("", 1, 0, 60, auto=False, env=TORCHRUN) is None
  # A coordinator_address with num_processes = 1 is an explicit single process.
  assert distributed.join("10.0.0.2:8476", 1, 0, 60, auto=True, env=TORCHRUN) is None
  assert distributed.join("", 1, 0, 60, auto=True, env={}) is None
  assert calls == []
  how = distributed.join("", 1, 0, 60, auto=True, env=TORCHRUN)
  assert calls == [("detected", detect(TORCHRUN), 60)]
  assert how.startswith("torchrun-style env vars") and "10.0.0.1:29500" in how
  with pytest.raises(EnvError, match="RANK"):
    distributed.join("", 1, 0, 60, auto=True, env={**TORCHRUN, "RANK": "x"})


# --- config --------------------------------------------------------------------------------------

def _problems(cfg, **kwargs) -> list[str]:
  with pytest.raises(ConfigError) as info:
    validate(cfg, 8, **kwargs)
  return info.value.problems


def test_auto_key():
  cfg = get_config()
  assert cfg.distributed.auto is True
  assert distributed_settings(cfg) == ("", 1, 0, 300)  # explicit settings only
  cfg = ConfigDict(cfg.to_dict(), type_safe=False)
  cfg.distributed.auto = 1
  assert distributed_settings(cfg) is None
  assert _problems(cfg) == ["config.distributed.auto: expected bool, got int 1"]


def test_checks_apply_to_the_detected_process_count():
  cfg = get_config()
  cfg.rollout.engine = "continuous"
  cfg.rollout.lag = 1  # a lag is fine with several processes (test_multiprocess_rollouts)
  cfg.dynamic_sampling.enabled = True  # each process filters its own groups: allowed
  validate(cfg, 8, num_processes=2)
  cfg.mesh.rollout = 4  # disaggregated batches are made inline: the engine is refused there
  validate(cfg, 8)
  validate(cfg, 8, num_processes=1)
  [problem] = _problems(cfg, num_processes=2)
  assert problem.startswith("config.rollout.engine: must be 'static' with 2 processes"), problem
  assert "distributed.auto" in problem
  cfg.rollout.engine = "static"
  validate(cfg, 8, num_processes=2)
  # Explicit keys keep their wording, whether or not the processes were joined yet.
  cfg = get_config()
  cfg.distributed.num_processes = 2
  cfg.distributed.coordinator_address = "10.0.0.1:8476"
  cfg.rollout.engine = "continuous"
  cfg.mesh.rollout = 4
  for n in (None, 1, 2):
    [problem] = _problems(cfg, num_processes=n)
    assert "must be 'static' with config.distributed.num_processes > 1" in problem


# --- real processes ------------------------------------------------------------------------------

def _env(devices: int, **extra: str) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TPU_", "MEGASCALE_"))}
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  return {**env, **extra}


def _torchrun_env(rank: int, port: int) -> dict:
  return _env(4, WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


JOIN = """
import os
from jaxrl.parallel import distributed
how = distributed.join("", 1, 0, 60, auto=True, env=os.environ)
import jax
print(f"process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices, "
      f"{jax.local_device_count()} local; {how}", flush=True)
"""


def test_two_processes_join_through_torchrun_style_env():
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", JOIN], env=_torchrun_env(i, port),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = communicate(procs, 120)
  for i, out in enumerate(outs):
    assert f"process {i} of 2, 8 devices, 4 local; torchrun-style env vars" in out, out
    assert f"127.0.0.1:{port}" in out, out


def test_malformed_launcher_variable_is_a_config_error(tmp_path):
  env = _torchrun_env(5, free_port())  # RANK 5 of WORLD_SIZE 2
  proc = subprocess.run([sys.executable, "-m", "jaxrl.train", f"--config.run_dir={tmp_path}"],
                        env={**env, "JAX_LOG_COMPILES": "1"}, cwd=tmp_path, capture_output=True,
                        text=True, timeout=120)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out
  assert "jaxrl: config.distributed.auto: RANK='5' must be < WORLD_SIZE=2;" in out, out
  assert "Compiling" not in out, out


def test_detected_processes_get_the_multi_process_checks(tmp_path):
  """Nothing distributed in the config, two processes joined from the environment: the
  continuous engine with a disaggregated rollout mesh (batches made inline) is refused, before
  compiling, as with explicit keys."""
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "jaxrl.train",
                             "--config.rollout.engine=continuous",
                             "--config.mesh.rollout=4",
                             f"--config.run_dir={tmp_path / 'run'}"],
                            env={**_torchrun_env(i, port), "JAX_LOG_COMPILES": "1"}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = communicate(procs, 120, check=False)
  assert "jaxrl | joined 2 processes (8 devices)" in outs[0], outs[0]
  for p, out in zip(procs, outs):
    assert p.returncode != 0, out
    assert "jaxrl: config.rollout.engine: must be 'static' with 2 processes" in out, out
    assert "Compiling" not in out, out


@pytest.mark.slow
def test_train_joins_two_processes_through_torchrun_style_env(tmp_path):
  """`python -m jaxrl.train` twice with torchrun-style variables and nothing distributed in the
  config: one 8-device run (2 processes x 4 devices), process 0 saying how it was joined."""
  args = ["--config.model.d_model=32", "--config.model.head_dim=16", "--config.model.mlp_dim=64",
          "--config.sft.enabled=false", "--config.train.steps=1", "--config.task.dev_size=16",
          "--config.task.val_size=16", "--config.val.batch_size=16", "--config.val.at_start=false",
          "--config.val.at_end=false", "--config.val.every=1000", "--config.rollout.num_prompts=4",
          "--config.mesh.data=-1", f"--config.run_dir={tmp_path / 'run'}"]
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "jaxrl.train", *args],
                            env=_torchrun_env(i, port), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = communicate(procs, 600)
  joined = [line for line in outs[0].splitlines() if line.startswith("jaxrl | joined")]
  assert len(joined) == 1, outs[0]
  assert "joined 2 processes (8 devices) through torchrun-style env vars" in joined[0]
  assert f"127.0.0.1:{port}" in joined[0]
  assert "mesh 8x1x1 on cpu" in outs[0], outs[0]
  assert "jaxrl | " not in outs[1], outs[1]  # only process 0 prints
  assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parity
def test_torchrun_itself(tmp_path):
  """Under torchrun (the parity extra's torch), whose agent already listens on MASTER_PORT."""
  pytest.importorskip("torch.distributed.run")
  script = tmp_path / "join.py"
  script.write_text(JOIN)
  proc = subprocess.run(
      [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(script)],
      env=_env(4), cwd=tmp_path, capture_output=True, text=True, timeout=180)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  for i in range(2):
    assert f"process {i} of 2, 8 devices, 4 local; torchrun-style env vars" in out, out
