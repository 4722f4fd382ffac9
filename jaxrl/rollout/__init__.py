"""Rollout generation: the pure sampler (and, later, the engine and worker thread)."""
