#!/usr/bin/env bash
# Sets up (first run only) and runs the tfamp demo. Extra arguments go to `tfamp demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tfamp demo "$@"
