#!/usr/bin/env bash
# Sets up (first run only) and runs the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the long convergence tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The HTML report is tested in a real headless browser (Debian's Chromium).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${TEST_CHROMIUM:-}" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium for the HTML report test (apt-get)..."
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium not found; the HTML browser test will fail until you" \
         "install it (apt-get install chromium) or set TEST_CHROMIUM." >&2
  fi
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# One pytest worker per core (pytest-xdist), each test file whole in one worker
# (its tests keep their order and share their module's caches); a single test
# runs in one process with TEST_WORKERS=0. (Not TFAMP_*: tfamp refuses unknown
# TFAMP_ variables, and the tests' TFAMP_ENABLE subprocesses inherit the environment.)
exec .venv/bin/python -m pytest -q --durations=25 -n "${TEST_WORKERS:-auto}" \
  --dist loadfile "$@"
