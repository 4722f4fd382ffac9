"""Agents as a task: a user's async function, written against the `openai` client, plays each
episode; the server records every request, and the episode becomes a trajectory.

    async def solve(client: openai.AsyncOpenAI, task) -> float | dict[str, float]: ...

`load_agent("agent:<module>:<function>")` imports it. `AgentLoop` has the multi-turn loop's `run`
(`jaxrl.rollout.multi_turn.MultiTurn.run`: tasks, G samples each -> `Episodes`), so the
producer, the data plane and the trainer take its rows unchanged:

- Each episode gets its own `openai.AsyncOpenAI` whose base URL is the run's server under
  `/episodes/<id>/v1`: every reply is recorded there (`OpenAIServer.open_episode`) with its exact
  prompt and completion tokens, log-probs and per-token policy versions; the episode samples with
  the run's temperature, top-k and top-p whatever a request asks (the trainer recomputes
  log-probs at that temperature). Any model name is accepted; a `max_tokens` over the run's
  `rollout.max_new_tokens` is lowered to it.
- Trajectory (`trajectory`): the first request's prompt is the row's prompt; its reply, then for
  each later request the tokens its prompt adds after everything so far (the tool results, the
  next user turn: context, never trained) and its reply (trained). A request whose prompt does
  not extend the previous prompt + reply token for token (the template re-rendered history
  differently, or the agent rewrote it) starts a new segment: its whole prompt (context) and its
  reply (trained) follow in the row as a causal sequence of their own (`Episodes.segment`,
  `TrainBatch.completion_segment`: it sees only its own tokens, positions from 0), so the tokens
  are never re-tokenised to force a fit; later requests that extend it add to it. Every segment
  shares the episode's reward; `Episodes.metadata["agent_segments"]` counts them.
- Reward: the function's return value; a dict is a set of named components summed into the
  reward.
- `max_concurrency` episodes run at once (0: every episode of the batch, so the engine batches
  them all); they share one HTTP connection pool; each has `timeout_s`. An episode that raises,
  times out, returns a non-number or whose first prompt does not fit `max_prompt_len` fails: it
  is logged with its error, gets a NaN reward and no loss mask, as a failed environment row does.
- Forced lag: `run(params, ..., version)` serves every request of the batch with `params`,
  stamped `version`, which the producer gives as the batch's version (b - L at lag L). With
  `newest` (partial rollouts) the batch's first engine run starts on those params and every
  later dispatch switches to newer published ones (`samplers.partial_source`): requests in flight
  are paused, their KV recomputed under the new params, and resumed; each token's version says
  which params made it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import uuid
from typing import Callable, Sequence

import numpy as np

from jaxrl import parallel
from jaxrl.data.tokenizer import left_pad
from jaxrl.envs.agent_task import load_agent  # noqa: F401  (re-exported)
from jaxrl.envs.base import Task
from jaxrl.envs.registry import make_env
from jaxrl.rollout import samplers
from jaxrl.rollout.multi_turn import Budget, Episodes, MultiTurn
from jaxrl.serving.dispatcher import Completion

log = logging.getLogger("jaxrl.agents")
# HTTP connections of a batch's episodes (see `AgentLoop._play`): on a 2-core CPU, 256 one-request
# episodes of the default model took 1.1-1.3 s a step with 8-32, 2.3 s with 64, 2.4 s with 256.
POOL = 32


@dataclasses.dataclass
class Trajectory:
  """One episode as a row: the first request's prompt, then every token after it, each with its
  causal sequence (`segment`: 0 continues the prompt, k >= 1 is the k-th later segment)."""

  prompt: list[int]
  tokens: list[int]
  mask: list[bool]  # generated tokens
  logprobs: list[float]
  versions: list[int]
  segment: list[int]
  segments: int  # the episode's segments, all of them (those cut by the budget too)
  truncated: bool  # cut to the completion budget


def trajectory(turns: Sequence[tuple[list[int], Completion]], max_total_tokens: int
               ) -> Trajectory:
  """The row of an episode's recorded replies (module docstring): a request that extends the
  current segment's prompt and replies adds what its prompt adds (context) and its reply
  (trained); one that does not starts the next segment with its whole prompt (context) and its
  reply, exactly as served."""
  prompt, first = turns[0]
  tokens, mask = list(first.tokens), [True] * len(first.tokens)
  lps, vers = list(first.logprobs), list(first.versions)
  seg = [0] * len(first.tokens)
  segment, context = 0, list(prompt) + list(first.tokens)
  for p, c in turns[1:]:
    if p[:len(context)] == context:
      added = p[len(context):]
    else:
      segment, added, context = segment + 1, list(p), []
    tokens += added + list(c.tokens)
    mask += [False] * len(added) + [True] * len(c.tokens)
    lps += [0.0] * len(added) + list(c.logprobs)
    vers += [0] * len(added) + list(c.versions)
    seg += [segment] * (len(added) + len(c.tokens))
    context += added + list(c.tokens)
  N = max_total_tokens
  return Trajectory(prompt, tokens[:N], mask[:N], lps[:N], vers[:N], seg[:N], segment + 1,
                    len(tokens) > N)


def reward_of(value) -> tuple[float, dict[str, float]]:
  """(reward, components) of an agent's return value."""
  if isinstance(value, dict):
    parts = {str(k): float(v) for k, v in value.items()}
    return sum(parts.values()), parts
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"the agent returned {type(value).__name__}; return a float or a dict of "
                    f"floats")
  return float(value), {}


