"""The multi-turn loop: one environment call per task per turn, results equal to a per-sample
synchronous reference given the same generations, budgets, masks, version stamps, and failing or
slow environments that fail their rows without hanging the loop."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

import jax
import numpy as np
import pytest

from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.envs.base import StepResult, Task, Turn
from jaxrl.rollout.multi_turn import Budget, MultiTurn

TOK = CharTokenizer("abcdefghij")  # ids: 0 pad, 1 EOS, 2.. letters


class Out(NamedTuple):
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray


def _draw(context: list[int], request_id: int, turn_salt: int, m: int):
  """A deterministic 'model': 1..m letters chosen from a hash of the context, EOS at the end
  unless the hash says the turn runs over the budget."""
  h = (hash((tuple(context), int(request_id), turn_salt)) & 0xFFFFFFFF)
  rng = np.random.default_rng(h)
  n = int(rng.integers(1, m + 1))
  toks = list(rng.integers(2, 12, size=n))
  if rng.random() < 0.85 and n < m:
    toks.append(TOK.eos_id)
  lps = -rng.random(len(toks)).astype(np.float32)
  return toks, lps


class FakeSampler:
  """Stands in for make_sampler: deterministic given (context, request id, key)."""

  def __init__(self, group_size: int, m: int):
    self.G, self.m, self.calls = group_size, m, 0

  def __call__(self, params, prompts, valid, key, request_ids, temperature, top_k=0, top_p=1.0,
               version=0):
    self.calls += 1
    rows = np.repeat(np.arange(len(prompts)), self.G)
    salt = 0  # the context differs every turn; the key is not needed for determinism
    out_t = np.zeros((len(rows), self.m), np.int32)
    out_m = np.zeros((len(rows), self.m), bool)
    out_l = np.zeros((len(rows), self.m), np.float32)
    for i, p in enumerate(rows):
      ctx = [int(t) for t, v in zip(prompts[p], valid[p]) if v]
      toks, lps = _draw(ctx, request_ids[i], salt, self.m)
      out_t[i, :len(toks)], out_m[i, :len(toks)], out_l[i, :len(toks)] = toks, True, lps
    return Out(out_t, out_m, out_l)


class CountingEnv:
  """Rewards and observations that depend on the response and turn; done at `done_turn` or when
  the response starts with 'a'. Counts calls and rows per call."""

  def __init__(self, name: str, max_turns: int, done_turn: int, delay: float = 0.0,
               fail: bool = False):
    self.name, self.max_turns, self.done_turn = name, max_turns, done_turn
    self.delay, self.fail = delay, fail
    self.calls: list[int] = []
    self.lock = threading.Lock()

  def score(self, t: Turn):
    r = (len(t.response) % 3) / 2 + (0.25 if t.truncated else 0.0) + 0.1 * t.turn
    done = t.turn >= self.done_turn or t.response.startswith("a")
    obs = "" if done else "bc"[: 1 + t.turn % 2] + self.name[0]
    return obs, r, done

  def step(self, turns):
    with self.lock:
      self.calls.append(len(turns))
    if self.delay:
      time.sleep(self.delay)
    if self.fail:
      raise RuntimeError("grader crashed")
    scored = [self.score(t) for t in turns]
    return StepResult(observations=[s[0] for s in scored],
                      rewards=np.array([s[1] for s in scored], np.float32),
                      done=np.array([s[2] for s in scored]),
                      components={"len": np.array([len(t.response) for t in turns], np.float32)})


KEY = jax.random.key(0)


def _tasks(n):
  # Two tasks ("e" and "f"), mixed per row; prompts of different lengths.
  return [Task(env="e" if i % 2 else "f", prompt="abcdefghij"[: 1 + i % 5], data={},
               uid=f"t{i}") for i in range(n)]


def _loop(envs, G=4, m=3, N=16, turns=3, timeout=5.0):
  budget = Budget(max_prompt_len=6, max_new_tokens=m, max_total_tokens=N, max_turns=turns)
  return MultiTurn(TOK, envs, budget, G, FakeSampler(G, m), FakeSampler(1, m),
                   fetch=lambda x: x, env_timeout_s=timeout)


def _reference(tasks, envs, G, m, N, max_turns):
  """Per-sample, fully synchronous: one env call per row per turn, same generations."""
  out = []
  for ti, task in enumerate(tasks):
    for g in range(G):
      i = ti * G + g
      env = envs[task.env]
      prompt = TOK.encode(task.prompt)
      comp, total, turn, history = [], 0.0, 0, [("user", task.prompt)]
      status = "truncated"
      limit = min(max_turns, env.max_turns)
      while True:
        ctx = prompt + comp
        salt = 0
        toks, _ = _draw(ctx if turn else prompt, i, salt, m)
        room = N - len(comp)
        cut = len(toks) > room
        toks = toks[:room]
        comp += toks
        ended = len(toks) > 0 and toks[-1] == TOK.eos_id
        text = TOK.decode([t for t in toks if t != TOK.eos_id])
        res = env.step([Turn(task, turn, text, bool(cut or not ended), tuple(history))])
        history.append(("assistant", text))
        total += float(res.rewards[0])
        turn += 1
        if res.done[0]:
          status = "terminated"
          break
        if cut or turn >= limit:
          break
        obs = TOK.encode(res.observations[0])
        history.append(("user", res.observations[0]))
        if len(comp) + len(obs) + 1 > N:
          break
        comp += obs
      out.append((total, turn, status, comp))
  return out


def test_one_env_call_per_task_per_turn_and_equal_to_per_sample_reference():
  # 64 prompts x 4 samples, up to 3 turns, two tasks.
  envs = {"e": CountingEnv("e", max_turns=3, done_turn=2), "f": CountingEnv("f", 3, 1)}
  loop = _loop(envs)
  tasks = _tasks(64)
  ep = loop.run(None, tasks, KEY, request_base=0, version=7, temperature=1.0)
  # Each turn, each task with active rows gets exactly one call holding all its active rows.
  n_turns = int(ep.turns.max())
  assert n_turns == 3
  for name, env in envs.items():
    active_per_turn = [int(((ep.turns > t) & np.array([r.env == name for r in ep.tasks])).sum())
                       for t in range(n_turns)]
    want = [a for a in active_per_turn if a]
    assert env.calls == want, (name, env.calls, want)
  assert ep.env_calls == sum(len(e.calls) for e in envs.values()) <= 2 * 3
  assert ep.env_calls_by_env == {k: len(e.calls) for k, e in envs.items()}

  ref_envs = {"e": CountingEnv("e", 3, 2), "f": CountingEnv("f", 3, 1)}
  ref = _reference(tasks, ref_envs, 4, 3, 16, 3)
  assert sum(len(e.calls) for e in ref_envs.values()) == int(ep.turns.sum())  # per-sample calls
  for i, (total, turns, status, comp) in enumerate(ref):
    assert ep.rewards[i] == pytest.approx(total, abs=1e-6), i
    assert ep.turns[i] == turns, i
    assert ep.terminated[i] == (status == "terminated")
    assert ep.truncated[i] == (status != "terminated")
    n = int(ep.valid[i].sum())
    assert ep.tokens[i, :n].tolist() == comp, i
  assert ep.terminated.mean() == np.mean([s == "terminated" for _, _, s, _ in ref])
  assert ep.env_calls == sum(ep.env_calls_by_env.values()) and not ep.failed.any()
  assert ep.fail_counts() == {}


def test_masks_versions_and_budget():
  envs = {"e": CountingEnv("e", max_turns=3, done_turn=5), "f": CountingEnv("f", 3, 5)}
  ep = _loop(envs, N=9).run(None, _tasks(8), KEY, request_base=0, version=3, temperature=1.0)
  # Loss mask is inside valid; observations are valid but never in the loss mask.
  assert not (ep.mask & ~ep.valid).any()
  assert (ep.valid & ~ep.mask).any()
  assert (ep.policy_version[ep.mask] == 3).all()
  assert (ep.logprobs[~ep.mask] == 0).all()
  # Valid tokens are a prefix of each row; nothing exceeds the 9-token budget.
  for v in ep.valid:
    n = int(v.sum())
    assert v[:n].all() and not v[n:].any()
  assert ep.truncated.any()  # with a 9-token budget and no early done, budgets end episodes
  assert not (ep.truncated & ep.terminated).any()


def test_failing_env_fails_its_rows_only():
  envs = {"e": CountingEnv("e", 3, 2), "f": CountingEnv("f", 3, 1, fail=True)}
  ep = _loop(envs).run(None, _tasks(8), KEY, request_base=0, version=0, temperature=1.0)
  is_f = np.array([t.env == "f" for t in ep.tasks])
  assert ep.failed[is_f].all() and not ep.failed[~is_f].any()
  assert np.isnan(ep.rewards[is_f]).all() and np.isfinite(ep.rewards[~is_f]).all()
  assert not ep.mask[is_f].any()  # excluded from the loss and advantages
  assert all(r.startswith("error: env 'f' turn 0: RuntimeError: grader crashed")
             for r, f in zip(ep.fail_reasons, is_f) if f)
  assert ep.fail_counts() == {"error": is_f.sum()}


def test_slow_env_times_out_without_hanging():
  envs = {"e": CountingEnv("e", 3, 2), "f": CountingEnv("f", 3, 1, delay=5.0)}
  t0 = time.monotonic()
  ep = _loop(envs, timeout=0.3).run(None, _tasks(8), KEY, request_base=0, version=0,
                                     temperature=1.0)
  assert time.monotonic() - t0 < 3.0
  is_f = np.array([t.env == "f" for t in ep.tasks])
  assert ep.failed[is_f].all() and not ep.failed[~is_f].any()
  assert all("timeout" in r and "env.timeout_s=0.3" in r for r, f in zip(ep.fail_reasons, is_f)
             if f)
  assert ep.fail_counts() == {"timeout": is_f.sum()}


def test_unknown_environment_and_long_prompt_are_named():
  loop = _loop({"e": CountingEnv("e", 1, 0)})
  with pytest.raises(KeyError, match=r"\['zz'\]"):
    loop.run(None, [Task("zz", "ab", {}, "x")], KEY, 0, 0, 1.0)
  with pytest.raises(ValueError, match="max_prompt_len=6.*'long'"):
    loop.run(None, [Task("e", "abcdefghij", {}, "long")], KEY, 0, 0, 1.0)


class Holey:
  """Wraps a sampler: moves each row's generated tokens one slot right behind a masked-out
  junk token, so the mask is no longer a prefix (an engine may return such rows)."""

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, *args, **kwargs):
    o = self.inner(*args, **kwargs)
    b, w = o.tokens.shape
    t = np.concatenate([np.full((b, 1), 7, np.int32), o.tokens], 1)
    m = np.concatenate([np.zeros((b, 1), bool), o.mask], 1)
    lp = np.concatenate([np.full((b, 1), -9.0, np.float32), o.logprobs], 1)
    return Out(t, m, lp)


def test_non_prefix_masks_give_the_same_episodes():
  # The loop writes prefix masks (the samplers' own) in one vectorised step and anything else
  # row by row: both must read "the tokens where mask is True", in order.
  tasks = _tasks(6)
  envs = lambda: {"e": CountingEnv("e", 3, 2), "f": CountingEnv("f", 2, 1)}
  budget = Budget(max_prompt_len=6, max_new_tokens=3, max_total_tokens=9, max_turns=3)
  plain = MultiTurn(TOK, envs(), budget, 4, FakeSampler(4, 3), FakeSampler(1, 3),
                    fetch=lambda x: x, env_timeout_s=5.0).run(None, tasks, KEY, 0, 2, 1.0)
  holey = MultiTurn(TOK, envs(), budget, 4, Holey(FakeSampler(4, 3)), Holey(FakeSampler(1, 3)),
                    fetch=lambda x: x, env_timeout_s=5.0).run(None, tasks, KEY, 0, 2, 1.0)
  assert plain.turns.max() > 1 and plain.truncated.any()  # several turns and the budget bit
  for f in ("tokens", "valid", "mask", "logprobs", "policy_version", "rewards", "turns",
            "terminated", "truncated", "failed"):
    np.testing.assert_array_equal(getattr(holey, f), getattr(plain, f), err_msg=f)


class Sections:
  """A `turns` that records what ran inside its sections."""

  def __init__(self):
    self.inside, self.entered, self.log = False, 0, []

  @contextlib.contextmanager
  def section(self):
    self.inside, self.entered = True, self.entered + 1
    try:
      yield
    finally:
      self.inside = False


def test_each_turns_sampler_call_and_fetch_is_one_section_and_env_calls_are_outside():
  """`MultiTurn(turns=)`: every sampler call and the copy of its outputs run inside a section
  (what `rollout.sampler_first` lets go before the train step), every environment call outside
  one; the episodes equal those of a loop without sections."""
  turns = Sections()

  class Watched(CountingEnv):
    def step(self, batch):
      turns.log.append(("env", turns.inside))
      return super().step(batch)

  class WatchedSampler(FakeSampler):
    def __call__(self, *a, **k):
      turns.log.append(("sample", turns.inside))
      return super().__call__(*a, **k)

  def fetch(x):
    turns.log.append(("fetch", turns.inside))
    return x

  budget = Budget(max_prompt_len=6, max_new_tokens=3, max_total_tokens=16, max_turns=3)
  envs = {"e": Watched("e", 3, 2), "f": Watched("f", 3, 1)}
  loop = MultiTurn(TOK, envs, budget, 4, WatchedSampler(4, 3), WatchedSampler(1, 3),
                   fetch=fetch, env_timeout_s=5.0, turns=turns)
  tasks = _tasks(8)
  ep = loop.run(None, tasks, KEY, request_base=0, version=3, temperature=1.0)
  plain = _loop({"e": CountingEnv("e", 3, 2), "f": CountingEnv("f", 3, 1)}).run(
      None, tasks, KEY, request_base=0, version=3, temperature=1.0)
  assert np.array_equal(ep.tokens, plain.tokens) and np.array_equal(ep.rewards, plain.rewards)
  n_turns = int(ep.turns.max())
  assert n_turns >= 2 and turns.entered == n_turns
  assert [k for k, _ in turns.log if k != "env"] == ["sample", "fetch"] * n_turns
  assert all(inside for k, inside in turns.log if k != "env")
  assert any(k == "env" for k, _ in turns.log) and not any(i for k, i in turns.log if k == "env")
