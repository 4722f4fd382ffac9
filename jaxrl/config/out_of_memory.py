"""XLA's out-of-memory error as a user reads it: whether an error (or what caused it) is one, and
the one `jaxrl: out of memory on <device>: ...` line with the memory plan's numbers and the keys
that lower them (`jaxrl.config.memory`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.config.memory import MemoryPlan, advice, summary
from jaxrl.config.schema import PREFIX


def _out_of_memory_cause(error: BaseException | None) -> BaseException | None:
  """The innermost error of `error`'s chain (causes, contexts) that is XLA's out-of-memory: a
  runtime error whose message holds RESOURCE_EXHAUSTED or "out of memory"; None if none is."""
  found, seen = None, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    text = str(error)
    if isinstance(error, RuntimeError) and ("RESOURCE_EXHAUSTED" in text or
                                            "out of memory" in text.lower()):
      found = error
    error = error.__cause__ or error.__context__
  return found


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` (or what caused it: the rollout thread's failure wraps it) is XLA's
  out-of-memory."""
  return _out_of_memory_cause(error) is not None


def out_of_memory_message(error: BaseException, plan: MemoryPlan | None, device: str,
                          good: Mapping[str, Any] | None = None) -> str:
  """The one `jaxrl: out of memory on <device>: ...` line: XLA's first line, the plan's numbers
  and the keys that lower them."""
  error = _out_of_memory_cause(error) or error
  first = next((line.strip() for line in str(error).splitlines() if line.strip()),
               type(error).__name__)[:200]
  if plan is None:
    return (f"jaxrl: out of memory on {device}: {first}; lower {PREFIX}train.num_microbatches, "
            f"{PREFIX}model.remat, {PREFIX}rollout.num_prompts or {PREFIX}rollout.lag")
  lower = ", ".join(PREFIX + k for k in advice(plan, good))
  return (f"jaxrl: out of memory on {device}: {first}; the memory plan needs {summary(plan)}; "
          f"lower it with {lower}")