class AgentLoop:
  """`MultiTurn`'s `run` over an agent function (module docstring). `server` is a started
  `OpenAIServer` whose params source is `self.served` (see `serving_source`)."""

  def __init__(self, fn: Callable, server, tokenizer, budget: Budget, group_size: int, *,
               max_concurrency: int = 0, timeout_s: float = 60.0, newest=None):
    self.fn, self.server, self.tok, self.budget, self.G = fn, server, tokenizer, budget, group_size
    self.max_concurrency, self.timeout_s, self.newest = max_concurrency, timeout_s, newest
    self.served: tuple[int, object] | None = None
    self._partial = None  # the batch's partial-rollout source (with `newest`)
    self.warm = False  # the server's engine has compiled its programs
    # What scores the `dev` split (the warm-up's stopping rule), when not this loop: a
    # `MultiTurn` of `agent.task` itself (`agent.warmup_through_agent=false`).
    self.dev_loop: MultiTurn | None = None

  def serving_source(self) -> tuple[int, object]:
    """The params the server generates with: those of the batch being run."""
    if self.served is None:
      raise RuntimeError("no agent batch is running")
    return self.served if self._partial is None else self._partial()

  def run(self, params, tasks: Sequence[Task], key, request_base: int, version: int,
          temperature: float, top_k: int = 0, top_p: float = 1.0) -> Episodes:
    """Plays the G episodes of each task (task-major rows) -> Episodes."""
    rows = [t for t in tasks for _ in range(self.G)]
    if not self.warm:
      self.server.engine.warmup(params)
      self.warm = True
    self.served = (int(version), params)
    if self.newest is not None:
      self._partial = samplers.partial_source(self.newest, int(version), params)
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    try:
      outcomes = asyncio.run(self._play(rows, sampling))
    finally:
      self.served = self._partial = None
    return self._episodes(rows, outcomes)

  async def _play(self, rows: list[Task], sampling: dict) -> list:
    import httpx  # the serve extra (openai's own HTTP stack)
    import openai

    width = self.max_concurrency or len(rows)
    gate = asyncio.Semaphore(width)
    # One HTTP connection pool for the batch's clients: a client of its own builds a TLS context
    # (~45 ms of this event loop's time each: most of a CPU step's time at 256 episodes). At most
    # POOL requests are on the wire at once (more queue for a connection): the pool's
    # bookkeeping grows with its connections, and the engine batches whatever is waiting.
    pool = min(width, POOL)
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(
        max_connections=pool, max_keepalive_connections=pool))

    async def one(task: Task):
      eid = uuid.uuid4().hex
      async with gate:
        url = self.server.open_episode(eid, **sampling)
        client = openai.AsyncOpenAI(base_url=url, api_key="jaxrl", max_retries=0,
                                    timeout=self.timeout_s, http_client=http)
        try:
          value = await asyncio.wait_for(self.fn(client, task), self.timeout_s)
          result = reward_of(value)
          error = None
        except asyncio.TimeoutError:
          result, error = None, f"timeout: no result within agent.timeout_s={self.timeout_s:g}"
        except Exception as e:  # noqa: BLE001  (the episode fails; the batch goes on)
          result, error = None, f"error: {type(e).__name__}: {e}"
        finally:
          turns = self.server.close_episode(eid)
      if error is None and not turns:
        error = "error: the agent made no request"
      if error is not None:
        log.warning("agent episode of %s failed: %s", task.uid, error)
      return turns, result, error

    try:
      return await asyncio.gather(*(one(t) for t in rows))
    finally:
      await http.aclose()

  def _episodes(self, rows: list[Task], outcomes: list) -> Episodes:
    b, B = self.budget, len(rows)
    N, Lp = b.max_total_tokens, b.max_prompt_len
    pad = self.tok.pad_id
    tokens, valid = np.full((B, N), pad, np.int32), np.zeros((B, N), bool)
    mask, lps = np.zeros((B, N), bool), np.zeros((B, N), np.float32)
    vers, rewards = np.zeros((B, N), np.int32), np.full(B, np.nan, np.float32)
    segment = np.zeros((B, N), np.int32)
    turns, segments = np.zeros(B, np.int32), np.full(B, np.nan, np.float32)
    truncated, failed, reasons = np.zeros(B, bool), np.zeros(B, bool), [None] * B
    components: dict[str, np.ndarray] = {}
    prompts = []
    for i, (recorded, result, error) in enumerate(outcomes):
      t = trajectory(recorded, N) if recorded else None
      if t is not None and len(t.prompt) > Lp:
        error = (f"error: the first prompt has {len(t.prompt)} tokens, over "
                 f"rollout.max_prompt_len={Lp}")
      if error is None and not math.isfinite(result[0]):
        error = f"error: the agent returned a non-finite reward {result[0]}"
      prompts.append(t.prompt[-Lp:] if t is not None else [pad])
      turns[i] = len(recorded)
      if error is not None:
        failed[i], reasons[i] = True, error
        continue
      n = len(t.tokens)
      tokens[i, :n], valid[i, :n], mask[i, :n] = t.tokens, True, t.mask
      lps[i, :n], vers[i, :n], segment[i, :n] = t.logprobs, t.versions, t.segment
      segment[i, n:] = t.segment[-1] if n else 0  # (padding; ids never decrease along a row)
      rewards[i], truncated[i], segments[i] = result[0], t.truncated, t.segments
      for k, v in result[1].items():
        components.setdefault(k, np.full(B, np.nan, np.float32))[i] = v
    prompt_tokens, prompt_valid = left_pad(prompts, Lp, pad)
    return Episodes(
        tasks=rows, prompt_tokens=prompt_tokens, prompt_valid=prompt_valid, tokens=tokens,
        valid=valid, mask=mask, logprobs=lps, policy_version=vers, rewards=rewards,
        components=components, metadata={"agent_segments": segments}, turns=turns,
        terminated=~failed & ~truncated, truncated=truncated, failed=failed,
        fail_reasons=reasons, env_calls=0, env_calls_by_env={}, segment=segment)


