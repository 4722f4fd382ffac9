"""The multi-turn rollout loop, shared by training and evaluation.

Each turn: generate for every active row in one sampler call, decode the new text, then call each
task's environment ONCE with all of its active rows (environments of different tasks run
concurrently, each under `env_timeout_s`). Observations are appended as tokens and the next turn
generates from the whole context. A single-turn task is the same loop stopping after turn 0.

Row layout (fixed shapes, so nothing recompiles): the first user message is the left-padded
prompt `[B, Lp]`; everything after it is the completion `[B, N]`:

    prompt | gen_0 | obs_0 | gen_1 | obs_1 | ... | gen_k | pad ...

`valid` marks every real completion token (what attention sees); `mask` marks only generated
tokens (what the loss trains on), so observations are context but never trained. `logprobs` and
`policy_version` are per token and meaningful where `mask` is set; each turn's tokens carry the
version of the params that generated them.

An episode ends when its environment says done (terminated), when the next observation or turn
would not fit in the N-token budget, or after `max_turns` model turns (truncated). A turn that
hits `max_new_tokens` without EOS is passed to the environment as `truncated`. An environment
that raises or exceeds `env_timeout_s` fails its rows for this batch: they get a reason, a NaN
reward and an all-False loss mask (so they are excluded from advantages and the loss), and the
loop goes on with the other rows; a timed-out call is abandoned on a daemon thread.

Every episode's reward is the sum of its turn rewards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from jaxrl.data.tokenizer import left_pad
from jaxrl.envs.base import StepResult, Task, Turn, call_step


@dataclasses.dataclass(frozen=True)
class Budget:
  max_prompt_len: int  # Lp: the first user message, left-padded to this
  max_new_tokens: int  # per model turn
  max_total_tokens: int  # N: the completion (all turns and observations) per row
  max_turns: int  # model turns per episode (each environment may stop earlier)


@dataclasses.dataclass
class Episodes:
  """Host arrays of B = len(tasks) * group_size rows (task-major: row = task * G + g)."""

  tasks: list[Task]  # per row
  prompt_tokens: np.ndarray  # [B, Lp] int32, left-padded
  prompt_valid: np.ndarray  # [B, Lp] bool
  tokens: np.ndarray  # [B, N] int32
  valid: np.ndarray  # [B, N] bool: real tokens (generated and observations)
  mask: np.ndarray  # [B, N] bool: generated tokens of rows that did not fail (the loss mask)
  logprobs: np.ndarray  # [B, N] float32 sampler log-probs (0 where not generated)
  policy_version: np.ndarray  # [B, N] int32 (0 where not generated)
  rewards: np.ndarray  # [B] float32 episode return; NaN for failed rows
  components: dict[str, np.ndarray]  # [B] float32 sums of named reward parts (NaN: failed)
  metadata: dict[str, np.ndarray]  # [B] float32 numeric `StepResult.metadata` values, the last
  # one an environment reported for the row (NaN where it reported none)
  turns: np.ndarray  # [B] int32 model turns taken
  terminated: np.ndarray  # [B] bool: the environment ended the episode
  truncated: np.ndarray  # [B] bool: the token budget or max_turns ended it
  failed: np.ndarray  # [B] bool
  fail_reasons: list[str | None]
  env_calls: int  # environment step() calls made
  env_calls_by_env: dict[str, int]
  # Mixture-of-experts models: [B, N, L, k] int16 experts of each generated token as the sampler
  # fed it (routing replay), -1 elsewhere; None for a dense model.
  routing: np.ndarray | None = None
  # [B, N] int32: rows that hold several causal sequences (an agent episode whose later request
  # does not extend the one before): 0 continues the row's prompt, k >= 1 is the episode's k-th
  # later sequence, which sees only its own tokens and counts its positions from 0
  # (`TrainBatch.completion_segment`); None where every row is one sequence.
  segment: np.ndarray | None = None

  def select(self, rows) -> Episodes:
    """The episodes of `rows` (indices or a slice), in that order. `env_calls` and
    `env_calls_by_env` count the calls that made the whole batch; a selection has none."""
    idx = np.arange(len(self.tasks))[rows]
    pick = lambda d: {k: v[idx] for k, v in d.items()}
    return Episodes(
        tasks=[self.tasks[i] for i in idx], prompt_tokens=self.prompt_tokens[idx],
        prompt_valid=self.prompt_valid[idx], tokens=self.tokens[idx], valid=self.valid[idx],
        mask=self.mask[idx], logprobs=self.logprobs[idx],
        policy_version=self.policy_version[idx], rewards=self.rewards[idx],
        components=pick(self.components), metadata=pick(self.metadata), turns=self.turns[idx],
        terminated=self.terminated[idx], truncated=self.truncated[idx], failed=self.failed[idx],
        fail_reasons=[self.fail_reasons[i] for i in idx], env_calls=0, env_calls_by_env={},
        routing=None if self.routing is None else self.routing[idx],
        segment=None if self.segment is None else self.segment[idx])

  @staticmethod
  def concat(parts: Sequence[Episodes]) -> Episodes:
    """The rows of `parts`, one after another (components and metadata a part lacks are NaN
    there); call counts add up."""
    first = parts[0]
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])

    def named(name):
      keys = dict.fromkeys(k for p in parts for k in getattr(p, name))
      return {k: np.concatenate([getattr(p, name).get(k, np.full(len(p.tasks), np.nan,
                                                                  np.float32)) for p in parts])
              for k in keys}

    calls: dict[str, int] = {}
    for p in parts:
      for k, n in p.env_calls_by_env.items():
        calls[k] = calls.get(k, 0) + n
    return dataclasses.replace(
        first, tasks=[t for p in parts for t in p.tasks],
        **{f: cat(f) for f in ("prompt_tokens", "prompt_valid", "tokens", "valid", "mask",
                               "logprobs", "policy_version", "rewards", "turns", "terminated",
                               "truncated", "failed")},
        components=named("components"), metadata=named("metadata"),
        fail_reasons=[r for p in parts for r in p.fail_reasons],
        env_calls=sum(p.env_calls for p in parts), env_calls_by_env=calls,
        routing=None if first.routing is None else cat("routing"),
        segment=None if first.segment is None else cat("segment"))

  def fail_counts(self) -> dict[str, int]:
    """Failed rows by kind of failure ("error", "timeout"), from `fail_reasons`."""
    counts: dict[str, int] = {}
    for r in self.fail_reasons:
      if r is not None:
        kind = r.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


class EnvTimeout(RuntimeError):
  pass


def _call_all(calls: dict[str, tuple[object, list[Turn]]], timeout_s: float
              ) -> dict[str, StepResult | BaseException]:
  """Runs each environment's step on its own daemon thread; waits at most `timeout_s` for all.

  A call still running at the deadline is reported as EnvTimeout and abandoned (a thread cannot
  be killed; it is a daemon so it never blocks exit).
  """
  cond = threading.Condition()
  results: dict[str, StepResult | BaseException] = {}

  def run(name, env, turns):
    try:
      res: StepResult | BaseException = call_step(env, turns)
    except BaseException as e:  # noqa: BLE001 - reported as the rows' failure reason
      res = e
    with cond:
      results[name] = res
      cond.notify_all()

  for name, (env, turns) in calls.items():
    threading.Thread(target=run, args=(name, env, turns), daemon=True,
                     name=f"jaxrl-env-{name}").start()
  deadline = time.monotonic() + timeout_s
  with cond:
    while len(results) < len(calls):
      left = deadline - time.monotonic()
      if left <= 0:
        break
      cond.wait(min(left, 0.05))
    done = dict(results)
  for name in calls:
    if name not in done:
      done[name] = EnvTimeout(f"no result within env.timeout_s={timeout_s:g}")
  return done


@dataclasses.dataclass
class _Rows:
  """The host state of one `MultiTurn.run`: B rows (task-major), their completions so far and
  what their environments said. `MultiTurn`'s steps read and write it in place, turn by turn."""

  rows: list[Task]  # per row
  prompt_ids: list[list[int]]  # per row: its task's encoded prompt (later turns' context)
  tokens: np.ndarray  # [B, N] int32
  valid: np.ndarray  # [B, N] bool
  gen: np.ndarray  # [B, N] bool: generated tokens (failed rows still included)
  logprobs: np.ndarray  # [B, N] float32
  pversion: np.ndarray  # [B, N] int32
  length: np.ndarray  # [B] int64: completion tokens written so far
  rewards: np.ndarray  # [B] float64: summed turn rewards
  components: dict[str, np.ndarray]  # [B] float64 sums, created as environments name them
  metadata: dict[str, np.ndarray]  # [B] float64, the last value reported per row
  turns: np.ndarray  # [B] int32
  terminated: np.ndarray  # [B] bool
  truncated: np.ndarray  # [B] bool
  failed: np.ndarray  # [B] bool
  reasons: list[str | None]
  history: list[list[tuple[str, str]]]  # per row: (role, text) of every message so far
  active: np.ndarray  # [B] bool: the episode goes on
  limit: np.ndarray  # [B]: model turns the row may take
  calls_by_env: dict[str, int]
  routing: np.ndarray | None = None  # [B, N, L, k] int16, from the first sampler output with it

  @classmethod
  def start(cls, rows: list[Task], prompt_ids: list[list[int]], N: int, pad: int,
            limit: list[int]) -> _Rows:
    """Every row active, with an empty completion of N tokens."""
    B = len(rows)
    return cls(
        rows=rows, prompt_ids=prompt_ids, tokens=np.full((B, N), pad, np.int32),
        valid=np.zeros((B, N), bool), gen=np.zeros((B, N), bool),
        logprobs=np.zeros((B, N), np.float32), pversion=np.zeros((B, N), np.int32),
        length=np.zeros(B, np.int64), rewards=np.zeros(B, np.float64), components={},
        metadata={}, turns=np.zeros(B, np.int32), terminated=np.zeros(B, bool),
        truncated=np.zeros(B, bool), failed=np.zeros(B, bool), reasons=[None] * B,
        history=[[("user", r.prompt)] for r in rows], active=np.ones(B, bool),
        limit=np.array(limit), calls_by_env={})

  def episodes(self, prompts: np.ndarray, pvalid: np.ndarray, G: int) -> Episodes:
    """The finished rows as `Episodes`: failed rows lose their loss mask and get NaN rewards."""
    failed = self.failed
    mask = self.gen & ~failed[:, None]
    rewards = self.rewards.astype(np.float32)
    rewards[failed] = np.nan
    components = {k: np.where(failed, np.nan, v).astype(np.float32)
                  for k, v in self.components.items()}
    return Episodes(
        tasks=self.rows, prompt_tokens=np.repeat(prompts, G, 0),
        prompt_valid=np.repeat(pvalid, G, 0), tokens=self.tokens, valid=self.valid, mask=mask,
        logprobs=self.logprobs, policy_version=self.pversion, rewards=rewards,
        components=components,
        metadata={k: v.astype(np.float32) for k, v in self.metadata.items()},
        turns=self.turns, terminated=self.terminated,
        truncated=self.truncated & ~self.terminated, failed=failed, fail_reasons=self.reasons,
        env_calls=sum(self.calls_by_env.values()), env_calls_by_env=self.calls_by_env,
        routing=self.routing)


