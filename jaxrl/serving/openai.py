"""An OpenAI-compatible HTTP server over the continuous engine (the `serve` extra).

    server = OpenAIServer(graphdef, params, tokenizer, model="tiny").start(port=0)
    client = openai.OpenAI(base_url=server.url, api_key="none")

Endpoints: `POST /v1/chat/completions` (streaming too), `POST /v1/completions` (streaming too),
`GET /v1/models`, `GET /health`. Chat prompts go through the model's chat template with the
request's tools; replies are parsed back into `tool_calls` (`chat_tools`). Every choice carries
its exact prompt and completion token ids and each token's policy version (`responses`).

Stack: starlette (the ASGI toolkit) on uvicorn (the ASGI server). Each handler is a few lines
over plain dicts, so the toolkit FastAPI is built on is enough: FastAPI would add pydantic
request models that duplicate the OpenAI schema without checking more than `responses` does,
and aiohttp would bring its own server and event loop conventions where uvicorn is the one
serving stack the rest of the ecosystem (vLLM, SGLang) runs on.

Threads: uvicorn runs its event loop on one thread (`start`; `wait` blocks on it); the
engine runs on the dispatcher's thread, which batches every client's requests (`dispatcher`).
Both are supervised: a dead engine thread turns every request into a 503 naming its error, and
`start` raises if uvicorn does not come up. Requests beyond `max_queue` waiting get a 429.

Streaming sends the reply as server-sent events as the engine makes its tokens: one chunk per
decode dispatch with the tokens it drew (`Job.on_tokens`); with tools the text is held back until
the reply is parsed for tool calls (the token ids still stream). A client that disconnects
mid-stream only loses its own stream: its row is cancelled and its slot freed at the next
dispatch.

Episodes (`open_episode`): requests under `/episodes/<id>/v1/...` are also recorded, reply by
reply, with the exact prompt and completion tokens, log-probs and versions, and sample with the
episode's settings; an agent task hands its function a client with that base URL
(`jaxrl.serving.agents`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxrl.data.chat_template import ChatTemplateError
from jaxrl.rollout.engine import Engine
from jaxrl.serving import responses as R
from jaxrl.serving.chat_tools import (RequestError, check_tools, parse_tool_calls, render_prompt,
                                      template_messages, tool_format)
from jaxrl.serving.dispatcher import Completion, Dispatcher, Job, ServerBusy


@dataclasses.dataclass
class EpisodeLog:
  """The requests of one agent episode: its forced sampling settings and, per reply in order,
  (prompt token ids, the completion as returned)."""

  sampling: dict
  turns: list = dataclasses.field(default_factory=list)


class OpenAIServer:
  """The server's state: the model's name, tokenizer and engine thread; `app` is the ASGI app.

  `params_source() -> (version, params)` replaces the fixed `params` (version `version`) when a
  trainer serves the params it publishes. `max_prompt_len` and `max_new_tokens` are the engine's
  budgets: a longer prompt gets a 400 (`context_length_exceeded`), and `max_tokens` may only lower
  the reply budget. `compact`, `prefill_buckets` and `steps_per_dispatch` are the engine's
  (`jaxrl.rollout.engine.Engine`); `warmup` compiles every program before serving.
  """

  def __init__(self, graphdef, params, tokenizer, *, model: str = "jaxrl", num_slots: int = 8,
               max_prompt_len: int = 512, max_new_tokens: int = 128, seed: int = 0,
               version: int = 0, params_source: Callable[[], tuple[int, object]] | None = None,
               max_queue: int = 1024, steps_per_dispatch: int = 8, warmup: bool = True,
               compact: bool = True, prefill_buckets=None):
    self.model, self.tokenizer = model, tokenizer
    eos = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    self.engine = Engine(graphdef, num_slots=num_slots, max_prompt_len=max_prompt_len,
                         max_new_tokens=max_new_tokens, eos_id=eos, pad_id=tokenizer.pad_id,
                         steps_per_dispatch=steps_per_dispatch, compact=compact,
                         prefill_buckets=prefill_buckets)
    source = params_source or (lambda: (version, params))
    if warmup:
      self.engine.warmup(source()[1])
    self.dispatcher = Dispatcher(self.engine, source, seed=seed, max_queue=max_queue).start()
    template = getattr(tokenizer, "chat_template", None)
    self.tool_format = tool_format(template)
    self.created = int(time.time())
    self.app = Starlette(routes=[
        Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
        Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
        Route("/v1/models", self._guard(self.models), methods=["GET"]),
        Route("/health", self._guard(self.health), methods=["GET"]),
        Route("/episodes/{episode}/v1/chat/completions", self._guard(self.chat),
              methods=["POST"]),
        Route("/episodes/{episode}/v1/completions", self._guard(self.completions),
              methods=["POST"]),
        Route("/episodes/{episode}/v1/models", self._guard(self.models), methods=["GET"])],
        exception_handlers={HTTPException: _http_error})
    # Episodes being recorded (`open_episode`): id -> its log.
    self.episodes: dict[str, EpisodeLog] = {}
    self._uvicorn: uvicorn.Server | None = None
    self._thread: threading.Thread | None = None
    self.error: BaseException | None = None

  # -- serving --------------------------------------------------------------------------------

  def _config(self, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off",
                          access_log=False, timeout_graceful_shutdown=5)

  def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> OpenAIServer:
    """Serves on a thread; returns once it listens (`port=0`: an ephemeral port, see `url`)."""
    self._uvicorn = uvicorn.Server(self._config(host, port))

    def main():
      try:
        self._uvicorn.run()
      except BaseException as e:  # noqa: BLE001  (reported by start and check)
        self.error = e

    self._thread = threading.Thread(target=main, name="jaxrl-openai-http", daemon=True)
    self._thread.start()
    t0 = time.monotonic()
    while not self._uvicorn.started:
      if self.error is not None or not self._thread.is_alive():
        raise RuntimeError(f"the OpenAI server did not start on {host}:{port}: "
                           f"{self.error!r}") from self.error
      if time.monotonic() - t0 > timeout:
        raise TimeoutError(f"the OpenAI server did not start on {host}:{port} in {timeout} s")
      time.sleep(0.01)
    return self

  def wait(self) -> None:
    """Blocks until the HTTP thread ends (Ctrl-C stops the server); raises if it died."""
    try:
      while self._thread.is_alive():
        self._thread.join(0.5)
        if not self.dispatcher.alive():
          self.stop()
    except KeyboardInterrupt:
      pass
    finally:
      self.stop()
    self.check_engine()

  @property
  def port(self) -> int:
    return self._uvicorn.servers[0].sockets[0].getsockname()[1]

  @property
  def url(self) -> str:
    """Base URL for an OpenAI client (`.../v1`)."""
    host = self._uvicorn.config.host
    return f"http://{host}:{self.port}/v1"

  def check(self) -> None:
    """Raises if the HTTP or the engine thread died."""
    if self.error is not None or (self._thread is not None and not self._thread.is_alive()):
      raise RuntimeError(f"the OpenAI HTTP thread died: {self.error!r}")
    self.check_engine()

  def check_engine(self) -> None:
    if self.dispatcher.error is not None:
      raise RuntimeError(f"the engine thread died: {self.dispatcher.error!r}")

  def stop(self) -> None:
    if self._uvicorn is not None:
      self._uvicorn.should_exit = True
      if self._thread is not None:
        self._thread.join(30)
    self.dispatcher.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  # -- episodes -------------------------------------------------------------------------------

  def open_episode(self, episode: str, **sampling) -> str:
    """Starts recording requests under `/episodes/<episode>/v1` (-> that base URL). `sampling`
    (temperature, top_p, top_k) replaces what the requests ask for, so a trainer knows the
    distribution its tokens came from."""
    self.episodes[episode] = EpisodeLog(dict(sampling))
    return f"{self.url[:-len('/v1')]}/episodes/{episode}/v1"

  def close_episode(self, episode: str) -> list[tuple[list[int], Completion]]:
    """Stops recording; -> every reply of the episode, in order, as (prompt ids, completion)."""
    return self.episodes.pop(episode).turns

  def _episode(self, request: Request, s: dict) -> EpisodeLog | None:
    eid = request.path_params.get("episode")
    if eid is None:
      return None
    log = self.episodes.get(eid)
    if log is None:
      raise RequestError(f"no episode {eid!r} is being recorded", status=404)
    if s["n"] != 1:
      raise RequestError("an episode's requests take n=1", param="n")
    s.update(log.sampling)
    return log

  # -- handlers -------------------------------------------------------------------------------

  def _guard(self, handler):
    async def endpoint(request: Request):
      try:
        return await handler(request)
      except RequestError as e:
        return JSONResponse(R.error_body(str(e), param=e.param, code=e.code), e.status)
      except ServerBusy as e:
        return JSONResponse(R.error_body(f"server busy: {e}", type_="rate_limit_error",
                                         code="server_busy"), 429)
      except Exception as e:  # noqa: BLE001  (one request fails; the server keeps serving)
        if not self.dispatcher.alive():
          return JSONResponse(R.error_body(f"the engine thread failed: {self.dispatcher.error!r}",
                                           type_="server_error"), 503)
        return JSONResponse(R.error_body(f"{type(e).__name__}: {e}", type_="server_error"), 500)
    return endpoint

  async def _body(self, request: Request) -> dict:
    try:
      body = json.loads(await request.body())
    except ValueError as e:
      raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise RequestError("the request body must be a JSON object")
    if "episode" in request.path_params:  # an agent's budget is the run's: lowered, not refused
      for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > self.engine.max_new_tokens:
          body[key] = self.engine.max_new_tokens
    model = body.get("model")
    if model != self.model and "episode" not in request.path_params:
      raise RequestError(f"the model {model!r} does not exist; this server serves "
                         f"{self.model!r}", status=404, param="model", code="model_not_found")
    return body

  def _check_length(self, prompt: list[int], param: str) -> None:
    if not prompt:
      raise RequestError("the prompt is empty", param=param)
    if len(prompt) > self.engine.max_prompt_len:
      raise RequestError(f"the prompt has {len(prompt)} tokens; this server's context takes "
                         f"at most {self.engine.max_prompt_len} prompt tokens", param=param,
                         code="context_length_exceeded")

  async def _generate(self, prompt: list[int], s: dict) -> list:
    futures = [self.dispatcher.submit(Job(prompt, s["temperature"], s["top_p"], s["top_k"]))
               for _ in range(s["n"])]
    done = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    return [R.finish(self.tokenizer, c, s["max_tokens"], s["stop"]) for c in done]

  async def models(self, request: Request):
    return JSONResponse({"object": "list", "data": [
        {"id": self.model, "object": "model", "created": self.created, "owned_by": "jaxrl",
         "max_model_len": self.engine.max_prompt_len + self.engine.max_new_tokens}]})

  async def health(self, request: Request):
    self.check()
    return JSONResponse({"status": "ok", "batches": self.dispatcher.batches,
                         "rows": self.dispatcher.rows})

  async def chat(self, request: Request):
    body = await self._body(request)
    messages = template_messages(body.get("messages"))
    tools = check_tools(body.get("tools"))
    if body.get("tool_choice") == "none":
      tools = None
    s = R.sampling(body, self.engine.max_new_tokens)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
      raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
      prompt = render_prompt(self.tokenizer, messages, tools, **kwargs)
    except (ChatTemplateError, TypeError) as e:
      raise RequestError(f"the chat template cannot render these messages: {e}",
                         param="messages") from None
    self._check_length(prompt, "messages")
    log = self._episode(request, s)
    if body.get("stream"):
      jobs, events = self._submit_live([prompt], s)
      return _LiveSSE(self._chat_stream(jobs, events, s, prompt, tools,
                                        bool(body.get("logprobs")),
                                        (body.get("stream_options") or {}).get("include_usage"),
                                        log), jobs)
    results = await self._generate(prompt, s)
    if log is not None:
      log.turns.append((prompt, results[0][0]))
    choices = []
    for i, (c, text, reason) in enumerate(results):
      content, calls = (parse_tool_calls(text, self.tool_format) if tools else (text, []))
      message = {"role": "assistant", "content": content}
      if calls:
        message["tool_calls"], reason = calls, "tool_calls"
      choices.append({"index": i, "message": message, "finish_reason": reason,
                      "logprobs": R.chat_logprobs(self.tokenizer, c) if body.get("logprobs")
                      else None, **R.exact_fields(prompt, c)})
    return JSONResponse(R.chat_response(self.model, prompt, choices))

  def _submit_live(self, prompts: list[list[int]], s: dict) -> tuple[list[Job], asyncio.Queue]:
    """Submits `n` streaming jobs per prompt -> (jobs, events): the engine thread puts
    `(choice index, (tokens, logprobs, versions))` after every dispatch that decoded the row,
    and `(choice index, None)` once its job is done."""
    loop, events, jobs = asyncio.get_running_loop(), asyncio.Queue(), []
    put = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)
    try:
      for prompt in prompts:
        for _ in range(s["n"]):
          i = len(jobs)
          job = Job(prompt, s["temperature"], s["top_p"], s["top_k"],
                    on_tokens=lambda *row, i=i: put((i, row)))
          self.dispatcher.submit(job)
          jobs.append(job)
          job.future.add_done_callback(lambda _, i=i: put((i, None)))
    except BaseException:
      for job in jobs:
        job.cancel()
      raise
    return jobs, events

  async def _follow(self, jobs: list[Job], events: asyncio.Queue, s: dict):
    """The events of live jobs, as their tokens are made: ("tokens", choice, tokens, logprobs,
    versions, the text they add) for the tokens a dispatch made, ("end", choice, (completion,
    text, finish_reason), text not yet sent), or one ("error", message) if the engine failed."""
    texts = [R.LiveText(self.tokenizer, s["max_tokens"], s["stop"]) for _ in jobs]
    left = len(jobs)
    while left:
      i, row = await events.get()
      if row is not None:
        new = texts[i].feed(row[0])
        if new:
          yield _new_tokens(i, row, new)
        if texts[i].done:  # max_tokens or a stop string: the row need not go on
          jobs[i].cancel()
        continue
      try:
        c = jobs[i].future.result()
      except BaseException as e:  # noqa: BLE001  (told to the client, in the stream)
        yield ("error", f"the engine failed: {e!r}")
        return
      c, text, reason = R.finish(self.tokenizer, c, s["max_tokens"], s["stop"])
      new = texts[i].feed(c.tokens)
      if new:
        yield _new_tokens(i, (c.tokens, c.logprobs, c.versions), new)
      left -= 1
      yield ("end", i, (c, text, reason), texts[i].rest(text))

  async def _chat_stream(self, jobs, events, s: dict, prompt: list[int], tools, logprobs: bool,
                         include_usage: bool, log: EpisodeLog | None):
    head = {"id": R.new_id("chatcmpl"), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.model}
    chunk = lambda i, delta, reason=None, **kw: {**head, "choices": [
        {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None, **kw}]}
    for i in range(len(jobs)):
      yield {**chunk(i, {"role": "assistant", "content": ""}), "prompt_token_ids": prompt}
    done = 0
    async for ev in self._follow(jobs, events, s):
      if ev[0] == "tokens":
        _, i, ts, lps, vs, piece = ev
        lps = (R.chat_logprobs(self.tokenizer, Completion(ts, lps, vs, False))
               if logprobs else None)
        # With tools the text is held back until the reply is parsed for tool calls.
        yield chunk(i, {"content": "" if tools else piece}, logprobs=lps, token_ids=ts,
                    policy_versions=vs)
      elif ev[0] == "end":
        _, i, (c, text, reason), rest = ev
        if i == 0 and log is not None:
          log.turns.append((prompt, c))
        content, calls = parse_tool_calls(text, self.tool_format) if tools else (text, [])
        if tools and content or not tools and rest:
          yield chunk(i, {"content": content if tools else rest})
        if calls:
          reason = "tool_calls"
          yield chunk(i, {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]})
        yield chunk(i, {}, reason)
        done += len(c.tokens)
      else:
        yield R.error_body(ev[1], type_="server_error")
        return
    if include_usage:
      yield {**head, "choices": [], "usage": R.usage(len(prompt), done)}

  def _completion_prompts(self, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
      return [self.tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
        for p in prompt):
      return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of token ids, or a list of either",
                       param="prompt")

  async def completions(self, request: Request):
    body = await self._body(request)
    prompts = self._completion_prompts(body.get("prompt"))
    vocab = getattr(self.tokenizer, "vocab_size", None)
    for p in prompts:
      self._check_length(p, "prompt")
      if vocab is not None and any(not 0 <= t < vocab for t in p):
        raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if body.get("echo"):
      raise RequestError("echo is not supported", param="echo")
    s = R.sampling(body, self.engine.max_new_tokens)
    log = self._episode(request, s)
    if log is not None and len(prompts) != 1:
      raise RequestError("an episode's requests take one prompt", param="prompt")
    if body.get("stream"):
      jobs, events = self._submit_live(prompts, s)
      return _LiveSSE(self._completion_stream(jobs, events, s, prompts, log), jobs)
    per_prompt = await asyncio.gather(*(self._generate(p, s) for p in prompts))
    if log is not None:
      log.turns.append((prompts[0], per_prompt[0][0][0]))
    choices = []
    for p, results in zip(prompts, per_prompt):
      for c, text, reason in results:
        choices.append({"index": len(choices), "text": text, "finish_reason": reason,
                        "logprobs": R.completion_logprobs(self.tokenizer, c)
                        if body.get("logprobs") is not None else None, **R.exact_fields(p, c)})
    done = sum(len(ch["token_ids"]) for ch in choices)
    out = {"id": R.new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
           "model": self.model, "choices": choices,
           "usage": R.usage(sum(len(p) for p in prompts) * s["n"], done)}
    return JSONResponse(out)

  async def _completion_stream(self, jobs, events, s: dict, prompts: list[list[int]],
                               log: EpisodeLog | None):
    head = {"id": R.new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": self.model}
    chunk = lambda i, text, reason=None, **kw: {**head, "choices": [
        {"index": i, "text": text, "finish_reason": reason, "logprobs": None, **kw}]}
    async for ev in self._follow(jobs, events, s):
      if ev[0] == "tokens":
        _, i, ts, _, vs, piece = ev
        yield chunk(i, piece, token_ids=ts, policy_versions=vs)
      elif ev[0] == "end":
        _, i, (c, _, reason), rest = ev
        if i == 0 and log is not None:
          log.turns.append((prompts[0], c))
        if rest:
          yield chunk(i, rest)
        yield chunk(i, "", reason)
      else:
        yield R.error_body(ev[1], type_="server_error")
        return


def _new_tokens(i: int, row, new: list[tuple[int, str]]) -> tuple:
  """The "tokens" event of `_follow` for the tokens `new` (LiveText.feed) of `row`."""
  ks = [k for k, _ in new]
  return ("tokens", i, [row[0][k] for k in ks], [row[1][k] for k in ks], [row[2][k] for k in ks],
          "".join(piece for _, piece in new))


class _LiveSSE(StreamingResponse):
  """Server-sent events of a live reply; however the response ends (its last event, a client
  that went away, an error), the jobs still running are cancelled, freeing their slots."""

  def __init__(self, chunks, jobs: list[Job]):
    self.jobs = jobs

    async def events():
      async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
      yield "data: [DONE]\n\n"

    super().__init__(events(), media_type="text/event-stream")

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      for job in self.jobs:
        if not job.future.done():
          job.cancel()


async def _http_error(request: Request, exc: HTTPException):
  return JSONResponse(R.error_body(exc.detail, code=str(exc.status_code)), exc.status_code)
