#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh), then runs the linter and the CI tiers of the test suite: the unit
# tier and the engine tier (`-m "not slow"`); the slow tier is scripts/test_slow.sh.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k spec`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -m "not slow" --durations=15 "$@"
