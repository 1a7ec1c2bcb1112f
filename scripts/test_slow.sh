#!/usr/bin/env bash
# The slow tier, not run by CI: learning checks (30-step PPO runs whose reward must rise, per framework).
# The full engine matrices are scripts/dschat_matrix.sh, colossalai_matrix.sh and trlx_matrix.sh.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q -m slow "$@"
