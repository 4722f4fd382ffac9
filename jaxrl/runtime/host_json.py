"""JSON-safe host state of a checkpoint: what its `host` item holds must come back from JSON
unchanged (numbers exact, numpy RNG states whole), so a resumed run sees exactly what it saved."""

from __future__ import annotations

import numpy as np


def numpy_rng_state(rng: np.random.Generator) -> dict:
  """JSON-safe state of a PCG64 Generator. The 128-bit integers are decimal strings: JSON
  readers that parse numbers as doubles would silently round them."""
  s = rng.bit_generator.state
  if s["bit_generator"] != "PCG64":
    raise ValueError(f"only PCG64 generators are checkpointed, got {s['bit_generator']}")
  return {"bit_generator": "PCG64", "state": str(s["state"]["state"]),
          "inc": str(s["state"]["inc"]), "has_uint32": int(s["has_uint32"]),
          "uinteger": int(s["uinteger"])}


def restore_numpy_rng(state: dict) -> np.random.Generator:
  """The Generator `numpy_rng_state` described: its next draws are the original's next draws
  (including the buffered half of a 64-bit word used by 32-bit draws)."""
  if state.get("bit_generator") != "PCG64":
    raise ValueError(f"not a PCG64 state: {state.get('bit_generator')!r}")
  bits = np.random.PCG64()
  bits.state = {"bit_generator": "PCG64",
                "state": {"state": int(state["state"]), "inc": int(state["inc"])},
                "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}
  return np.random.Generator(bits)


def check_json(x, where: str) -> None:
  """Rejects what JSON would change on the way back (tuples -> lists, int keys -> str keys) or
  cannot hold (numpy scalars, objects), so a resumed run sees exactly the host state it saved.
  Non-finite floats pass: Python's json writes and reads them (NaN, Infinity)."""
  if x is None or isinstance(x, (bool, int, float, str)):
    return
  if isinstance(x, list):
    for i, v in enumerate(x):
      check_json(v, f"{where}[{i}]")
    return
  if isinstance(x, dict):
    for k, v in x.items():
      if not isinstance(k, str):
        raise ValueError(f"{where} has key {k!r} of type {type(k).__name__}; JSON keys are str")
      check_json(v, f"{where}[{k!r}]")
    return
  raise ValueError(f"{where} is a {type(x).__name__}, which does not round-trip through JSON "
                   "(use lists, dicts with str keys, str, int, float, bool, None)")


def json_num(x):
  """Numbers for a checkpoint's JSON: floats as repr strings (exact, NaN-safe), ints as is."""
  return repr(float(x)) if isinstance(x, (float, np.floating)) else int(x)


def from_json_num(x):
  """The number `json_num` wrote."""
  return float(x) if isinstance(x, str) else x
