"""`jaxrl.aot` without a compiler: target names, the collectives read from HLO text, what is live
at once at a lag, the verdict's lines, and the plan command's bad input (one `jaxrl:` line
before any compile). The compiles themselves are tests/test_aot_compile.py (marked `aot`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

from jaxrl.aot import report, targets

GIB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,chips,hosts,topology", [
    ("v5e-4", 4, 1, "2x2"), ("v5e-16", 16, 4, "4x4"), ("v6e-256", 256, 64, "16x16"),
    # Cloud TPU names v5p by TensorCores, two a chip: v5p-8 is a 2x2x1 slice of 4 chips.
    ("v5p-8", 4, 1, "2x2x1"), ("v5p-16", 8, 2, "2x2x2"), ("v5p-32", 16, 4, "2x2x4"),
    ("v5p-128", 64, 16, "4x4x4"),
    ("h100-1", 1, 1, "1x1x1"), ("h200-8", 8, 1, "1x1x8"), ("h100-8x2", 16, 2, "1x2x8"),
])
def test_target_names(name, chips, hosts, topology):
  t = targets.parse_target(name)
  assert (t.chips, t.hosts, t.topology) == (chips, hosts, topology)
  assert t.hbm_bytes > 0 and t.peak_flops > 0 and t.hbm_bandwidth > 0 and t.source
  assert 0 < t.usable_bytes < t.hbm_bytes


@pytest.mark.parametrize("name,host,chips", [
    ("v5e-16", "v5e-4", 4), ("v6e-256", "v6e-4", 4), ("v5p-32", "v5p-8", 4),
    ("h100-8x2", "h100-8", 8), ("v5e-4", "v5e-4", 4), ("h200-1", "h200-1", 1),
])
def test_one_host_of_a_slice(name, host, chips):
  # A TPU host holds 4 chips (v5p names them by TensorCores: v5p-8); a GPU host its N cards.
  h = targets.host_target(targets.parse_target(name))
  assert (h.name, h.chips, h.hosts) == (host, chips, 1)


def test_target_figures_are_the_published_ones():
  # Per chip: v5e 16 GiB / 197 TFLOP/s / 819 GB/s; v5p 95 GiB / 459 / 2,765; H100 SXM 80 GB /
  # 989.4 / 3.35 TB/s.
  v5e, v5p, h100 = (targets.parse_target(n) for n in ("v5e-4", "v5p-8", "h100-8"))
  assert (v5e.hbm_bytes, v5e.peak_flops, v5e.hbm_bandwidth) == (16 * GIB, 197e12, 819e9)
  assert (v5p.hbm_bytes, v5p.peak_flops, v5p.hbm_bandwidth) == (95 * GIB, 459e12, 2765e9)
  assert (h100.hbm_bytes, h100.peak_flops, h100.hbm_bandwidth) == (80 * 10**9, 989.4e12, 3.35e12)
  # A GPU keeps 75% of its HBM for XLA's allocator: 60 GB of an H100's 80.
  assert h100.usable_bytes == 60 * 10**9
  assert "core_count: 132" in targets.gpu_target_config(h100)
  assert f"device_memory_size: {80 * 10**9}" in targets.gpu_target_config(h100)


@pytest.mark.parametrize("name,needle", [
    ("tpu-8", "known: v5e-4"), ("v5e-3", "1, 4, 8, 16"), ("v5p-3", "TensorCores"),
    ("v5p-12", "power of two"), ("h100-3", "1, 2, 4 or 8"), ("v4-8", "known:"),
])
def test_bad_target_names(name, needle):
  with pytest.raises(targets.TargetError, match=needle):
    targets.parse_target(name)


HLO = """
  %all-gather-start = (bf16[4096,512]{0,1}, bf16[4096,4096]{0,1}) all-gather-start(%p), channel_id=1
  %all-gather-done = bf16[4096,4096]{0,1} all-gather-done(%all-gather-start)
  %ar = f32[1024]{0} all-reduce(%x), channel_id=2, to_apply=%add
  %ar.1 = f32[256,8]{1,0} all-reduce(%y), channel_id=3, to_apply=%add
  %rs = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) reduce-scatter(%a, %b), dimensions={0}
  %add.3 = f32[1024]{0} add(%ar, %ar)
