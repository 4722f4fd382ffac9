"""jaxrl: functional, asynchronous RL post-training for language models in JAX."""

__version__ = "0.1.0"
