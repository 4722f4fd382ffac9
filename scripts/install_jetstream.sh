#!/usr/bin/env bash
# Installs the `jetstream` extra into the active Python environment: jaxrl's JetStream adapter
# (jaxrl/serving/jetstream_engine.py), scripts/serve.py and tests/test_jetstream.py need it.
#
#   scripts/install_jetstream.sh            # after `pip install -e ".[dev]"` (or any jaxrl install)
#
# Why not a plain `pip install google-jetstream`: google-jetstream 0.2.2 (the newest release)
# requires seqio, which requires tensorflow-text and with it TensorFlow 2.21: ~2.4 GB more and a
# 6 s import, all for SentencePiece tokenizers that the adapter never builds. So the package is
# installed without its declared dependencies (`--no-deps`), and the `jetstream` extra lists the
# ones it really imports (grpcio, prometheus-client, shortuuid, tiktoken); jax, flax, numpy and
# absl-py come with jaxrl itself. seqio is replaced by a stub that the adapter module registers
# when seqio is absent, and the adapter shims the one jax API 0.2.2 uses that jax 0.6 removed
# (`jax.tree_map`); both are documented in jaxrl/serving/jetstream_engine.py. The extra cannot
# express `--no-deps`, hence this script. `pip check` will name the skipped requirements
# (seqio, blobfile, portpicker, parameterized, coverage: test and cloud-storage helpers); that is
# expected.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet -e ".[jetstream]"
python -m pip install --quiet --no-deps "google-jetstream==0.2.2"
python - <<'PY'
import jaxrl.serving.jetstream_engine as js
import jetstream.core.server_lib  # noqa: F401  (the gRPC server imports too)
print("jetstream adapter OK:", js.JaxrlJetStreamEngine.__name__)
PY
