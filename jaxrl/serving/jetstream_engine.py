"""jaxrl's slot engine behind JetStream's Engine API (google-jetstream 0.2.2).

JetStream's orchestrator (`jetstream.core.orchestrator.Driver`, served over gRPC by
`jetstream.core.server_lib`) runs four host threads around an `engine_api.Engine`: prefill one
request, insert its prefix into a free slot, `generate` one token for every slot, detokenize.
`JaxrlJetStreamEngine` implements that API on top of
`jaxrl.rollout.decode_programs.make_engine_fns`, so a served model produces exactly the tokens
`jaxrl.rollout.engine.Engine.run` produces for the same prompt, sampling settings and request
ids. `JaxrlTokenizer` adapts a jaxrl tokenizer (`CharTokenizer`, `HFTokenizer`) to JetStream's
`tokenizer_api.Tokenizer`. `run_server` starts the gRPC server on a chosen host
(`scripts/serve.py` is its command line).

How the two APIs meet:

- jaxrl's `insert` already draws the slot's first token (from the prefix's logits), while
  JetStream expects every token from `generate`. So the adapter's decode state adds one counter
  per slot, `emitted`, and each `generate` call first *emits* the oldest token not yet emitted
  (`tokens[slot, emitted]`) and then runs one jaxrl decode step (`steps=1`). Emission lags
  sampling by one token; the token stream is the same.
- A slot that ended in jaxrl (an end id, or `max_new_tokens` reached) keeps emitting its
  recorded tokens and then reports `valid=0`, which is how JetStream learns that the request is
  complete when the budget, not a stop token, ended it. `lengths` counts emitted tokens, so
  JetStream's own `max_tokens` per request (`lengths > max_tokens`) cuts at the same place.
- JetStream ends a request at any of `tokenizer.stop_tokens`, which default to
  `{eos_id, pad_id}`. The adapter's tokenizer names every end id of the jaxrl tokenizer (a
  Hugging Face model may have several) plus the pad id, and the jaxrl engine is built with the
  same set, so a slot stops decoding exactly where JetStream stops reading it. (The stop token
  itself is not streamed: JetStream drops it.)
- Prompts. Text requests are encoded by the jaxrl tokenizer (`encode`, or `encode_prompt` with
  `chat=True`: one user turn through the chat template), so BOS is whatever the model's own
  tokenizer adds, as in training. Token requests (`token_content`) are used verbatim: JetStream
  would prepend `bos_id` to them, so `bos_id` is a sentinel (-1, never a real id) that `prefill`
  removes again. A prompt longer than `max_prefill_length` keeps its last tokens (JetStream's
  `pad_tokens` does that, with a warning); an empty prompt is started from BOS if the tokenizer
  has one, else from its EOS (the document separator of base models).
- `max_prefill_length` must be one of JetStream's buckets (16, 32, ..., 32768): `pad_tokens`
  looks it up with `list.index`. `max_prompt_len` is rounded up to the next bucket.
- Sampling (greedy, or temperature / top-k / top-p) is fixed at construction. Request `r` (the
  r-th insert, counting from 0) draws with `fold_in(key(seed), r)`, as in the jaxrl engine.

Streaming text: JetStream detokenizes one id at a time (`decode([id])`) and only reassembles
split characters for SentencePiece byte tokens (`<0xAB>`). A byte-level BPE token holding part
of a multi-byte UTF-8 character therefore streams as U+FFFD. The ids are always exact: every
response carries `token_ids`, and clients that need exact non-ASCII text can send
`token_content` and decode the ids themselves.

Compatibility shims for google-jetstream 0.2.2 (all here, applied when this module is imported):

1. `seqio` stub. `jetstream.engine.token_utils` imports `seqio.vocabularies` at load time only
   for SentencePiece tokenizers, which this adapter never builds; the real seqio pulls
   TensorFlow (~2 GB). If seqio is not installed, a stub `seqio.vocabularies` with the two names
   imported is registered in `sys.modules`; constructing its `SentencePieceVocabulary` raises.
2. `jax.tree_map` was removed in jax 0.6; `orchestrator.delete_pytree` still calls it on the
   generate thread, where any exception SIGKILLs the process. The module-level
   `orchestrator.delete_pytree` is replaced by the same function written with `jax.tree.map`
   (jax itself is not patched).
3. Importing `jetstream.core.orchestrator` sets the root logger to DEBUG with a stdout handler
   (and the orchestrator logs every generate step at INFO). The root logger's level and
   handlers are restored right after that import; applications configure logging themselves.
4. `server_lib` binds `[::]:port` (every interface) through a module constant; `run_server`
   sets that constant to the requested host while it builds the server.

Pitfall kept in mind throughout: an exception on any orchestrator thread kills the process with
SIGKILL (no traceback reaches the caller). So nothing in `prefill`/`insert`/`generate` raises on
request content; construction validates everything, and `warmup()` compiles every program (each
prefill bucket, insert per bucket, generate) before a server starts taking requests.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
import types
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _install_seqio_stub() -> None:
  """Shim 1 (see the module docstring): a stub `seqio.vocabularies` when seqio is absent."""
  if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
    return
  import abc

  class Vocabulary(abc.ABC):  # noqa: B024  (only a base class for isinstance/type hints)
    def __init__(self, extra_ids: int = 0):
      self._extra_ids = extra_ids

  class SentencePieceVocabulary(Vocabulary):
    def __init__(self, *args, **kwargs):
      raise NotImplementedError(
          "seqio is stubbed by jaxrl.serving.jetstream_engine (installed without TensorFlow); "
          "SentencePiece vocabularies are unavailable: use the engine's build_tokenizer")

  seqio = types.ModuleType("seqio")
  seqio.__doc__ = "Stub installed by jaxrl.serving.jetstream_engine (no TensorFlow)."
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = Vocabulary
  vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
  seqio.vocabularies = vocabularies
  sys.modules["seqio"] = seqio
  sys.modules["seqio.vocabularies"] = vocabularies


def _import_orchestrator():
  """Imports `jetstream.core.orchestrator` with shims 2 and 3 (see the module docstring)."""
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator
  root.setLevel(level)
  for h in root.handlers[:]:
    if h not in handlers:
      root.removeHandler(h)

  if not hasattr(jax, "tree_map"):
    def delete_pytree(p):
      """`orchestrator.delete_pytree` of 0.2.2 with `jax.tree.map` for the removed
      `jax.tree_map`: frees a prefix's device buffers once it is inserted."""
      def delete_leaf(leaf):
        if isinstance(leaf, jax.Array):
          leaf.delete()
      jax.tree.map(delete_leaf, p)

    orchestrator.delete_pytree = delete_pytree
  return orchestrator


