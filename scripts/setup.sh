#!/usr/bin/env bash
# Sets up .venv with everything rlhf-bench needs on a fresh machine. Safe to re-run.
#   TORCH_SPEC   pip requirement for torch (default torch==2.13.0, the CPU build; on a GPU cluster
#                pass the CUDA build you use, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index)
#   PYTHON       interpreter that creates the venv (default python3, >= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."

# DeepSpeed JIT-compiles its C++ ops (shm_comm on every CPU init, FusedAdam, CPUAdam): g++ is required.
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "setup: g++ is required (DeepSpeed compiles its ops at first use); install it and re-run" >&2
    exit 1
  fi
fi

# pip's exit status is kept; only the noise about this machine's missing local indexes is dropped.
pip_install() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip_install --upgrade pip
# torch first and alone, so that no other requirement can pull a multi-GB CUDA build of it.
pip_install "${TORCH_SPEC:-torch==2.13.0}"
pip_install -e ".[dev]"
.venv/bin/python -c "import torch, deepspeed, transformers; print('setup: torch', torch.__version__, \
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>/dev/null
