"""Rollout generation: the pure static sampler (`static_sampler`), the continuous-batching slot
engine (`engine`: its jitted programs in `decode_programs`, the records they share in
`slot_state`, its host-side scheduling in `scheduler`), the `Sampler` protocol and a run's
samplers built from its config (`samplers`), the multi-turn episode loop over environments
(`multi_turn`), and the samplers' own precision, `rollout.dtype` (`precision`: the sampler's
model config and the cast of each published params version)."""
