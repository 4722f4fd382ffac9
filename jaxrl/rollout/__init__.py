"""Rollout generation: the pure static sampler (`sampler`), the continuous-batching slot engine
(`engine`) and the multi-turn episode loop over environments (`multi_turn`)."""
