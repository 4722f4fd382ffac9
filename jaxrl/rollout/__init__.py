"""Rollout generation: the pure static sampler (`sampler`), the continuous-batching slot engine
(`engine`, its host-side scheduling in `scheduler`), the `Sampler` protocol and a run's samplers
built from its config (`samplers`), and the multi-turn episode loop over environments
(`multi_turn`)."""
