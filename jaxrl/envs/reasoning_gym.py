"""`reasoning_gym:<dataset>`: one of reasoning-gym's procedurally generated datasets as a jaxrl
task (single turn), graded by the dataset's own verifier. reasoning-gym is optional
(`pip install -e ".[reasoning-gym]"` from a clone): nothing here imports it until such a task is
named.

Any dataset of `reasoning_gym.factory.DATASETS` is a task name, alone or mixed with others
(`task.name=reasoning_gym:basic_arithmetic+reasoning_gym:leg_counting`, `task.weights`). The
names form a family (`jaxrl.envs.registry.register_family`): a name is registered when config
validation (or `make_env` / `make_source`) first meets it, once the dataset is known to exist.

Prompt: reasoning-gym's answer-format instruction (its default system prompt,
`reasoning_gym.utils.SYSTEM_PROMPTS["default"]`, which asks for the final answer as
`<answer>answer here</answer>`), a blank line, then the dataset's question as is. Like every
task's prompt it is plain text; the tokenizer renders it as a user turn through the model's chat
template when `tokenizer.chat_template` is on.

Answer and reward, reasoning-gym's convention: the answer is `reasoning_gym.utils.extract_answer`
of the response (the text inside the LAST `<answer>...</answer>`, stripped; None without one) and
the reward is `dataset.score_answer(answer=..., entry=row)`, a float the dataset defines (many
give 1.0 for the exact answer and partial credit otherwise, e.g. len(gold) / len(answer) when the
answer contains the gold). `row` is the very entry the prompt was made from (kept in the task
data) and the dataset object is built with the same config, so config-dependent scorers grade as
they generated. As in the built-in tasks, a truncated turn scores 0. A scorer that raises, or
returns a non-finite value, scores 0 with the error in the row's metadata: grading never raises.
Components: "format" (an `<answer>` tag was found) and "correct" (score >= 1); each row's
metadata reports `<task>/score`, so a mixture logs `env/metadata/reasoning_gym:<dataset>/score`
per dataset every step.

Splits, from one dataset object built with `seed=config.seed`: reasoning-gym seeds row i with
`seed + i`, so split by index ranges, each row has its own seed and no two splits share one.
`val` is the rows 0 .. task.val_size - 1, `dev` the next task.dev_size rows, train the next
`size` rows (10,000 unless `task.rg_config` says). Duplicate questions are dropped: val and dev
keep each question once (so they hold at most their size), dev drops val's questions, and a
training draw whose question is in val or dev is drawn again, so the held-out questions are never
trained on. Val and dev are generated when first needed; training rows are generated when drawn
(uniformly, with replacement: a stream that is not listed ahead, so its prompts are checked on
the first draws), so a slow dataset costs time per draw, not at start.

Config, `task.rg_config`: "" or a JSON object keyed by dataset name, each value the keyword
arguments of that dataset's config class, e.g. `{"basic_arithmetic": {"max_terms": 3},
"leg_counting": {"max_animals": 4}}` (the same form alone or in a mixture; a dataset without a key
gets its defaults). `size` is the number of training rows; `seed` is refused (it comes from
`config.seed`). A key that is not a dataset of `task.name`, and a config the dataset rejects
(an unknown argument, a failed `validate()`, a first row that cannot be generated), are config
errors before anything is built.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import string
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from jaxrl.data.sources import alphabet_of, unknown_split
from jaxrl.envs.base import StepResult, Task, Turn, single_turn_result
from jaxrl.envs.registry import register, register_family

PREFIX = "reasoning_gym:"
INSTALL = 'pip install -e ".[reasoning-gym]"'
KEY = "config.task.rg_config"
TRAIN_SIZE = 10_000  # training rows of a dataset whose `task.rg_config` gives no `size`
MAX_REDRAWS = 1000  # training draws per row whose question is held out, before giving up
TRAIN_CACHE = 4096  # generated training rows kept (the cache starts over when full)
# Characters every prompt may hold besides those of the val and dev rows: a character
# tokenizer (a fresh model) then encodes nearly every training row too.
BASE_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def dataset_names() -> list[str]:
  """reasoning-gym's dataset names; ImportError when it is not installed."""
  from reasoning_gym.factory import DATASETS  # optional: the reasoning-gym extra
  return sorted(DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(dataset: str, kwargs_json: str):
  """The dataset object for `create_dataset(dataset, **kwargs)`, shared by the source that makes
  rows and the environment that grades them (and by config validation, which builds it first)."""
  import reasoning_gym
  return reasoning_gym.create_dataset(dataset, **json.loads(kwargs_json))


def parse_rg_config(text: str) -> dict[str, Any]:
  """`task.rg_config` as a dict of dataset name -> config ({} for "")."""
  config = json.loads(text) if text else {}
  if not isinstance(config, dict):
    raise ValueError(f"task.rg_config must be a JSON object, got {text!r}")
  return config


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class ReasoningGymSource:
  """The val, dev and train rows of one reasoning-gym dataset (see the module docstring).

  `config`: the keyword arguments of the dataset's config class, `size` meaning the training
  rows. Rows are `Task`s of environment `name` with data {"dataset", "config" (the dataset's
  arguments as canonical JSON), "entry" (the reasoning-gym row), "answer" (its gold answer)}.
  """

  def __init__(self, dataset: str, seed: int = 0, val_size: int = 1000, dev_size: int = 1000,
               config: Mapping[str, Any] | None = None, name: str | None = None):
    config = dict(config or {})
    if "seed" in config:
      raise ValueError(f"reasoning-gym dataset {dataset!r}: 'seed' comes from the run's seed, "
                       "not its config")
    train_size = config.pop("size", TRAIN_SIZE)
    if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1 or \
        val_size < 0 or dev_size < 0:
      raise ValueError(f"reasoning-gym dataset {dataset!r}: size must be an integer >= 1 and "
                       f"the val and dev sizes >= 0, got {train_size!r}, {val_size}, {dev_size}")
    self.dataset, self.name = dataset, name or PREFIX + dataset
    total = val_size + dev_size + train_size
    self.config = json.dumps({**config, "seed": seed, "size": total}, sort_keys=True)
    self.rg_dataset = _dataset(dataset, self.config)
    from reasoning_gym.utils import SYSTEM_PROMPTS
    self.instruction = SYSTEM_PROMPTS["default"].strip()
    self.ranges = {"val": (0, val_size), "dev": (val_size, val_size + dev_size),
                   "train": (val_size + dev_size, total)}
    self._splits: dict[str, list[Task]] = {}
    self._train: dict[int, Task] = {}
    self._alphabet: str | None = None

  def row(self, split: str, index: int) -> Task:
    """The task of dataset row `index` (split `split` names its uid)."""
    try:
      entry = self.rg_dataset[index]
    except Exception as e:  # a generator bug: name the dataset and the row
      raise RuntimeError(f"reasoning-gym dataset {self.dataset!r} could not generate row "
                         f"{index} ({_one_line(e)})") from e
    return Task(env=self.name, prompt=f"{self.instruction}\n\n{entry['question']}",
                data={"dataset": self.dataset, "config": self.config, "entry": entry,
                      "answer": str(entry["answer"])},
                uid=f"{self.name}/{split}/{index}")

  def split(self, name: str) -> list[Task]:
    """Rows of "val" or "dev" (generated on first use); training rows are only drawn."""
    if name == "train":
      raise NotImplementedError(f"source {self.name!r} generates its training rows when drawn "
                                "(sample), it does not list them")
    if name not in ("val", "dev"):
      raise unknown_split(self.name, name, ["val", "dev"])
    if name not in self._splits:
      seen = {t.data["entry"]["question"] for t in self.split("val")} if name == "dev" else set()
      rows = []
      for i in range(*self.ranges[name]):
        task = self.row(name, i)
        question = task.data["entry"]["question"]
        if question not in seen:
          seen.add(question)
          rows.append(task)
      self._splits[name] = rows
    return list(self._splits[name])

  @functools.cached_property
  def held_out(self) -> frozenset[str]:
    """The questions of val and dev, never trained on."""
    return frozenset(t.data["entry"]["question"] for s in ("val", "dev") for t in self.split(s))

  @property
  def alphabet(self) -> str:
    """`BASE_ALPHABET` and the characters of the val and dev prompts and answers."""
    if self._alphabet is None:
      rows = self.split("val") + self.split("dev")
      self._alphabet = alphabet_of([t.prompt for t in rows] + [t.data["answer"] for t in rows],
                                   base=BASE_ALPHABET)
    return self._alphabet

  def sample(self, rng: np.random.Generator, n: int) -> list[Task]:
    """n training rows drawn with replacement (deterministic given rng); a draw whose question is
    held out is drawn again."""
    lo, hi = self.ranges["train"]
    held, out, redraws = self.held_out, [], 0
    while len(out) < n:
      for i in rng.integers(lo, hi, size=n - len(out)):
        task = self._train.get(int(i))
        if task is None:
          if len(self._train) >= TRAIN_CACHE:
            self._train.clear()
          task = self._train[int(i)] = self.row("train", int(i))
        if task.data["entry"]["question"] in held:
          redraws += 1
        else:
          out.append(task)
      if redraws > MAX_REDRAWS * n:
        raise ValueError(f"source {self.name!r}: over {MAX_REDRAWS} training draws per row "
                         "repeat a val or dev question; the dataset's config leaves too few "
                         "distinct questions (lower config.task.val_size / dev_size or widen "
                         f"{KEY})")
    return out


class ReasoningGymEnvironment:
  """Grades rows of one reasoning-gym dataset by its own scorer (see the module docstring).

  Registered once per dataset, as a subclass whose `dataset` is set (`_resolve`); the grading
  itself uses each row's own dataset and config.
  """
  name = "reasoning_gym"
  dataset = ""
  max_turns = 1

  def step(self, turns: Sequence[Turn]) -> StepResult:
    from reasoning_gym.utils import extract_answer
    scores, fmt, meta = [], [], []
    for t in turns:
      data = t.task.data
      answer = extract_answer(t.response)
      score, error = 0.0, None
      if t.truncated:
        error = "truncated"
      else:
        try:
          score = float(_dataset(data["dataset"], data["config"]).score_answer(
              answer=answer, entry=data["entry"]))
        except Exception as e:  # the dataset's scorer: a bad answer must not end the run
          error = f"score_answer raised {_one_line(e)}"
        if not math.isfinite(score):
          score, error = 0.0, f"score_answer returned {score}"
      scores.append(score)
      fmt.append(float(answer is not None))
      meta.append({f"{self.name}/score": score, "extracted": answer, "error": error})
    correct = [float(s >= 1.0) for s in scores]
    return single_turn_result(scores, {"format": fmt, "correct": correct}, meta)


def rg_source(dataset: str, cfg) -> ReasoningGymSource:
  """Task `reasoning_gym:<dataset>` of a run config: `seed`, `task.val_size`, `task.dev_size`
  and the dataset's entry of `task.rg_config`."""
  t = cfg.task
  return ReasoningGymSource(dataset, seed=cfg.seed, val_size=t.val_size, dev_size=t.dev_size,
                            config=parse_rg_config(t.rg_config).get(dataset))


def rg_checks(dataset: str, values: Mapping[str, Any]) -> list[str]:
  """What task `reasoning_gym:<dataset>` needs from a run config: its entry of `task.rg_config`
  (an object without `seed`, `size` >= 1) accepted by the dataset, which is built here with the
  run's seed and sizes and generates its first row. The first reasoning-gym task of `task.name`
  also reports keys of `task.rg_config` that name none of them."""
  if "task.rg_config" not in values:  # a bad value: reported by its own rule
    return []
  config = parse_rg_config(values["task.rg_config"])
  names = [n[len(PREFIX):] for n in values.get("task.name", "").split("+") if
           n.startswith(PREFIX)]
  problems = []
  extra = sorted(set(config) - set(names))
  if names and names[0] == dataset and extra:
    problems.append(f"{KEY}: key(s) {extra} name no reasoning-gym dataset of config.task.name "
                    f"(its datasets: {names}); keys are dataset names, e.g. "
                    f"{{\"{names[0]}\": {{...}}}}")
  own = config.get(dataset, {})
  if not isinstance(own, dict):
    return problems + [f"{KEY}: the config of dataset {dataset!r} must be a JSON object of its "
                       f"arguments, got {json.dumps(own)}"]
  if "seed" in own:
    return problems + [f"{KEY}: dataset {dataset!r} sets 'seed'; its rows are seeded from "
                       "config.seed (drop the key)"]
  size = own.get("size", TRAIN_SIZE)
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    return problems + [f"{KEY}: 'size' of dataset {dataset!r} (its training rows) must be an "
                       f"integer >= 1, got {json.dumps(size)}"]
  if not all(k in values for k in ("seed", "task.val_size", "task.dev_size")):
    return problems
  try:
    source = ReasoningGymSource(dataset, values["seed"], values["task.val_size"],
                                values["task.dev_size"], own)
    source.row("val", 0)
  except Exception as e:  # whatever the dataset's config class or generator refuses
    problems.append(f"{KEY}: reasoning-gym dataset {dataset!r} rejects {json.dumps(own)} "
                    f"({_one_line(e.__cause__ or e)})")
  return problems


def _resolve(name: str) -> str | None:
  """Registers task `name` = `reasoning_gym:<dataset>` (see `jaxrl.envs.registry.Family`)."""
  dataset = name[len(PREFIX):]
  try:
    names = dataset_names()
  except ImportError:
    return (f"task {name!r} needs the reasoning-gym package, which is not installed: "
            f"{INSTALL}")
  if dataset not in names:
    close = difflib.get_close_matches(dataset, names, n=5, cutoff=0.6)
    hint = (f"close matches: {', '.join(PREFIX + c for c in close)}" if close else
            f"none of its {len(names)} datasets is close (reasoning_gym.factory.DATASETS)")
    return f"no reasoning-gym dataset {dataset!r} (task {name!r}); {hint}"
  cls = type(f"ReasoningGymEnvironment_{dataset}", (ReasoningGymEnvironment,),
             {"dataset": dataset, "__module__": __name__})
  register(name, source=functools.partial(rg_source, dataset),
           checks=functools.partial(rg_checks, dataset))(cls)
  return None


register_family(PREFIX[:-1], _resolve, f"{PREFIX}<dataset>")
