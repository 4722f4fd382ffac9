"""Evaluation through an OpenAI-compatible endpoint: `python -m jaxrl.evaluate --endpoint URL`.

The pass is the run's validation pass (`jaxrl.run.validation.evaluate`) with the sampler replaced
by HTTP requests to any OpenAI-compatible server (`python -m jaxrl.serve --openai`, vLLM, ...),
made with the `openai` package's client (the `serve` extra):

- Rows: the split of the config's task source, in chunks of `val.batch_size` prompts, each
  sampled `val.samples_per_prompt` times (one request per sample, `n=1`).
- Turns: with `tokenizer.chat_template` (the default) each request is a chat completion of
  [system (`tokenizer.system_prompt`, if set), user: the row's prompt, then the assistant replies
  and the environment's observations as user turns]; the server renders them with its own chat
  template, as the run's tokenizer renders them in process. Without it, a completion of the
  prompt text followed by the replies and observations. Each turn samples at `val.temperature`
  with `max_tokens` = `rollout.max_new_tokens`; a reply that ends on `finish_reason == "length"`
  is passed to the environment as truncated.
- Environments: as in process, each task's environment is called once per turn with all its
  active rows of the chunk (`call_step`), under `env.timeout_s`.
- Lengths: a reply's tokens are its `token_ids` when the server returns them (jaxrl's server
  does, EOS included, as the in-process mask counts it), else `usage.completion_tokens`. The
  completion budget `rollout.max_total_tokens` counts replies and observations, the latter from
  the growth of `usage.prompt_tokens` (a turn whose reply would not fit ends the episode as
  truncated).
- Agent tasks (`agent:<module>:<function>`): the function plays each episode with an
  `openai.AsyncOpenAI` pointed at the endpoint. As in a training run, every request is served
  with the evaluation's sampling, whatever it asks: its `model` becomes the endpoint's model,
  its `temperature` `val.temperature`, and a `max_tokens` over `rollout.max_new_tokens` is
  lowered to it. The reward is the function's return value; the length is the completion tokens
  of the episode's non-streamed replies; each episode has `agent.timeout_s`.
- At most `concurrency` requests (agent tasks: episodes) are in flight at once.
- A row whose request the server refuses (a 4xx: a prompt over its context, ...) or that times
  out fails, as a row whose environment raises does: NaN reward, counted in `val/failed_frac`,
  its reason in the row's `error`. An endpoint that stops answering ends the evaluation with one
  line naming its URL.

Metrics are those of the in-process pass, with the same names and formulas (`metrics`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from typing import Sequence

import numpy as np

from jaxrl.core.errors import UserError
from jaxrl.envs import make_env
from jaxrl.envs.agent_task import is_agent, load_agent
from jaxrl.envs.base import Task, Turn, call_step
from jaxrl.serving.agents import reward_of


class EndpointError(UserError):
  """The endpoint cannot be used (unreachable, not OpenAI-compatible, no such model)."""


@dataclasses.dataclass
class Row:
  """One sample of one prompt, as the pass plays it."""
  task: Task
  sample: int
  messages: list  # chat turns after the prompt: (role, text)
  reward: float = 0.0
  length: int = 0  # generated tokens
  used: int = 0  # completion budget used: replies and observations
  first_prompt_tokens: int | None = None
  turns: int = 0
  terminated: bool = False
  truncated: bool = False
  error: str | None = None

  @property
  def active(self) -> bool:
    return not (self.terminated or self.truncated or self.error)

  def record(self) -> dict:
    reward = float("nan") if self.error else self.reward
    return {"uid": self.task.uid, "task": self.task.env, "sample": self.sample,
            "reward": reward, "solved": bool(not self.error and reward >= 1.0 - 1e-6),
            "length": self.length, "turns": self.turns, "error": self.error}


def _short(e: BaseException) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())[:300]


class Endpoint:
  """An OpenAI-compatible endpoint at `url` (ending in `/v1`, as clients take it)."""

  def __init__(self, url: str, model: str | None = None, *, api_key: str = "none",
               timeout_s: float = 300.0):
    try:
      import openai  # noqa: F401  (the serve extra)
    except ImportError:
      raise UserError("python -m jaxrl.evaluate --endpoint needs the openai package: "
                      "pip install -e \".[serve]\"") from None
    if not url.startswith(("http://", "https://")):
      raise EndpointError(f"--endpoint={url!r} is not an http:// or https:// URL")
    self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
    self.model = model

  def probe(self) -> str:
    """Checks the endpoint answers `GET /models` and serves `model` (default: the first it
    lists) -> the model name; `EndpointError` naming the URL otherwise."""
    import openai

    client = openai.OpenAI(base_url=self.url, api_key=self.api_key, max_retries=0,
                           timeout=min(self.timeout_s, 30.0))
    try:
      names = [m.id for m in client.models.list().data]
    except openai.APIStatusError as e:
      raise EndpointError(f"the endpoint {self.url} answered GET /models with HTTP "
                          f"{e.status_code}: is it an OpenAI-compatible API (its URL ends in "
                          f"/v1)?") from None
    except openai.APIError as e:
      raise EndpointError(f"cannot reach the endpoint {self.url}: {_short(e)}") from None
    except Exception as e:  # noqa: BLE001  (a reply that is not the models list)
      raise EndpointError(f"the endpoint {self.url} did not answer GET /models with a model "
                          f"list: {_short(e)}") from None
    finally:
      client.close()
    if not names:
      raise EndpointError(f"the endpoint {self.url} serves no model")
    if self.model is None:
      self.model = names[0]
    elif self.model not in names:
      raise EndpointError(f"--model={self.model!r}: the endpoint {self.url} serves "
                          f"{', '.join(map(repr, names))}")
    return self.model

  def client(self, **kwargs):
    import openai

    return openai.AsyncOpenAI(base_url=self.url, api_key=self.api_key, max_retries=0,
                              timeout=self.timeout_s, **kwargs)


class Stopped(Exception):
  """The endpoint stopped answering during the pass."""


class Pass:
  """One evaluation pass over rows of built-in tasks through `endpoint` (module docstring)."""

  def __init__(self, endpoint: Endpoint, envs: dict, *, chat: bool, system_prompt: str,
               temperature: float, max_new_tokens: int, max_total_tokens: int, max_turns: int,
               env_timeout_s: float, concurrency: int):
    self.endpoint, self.envs, self.chat, self.system = endpoint, envs, chat, system_prompt
    self.temperature, self.max_new, self.N = temperature, max_new_tokens, max_total_tokens
    self.max_turns, self.env_timeout_s = max_turns, env_timeout_s
    self.concurrency = concurrency
    self.env_calls = 0

  def limit(self, task: Task) -> int:
    return max(1, min(self.max_turns, int(getattr(self.envs[task.env], "max_turns", 1))))

  async def run(self, rows: list[Row]) -> None:
    """Plays `rows` to their end: one round of requests and of environment calls per turn."""
    import openai

    gate = asyncio.Semaphore(self.concurrency)
    client = self.endpoint.client()
    try:
      turn = 0
      while any(r.active for r in rows):
        active = [r for r in rows if r.active]
        replies = await asyncio.gather(*(self._ask(client, gate, r) for r in active))
        calls: dict[str, list[tuple[Row, Turn]]] = {}
        for r, reply in zip(active, replies):
          if isinstance(reply, openai.APIConnectionError) and not \
              isinstance(reply, openai.APITimeoutError):
            raise Stopped(_short(reply))
          if isinstance(reply, BaseException):
            why = "timeout" if isinstance(reply, openai.APITimeoutError) else "error"
            r.error = f"{why}: turn {turn}: {_short(reply)}"
            continue
          if reply is None:  # the last observation left no room for this turn
            r.truncated = True
            continue
          text, truncated, cut = reply
          calls.setdefault(r.task.env, []).append(
              (r, Turn(task=r.task, turn=turn, response=text, truncated=truncated,
                       history=self._history(r))))
          r.messages.append(("assistant", text))
          r.turns += 1
          r.truncated |= cut
        await asyncio.gather(*(self._step(name, pairs, turn) for name, pairs in calls.items()))
        turn += 1
    finally:
      await client.close()

  def _history(self, r: Row) -> tuple:
    return (("user", r.task.prompt), *r.messages)

  async def _ask(self, client, gate, r: Row):
    """The row's next reply -> (text, truncated, cut by the completion budget); None when the
    last observation did not fit the budget (in process the row ends before this turn); or the
    exception the request raised."""
    s = dict(model=self.endpoint.model, temperature=self.temperature,
             max_tokens=min(self.max_new, max(1, self.N - r.used)), n=1)
    try:
      async with gate:
        if self.chat:
          messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
              [{"role": role, "content": text} for role, text in self._history(r)]
          resp = await client.chat.completions.create(messages=messages, **s)
          choice = resp.choices[0]
          text = choice.message.content or ""
        else:
          prompt = "".join(text for _, text in self._history(r))
          resp = await client.completions.create(prompt=prompt, **s)
          choice = resp.choices[0]
          text = choice.text or ""
    except Exception as e:  # noqa: BLE001  (the row fails, or the pass stops: see `run`)
      return e
    ids = (choice.model_extra or {}).get("token_ids")
    usage = resp.usage
    n = len(ids) if isinstance(ids, list) else int(usage.completion_tokens if usage else 0)
    if usage is not None:  # observations: the growth of the prompt since the first turn
      if r.first_prompt_tokens is None:
        r.first_prompt_tokens = usage.prompt_tokens
      r.used = usage.prompt_tokens - r.first_prompt_tokens
      if r.turns and r.used + 1 > self.N:
        return None
    take = min(n, self.N - r.used)
    r.length += take
    r.used += take
    return text, choice.finish_reason == "length" or take < n, take < n

  async def _step(self, name: str, pairs: list, turn: int) -> None:
    """One environment call with all its rows of this turn; applies its result."""
    rows = [r for r, _ in pairs]
    try:
      res = await asyncio.wait_for(_in_thread(call_step, self.envs[name], [t for _, t in pairs],
                                              name=f"jaxrl-env-{name}"), self.env_timeout_s)
    except asyncio.TimeoutError:
      res = TimeoutError(f"no result within env.timeout_s={self.env_timeout_s:g}")
    except Exception as e:  # noqa: BLE001  (its rows fail; the pass goes on)
      res = e
    self.env_calls += 1
    if isinstance(res, BaseException):
      why = "timeout" if isinstance(res, TimeoutError) else "error"
      for r in rows:
        r.error = f"{why}: env {name!r} turn {turn}: {_short(res)}"
      return
    for j, r in enumerate(rows):
      r.reward += float(res.rewards[j])
      if res.done[j]:
        r.terminated = True
      elif r.truncated or r.turns >= self.limit(r.task) or r.used + 1 >= self.N:
        r.truncated = True  # (no room left for an observation and a next token)
      else:
        r.messages.append(("user", res.observations[j]))


def _in_thread(fn, *args, name: str) -> asyncio.Future:
  """`fn(*args)` on its own daemon thread, as a future of this loop: a call that outlives its
  timeout is abandoned there (as the in-process loop abandons one), never joined at exit."""
  loop = asyncio.get_running_loop()
  future = loop.create_future()

  def settle(value, error):
    if future.done():
      return
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(value)

  def run():
    try:
      value, error = fn(*args), None
    except BaseException as e:  # noqa: BLE001  (handed to the waiting coroutine)
      value, error = None, e
    try:
      loop.call_soon_threadsafe(settle, value, error)
    except RuntimeError:  # the pass has ended (the call timed out and was abandoned)
      pass

  threading.Thread(target=run, daemon=True, name=name).start()
  return future


class ForcedRequests:
  """An httpx transport over `inner` that serves an agent's requests with the evaluation's
  sampling (module docstring) and counts the completion tokens of the replies."""

  def __init__(self, inner, model: str, temperature: float, max_new_tokens: int):
    self.inner, self.model = inner, model
    self.temperature, self.max_new = temperature, max_new_tokens
    self.completion_tokens = 0
    self.requests = 0

  async def handle_async_request(self, request):
    import httpx

    if request.method == "POST" and request.url.path.endswith("completions"):
      self.requests += 1
      body = json.loads(request.content or b"{}")
      body["model"], body["temperature"] = self.model, self.temperature
      for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and v > self.max_new:
          body[key] = self.max_new
      if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = self.max_new
      headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
      request = httpx.Request(request.method, request.url, headers=headers,
                              content=json.dumps(body).encode(), extensions=request.extensions)
      response = await self.inner.handle_async_request(request)
      if not body.get("stream") and response.status_code == 200:
        await response.aread()
        try:
          self.completion_tokens += int(json.loads(response.content)["usage"]
                                        ["completion_tokens"])
        except (ValueError, KeyError, TypeError):
          pass
      return response
    return await self.inner.handle_async_request(request)

  async def aclose(self):
    await self.inner.aclose()


async def play_agents(endpoint: Endpoint, fn, rows: list[Row], *, temperature: float,
                      max_new_tokens: int, timeout_s: float, concurrency: int) -> None:
  """Plays an agent task's episodes through `endpoint` (module docstring)."""
  import httpx
  import openai

  gate = asyncio.Semaphore(concurrency)

  async def one(r: Row):
    async with gate:
      transport = ForcedRequests(httpx.AsyncHTTPTransport(), endpoint.model, temperature,
                                 max_new_tokens)
      http = httpx.AsyncClient(transport=transport, timeout=endpoint.timeout_s)
      client = endpoint.client(http_client=http)
      try:
        r.reward = reward_of(await asyncio.wait_for(fn(client, r.task), timeout_s))[0]
        if not math.isfinite(r.reward):
          r.error = f"error: the agent returned a non-finite reward {r.reward}"
      except asyncio.TimeoutError:
        r.error = f"timeout: no result within agent.timeout_s={timeout_s:g}"
      except openai.APIConnectionError as e:
        if not isinstance(e, openai.APITimeoutError):
          raise Stopped(_short(e)) from None
        r.error = f"timeout: {_short(e)}"
      except Exception as e:  # noqa: BLE001  (the episode fails; the pass goes on)
        r.error = f"error: {_short(e)}"
      finally:
        await client.close()
      r.length, r.turns = transport.completion_tokens, transport.requests
      r.terminated = r.error is None
      if r.error is None and not r.turns:
        r.error = "error: the agent made no request"

  await asyncio.gather(*(one(r) for r in rows))


