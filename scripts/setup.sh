#!/usr/bin/env bash
# Set up a virtual environment in .venv with swarmpipe (editable) and its dev tools.
# torch is pinned here, and only here, to the CPU build these machines carry;
# the package itself asks for a range so GPU users keep their own build.
#
# It prints a line per step and what pip reports with -q: warnings and errors. A step that
# fails shows pip's error and stops the script with exit code 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "swarmpipe needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi

pip_install() {
  # pip warns about every configured find-links/index location that does not exist on this
  # machine; that is the machine's configuration, not this install's concern. The exit
  # status is pip's (pipefail), whatever grep keeps.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v '^WARNING: Location' || true; }
}

failed() {
  echo "setup failed while $1; pip's error is above" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PYTHON" -m venv .venv
fi
echo "setup: upgrading pip"
pip_install --upgrade pip || failed "upgrading pip"
echo "setup: installing torch 2.13.0"
pip_install "torch==2.13.0" || failed "installing torch"
echo "setup: installing swarmpipe (editable) and its dev tools"
# setuptools announces every editable install of a layout other than src/ with a warning box
# ("Editable installation ... folders in your working directory with the same name as your
# package"), and pip shows it: an InformationOnly notice, not a problem (pypa/packaging-
# problems#558), and no setting avoids it for a package at the repository root (strict
# mode prints its own). Ignore warnings whose message starts with exactly that, and only
# in this step; every other warning and error still shows.
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[dev]" \
  || failed "installing swarmpipe"
.venv/bin/python -c 'import swarmpipe, torch, grpc, aiomqtt' || { echo "setup failed: swarmpipe does not import" >&2; exit 1; }
echo "swarmpipe is set up in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
