"""A plan's numbers: each program compiled for the target (`compile_program`), what is live at
once at the run's lag (`live_peak`), the compiler's estimates (`estimates`), whether it fits and
which keys lower it (`verdict`), as a table (`render`) or one JSON object (`as_json`).

Every figure here comes from the target's compiler or from arithmetic on the config, never from
a run: memory is XLA's buffer assignment per chip (`memory_analysis()`), step times are
XLA:TPU's own estimate (`cost_analysis()["optimal_seconds"]`, no such estimate on GPU) or a
roofline, and they are labelled "compiled" or "estimated" wherever they are shown.
"""

from __future__ import annotations

import dataclasses
import re
import time

from jaxrl.config.schema import PREFIX

GIB = 1 << 30
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVE_RE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY_RE = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass
class Compiled:
  """One program's compile for the target: XLA's memory per chip, its cost figures and the
  collectives in its HLO; `error` instead when the compiler refused it."""
  name: str
  side: str
  what: str
  compile_s: float = 0.0
  memory: dict = dataclasses.field(default_factory=dict)
  flops: float | None = None
  bytes_accessed: float | None = None
  optimal_seconds: float | None = None
  collectives: dict = dataclasses.field(default_factory=dict)
  error: str | None = None

  @property
  def peak(self) -> int:
    """Arguments + outputs - aliased + temporaries: the bytes the program holds on a chip while
    it runs (a donated argument counted once)."""
    m = self.memory
    return (m.get("argument", 0) + m.get("output", 0) - m.get("alias", 0) + m.get("temp", 0))


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Per kind of collective in an optimised HLO module's text: how many ops and the bytes of
  their results (the largest array of an async start's tuple). A loop body's ops are counted
  once, however often the loop runs."""
  out: dict[str, dict[str, int]] = {}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE_RE.search(line)
    if m is None:
      continue
    sizes = [_DTYPE_BYTES.get(dt, 4) * _prod(dims) for dt, dims in _ARRAY_RE.findall(m.group(1))]
    entry = out.setdefault(m.group(2), {"ops": 0, "bytes": 0})
    entry["ops"] += 1
    entry["bytes"] += max(sizes, default=0)
  return out


def _prod(dims: str) -> int:
  n = 1
  for d in dims.split(","):
    if d:
      n *= int(d)
  return n


def compile_program(program, progress=None) -> Compiled:
  """Lowers and compiles `program` (`jaxrl.aot.programs.Program`) for its target."""
  c = Compiled(program.name, program.side, program.what)
  t0 = time.perf_counter()
  try:
    compiled = program.lower().compile()
  except Exception as e:  # noqa: BLE001  (the compiler's refusal is the plan's finding)
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    c.error = f"{type(e).__name__}: {first}"[:400]
    c.compile_s = round(time.perf_counter() - t0, 1)
    return c
  c.compile_s = round(time.perf_counter() - t0, 1)
  ma = compiled.memory_analysis()
  if ma is not None:
    c.memory = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
                for k in ("argument", "output", "alias", "temp", "generated_code")}
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  if isinstance(cost, dict):
    c.flops = cost.get("flops")
    c.bytes_accessed = cost.get("bytes accessed")
    c.optimal_seconds = cost.get("optimal_seconds")
  c.collectives = collectives(compiled.as_text())
  if progress:
    progress(f"compiled {c.name} in {c.compile_s:.0f} s: peak {c.peak / GIB:.2f} GiB per chip")
  return c


def live_peak(compiled: dict[str, Compiled], built, lag: int, colocated: bool) -> dict:
  """What one chip holds at once at `rollout.lag` = `lag`, by side.

  Train side: the train step's own peak (its state, one batch, its temporaries) and the lag
  ring's other `lag` batches. Rollout side: the published copies (two at lag >= 1: the one being
  sampled and the one just published; one at lag 0) and the largest rollout program's own
  buffers (its peak less the params copy it reads). Colocated at lag >= 1 both sides are live at
  once (their sum); at lag 0 they alternate: the train step with the sampler's copy kept, or the
  state (the train step's arguments less its batch) with the sampler running; disaggregated,
  each side is on its own chips."""
  step = compiled.get("train_step")
  train = (step.peak if step and not step.error else 0) + lag * built.batch_bytes
  state = (step.memory.get("argument", 0) - built.batch_bytes) if step and not step.error else 0
  copies = 2 if lag else 1
  own = {n: max(c.peak - built.rollout_param_bytes, 0) for n, c in compiled.items()
         if c.side == "rollout" and n != "publish" and not c.error}
  largest = max(own, key=own.get) if own else None
  rollout = copies * built.rollout_param_bytes + (own[largest] if largest else 0)
  if not colocated:
    return {"train": train, "rollout": rollout, "total": max(train, rollout),
            "how": "disaggregated: each side on its own chips", "largest_rollout": largest}
  if lag:
    return {"train": train, "rollout": rollout, "total": train + rollout,
            "how": f"rollout.lag {lag}: train step and sampler at once", "largest_rollout": largest}
  alone = state + rollout
  with_copy = train + built.rollout_param_bytes
  return {"train": with_copy, "rollout": alone, "total": max(alone, with_copy),
          "how": "rollout.lag 0: train step and sampler one at a time",
          "largest_rollout": largest}


def train_flops(built, cfg) -> float:
  """The RL step's model FLOPs (the MFU numerator): 6 x the trained matmul parameters x the
  tokens of the batch (forward and backward; LoRA still backpropagates through the base, so 6x
  the base's), plus the attention's 12 x layers x heads x head dim x query-key pairs (causal:
  half of T^2 per row of T tokens), plus the recompute before the update: 2 x params x tokens
  for the trainer's log-probs where the loss needs them (not counted: remat's recomputation,
  which is overhead, not model FLOPs)."""
  m, r = built.model_cfg, cfg.rollout
  rows = r.num_prompts * r.group_size
  t = r.max_prompt_len + (r.max_total_tokens or r.max_new_tokens)
  active = _matmul_params(m)
  tokens = rows * t
  attention = 12 * m.num_layers * m.num_heads * m.head_dim * rows * t * t / 2
  return 6 * active * tokens + attention


def _matmul_params(m) -> float:
  """Parameters each token multiplies by: attention and MLP projections (the k active experts'
  for a mixture of experts) and the unembedding."""
  attn = m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + \
      m.num_heads * m.head_dim * m.d_model
  width = m.num_experts_per_tok * m.moe_intermediate_size if m.num_experts else m.mlp_dim
  return m.num_layers * (attn + 3 * m.d_model * width) + m.vocab_size * m.d_model


def estimates(compiled: dict[str, Compiled], built, cfg, target) -> dict:
  """The step time and decode rate a plan can say without running, each labelled:

  - `train_step_s`: the train step at the chip's bf16 peak, the model FLOPs per chip
    (`train_flops` / chips) over `peak_flops`: a lower bound (MFU 100%). XLA:TPU's own
    `optimal_seconds` is not used for it: its cost analysis counts each loop body once (the
    layer scan, the micro-batch scan), so for a scanned step it is no step time (it came out
    negative for the 0.5B recipe); it is kept as `train_compiler_s` where positive.
  - `decode_tokens_per_s`: the memory roofline of one decode step: every chip reads its share of
    the published params and the whole KV cache once per token (an upper bound on the bytes:
    slots not yet filled are skipped by the decode kernels), at the chip's bandwidth; rows over
    the rollout mesh's 'data' axis decode in parallel.
  - `decode_compiler_tokens_per_s`: XLA:TPU's `optimal_seconds` for the decode program, which
    counts its loop body (one token for every row) once: the rows over that time."""
  out: dict = {"source": "estimated (compiler and roofline), not measured"}
  step = compiled.get("train_step")
  flops = train_flops(built, cfg)
  out["train_model_flops"] = flops
  out["train_step_s"] = flops / built.mesh.size / target.peak_flops
  out["train_compiler_s"] = step.optimal_seconds if step and (step.optimal_seconds or 0) > 0 \
      else None
  r = cfg.rollout
  rows = r.num_prompts * r.group_size
  decode = compiled.get("decode")
  kv = 0
  if decode and not decode.error:
    kv = max(decode.memory.get("argument", 0) - built.rollout_param_bytes, 0)
  per_step = (built.rollout_param_bytes + kv) / target.hbm_bandwidth
  out["decode_step_s"] = per_step
  out["decode_tokens_per_s"] = rows / per_step if per_step else None
  compiler = decode.optimal_seconds if decode and not decode.error else None
  out["decode_compiler_step_s"] = compiler if compiler and compiler > 0 else None
  out["decode_compiler_tokens_per_s"] = rows / compiler if compiler and compiler > 0 else None
  return out


# Which keys lower each part of the peak, most effective first.
ADVICE = {
    "train_step": ["train.microbatch_tokens", "train.num_microbatches", "model.remat",
                   "mesh.fsdp"],
    "state": ["mesh.fsdp", "model.param_dtype", "model.lora.rank"],
    "decode": ["rollout.num_prompts", "rollout.kv_cache_dtype", "mesh.tensor"],
    "prefill": ["rollout.num_prompts", "rollout.max_prompt_len", "mesh.tensor"],
    "val_decode": ["val.batch_size", "val.samples_per_prompt"],
    "val_prefill": ["val.batch_size"],
    "lag": ["rollout.lag"],
}


def verdict(compiled: dict[str, Compiled], peak: dict, target, cfg) -> tuple[bool, list[str]]:
  """(fits, lines): one `jaxrl:` line per program over the chip's usable memory and one for the
  peak of what is live at once, each saying by how much and which keys lower it; when it fits,
  one line with the headroom."""
  limit = target.usable_bytes
  lines = []
  g = lambda n: f"{n / GIB:.2f} GiB"
  for c in compiled.values():
    if c.error:
      lines.append(f"jaxrl: {c.name}: the {target.platform.upper()} compiler refused it: "
                   f"{c.error}")
    elif c.peak > limit:
      keys = ", ".join(PREFIX + k for k in ADVICE.get(c.name, ADVICE["train_step"]))
      lines.append(f"jaxrl: {c.name} needs {g(c.peak)} per chip, {g(c.peak - limit)} over "
                   f"{target.name}'s {g(limit)} usable; lower it with {keys}")
  fits = not lines and peak["total"] <= limit
  if not lines and not fits:
    big = "train_step" if peak["train"] >= peak["rollout"] else (peak["largest_rollout"] or "decode")
    keys = [*ADVICE.get(big, ADVICE["train_step"])]
    if cfg.rollout.lag:
      keys += ADVICE["lag"]
    lines.append(f"jaxrl: the run needs {g(peak['total'])} per chip at once ({peak['how']}), "
                 f"{g(peak['total'] - limit)} over {target.name}'s {g(limit)} usable; lower it "
                 f"with {', '.join(PREFIX + k for k in keys)}")
  if fits:
    lines.append(f"fits: {g(peak['total'])} of {g(limit)} usable per chip "
                 f"({1 - peak['total'] / limit:.0%} headroom; {target.reserve_note})")
  return fits, lines
