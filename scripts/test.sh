#!/usr/bin/env bash
# Set up everything and run every check: lint, types, generated-code drift, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The real-broker tests use Debian's mosquitto; install it where we may.
if ! command -v mosquitto >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing mosquitto for the real-broker tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients) >/dev/null
  else
    echo "mosquitto is not installed: the real-broker tests will be skipped" >&2
  fi
fi
# mypy resolves `swarmpipe` through this link, since the repository root is the package.
mkdir -p .build && ln -sfn .. .build/swarmpipe
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy -p swarmpipe
echo "== generated protobuf code"; .venv/bin/python scripts/gen_protos.py --check
# Two workers (PYTEST_WORKERS=3 is faster on two cores, the long scenarios mostly waiting on
# slow links, but starves the tests that measure a link; docs/design.md, Tests; =0: one process). loadfile keeps each module on one worker, so a
# swarm or run that a module's tests share starts once; files go out in collection order
# (tests/conftest.py puts the modules with slow tests first), not reordered by size.
echo "== pytest"
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
