"""After warm-up nothing recompiles: prompt and completion lengths vary, shapes do not."""

import jax
import pytest
import numpy as np
from jax._src import dispatch, monitoring

from jaxrl import config as config_lib, parallel
from jaxrl.data import left_pad
from jaxrl.recipes.default import get_config
from jaxrl.run.validation import Evaluator
from jaxrl.run.parts import build_parts
from jaxrl.core.types import TrainBatch


def _small_config():
  c = get_config()
  c.model.d_model, c.model.num_heads, c.model.num_kv_heads = 32, 2, 1
  c.model.head_dim, c.model.mlp_dim = 16, 64
  c.rollout.num_prompts, c.rollout.group_size = 4, 4
  c.rollout.max_new_tokens = 6
  c.task.dev_size = c.task.val_size = 16
  c.val.batch_size = 16
  return c


@pytest.mark.slow
def test_no_recompilation_after_second_step():
  cfg = _small_config()
  parts, params = build_parts(cfg, config_lib.validate(cfg, jax.device_count()))
  from jaxrl.learner.step import StepConfig, build_train_step, make_optimizer
  step_fn, init = build_train_step(parts.graphdef, make_optimizer(1e-3), StepConfig(), parts.mesh,
                                   params)
  events = []
  watched = {dispatch.BACKEND_COMPILE_EVENT, dispatch.JAXPR_TRACE_EVENT}

  def listener(name, secs, **kw):
    if name in watched:
      events.append(name)

  monitoring.register_event_duration_secs_listener(listener)
  try:
    per_step, prompt_lens, completion_lens = _steps(cfg, parts, step_fn, init(params),
                                                    events)
  finally:
    monitoring.unregister_event_duration_listener(listener)

  assert len(prompt_lens) >= 4 and len(completion_lens) >= 3  # lengths really varied
  assert sum(per_step[:5]) > 0  # the listener sees compilations at all
  # Steps 3..20 (step 5 also runs the first evaluation, compiled then).
  later = [n for i, n in enumerate(per_step[2:], start=3) if i != 5]
  assert sum(later) == 0, f"compile/trace events per step: {per_step}"


def _steps(cfg, parts, step_fn, state, events):

  rng = np.random.default_rng(0)
  sample = parts.train_loop().sample_first
  evaluator = Evaluator(parts, asynchronous=False)
  P, G, Lp = cfg.rollout.num_prompts, cfg.rollout.group_size, cfg.rollout.max_prompt_len
  per_step, prompt_lens, completion_lens = [], set(), set()
  for step in range(1, 21):
    start = len(events)
    # Prompts of random real length 1..Lp (left-padded to Lp), random tokens.
    lens = rng.integers(1, Lp + 1, P)
    prompt_lens.update(lens.tolist())
    prompts = [list(rng.integers(2, parts.tok.vocab_size, n)) for n in lens]
    tokens, valid = left_pad(prompts, Lp, parts.tok.pad_id)
    out = sample(state.params, tokens, valid, jax.random.key(step), np.arange(P * G),
                       1.0, 0, 1.0)
    comp, mask, lps = jax.device_get((out.tokens, out.mask, out.logprobs))
    completion_lens.update(mask.sum(1).tolist())
    batch = TrainBatch(np.repeat(tokens, G, 0), np.repeat(valid, G, 0), comp, mask, lps,
                       rng.integers(0, 2, P * G).astype(np.float32),
                       np.repeat(np.arange(P, dtype=np.int32), G), np.ones(P * G, np.float32))
    state, m = step_fn(state, jax.device_put(batch, parallel.batch_sharding(parts.mesh)))
    jax.block_until_ready(m)
    if step % 5 == 0:
      evaluator.evaluate(state.params)  # the multi-turn loop, data plane put and free
    per_step.append(len(events) - start)

  return per_step, prompt_lens, completion_lens