def metrics(rows: Sequence[Row], k: int, env_calls: int, task_names: Sequence[str]) -> dict:
  """The in-process pass's `val/*` metrics (`jaxrl.run.validation.evaluate`) of played rows
  (prompt-major, k samples each)."""
  failed = np.array([r.error is not None for r in rows])
  rewards = np.array([np.nan if r.error else r.reward for r in rows], np.float64)
  lengths = np.array([r.length for r in rows], np.float64)
  solved = (np.nan_to_num(rewards, nan=0.0) >= 1.0 - 1e-6).reshape(-1, k)
  finite = rewards[np.isfinite(rewards)]
  out = {"val/accuracy": float(solved.mean()), f"val/pass@{k}": float(solved.any(1).mean()),
         "val/reward": float(finite.mean()) if finite.size else float("nan"),
         "val/avg_length": float(lengths.mean()),
         "val/turns/mean": float(np.mean([r.turns for r in rows])),
         "val/terminated_frac": float(np.mean([r.terminated and not r.error for r in rows])),
         "val/truncated_frac": float(np.mean([r.truncated and not r.error for r in rows])),
         "val/failed_frac": float(failed.mean()), "val/env_calls": float(env_calls)}
  if len(task_names) > 1:
    env_of = np.array([r.task.env for r in rows])
    flat = solved.reshape(-1)
    for name in task_names:
      sel = env_of == name
      if sel.any():
        out[f"val/{name}/accuracy"] = float(flat[sel].mean())
        out[f"val/{name}/pass@{k}"] = float(solved[sel.reshape(-1, k)[:, 0]].any(1).mean())
        out[f"val/{name}/avg_length"] = float(lengths[sel].mean())
  return out


