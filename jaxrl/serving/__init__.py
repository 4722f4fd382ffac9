"""Serving jaxrl models: an OpenAI-compatible HTTP server, agents as a task, and other stacks.

`jaxrl.serving.openai` is the OpenAI-compatible server (the `serve` extra: starlette, uvicorn),
`jaxrl.serving.agents` the agent task's loop over it (see docs/serving.md).

`jaxrl.serving.jetstream_engine` adapts the slot engine (`jaxrl.rollout.engine`) to JetStream's
Engine API (the `jetstream` extra; install with `scripts/install_jetstream.sh`). Nothing is
imported here: importing `jaxrl.serving` must work without JetStream installed, and importing
the adapter installs the compatibility shims JetStream 0.2.2 needs (documented there), which
should happen only when it is asked for.
"""