class MultiTurn:
  """Runs episodes for a list of tasks, G samples each (see the module docstring).

  `sample_first(params, prompts [P, Lp], valid, key, request_ids [P*G], T, top_k, top_p)` is a
  sampler with G samples per prompt (turn 0 shares one prefill per task);
  `sample_next(params, contexts [B, Lp + N], valid, key, request_ids [B], ...)` one with a single
  sample per row (later turns, every row its own context). `fetch` copies sampler outputs to the
  host (multi-process safe).
  """

  def __init__(self, tokenizer, envs: Mapping[str, object], budget: Budget, group_size: int,
               sample_first: Callable, sample_next: Callable | None, fetch: Callable,
               env_timeout_s: float, turns=None):
    self.tok, self.envs, self.budget, self.G = tokenizer, dict(envs), budget, group_size
    self.sample_first, self.sample_next, self.fetch = sample_first, sample_next, fetch
    self.env_timeout_s = env_timeout_s
    # Each turn's sampler call and copy to the host is a device section of `turns` (a
    # `jaxrl.pipeline.turns.SamplerFirst`: the trainer lets it go first), or nothing.
    self.section = contextlib.nullcontext if turns is None else turns.section

  def max_turns(self, task: Task) -> int:
    return max(1, min(self.budget.max_turns, int(getattr(self.envs[task.env], "max_turns", 1))))

  def run(self, params, tasks: Sequence[Task], key, request_base: int, version: int,
          temperature: float, top_k: int = 0, top_p: float = 1.0) -> Episodes:
    """Runs the G episodes of each task to their end: one sampler call and one round of
    environment calls per turn, while any row is active."""
    tasks, G = list(tasks), self.G
    encoded, prompts, pvalid = self._encode_prompts(tasks)
    rows = [t for t in tasks for _ in range(G)]
    st = _Rows.start(rows, [encoded[i // G] for i in range(len(rows))],
                     self.budget.max_total_tokens, self.tok.pad_id,
                     [self.max_turns(r) for r in rows])
    request_ids = np.arange(len(rows)) + request_base
    turn = 0
    while st.active.any():
      tkey = key if turn == 0 else jax.random.fold_in(key, 1_000_003 + turn)
      with self.section():
        if turn == 0:
          out = self.sample_first(params, prompts, pvalid, tkey, request_ids, temperature, top_k,
                                  top_p, version=version)
        else:
          out = self.sample_next(params, *self._contexts(st), tkey, request_ids, temperature,
                                 top_k, top_p, version=version)
        news, cut, ended_eos = self._record(st, out, version)
      calls, where = self._env_turns(st, news, cut, ended_eos, turn)
      self._apply(st, _call_all(calls, self.env_timeout_s), where, turn)
      turn += 1
    return st.episodes(prompts, pvalid, G)

  def _encode_prompts(self, tasks: list[Task]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Checks the tasks against this run -> (each task's prompt tokens, the prompts left-padded
    [P, Lp], their valid mask)."""
    Lp = self.budget.max_prompt_len
    unknown = sorted({t.env for t in tasks} - set(self.envs))
    if unknown:
      raise KeyError(f"tasks name environments {unknown} that this run did not build; it has "
                     f"{sorted(self.envs)}")
    encoded = [self.tok.encode_prompt(t.prompt) for t in tasks]
    too_long = [(t.uid, len(e)) for t, e in zip(tasks, encoded) if len(e) > Lp]
    if too_long:
      raise ValueError(f"prompts longer than rollout.max_prompt_len={Lp}: {too_long[:5]}")
    prompts, pvalid = left_pad(encoded, Lp, self.tok.pad_id)
    return encoded, prompts, pvalid

  def _contexts(self, st: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """Each row's whole context so far (prompt, then completion), left-padded to Lp + N."""
    b = self.budget
    seqs = [st.prompt_ids[i] + st.tokens[i, :st.length[i]].tolist() for i in range(len(st.rows))]
    return left_pad(seqs, b.max_prompt_len + b.max_total_tokens, self.tok.pad_id)

  def _record(self, st: _Rows, out, version: int
              ) -> tuple[dict[int, list[int]], np.ndarray, np.ndarray]:
    """Appends the turn's generated tokens of the active rows (cut to the budget) -> (each
    active row's new tokens, whether the budget cut it [B], whether it ended on EOS [B])."""
    N, B, eos_ids = self.budget.max_total_tokens, len(st.rows), set(self.tok.eos_ids)
    tokens, valid, gen, logprobs, pversion, length = (st.tokens, st.valid, st.gen, st.logprobs,
                                                      st.pversion, st.length)
    o_tokens, o_mask, o_lps, o_routing = self.fetch(
        (out.tokens, out.mask, out.logprobs, getattr(out, "routing", None)))
    if o_routing is not None:
      if st.routing is None:
        st.routing = np.full((B, N, *o_routing.shape[2:]), -1, o_routing.dtype)
    # Per-token params versions, when the sampler can switch params mid-generation (partial
    # rollouts); otherwise every token is the batch's version.
    o_versions = getattr(out, "versions", None)
    act = np.flatnonzero(st.active)
    counts = o_mask.sum(1)
    cut = counts > N - length  # the sequence budget ends this turn
    last = o_tokens[np.arange(B), np.maximum(counts - 1, 0)]
    ended_eos = (counts > 0) & np.isin(last, list(eos_ids))
    take = np.where(cut, N - length, counts)
    if np.array_equal(o_mask, np.arange(o_mask.shape[1]) < counts[:, None]):
      # Every row's new tokens are a prefix (the samplers' masks: up to the first EOS): write
      # them all at once; only text and environment calls stay per row.
      n_act = take[act]
      r_idx = np.repeat(act, n_act)
      offs = np.arange(r_idx.size) - np.repeat(np.cumsum(n_act) - n_act, n_act)
      c_idx = length[r_idx] + offs
      tokens[r_idx, c_idx] = o_tokens[r_idx, offs]
      valid[r_idx, c_idx] = True
      gen[r_idx, c_idx] = True
      logprobs[r_idx, c_idx] = o_lps[r_idx, offs]
      if o_routing is not None:
        st.routing[r_idx, c_idx] = o_routing[r_idx, offs]
      pversion[r_idx, c_idx] = (version if o_versions is None
                                else np.asarray(o_versions)[r_idx, offs])
      new_ids = o_tokens.tolist()
      news = {int(i): new_ids[i][:take[i]] for i in act}
    else:
      news = {}
      for i in act:
        full = o_tokens[i][o_mask[i]]
        ended_eos[i] = len(full) > 0 and int(full[-1]) in eos_ids
        new = full[:take[i]]
        s = slice(length[i], length[i] + len(new))
        tokens[i, s], valid[i, s], gen[i, s] = new, True, True
        logprobs[i, s] = o_lps[i][o_mask[i]][:len(new)]
        if o_routing is not None:
          st.routing[i, s] = o_routing[i][o_mask[i]][:len(new)]
        pversion[i, s] = version if o_versions is None else \
            np.asarray(o_versions)[i][o_mask[i]][:len(new)]
        news[int(i)] = new
    length[act] += take[act]
    st.turns[act] += 1
    st.truncated[act] |= cut[act]
    return news, cut, ended_eos

  def _env_turns(self, st: _Rows, news: dict[int, list[int]], cut: np.ndarray,
                 ended_eos: np.ndarray, turn: int
                 ) -> tuple[dict[str, tuple[object, list[Turn]]], dict[str, list[int]]]:
    """Decodes each row's new tokens into its environment's `Turn` -> (per environment: it and
    its turns, the rows of those turns in order)."""
    calls: dict[str, tuple[object, list[Turn]]] = {}
    where: dict[str, list[int]] = {}
    for i, new in news.items():
      text = self.tok.decode(new)
      row = st.rows[i]
      calls.setdefault(row.env, (self.envs[row.env], []))[1].append(
          Turn(task=row, turn=turn, response=text,
               truncated=bool(cut[i] or not ended_eos[i]), history=tuple(st.history[i])))
      where.setdefault(row.env, []).append(i)
      st.history[i].append(("assistant", text))
    return calls, where

  def _apply(self, st: _Rows, results: dict[str, StepResult | BaseException],
             where: dict[str, list[int]], turn: int) -> None:
    """Adds each environment's rewards to its rows, ends the rows it ended (or failed), and
    appends the observations of the rows that go on."""
    N, B = self.budget.max_total_tokens, len(st.rows)
    for name, res in results.items():
      st.calls_by_env[name] = st.calls_by_env.get(name, 0) + 1
      idx = where[name]
      if isinstance(res, BaseException):
        why = "timeout" if isinstance(res, EnvTimeout) else "error"
        for i in idx:
          st.failed[i], st.active[i] = True, False
          st.reasons[i] = f"{why}: env {name!r} turn {turn}: {type(res).__name__}: {res}"
        continue
      for j, i in enumerate(idx):
        st.rewards[i] += float(res.rewards[j])
        for c, v in res.components.items():
          st.components.setdefault(c, np.zeros(B, np.float64))[i] += float(v[j])
        for k, v in (res.metadata[j] if res.metadata is not None else {}).items():
          if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
            st.metadata.setdefault(k, np.full(B, np.nan))[i] = float(v)
        if res.done[j]:
          st.terminated[i], st.active[i] = True, False
          continue
        if st.truncated[i] or st.turns[i] >= st.limit[i]:
          st.truncated[i], st.active[i] = True, False
          continue
        obs = self.tok.encode_observation(res.observations[j])
        st.history[i].append(("user", res.observations[j]))
        if st.length[i] + len(obs) + 1 > N:  # no room for the observation and a next token
          st.truncated[i], st.active[i] = True, False
          continue
        s = slice(st.length[i], st.length[i] + len(obs))
        st.tokens[i, s], st.valid[i, s] = obs, True
        st.length[i] += len(obs)
