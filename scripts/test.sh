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
.venv/bin/python -m pytest -q -m "not slow" --durations=15 "$@"
