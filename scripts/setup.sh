#!/usr/bin/env bash
# Sets up .venv with everything rlhf-bench needs on a fresh machine. Safe to re-run.
#   TORCH_SPEC   pip requirement for torch (default torch==2.13.0, the CPU build; on a GPU cluster
#                pass the CUDA build you use, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index)
#   PYTHON       interpreter that creates the venv (default python3, >= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

# DeepSpeed JIT-compiles its C++ ops (shm_comm on every CPU init, FusedAdam, CPUAdam), built below into
# .venv/torch_extensions (scripts/build_ops.py): g++ is required.
# Debian's chromium renders the HTML report in the report test (SKIP_CHROMIUM=1 leaves it out; that test
# is then skipped). Debian's slurm-wlm daemons and munge are the real SLURM the SLURM test starts with
# scripts/slurm_local.sh (SKIP_SLURM=1 leaves them out; that test is then skipped, saying why).
apt_missing=()
command -v g++ >/dev/null 2>&1 || apt_missing+=(g++)
[ -n "${SKIP_CHROMIUM:-}" ] || [ -x /usr/bin/chromium ] || apt_missing+=(chromium)
if [ -z "${SKIP_SLURM:-}" ]; then
  for pair in slurmctld:slurmctld slurmd:slurmd srun:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || apt_missing+=("${pair#*:}")
  done
fi
if [ ${#apt_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_missing[@]}" >/dev/null
  elif ! command -v g++ >/dev/null 2>&1; then
    echo "setup: g++ is required (DeepSpeed compiles its ops at first use); install it and re-run" >&2
    exit 1
  else
    echo "setup: no root for apt-get; not installed: ${apt_missing[*]} (the HTML render and SLURM tests are skipped" \
      "where theirs are missing)" >&2
  fi
fi

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
# Everything pip prints goes to .venv/setup.log; the terminal gets what needs a reader (scripts/pip_quiet.py:
# not the resolver's report about colossalai's unused requirements, which is summed up in one line at the end).
log=.venv/setup.log
: > "$log"
pip_install() { .venv/bin/python -m pip install -q "$@" 2>&1 | .venv/bin/python scripts/pip_quiet.py "$log"; }

pip_install --upgrade pip
# torch first and alone, so that no other requirement can pull a multi-GB CUDA build of it.
echo "setup: torch (${TORCH_SPEC:-torch==2.13.0})"
pip_install "${TORCH_SPEC:-torch==2.13.0}"
# The one package installed outside pip's resolver: colossalai 0.5.0 declares torch<=2.5.1, ray, diffusers,
# fabric, ... but imports only the modules of the project's `colossalai` extra on the paths the adapter uses, so
# it goes in first without dependencies and the install below brings that extra (pip's report about the rest,
# which it then prints, is kept off the terminal by pip_quiet.py). Pinned because the adapter's CPU
# compatibility layer patches 0.5.0's internals. Its transformers==4.51.3 and peft<=0.13.2 pins are the
# project's own (pyproject.toml).
echo "setup: colossalai 0.5.0 (without the requirements it declares, on purpose)"
pip_install --no-deps "colossalai==0.5.0"
echo "setup: rlhf-bench, its pinned engines and the modules colossalai imports (pyproject.toml)"
torch_now=$(.venv/bin/python -c "from importlib.metadata import version; print(version('torch').split('+')[0])")
constraints=$(mktemp)
echo "torch==$torch_now" > "$constraints"  # the torch installed above stays: no requirement may replace it
pip_install -c "$constraints" -e ".[dev,colossalai]"
rm -f "$constraints"
.venv/bin/python scripts/pip_quiet.py --summary "$log"
# The engines must import; what they print on import (DeepSpeed's accelerator notice) belongs in the log.
if ! .venv/bin/python -c "import torch, deepspeed, transformers, colossalai, trl" >> "$log" 2>&1; then
  echo "setup: importing the engines failed; the end of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
# The engines' JIT ops, built once here rather than inside the first run or test that loads them (each takes 1-2
# minutes); an op that cannot build on this machine is reported and left to build at first use.
.venv/bin/python scripts/build_ops.py
.venv/bin/python - "$(( $(date +%s) - started ))" <<'EOF'
import sys
from importlib.metadata import version

names = ("torch", "deepspeed", "colossalai", "transformers", "trl")
print(f"setup: ready in {sys.argv[1]} s:", ", ".join(f"{name} {version(name)}" for name in names))
EOF
