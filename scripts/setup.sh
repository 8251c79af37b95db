#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs tfamp with its test extras into it.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "tfamp needs Python 3.11 or newer; '$PYTHON' is $("$PYTHON" --version 2>&1)." >&2
  echo "Set PYTHON=/path/to/python3.11 and run again." >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
# Not editable: the start-up hook (tfamp_startup.pth) must sit in site-packages.
.venv/bin/python -m pip install --quiet --disable-pip-version-check ".[test]"