def evaluate(endpoint: Endpoint, cfg, tasks: list[Task], *, concurrency: int) -> tuple[dict,
                                                                                    list[dict]]:
  """Plays `tasks` (the split) through `endpoint` with `cfg`'s evaluation settings -> (the
  `val/*` metrics, one record per row). `endpoint` has been probed."""
  v, r = cfg.val, cfg.rollout
  k, bs = v.samples_per_prompt, v.batch_size
  names = cfg.task.name.split("+")
  played: list[Row] = []
  env_calls = 0
  t0 = time.perf_counter()
  try:
    if is_agent(cfg.task.name):
      rows = [Row(t, g, []) for t in tasks for g in range(k)]
      asyncio.run(play_agents(endpoint, load_agent(cfg.task.name), rows,
                              temperature=v.temperature, max_new_tokens=r.max_new_tokens,
                              timeout_s=cfg.agent.timeout_s, concurrency=concurrency))
      played = rows
    else:
      envs = {name: make_env(name) for name in names}
      p = Pass(endpoint, envs, chat=bool(cfg.tokenizer.chat_template),
               system_prompt=cfg.tokenizer.system_prompt, temperature=v.temperature,
               max_new_tokens=r.max_new_tokens,
               max_total_tokens=r.max_total_tokens or r.max_new_tokens, max_turns=r.max_turns,
               env_timeout_s=cfg.env.timeout_s, concurrency=concurrency)
      for start in range(0, len(tasks), bs):
        rows = [Row(t, g, []) for t in tasks[start:start + bs] for g in range(k)]
        asyncio.run(p.run(rows))
        played += rows
      env_calls = p.env_calls
  except Stopped as e:
    raise EndpointError(f"the endpoint {endpoint.url} stopped answering after "
                        f"{time.perf_counter() - t0:.0f} s: {e}") from None
  return metrics(played, k, env_calls, names), [row.record() for row in played]
