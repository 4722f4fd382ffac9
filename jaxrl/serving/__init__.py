"""Serving jaxrl models through other stacks.

`jaxrl.serving.jetstream_engine` adapts the slot engine (`jaxrl.rollout.engine`) to JetStream's
Engine API (the `jetstream` extra; install with `scripts/install_jetstream.sh`). Nothing is
imported here: importing `jaxrl.serving` must work without JetStream installed, and importing
the adapter installs the compatibility shims JetStream 0.2.2 needs (documented there), which
should happen only when it is asked for.
"""
