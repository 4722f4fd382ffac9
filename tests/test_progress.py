"""Tests for jaxrl.observe.metrics.Progress: the plain lines of a log file, the rich bar of a terminal."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from jaxrl.observe.metrics import Progress


def _drive(p: Progress) -> None:
  """What a run does: a phase of 7 steps, a forced line, the end of the phase, a summary."""
  p.say("RL: 7 GRPO steps")
  for step in range(1, 8):
    p.update(step, 7, f"reward {step / 10:.3f} | val 0.300 | 0.20 s/step")
    time.sleep(0.01)  # a rate for the terminal's ETA
  p.update(7, 7, "[done] kept", force=True)
  p.newline()
  p.say("held-out accuracy: 0.300 before RL -> 0.700")


def test_plain_lines_when_not_a_terminal():
  # The format the README shows and log files keep: every `every` steps, the last step and
  # forced updates; newline() adds nothing; no terminal control characters.
  out = io.StringIO()
  p = Progress(stream=out, every=3)
  assert not p.live
  _drive(p)
  assert out.getvalue() == (
      "RL: 7 GRPO steps\n"
      "    3/7 | reward 0.300 | val 0.300 | 0.20 s/step\n"
      "    6/7 | reward 0.600 | val 0.300 | 0.20 s/step\n"
      "    7/7 | reward 0.700 | val 0.300 | 0.20 s/step\n"
      "    7/7 | [done] kept\n"
      "held-out accuracy: 0.300 before RL -> 0.700\n")


def test_terminal_draws_a_bar_with_eta():
  out = io.StringIO()
  # color_system=None: cursor control codes only, so the text can be matched as written.
  console = Console(force_terminal=True, file=out, width=120, color_system=None)
  p = Progress(stream=io.StringIO(), every=3, console=console)
  assert p.live
  _drive(p)
  text = out.getvalue()
  frames = [f for f in re.split(r"\r|\n", text) if "ETA" in f]
  # A frame per update, each redrawn in place (\r + erase line).
  assert len(frames) >= 7 and "\x1b[2K" in text
  last = frames[-1]
  assert re.search(r"━+ 7/7 \d:\d\d:\d\d ETA \d:\d\d:\d\d \| \[done\] kept", last), last
  # Mid-run frames: a part-filled bar, the step count, a time estimate once a rate is known,
  # and the caller's text (reward, val, throughput) after it.
  mid = [f for f in frames if " 5/7 " in f]
  assert mid and re.search(r"ETA 0:00:0\d \| reward 0\.500 \| val 0\.300 \| 0\.20 s/step",
                           mid[-1]), mid
  # Lines said, and a forced update as its plain line, stay in the scrollback.
  assert "RL: 7 GRPO steps\n" in text and "    7/7 | [done] kept\n" in text
  assert text.endswith("held-out accuracy: 0.300 before RL -> 0.700\n")


def test_a_new_phase_starts_a_new_bar():
  out = io.StringIO()
  p = Progress(console=Console(force_terminal=True, file=out, width=120, color_system=None))
  p.update(5, 10, "warm-up")
  p.newline()
  p.update(1, 20, "rl")
  p.newline()
  frames = [f for f in re.split(r"\r|\n", out.getvalue()) if "ETA" in f]
  assert any(" 5/10 " in f for f in frames) and " 1/20 " in frames[-1]
