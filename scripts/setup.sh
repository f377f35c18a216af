#!/usr/bin/env bash
# Set up a virtual environment in .venv with swarmpipe (editable) and its dev tools.
# torch is pinned here, and only here, to the CPU build these machines carry;
# the package itself asks for a range so GPU users keep their own build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "swarmpipe needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import swarmpipe, torch, grpc, aiomqtt' || { echo "setup failed: swarmpipe does not import" >&2; exit 1; }
echo "swarmpipe is set up in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