def agent_loop(parts, group_size: int, newest=None) -> AgentLoop:
  """The agent loop of a run whose task is `agent:<module>:<function>`: a started server on
  127.0.0.1 (an ephemeral port) over the run's rollout model, serving the params of the batch
  being run; prompts up to max_prompt_len + max_total_tokens (later turns hold the whole
  conversation). `newest`: the newest-params source of partial rollouts."""
  from jaxrl.serving.openai import OpenAIServer  # the serve extra

  cfg, b = parts.cfg, parts.budget
  r = cfg.rollout
  fn = load_agent(cfg.task.name)
  holder: list[AgentLoop] = []
  server = OpenAIServer(parts.rollout_graphdef, None, parts.tok, model="policy",
                        num_slots=r.engine_slots or min(64, r.num_prompts * group_size),
                        max_prompt_len=b.max_prompt_len + b.max_total_tokens,
                        max_new_tokens=b.max_new_tokens, seed=cfg.seed,
                        steps_per_dispatch=r.engine_steps, compact=r.engine_compact,
                        params_source=lambda: holder[0].serving_source(), warmup=False).start()
  loop = AgentLoop(fn, server, parts.tok, b, group_size,
                   max_concurrency=cfg.agent.max_concurrency, timeout_s=cfg.agent.timeout_s,
                   newest=newest)
  holder.append(loop)
  if not cfg.agent.warmup_through_agent:
    loop.dev_loop = _task_loop(parts)
  return loop


def _task_loop(parts) -> MultiTurn:
  """The evaluation loop of `agent.task` itself over the agent's rows: the sampler's one pass,
  scored by that task's environment (what the warm-up's stopping rule reads on `dev`)."""
  cfg = parts.cfg
  s = samplers.build_samplers(cfg, parts.rollout_graphdef, parts.tok, parts.rollout_mesh)
  return MultiTurn(parts.tok, {cfg.task.name: make_env(cfg.agent.task)}, parts.budget,
                   cfg.val.samples_per_prompt, s.val, s.next_turn, parallel.distributed.fetch,
                   cfg.env.timeout_s)