"""


def test_collectives_from_hlo_text():
  got = report.collectives(HLO)
  # all-gather: the start's larger array, 4096 x 4096 x 2 bytes; its -done is not counted again.
  assert got["all-gather"] == {"ops": 1, "bytes": 4096 * 4096 * 2}
  # all-reduce: 1024 x 4 + 256 x 8 x 4 bytes over two ops.
  assert got["all-reduce"] == {"ops": 2, "bytes": 1024 * 4 + 256 * 8 * 4}
  # A tuple's largest array (both 8 x 128 x 2 here).
  assert got["reduce-scatter"] == {"ops": 1, "bytes": 8 * 128 * 2}
  assert set(got) == {"all-gather", "all-reduce", "reduce-scatter"}


def _compiled(name, side, argument, output, temp, alias=0):
  c = report.Compiled(name, side, "")
  c.memory = {"argument": argument, "output": output, "alias": alias, "temp": temp}
  return c


def _fake():
  # A train step holding 10 GiB of state and a 1 GiB batch as arguments, donating the state
  # (alias 10) into its output (10), with 4 GiB of temporaries: peak 11 + 10 - 10 + 4 = 15 GiB.
  # A decode reading a 2 GiB params copy and a 3 GiB cache, with 1 GiB of temporaries and a
  # 3 GiB output: peak 2 + 3 + 3 + 1 = 9 GiB, of which 7 are its own (less the params copy).
  compiled = {"train_step": _compiled("train_step", "train", 11 * GIB, 10 * GIB, 4 * GIB,
                                      alias=10 * GIB),
              "decode": _compiled("decode", "rollout", 5 * GIB, 3 * GIB, 1 * GIB)}
  built = types.SimpleNamespace(batch_bytes=1 * GIB, rollout_param_bytes=2 * GIB)
  return compiled, built


def test_live_peak_at_lag_one_adds_both_sides():
  compiled, built = _fake()
  assert compiled["train_step"].peak == 15 * GIB
  p = report.live_peak(compiled, built, lag=1, colocated=True)
  # Train side: 15 + one more ring batch (1) = 16. Rollout: two copies (2 x 2) + decode's own 7
  # = 11. At once: 27.
  assert (p["train"], p["rollout"], p["total"]) == (16 * GIB, 11 * GIB, 27 * GIB)
  assert p["largest_rollout"] == "decode"


def test_live_peak_at_lag_zero_takes_the_larger_phase():
  compiled, built = _fake()
  p = report.live_peak(compiled, built, lag=0, colocated=True)
  # Training: 15 + the sampler's copy (2) = 17. Sampling: the state (11 - 1 = 10) + one copy (2)
  # + decode's own 7 = 19. One at a time: 19 (a sum would say 36).
  assert (p["train"], p["rollout"], p["total"]) == (17 * GIB, 19 * GIB, 19 * GIB)


def test_live_peak_disaggregated_is_the_larger_side():
  compiled, built = _fake()
  p = report.live_peak(compiled, built, lag=2, colocated=False)
  assert (p["train"], p["rollout"], p["total"]) == (17 * GIB, 11 * GIB, 17 * GIB)


def test_verdict_names_the_keys_and_the_headroom():
  compiled, built = _fake()
  cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(lag=1))
  peak = report.live_peak(compiled, built, lag=1, colocated=True)
  v5e = targets.parse_target("v5e-4")  # 16 GiB, 15.2 usable: 27 GiB does not fit
  fits, lines = report.verdict(compiled, peak, v5e, cfg)
  assert not fits
  assert lines == [f"jaxrl: the run needs 27.00 GiB per chip at once (rollout.lag 1: train step "
                   f"and sampler at once), 11.80 GiB over v5e-4's 15.20 GiB usable; lower it with "
                   f"config.train.microbatch_tokens, config.train.num_microbatches, "
                   f"config.model.remat, config.mesh.fsdp, config.rollout.lag"]
  v5p = targets.parse_target("v5p-8")  # 95 GiB, 90.25 usable: 27 fits with 70% headroom
  fits, lines = report.verdict(compiled, peak, v5p, cfg)
  assert fits and lines[0].startswith("fits: 27.00 GiB of 90.25 GiB usable per chip (70% headroom")


def test_a_program_over_the_chip_is_its_own_line():
  compiled = {"decode": _compiled("decode", "rollout", 10 * GIB, 3 * GIB, 5 * GIB)}
  built = types.SimpleNamespace(batch_bytes=0, rollout_param_bytes=2 * GIB)
  cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(lag=0))
  peak = report.live_peak(compiled, built, lag=0, colocated=True)
  fits, lines = report.verdict(compiled, peak, targets.parse_target("v5e-4"), cfg)
  assert not fits and len(lines) == 1
  assert lines[0].startswith("jaxrl: decode needs 18.00 GiB per chip, 2.80 GiB over v5e-4's")
  assert "config.rollout.num_prompts, config.rollout.kv_cache_dtype" in lines[0]


def _plan(*args):
  return subprocess.run([sys.executable, "-m", "jaxrl.plan", *args], cwd=ROOT, text=True,
                        capture_output=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["--target", "tpu-8"], "jaxrl: unknown target 'tpu-8'; known: v5e-4"),
    (["--target", "v5e-4", "--config.mesh.fsdp=3"], "jaxrl: target v5e-4 (4 chips, 1 host(s)): "
                                                   "config.mesh"),
    (["--target", "v5e-4", "--config.model.hf_path=/nowhere/Qwen9-1B"],
     "no config.json in '/nowhere/Qwen9-1B', and no shipped shape of that name "
     "(Llama-3.2-1B-Instruct, Qwen2.5-0.5B-Instruct, Qwen2.5-7B-Instruct"),
    (["--target", "v5e-4", "--config.rollout.lagg=1"], "config.rollout.lagg"),
    (["--target", "v5e-4", "--programs", "train_step,bogus"],
     "jaxrl: --programs: unknown program(s) 'bogus'; known: train_step, publish"),
])
def test_bad_input_is_one_line_before_any_compile(args, needle, tmp_path):
  r = _plan(*args)
  assert r.returncode == 1, r.stderr
  errors = [ln for ln in r.stderr.splitlines() if ln.startswith("jaxrl:")]
  assert len(errors) == 1 and needle in errors[0], r.stderr
  assert "compiling" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                    reason="libtpu is installed here: the missing-compiler line cannot show")
def test_a_missing_compiler_names_its_extra():
  r = _plan("--target", "v5e-4")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == ('jaxrl: target v5e-4: compiling for a TPU needs '
                                               'libtpu: pip install -e ".[tpu]"')
