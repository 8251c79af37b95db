#!/usr/bin/env bash
# Sets up (first run only) and runs the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the long convergence tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/python -m pytest -q --durations=10 "$@"