_install_seqio_stub()
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

orchestrator = _import_orchestrator()

from jaxrl.rollout.decode_programs import make_engine_fns  # noqa: E402

# JetStream's prefill buckets (`token_utils.pad_tokens`): `max_prefill_length` must be one.
JETSTREAM_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# `bos_id` of the adapter's tokenizer: JetStream prepends it to token prompts, prefill drops it.
BOS_SENTINEL = -1


def jetstream_bucket(length: int) -> int:
  """The smallest JetStream prefill bucket holding `length` tokens."""
  for b in JETSTREAM_BUCKETS:
    if length <= b:
      return b
  raise ValueError(f"max_prompt_len={length} exceeds JetStream's largest prefill bucket "
                   f"{JETSTREAM_BUCKETS[-1]}")


class JaxrlTokenizer(tokenizer_api.Tokenizer):
  """A jaxrl tokenizer (`CharTokenizer`, `HFTokenizer`) as a JetStream tokenizer.

  `encode` uses the jaxrl tokenizer's own rules (BOS included if the model's tokenizer adds
  one; `chat=True`: the prompt is one user turn through the chat template) and pads with
  JetStream's `pad_tokens`, ignoring `is_bos` (see the module docstring). `decode` of a list
  of ids is the jaxrl tokenizer's; JetStream calls it with one id per streamed token.
  """

  def __init__(self, tokenizer, *, chat: bool = False):
    self.tokenizer = tokenizer
    self.chat = bool(chat)
    self._eos_ids = tuple(int(i) for i in getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    self._pad_id = int(tokenizer.pad_id)
    bos = getattr(tokenizer, "bos_id", None)
    # The token an empty prompt starts from (it must have at least one real token).
    self.start_id = int(bos) if bos is not None else self._eos_ids[0]

  def encode(self, s: str, **kwargs):
    """-> (padded tokens, true length); kwargs as JetStream passes them (`is_bos` ignored)."""
    ids = self.tokenizer.encode_prompt(s) if self.chat else self.tokenizer.encode(s)
    ids = np.asarray(list(ids) or [self.start_id], np.int32)
    return token_utils.pad_tokens(
        ids, BOS_SENTINEL, self.pad_id, is_bos=False,
        prefill_lengths=kwargs.get("prefill_lengths"),
        max_prefill_length=kwargs.get("max_prefill_length"),
        jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids: Sequence[int], **kwargs) -> str:
    return self.tokenizer.decode([int(t) for t in token_ids])

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def eos_id(self) -> int:
    return self._eos_ids[0]

  @property
  def bos_id(self) -> int:
    return BOS_SENTINEL

  @property
  def stop_tokens(self) -> set[int]:
    """Every end id of the model (not only the first) and the pad id: JetStream ends a request
    at these, and the jaxrl engine under the adapter stops its slot at the same set."""
    return set(self._eos_ids) | {self._pad_id}


class DecodeState(NamedTuple):
  """The jaxrl engine's decode state plus how many of each slot's tokens were streamed."""

  inner: Any  # jaxrl.rollout.slot_state.DecodeState
  emitted: jax.Array  # [B] int32: tokens of the slot already returned by `generate`


class JaxrlJetStreamEngine(engine_api.Engine):
  """`jetstream.engine.engine_api.Engine` (0.2.2) over
  `jaxrl.rollout.decode_programs.make_engine_fns`.

  Args:
    graphdef, params: the model (`jaxrl.models.init_model`, `load_hf`, a restored checkpoint).
      `load_params()` returns these `params`; the Driver may pass any params of the same shapes.
    tokenizer: a jaxrl tokenizer (see `JaxrlTokenizer`).
    num_slots: concurrent requests (`max_concurrent_decodes`).
    max_prompt_len: longest prompt; rounded up to JetStream's next prefill bucket.
    max_new_tokens: the per-request budget of the decode state (a request's own `max_tokens`
      can only lower it).
    temperature, top_k, top_p: sampling for every request (temperature <= 0: greedy).
    seed: request r samples with `fold_in(key(seed), r)`.
    chat: text prompts go through the tokenizer's chat template (`encode_prompt`).
  """

  def __init__(self, graphdef, params, tokenizer, *, num_slots: int = 8,
               max_prompt_len: int = 256, max_new_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False):
    if num_slots < 1 or max_new_tokens < 1 or max_prompt_len < 1:
      raise ValueError(f"num_slots={num_slots}, max_prompt_len={max_prompt_len} and "
                       f"max_new_tokens={max_new_tokens} must all be >= 1")
    if not 0.0 < top_p <= 1.0 or top_k < 0:
      raise ValueError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
    self.tokenizer = JaxrlTokenizer(tokenizer, chat=chat)
    self._params = params
    self._graphdef = graphdef
    self.num_slots, self.max_new_tokens = int(num_slots), int(max_new_tokens)
    self.max_prompt_len = jetstream_bucket(int(max_prompt_len))
    self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
    self._key = jax.random.key(seed)
    self._request_ids = itertools.count()
    self.buckets = tuple(b for b in JETSTREAM_BUCKETS if b < self.max_prompt_len) + (
        self.max_prompt_len,)
    stop = sorted(self.tokenizer.stop_tokens)
    (self._init, self._prefill, insert, generate, _) = make_engine_fns(
        graphdef, num_slots=self.num_slots, max_prompt_len=self.max_prompt_len,
        max_new_tokens=self.max_new_tokens, eos_ids=stop, pad_id=self.tokenizer.pad_id)
    N = self.max_new_tokens

    # One program per call, so the counter update rides along with jaxrl's; the state is
    # donated like jaxrl's (the KV cache is updated in place, never copied).
    def insert_fn(prefix, state: DecodeState, slot, request_id, key, temperature, top_k, top_p):
      inner = insert(prefix, state.inner, slot, request_id, key, temperature, top_k, top_p,
                     jnp.int32(0))
      return DecodeState(inner, state.emitted.at[slot].set(0))

    def generate_fn(params, state: DecodeState):
      s, e = state.inner, state.emitted
      # Emit first, then step: insert already drew token 0, so call k streams token k-1.
      valid = e < s.count
      tok = jnp.take_along_axis(s.tokens, jnp.minimum(e, N - 1)[:, None], 1)[:, 0]
      e = e + valid.astype(jnp.int32)
      inner = generate(params, s, jnp.int32(0), jnp.int32(1))
      data = jnp.stack([tok, valid.astype(jnp.int32), e], axis=-1)  # [B, token|valid|length]
      return DecodeState(inner, e), engine_api.ResultTokens(
          data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1)

    self._insert = jax.jit(insert_fn, donate_argnums=(1,))
    self._generate = jax.jit(generate_fn, donate_argnums=(1,))
    leaf = jax.tree.leaves(params)[0]
    devices = sorted(leaf.devices(), key=lambda d: d.id) if isinstance(leaf, jax.Array) else [
        jax.devices()[0]]
    self._mesh = jax.sharding.Mesh(np.array(devices), ("x",))

  # -- Engine API --------------------------------------------------------------------------------

  def load_params(self, *args, **kwargs):
    """The params given at construction (`server_lib.run` calls this with no arguments)."""
    return self._params

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
    """Prefills the real tokens (BOS sentinel dropped) at jaxrl's own bucket -> jaxrl Prefix.

    Host-side work: the orchestrator's prefill thread blocks on this request anyway, and
    re-padding here keeps jaxrl's bucketing (and its compiled programs) independent of
    JetStream's.
    """
    if existing_prefix is not None:
      raise NotImplementedError("JaxrlJetStreamEngine: existing_prefix (session cache) is not "
                                "supported")
    ids = np.asarray(padded_tokens)[:int(true_length)].astype(np.int32)
    if ids.size and ids[0] == BOS_SENTINEL:
      ids = ids[1:]
    if ids.size == 0:
      ids = np.array([self.tokenizer.start_id], np.int32)
    ids = ids[-self.max_prompt_len:]
    bucket = next(b for b in self.buckets if ids.size <= b)
    padded = np.full((bucket,), self.tokenizer.pad_id, np.int32)
    padded[:ids.size] = ids
    return self._prefill(params, padded, np.int32(ids.size))

  def insert(self, prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Copies the prefix into `slot` and draws the request's first token (not yet emitted)."""
    return self._insert(prefix, decode_state, np.int32(slot), np.int32(next(self._request_ids)),
                        self._key, np.float32(self.temperature), np.int32(self.top_k),
                        np.float32(self.top_p))

  def generate(self, params, decode_state: DecodeState):
    """-> (state, ResultTokens): one token per slot, then one jaxrl decode step."""
    return self._generate(params, decode_state)

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """All slots empty. Fresh buffers every call: the state is donated."""
    return DecodeState(self._init(self._params), jnp.zeros((self.num_slots,), jnp.int32))

  def get_prefix_destination_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    """Only a label: `build_tokenizer` returns the adapter's tokenizer whatever it says."""
    name = type(self.tokenizer.tokenizer).__name__
    return tokenizer_pb2.TokenizerParameters(path=f"jaxrl:{name}")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JaxrlTokenizer:
    return self.tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.max_prompt_len

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None

  # -- jaxrl additions ---------------------------------------------------------------------------

  def warmup(self, params=None) -> None:
    """Compiles every program a request can reach (each prefill bucket with its insert, and
    generate) and runs it once, outside the orchestrator's threads: a failure raises here with
    its traceback instead of SIGKILLing a server mid-request, and no request pays a compile."""
    params = self._params if params is None else params
    state = self.init_decode_state()
    for b in self.buckets:
      prefix = self.prefill(params=params, padded_tokens=np.full((b,), self.tokenizer.start_id,
                                                                  np.int32), true_length=b)
      state = self._insert(prefix, state, np.int32(0), np.int32(0), self._key,
                           np.float32(self.temperature), np.int32(self.top_k),
                           np.float32(self.top_p))
      state, result = self.generate(params, state)
    jax.block_until_ready((state, result))


def run_server(engine: JaxrlJetStreamEngine, *, host: str = "127.0.0.1", port: int,
               threads: int | None = None, devices: Sequence[Any] | None = None):
  """Starts JetStream's orchestrator (interleaved: one engine prefills and generates) and its
  gRPC server on `host:port` through `jetstream.core.server_lib.run`; returns the started
  `JetStreamServer` (`.stop()` stops the driver threads and the server)."""
  from jetstream.core import config_lib, server_lib

  devices = list(devices if devices is not None else engine.mesh.devices.flat)
  config = config_lib.ServerConfig(
      interleaved_slices=(f"cpu={len(devices)}",),
      interleaved_engine_create_fns=(lambda _devices: engine,))
  bind = server_lib._HOST  # shim 4: server_lib binds [::] through this constant
  server_lib._HOST = f"[{host}]" if ":" in host and not host.startswith("[") else host
  try:
    return server_lib.run(port=port, config=config, devices=devices, threads=threads)
  finally:
    server_lib._HOST = bind


__all__ = ["BOS_SENTINEL", "DecodeState", "JETSTREAM_BUCKETS", "JaxrlJetStreamEngine",
           "JaxrlTokenizer", "jetstream_bucket", "orchestrator", "run_server"]
