#!/usr/bin/env bash
# Installs procpipe with its test dependencies (PyTorch's CPU build and Keras 3 included,
# for the adapter tests) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 resolves to the local CPU build on the project's machines; never pull CUDA wheels.
python -m pip install --quiet "torch==2.13.0" -e ".[test]"
python -m pytest -q
