"""The evaluation thread: runs alongside the caller, results under the step they describe,
bounded waits, failures re-raised with their traceback, inline mode."""

from __future__ import annotations

import threading
import time

import pytest

from jaxrl.run.validation import EvaluationFailed, EvaluationStalled, Evaluator


def test_async_pass_runs_alongside_and_reports_its_step():
  gate = threading.Condition()
  release = []

  def run(step, params):
    with gate:
      while not release:
        gate.wait(0.05)
    return {"val/accuracy": params * 2}

  v = Evaluator(run=run, asynchronous=True, max_wait_s=5.0)
  t0 = time.monotonic()
  v.submit(10, 0.25)
  assert time.monotonic() - t0 < 0.5  # submit did not wait for the pass
  assert v.poll() == []  # still running
  with gate:
    release.append(1)
    gate.notify_all()
  (step, m), = v.wait()
  assert step == 10 and m["val/accuracy"] == 0.5 and m["val/time_s"] >= 0
  v.submit(20, 1.0)
  assert [s for s, _ in v.wait()] == [20]
  v.close()


def test_next_submit_waits_at_most_max_wait_s():
  def run(step, params):
    time.sleep(2.0)
    return {}

  v = Evaluator(run=run, asynchronous=True, max_wait_s=0.2)
  v.submit(1, None)
  t0 = time.monotonic()
  with pytest.raises(EvaluationStalled, match="step 1 did not finish within val.max_wait_s=0.2"):
    v.submit(2, None)
  assert time.monotonic() - t0 < 1.0


def test_failure_surfaces_with_traceback():
  def run(step, params):
    raise ZeroDivisionError("bad grader")

  v = Evaluator(run=run, asynchronous=True, max_wait_s=5.0)
  v.submit(3, None)
  with pytest.raises(EvaluationFailed, match="ZeroDivisionError: bad grader") as info:
    v.wait()
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  assert "in run" in str(info.value)  # the pass's own frame is in the message


def test_inline_mode_runs_in_submit():
  seen = []
  v = Evaluator(run=lambda s, p: seen.append(threading.current_thread()) or {"x": s},
                asynchronous=False)
  v.submit(5, None)
  assert seen == [threading.current_thread()]
  assert v.poll()[0][0] == 5
