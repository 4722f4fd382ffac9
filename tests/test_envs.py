"""The environment layer: protocol and validation, registry, sources and the four built-in
environments, graded on hand-picked tricky answers (with and without math-verify)."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import sys
import threading

import numpy as np
import pytest

from jaxrl import envs
from jaxrl.data import CharTokenizer, MixedSource
from jaxrl.envs import StepResult, Task, Turn, call_step, make_env
from jaxrl.envs import countdown, expr, mathqa

# --------------------------------------------------------------------------------------------
# helpers


def _turns(env: str, rows, turn=0, truncated=False):
  """[(data, response)] -> Turns of env `env` at `turn`."""
  return [Turn(Task(env, "p", data, f"{env}/test/{i}"), turn, resp, truncated)
          for i, (data, resp) in enumerate(rows)]


# --------------------------------------------------------------------------------------------
# StepResult.validate / call_step


def test_validate_coerces_types():
  r = StepResult(["a", ""], [1, 0], np.array([0, 1]), {"c": [True, False]}, [{}, {"x": 1}])
  out = r.checked(2, "toy")
  assert out is r
  assert r.rewards.dtype == np.float32 and r.done.dtype == bool
  assert r.done.tolist() == [False, True]
  assert r.components["c"].dtype == np.float32 and r.components["c"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("bad, match", [
    (dict(observations=["a"]), "observations has 1 entries for 2 rows"),
    (dict(observations=["a", 3]), r"observations\[1\] is int"),
    (dict(rewards=[1.0, 2.0, 3.0]), r"rewards: shape \(3,\), expected \(2,\)"),
    (dict(rewards=[1.0, float("nan")]), "rewards: non-finite value nan at row 1"),
    (dict(rewards=[float("inf"), 0.0]), "rewards: non-finite value inf at row 0"),
    (dict(rewards=["1", "0"]), "rewards: dtype <U1 is not a real number"),
    (dict(done=[0.5, 1.0]), "done: dtype float64 is not bool"),
    (dict(done=[2, 0]), "done: dtype int64 is not bool"),
    (dict(components={"fmt": [1.0]}), r"components\['fmt'\]: shape \(1,\)"),
    (dict(components={"fmt": [np.nan, 1.0]}), r"components\['fmt'\]: non-finite"),
    (dict(metadata=[{}]), "metadata must be None or a list of 2 dicts, got 1"),
    (dict(metadata=[{}, "x"]), r"metadata\[1\] is str"),
])
def test_validate_rejects_and_names_env_and_field(bad, match):
  kw = dict(observations=["", ""], rewards=[0.0, 1.0], done=[True, True])
  kw.update(bad)
  with pytest.raises(ValueError, match=match) as e:
    StepResult(**kw).checked(2, "toy")
  assert "environment 'toy'" in str(e.value)


class _SyncEnv:
  name = "sync"
  max_turns = 1

  def __init__(self, result=None):
    self.calls = []
    self.result = result

  def step(self, turns):
    self.calls.append(len(turns))
    if self.result is not None:
      return self.result
    return envs.single_turn_result([float(len(t.response)) for t in turns])


class _AsyncEnv:
  name = "async"
  max_turns = 1

  def __init__(self):
    self.calls = 0

  async def astep(self, turns):
    self.calls += 1
    await asyncio.sleep(0)
    return envs.single_turn_result([2.0] * len(turns))


def test_call_step_sync_one_call_for_all_rows():
  env = _SyncEnv()
  res = call_step(env, _turns("sync", [({}, "ab"), ({}, "abcd"), ({}, "")]))
  assert env.calls == [3]
  assert res.rewards.tolist() == [2.0, 4.0, 0.0] and res.done.all()
  assert call_step(env, []).rewards.shape == (0,) and env.calls == [3]  # no rows, no call


def test_call_step_async_plain_and_inside_running_loop():
  env = _AsyncEnv()
  assert call_step(env, _turns("async", [({}, "x")] * 3)).rewards.tolist() == [2.0] * 3

  async def from_a_coroutine():  # asyncio.run is refused here; call_step must still work
    return call_step(env, _turns("async", [({}, "x")] * 2))

  assert asyncio.run(from_a_coroutine()).rewards.tolist() == [2.0, 2.0]
  assert env.calls == 2
  assert isinstance(env, envs.AsyncEnvironment) and isinstance(_SyncEnv(), envs.Environment)


def test_call_step_validates_env_output():
  short = StepResult([""], np.zeros(1, np.float32), np.ones(1, bool))
  with pytest.raises(ValueError, match="environment 'sync': observations has 1 entries for 2"):
    call_step(_SyncEnv(short), _turns("sync", [({}, "a"), ({}, "b")]))
  nan = StepResult(["", ""], np.array([0.0, np.nan]), np.ones(2, bool))
  with pytest.raises(ValueError, match="environment 'sync': rewards: non-finite"):
    call_step(_SyncEnv(nan), _turns("sync", [({}, "a"), ({}, "b")]))
  with pytest.raises(ValueError, match="returned tuple, not StepResult"):
    call_step(_SyncEnv(([""], [0.0], [True])), _turns("sync", [({}, "a")]))


# --------------------------------------------------------------------------------------------
# registry


def test_registry_builds_each_builtin_and_names_unknown():
  assert set(envs.ENVIRONMENTS) >= {"add", "countdown", "math", "guess"}
  for name in ("add", "countdown", "guess"):
    env = make_env(name)
    assert env.name == name and env.max_turns >= 1
  assert make_env("guess", max_turns=7).max_turns == 7
  assert make_env("math", use_math_verify=False).use_math_verify is False
  with pytest.raises(KeyError, match=r"unknown environment 'cowntdown'.*'countdown'"):
    make_env("cowntdown")
  with pytest.raises(KeyError, match=r"unknown task 'nope'.*'guess'"):
    envs.make_source("nope", None)


def test_register_refuses_to_replace_a_grader():
  with pytest.raises(ValueError, match="'add' is already registered"):
    @envs.register("add")
    class Other:  # noqa: F841
      pass
  assert envs.ENVIRONMENTS["add"] is envs.AddEnvironment


def test_built_in_tasks_register_once_with_their_sources():
  assert envs.task_names() == ("add", "countdown", "guess", "math", "word_math")
  assert {n: r.env for n, r in envs.TASKS.items()} == {
      "add": envs.AddEnvironment, "countdown": envs.CountdownEnvironment,
      "guess": envs.GuessEnvironment, "math": envs.MathEnvironment,
      "word_math": envs.WordMathEnvironment}
  assert [n for n, r in envs.TASKS.items() if r.demonstrations] == ["add"]
  from jaxrl.recipes.default import get_config
  cfg = get_config()
  src = envs.make_source("add", cfg)
  assert [t.prompt for t in src.split("val")] == [
      p.prompt for p in envs.AdditionTask(cfg.task.num_digits, cfg.seed, cfg.task.dev_size,
                                          cfg.task.val_size).split("val")]
  p = envs.AdditionTask(num_digits=2, seed=0).split("val")[0]
  assert isinstance(p, envs.Problem) and p.prompt.endswith("=") and len(p.prompt) == 6


# --------------------------------------------------------------------------------------------
# add


def test_add_env_and_source_match_addition_task():
  src = envs.AddSource(num_digits=2, seed=3)
  task = envs.AdditionTask(num_digits=2, seed=3)
  val = src.split("val")
  assert [t.prompt for t in val] == [p.prompt for p in task.split("val")]
  assert [t.data["answer"] for t in val] == [p.answer for p in task.split("val")]
  rows = [(val[0].data, val[0].data["answer"]), (val[0].data, f" {val[0].data['answer']}\n"),
          (val[0].data, val[0].data["answer"] + "0")]
  res = call_step(make_env("add"), _turns("add", rows))
  assert res.rewards.tolist() == [1.0, 1.0, 0.0] and res.done.all()
  cut = call_step(make_env("add"), _turns("add", rows[:1], truncated=True))
  assert cut.rewards.tolist() == [0.0]
  # the source's alphabet encodes every prompt and answer
  tok = CharTokenizer(src.alphabet)
  for t in val[:50]:
    tok.encode(t.prompt + t.data["answer"])


# --------------------------------------------------------------------------------------------
# countdown: the expression parser, then the grader


@pytest.mark.parametrize("text, value, numbers", [
    ("1+2*3", 7, (1, 2, 3)),
    ("(1+2)*3", 9, (1, 2, 3)),
    ("  ( 8 / 4 ) * 3 ", 6, (8, 4, 3)),
    ("7/2*2", 7, (7, 2, 2)),
    ("-3+5", 2, (3, 5)),
    ("--3", 3, (3,)),
    ("2*-3", -6, (2, 3)),
    ("10-2-3", 5, (10, 2, 3)),  # left associative
    ("12/3/2", 2, (12, 3, 2)),
    ("1/3+1/3+1/3", 1, (1, 3, 1, 3, 1, 3)),
])
def test_expr_evaluates_exactly(text, value, numbers):
  ev = expr.evaluate(text)
  assert ev.value == value and ev.numbers == numbers


@pytest.mark.parametrize("text", [
    "", "   ", "1+", "(1+2", "1+2)", "2(3)", "+3", "1 2", "1/0", "3/(2-2)", "1.5*2", "2**3",
    "__import__('os')", "__import__('os').system('echo hi')", "exec('1')", "1;2", "x",
    "1e3", "0x10", "\u00b2", "\u0663", "1+2 # comment", "[1]", "1 if 1 else 2",
    "1" * 201, "(" * 33 + "1" + ")" * 33, "-" * 33 + "1",
])
def test_expr_rejects_without_other_exceptions(text):
  with pytest.raises(expr.ExprError):
    expr.evaluate(text)


def test_expr_limits_are_exactly_at_the_documented_bounds():
  assert expr.evaluate("(" * 32 + "1" + ")" * 32).value == 1
  assert expr.evaluate("-" * 32 + "1").value == 1
  assert expr.evaluate("1" * 200).value == int("1" * 200)


CD = {"numbers": [8, 4, 3], "target": 6}


@pytest.mark.parametrize("response, fmt, correct", [
    ("(8/4)*3", 1, 1),              # a fraction on the way still hits the target exactly
    ("( 8 / 4 ) * 3", 1, 1),
    ("3*8/4", 1, 1),
    ("(8/4)*3 = 6", 1, 1),          # trailing "= <number>" ignored
    ("(8/4)*3 = 24", 1, 1),         # ... and not checked: the expression's value is
    ("I think\n\n(8/4)*3\n", 1, 1),  # last non-empty line
    ("(8/4)*3\nso the answer is 6", 0, 0),
    ("3-(4-8)/... ", 0, 0),
    ("-(4-8)+8/4*3-8+6", 1, 0),     # uses numbers not given (6) and 8 twice
    ("8-4+3", 1, 0),                # uses all, wrong value (7)
    ("8/4+3+1", 1, 0),              # 1 not given
    ("8*3/4/1", 1, 0),              # 1 not given
    ("8-4+3-1", 1, 0),
    ("8/4*3*1", 1, 0),
    ("8/(4-4)*3", 0, 0),            # division by zero: not parseable, no exception
    ("8/4*3*3/3", 1, 0),            # reuses 3
    ("8-3+1", 1, 0),                # 4 missing
    ("4*3/2", 1, 0),                # 8 missing, 2 not given
    ("-(-8/4)*3", 1, 1),            # unary minus is allowed
    ("__import__('os')", 0, 0),
    ("(8/4)*3; import os", 0, 0),
    ("eval('(8/4)*3')", 0, 0),
    ("", 0, 0),
    ("\n\n", 0, 0),
    ("(" * 40 + "8/4*3" + ")" * 40, 0, 0),
    ("8/4*3" + "+0" * 100, 0, 0),  # over 200 characters
])
def test_countdown_tricky_answers(response, fmt, correct):
  res = call_step(make_env("countdown"), _turns("countdown", [(CD, response)]))
  assert res.components["format"].tolist() == [fmt]
  assert res.components["correct"].tolist() == [correct]
  assert res.rewards.tolist() == [correct] and res.done.tolist() == [True]


def test_countdown_multiset_and_truncation_in_one_batch():
  twice = {"numbers": [5, 5, 2], "target": 12}
  rows = [(twice, "5+5+2"), (twice, "2+(5+5)"), (twice, "5*2+2"), (twice, "5+5"), (CD, "8/4*3")]
  res = call_step(make_env("countdown"), _turns("countdown", rows))
  assert res.rewards.tolist() == [1, 1, 0, 0, 1]
  cut = call_step(make_env("countdown"), _turns("countdown", rows[:1], truncated=True))
  assert cut.rewards.tolist() == [0.0] and cut.metadata[0]["error"] == "truncated"


def test_countdown_source_solvable_deterministic_disjoint():
  a = envs.CountdownSource(seed=1, train_size=300, val_size=60)
  b = envs.CountdownSource(seed=1, train_size=300, val_size=60)
  c = envs.CountdownSource(seed=2, train_size=300, val_size=60)
  assert a.split("train") == b.split("train") and a.split("val") == b.split("val")
  assert a.split("train") != c.split("train")
  # val does not depend on train_size
  assert envs.CountdownSource(seed=1, train_size=10, val_size=60).split("val") == a.split("val")
  key = lambda t: (tuple(sorted(t.data["numbers"])), t.data["target"])  # noqa: E731
  train, val = {key(t) for t in a.split("train")}, {key(t) for t in a.split("val")}
  assert len(train) == 300 and len(val) == 60 and not train & val
  rows = a.split("train") + a.split("val")
  assert all(3 <= len(t.data["numbers"]) <= 4 and all(1 <= x <= 20 for x in t.data["numbers"])
             for t in rows)
  # every puzzle is solvable: its stored solution scores 1, in one batched call
  res = call_step(make_env("countdown"), _turns("countdown",
                                                [(t.data, t.data["solution"]) for t in rows]))
  assert res.rewards.sum() == len(rows)
  assert len({t.uid for t in rows}) == len(rows)
  s1 = a.sample(np.random.default_rng(5), 50)
  assert s1 == a.sample(np.random.default_rng(5), 50) and {key(t) for t in s1} <= train
  tok = CharTokenizer(a.alphabet)
  for t in rows:
    tok.encode(t.prompt + t.data["solution"] + " = 6")


# --------------------------------------------------------------------------------------------
# math


@pytest.mark.parametrize("response, extracted", [
    ("so 1,000 in all", "1,000"),
    ("It costs $18", "18"),
    ("18.0", "18.0"),
    ("\\boxed{18}", "18"),
    ("first \\boxed{3}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{7} then \\boxed{unclosed", "7"),
    ("\\boxed{}", None),
    ("The answer is 18.", "18"),
    ("12 apples... The Answer Is: 18 and then 4 more", "18"),
    ("#### 72\nbut 99", "72"),
    ("5 - 8 = -3", "-3"),
    ("from 3-5 we get", "5"),
    ("1/2 of it", "1/2"),
    ("no number at all", None),
    ("", None),
])
def test_math_extraction(response, extracted):
  assert mathqa.extract_answer(response) == extracted


MATH_CASES = [
    # gold, response, correct with the fallback, correct with math-verify
    ("1000", "so 1,000 in all", 1, 1),
    ("1,000", "1000", 1, 1),
    ("18", "It costs $18", 1, 1),
    ("18", "18.0", 1, 1),
    ("18", "\\boxed{18}", 1, 1),
    ("18", "The answer is 18.", 1, 1),
    ("18", "#### 18", 1, 1),
    ("0.5", "1/2", 1, 1),
    ("1/2", "0.5", 1, 1),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1, 1),
    ("-3", "The answer is -3", 1, 1),
    ("-3", "The answer is 3", 0, 0),
    ("3", "The answer is -3", 0, 0),
    ("18", "no number at all", 0, 0),
    ("18", "", 0, 0),
    ("18", "17.9999", 0, 0),
    ("50", "50%", 1, 1),            # percent sign dropped, not divided by 100
    ("18", "\\boxed{18 \\text{ dollars}}", 0, 1),
    ("1024", "\\boxed{2^{10}}", 0, 1),
    ("2", "\\boxed{\\sqrt{4}}", 0, 1),
    ("18", "\\boxed{9^{9^{9^9}}}", 0, 0),  # too risky for the symbolic stage: never hangs
    ("120", "\\boxed{5!}", 0, 0),
    ("18", "\\boxed{2^{99999999999}}", 0, 0),
    ("Monday", "\\boxed{Monday}", 1, 1),
]


def _grade(env, cases, truncated=False):
  rows = [({"answer": g}, r) for g, r, *_ in cases]
  return call_step(env, _turns("math", rows, truncated=truncated))


def test_math_fallback_grader():
  env = envs.MathEnvironment(use_math_verify=False)
  assert env.verifier is None
  res = _grade(env, MATH_CASES)
  assert res.rewards.tolist() == [float(c[2]) for c in MATH_CASES]
  assert res.components["format"].tolist() == [float(mathqa.extract_answer(c[1]) is not None)
                                               for c in MATH_CASES]
  assert _grade(env, MATH_CASES[:1], truncated=True).rewards.tolist() == [0.0]


def test_math_without_math_verify_installed(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
  assert not mathqa.math_verify_available()
  env = make_env("math")  # auto: the exact fallback
  assert not env.use_math_verify
  assert _grade(env, MATH_CASES).rewards.tolist() == [float(c[2]) for c in MATH_CASES]
  with pytest.raises(ImportError):
    envs.MathEnvironment(use_math_verify=True)


def test_math_verify_grader():
  pytest.importorskip("math_verify")
  env = envs.MathEnvironment(use_math_verify=True)
  assert env.verifier is not None and make_env("math").use_math_verify
  res = _grade(env, MATH_CASES)
  assert res.rewards.tolist() == [float(c[3]) for c in MATH_CASES]
  # off the main thread math-verify runs without its SIGALRM timeout; same verdicts
  box = {}
  t = threading.Thread(target=lambda: box.setdefault("r", _grade(env, MATH_CASES)))
  t.start()
  t.join(60)
  assert not t.is_alive() and box["r"].rewards.tolist() == res.rewards.tolist()


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return path


def test_math_source_from_jsonl(tmp_path):
  rows = [json.dumps({"question": f"What is {i}+{i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"})
          for i in range(20)]
  path = _write(tmp_path / "gsm.jsonl", rows[:10] + [""] + rows[10:])  # blank line: no row
  src = envs.MathSource.from_jsonl(path, val_fraction=0.25, seed=0)
  train, val = src.split("train"), src.split("val")
  assert len(train) == 15 and len(val) == 5
  assert not {t.prompt for t in train} & {t.prompt for t in val}
  assert src.split("val") == envs.MathSource.from_jsonl(path, val_fraction=0.25).split("val")
  t = train[0]
  assert t.env == "math" and t.data["answer"] == "0" and t.uid == "math/train/0"
  res = call_step(make_env("math", use_math_verify=False),
                  _turns("math", [(r.data, r.data["solution"]) for r in train + val]))
  assert res.rewards.all()  # the gold solution text grades as correct
  tok = CharTokenizer(src.alphabet)
  for r in train + val:
    tok.encode(r.prompt + r.data["solution"] + "The answer is \\boxed{-1.5}")
  split = envs.MathSource.from_jsonl(path, val_path=_write(tmp_path / "v.jsonl", rows[:3]),
                                     instruction="Answer after ####.")
  assert len(split.split("train")) == 20 and len(split.split("val")) == 3
  assert split.split("val")[0].prompt == "What is 0+0?\nAnswer after ####."


@pytest.mark.parametrize("line, match", [
    ('{"question": "q", "answer": "#### 1"', "line 3: invalid JSON"),
    ('{"question": "q"}', "line 3: missing field 'answer'"),
    ('{"question": "", "answer": "#### 1"}', "line 3: field 'question' is empty"),
    ('{"question": "q", "answer": "   "}', "line 3: field 'answer' is empty"),
    ('{"question": "q", "answer": 18}', "line 3: field 'answer' must be a string"),
    ('{"question": "q", "answer": "so #### "}', "line 3: field 'answer' has nothing after"),
    ('["q", "a"]', "line 3: expected a JSON object"),
])
def test_math_jsonl_errors_name_file_and_line(tmp_path, line, match):
  good = json.dumps({"question": "q", "answer": "#### 1"})
  path = _write(tmp_path / "bad.jsonl", [good, good, line, good])
  with pytest.raises(ValueError, match=match) as e:
    envs.MathSource.from_jsonl(path)
  assert str(path) in str(e.value)


# --------------------------------------------------------------------------------------------
# guess


def _guess(env, secret, responses, turn, truncated=False):
  return call_step(env, _turns("guess", [({"secret": secret, "high": 100}, r) for r in responses],
                               turn=turn, truncated=truncated))


def test_guess_hints_success_and_max_turns():
  env = make_env("guess", max_turns=4)
  res = _guess(env, 37, ["50", "I guess 20, or 30", "37", "nothing", "-5"], turn=0)
  assert res.observations == ["lower", "higher", "", "no number", "higher"]
  assert res.rewards.tolist() == [0, 0, 1, 0, 0]
  assert res.done.tolist() == [False, False, True, False, False]
  assert res.components["correct"].tolist() == [0, 0, 1, 0, 0]
  assert [m["guess"] for m in res.metadata] == [50, 20, 37, None, -5]
  # The last allowed turn: only a correct guess ends the episode; running out of turns is the
  # rollout loop's call (a truncation), never reported as done here.
  last = _guess(env, 37, ["50", "37"], turn=3)
  assert last.done.tolist() == [False, True] and last.rewards.tolist() == [0, 1]
  assert last.observations == ["lower", ""]


def test_guess_truncated_turn_is_a_wrong_guess():
  env = make_env("guess", max_turns=4)
  res = _guess(env, 37, ["37"], turn=1, truncated=True)
  assert res.rewards.tolist() == [0.0] and res.done.tolist() == [False]
  assert res.observations == ["too long"]


def test_guess_episode_binary_search_succeeds_on_turn_k():
  """Drive episodes turn by turn as the rollout loop does: one call per turn, active rows only."""
  env = make_env("guess", max_turns=7)
  secrets = [1, 37, 64, 100]
  lo, hi = [1] * 4, [100] * 4
  active, found_at, calls = list(range(4)), {}, 0
  for turn in range(env.max_turns):
    guesses = {i: (lo[i] + hi[i]) // 2 for i in active}
    res = _guess_rows(env, [(secrets[i], str(guesses[i])) for i in active], turn)
    calls += 1
    for i, obs, r, d in zip(active, res.observations, res.rewards, res.done):
      if obs == "higher":
        lo[i] = guesses[i] + 1
      elif obs == "lower":
        hi[i] = guesses[i] - 1
      if r == 1.0:
        found_at[i] = turn
    active = [i for i, d in zip(active, res.done) if not d]
    if not active:
      break
  assert found_at == {0: 5, 1: 2, 2: 6, 3: 6} and calls == 7


def _guess_rows(env, rows, turn):
  return call_step(env, _turns("guess", [({"secret": s, "high": 100}, r) for s, r in rows],
                               turn=turn))


def test_guess_source_disjoint_and_alphabet():
  src = envs.GuessSource(seed=0, high=50)
  train, val = src.split("train"), src.split("val")
  assert len(val) == 10 and len(train) == 40
  assert sorted(t.data["secret"] for t in train + val) == list(range(1, 51))
  assert envs.GuessSource(seed=0, high=50).split("val") == val
  assert envs.GuessSource(seed=1, high=50).split("val") != val
  tok = CharTokenizer(src.alphabet)
  for word in ("higher", "lower", "no number", "too long", train[0].prompt, "-50 42"):
    tok.encode(word)
  assert len(src.alphabet) <= 32


# --------------------------------------------------------------------------------------------
# sources


class _Const:
  """A tiny source whose rows are named by their index."""

  def __init__(self, name, size=5):
    self.name = name
    self.alphabet = name
    self._rows = {s: [Task(name, f"{name}{i}", {}, f"{name}/{s}/{i}") for i in range(size)]
                  for s in ("train", "val")}

  def split(self, name):
    return list(self._rows[name])

  def sample(self, rng, n):
    return [self._rows["train"][i] for i in rng.integers(5, size=n)]


def test_mixed_source_keeps_env_per_row_and_follows_weights():
  mix = MixedSource([_Const("ab"), _Const("cd"), _Const("ef")], weights=[6, 3, 1], seed=0)
  rows = mix.sample(np.random.default_rng(0), 2000)
  assert all(t.uid.startswith(t.env + "/train/") for t in rows)
  counts = collections.Counter(t.env for t in rows)
  # a fixed seed: deterministic counts, checked to follow 6:3:1
  assert counts["ab"] > counts["cd"] > counts["ef"] > 100
  assert abs(counts["ab"] / 2000 - 0.6) < 0.03 and abs(counts["ef"] / 2000 - 0.1) < 0.03
  assert rows == mix.sample(np.random.default_rng(0), 2000)
  assert mix.alphabet == "abcdef" and mix.name == "ab+cd+ef"
  val = mix.split("val")
  assert sorted(t.uid for t in val) == sorted(f"{s}/val/{i}" for s in ("ab", "cd", "ef")
                                               for i in range(5))
  assert [t.env for t in val[:6]] != ["ab"] * 5 + ["cd"]  # shuffled across sources
  assert val == MixedSource([_Const("ab"), _Const("cd"), _Const("ef")], seed=0).split("val")
  zero = MixedSource([_Const("ab"), _Const("cd")], weights=[0, 1])
  assert {t.env for t in zero.sample(np.random.default_rng(1), 100)} == {"cd"}


def test_mixed_source_of_builtins_routes_rows_to_their_envs():
  mix = MixedSource([envs.CountdownSource(seed=0, train_size=50, val_size=5),
                     envs.GuessSource(seed=0, high=20), envs.AddSource(num_digits=1, dev_size=10,
                                                                      val_size=10)], seed=3)
  rows = mix.sample(np.random.default_rng(2), 60)
  by_env = collections.defaultdict(list)
  for t in rows:
    by_env[t.env].append(t)
  assert set(by_env) == {"countdown", "guess", "add"}
  answers = {"countdown": lambda t: t.data["solution"], "guess": lambda t: str(t.data["secret"]),
             "add": lambda t: t.data["answer"]}
  for name, tasks in by_env.items():  # one call per environment for all its rows
    res = call_step(make_env(name), [Turn(t, 0, answers[name](t), False) for t in tasks])
    assert res.rewards.tolist() == [1.0] * len(tasks) and res.done.all()
  CharTokenizer(mix.alphabet)  # no duplicate characters


@pytest.mark.parametrize("weights, match", [([1], "1 weights for 2 sources"),
                                            ([0, 0], "not all 0"), ([1, -1], ">= 0"),
                                            ([1, float("nan")], "finite")])
def test_mixed_source_rejects_bad_weights(weights, match):
  with pytest.raises(ValueError, match=match):
    MixedSource([_Const("ab"), _Const("cd")], weights=weights)


def test_unknown_split_is_named():
  with pytest.raises(KeyError, match=r"no split 'test'.*'train'"):
    envs.GuessSource().split("test")


def test_countdown_grade_never_raises_on_garbage():
  rng = np.random.default_rng(0)
  chars = list("0123456789+-*/() =\n.x_'[]") + ["\u0663", "\x00"]
  for _ in range(300):
    text = "".join(rng.choice(chars, size=int(rng.integers(0, 60))))
    ok, right, _ = countdown.grade(text, [1, 2, 3], 6)
    assert isinstance(ok, bool) and isinstance(right, bool)


def test_char_tokenizer_decode_stops_at_eos_and_drops_padding():
  tok = CharTokenizer("0123456789+=")  # ids: 0 pad, 1 EOS, 2.. the alphabet in order
  assert tok.decode([0, 0, 3, 4, 12, 1, 5]) == "12+"  # 3 -> "1", 4 -> "2", 12 -> "+"
  assert tok.decode(np.array([0, 3, 0, 4], np.int32)) == "12"  # padding anywhere is dropped
  assert tok.decode(np.array([1, 3], np.int64)) == "" and tok.decode([]) == ""
  assert tok.decode(tok.encode("07+35=")) == "07+35="


def test_word_math_holds_out_the_arithmetic_and_grades_real_replies():
  src = envs.WordProblemSource(num_digits=2, seed=0, dev_size=50, val_size=100)
  def problem(t):  # the two operands and the answer, whatever the wording
    return tuple(int(x) for x in re.findall(r"\d+", t.prompt)) + (t.data["answer"],)
  train, val = src.split("train"), src.split("val")
  # 90 * 90 sums + 90 * 91 / 2 differences a >= b of 2-digit numbers = 8,100 + 4,095.
  assert len(train) + len(val) + len(src.split("dev")) == 12195
  assert not {problem(t) for t in val} & {problem(t) for t in train}
  assert all(int(t.data["answer"]) >= 0 for t in train)
  env = envs.WordMathEnvironment(use_math_verify=False)
  t = val[0]
  a = t.data["answer"]
  replies = [f"So the total is {a}.", f"{a} - 1 = {int(a) - 1}", f"The answer is \\boxed{{{a}}}"]
  turns = [envs.Turn(task=t, turn=0, response=r, truncated=False) for r in replies]
  assert list(env.step(turns).rewards) == [1.0, 0.0, 1.0]
  # Operands 1..30: 30 * 30 sums + 30 * 31 / 2 differences a >= b = 900 + 465.
  small = envs.WordProblemSource(max_operand=30, dev_size=100, val_size=200)
  rows = small.split("train") + small.split("val") + small.split("dev")
  assert len(rows) == 1365
  assert max(max(problem(t)[:2]) for t in rows) == 30
