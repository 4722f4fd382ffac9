"""`task.name=agent:<module>:<function>` in a real run: the agent (an `openai`-client function, here
one completion per episode on the built-in `add` rows) is played through the run's own server by
the producer's loop, with no branch in the run loop; forced lag holds exactly (batch b is served
by params b - L: first- and last-token staleness are both exactly min(b, L)), and validation
plays the agent too."""

from __future__ import annotations

import json

import jax
import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")

from jaxrl import config as config_lib  # noqa: E402
from jaxrl.run import driver  # noqa: E402

from test_bad_input import _tiny_cfg  # noqa: E402

CALLS: list[str] = []


async def answer(client, task):
  """One completion of the row's prompt ("07+35="); reward: exact answer, as `add` grades."""
  r = await client.completions.create(model="policy", prompt=task.prompt, max_tokens=3)
  CALLS.append(task.uid)
  return {"correct": float(r.choices[0].text.strip() == task.data["answer"])}


def test_config_rejects_an_agent_that_does_not_import():
  cfg = _tiny_cfg(task__name="agent:test_agent_run:no_such_function")
  with pytest.raises(config_lib.ConfigError, match="not an async function"):
    config_lib.validate(cfg, jax.device_count())


@pytest.mark.parametrize("over,key", [
    (dict(task__name="agent:test_agent_run:answer+add"), "config.task.name")])
def test_config_rejects_what_agent_tasks_do_not_do(over, key):
  cfg = _tiny_cfg(**{"task__name": "agent:test_agent_run:answer", **over})
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, jax.device_count())
  assert [q for q in e.value.problems if q.startswith(key + ":")], e.value.problems


def _run(cfg, tmp_path):
  """Runs `cfg` in `tmp_path/run`: (every metrics row, the RL rows, one per step in order)."""
  driver.run(cfg, str(tmp_path / "run"), config_lib.validate(cfg, jax.device_count()))
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
          .splitlines()]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["batch_id"] for r in rl] == list(range(cfg.train.steps))
  return rows, rl


@pytest.mark.slow  # a 4-step run plus validation through the server: ~40 s on 2 busy cores
def test_an_agent_task_trains_with_exact_forced_lag(tmp_path):
  lag, steps = 2, 4
  cfg = _tiny_cfg(task__name="agent:test_agent_run:answer", rollout__lag=lag,
                  train__steps=steps, val__at_end=True, agent__max_concurrency=8)
  CALLS.clear()
  rows, rl = _run(cfg, tmp_path)
  for r in rl:
    want = min(r["batch_id"], lag)
    for kind in ("first_token", "last_token"):
      assert r[f"staleness/{kind}/min"] == r[f"staleness/{kind}/max"] == want, (kind, r)
    assert "reward/correct" in r
  val = [r for r in rows if r["phase"] == "val"]
  assert val and 0.0 <= val[-1]["val/accuracy"] <= 1.0
  G = cfg.rollout.group_size
  # Every training episode went through the agent (batches made ahead by the lag included).
  assert len(CALLS) >= steps * cfg.rollout.num_prompts * G


REPLIES: list[tuple[int, int]] = []  # (version, token count) of every reply served


async def two_sequences(client, task):
  """Two completions: the row's prompt, then "1" + that prompt, which does not extend the first
  prompt and reply, so the episode's row holds two causal sequences."""
  replies = [await client.completions.create(model="policy", prompt=p, max_tokens=3)
             for p in (task.prompt, "1" + task.prompt)]
  for r in replies:
    extra = r.choices[0].model_extra
    REPLIES.append((extra["policy_versions"][0], len(extra["token_ids"])))
  return float(replies[1].choices[0].text.strip() == task.data["answer"])


@pytest.mark.slow  # a 3-step run through the server: ~30 s on 2 busy cores
def test_an_agent_episode_of_two_sequences_trains_both(tmp_path):
  # Lag 0: batch b is served by version b alone, so each step's trained tokens are the replies
  # stamped b. Were the second sequence dropped (or run as one sequence with the first, whose
  # loss is the same shape), the count would be the first replies' alone.
  steps = 3
  cfg = _tiny_cfg(task__name="agent:test_agent_run:two_sequences", rollout__lag=0,
                  train__steps=steps, rollout__max_total_tokens=16)
  REPLIES.clear()
  _, rl = _run(cfg, tmp_path)
  for r in rl:
    served = [n for v, n in REPLIES if v == r["batch_id"]]
    assert len(served) == 2 * cfg.rollout.num_prompts * cfg.rollout.group_size
    assert r["tokens"] == sum(served), (r["tokens"], sum(served[::2]))
    assert r["env/metadata/agent_segments"] == 2.0
