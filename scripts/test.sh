#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh), then runs the linter, builds the documentation site (strict) and
# runs the CI tiers of the test suite: the unit tier and the engine tier (`-m "not slow"`); the slow tier is scripts/test_slow.sh.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k spec`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check .
# The documentation site: a broken link, a missing page or an unknown anchor fails the build (mkdocs.yml).
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
echo "docs: mkdocs build --strict passed"
# Two pytest workers (pytest-xdist; TEST_WORKERS=0: one process), a test file to a worker so that its module
# fixtures are built once. One process kept the 2 cores 60 % busy (34 CPU minutes in 28.5): an engine test's ranks
# wait on start-up, imports and rendezvous. No CI test times an engine, and the memory figures CI checks are each
# process's own, so a second test beside it changes neither.
.venv/bin/python -m pytest -q -m "not slow" -n "${TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
