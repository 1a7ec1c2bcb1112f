#!/usr/bin/env bash
# The ColossalChat acceptance matrix: SFT -> RM -> PPO (stage=pipeline) on every plugin the common knobs
# reach -- ZeRO 0/1/2 x fp32/bf16 x LoRA off/on on 1 rank -- then 3d with tp=2 and pp=2 on 2 ranks, and
# zero=3 (Gemini; `unsupported` on a CPU). About 15 minutes on 2 CPU cores. Records land in
# results/sweeps/<time>/<overrides>/record.json. Extra arguments are Hydra overrides for every sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
run() { .venv/bin/python -m bench.run -m framework=colossalai steps=4 warmup_steps=1 "$@"; }
run stage=pipeline zero=0,1,2 precision=fp32,bf16 lora=0,8 "${@}"
run stage=pipeline plugin=3d tp=2 launcher.nproc=2 precision=fp32,bf16 "${@}"
run stage=sft plugin=3d pp=2 launcher.nproc=2 precision=fp32,bf16 "${@}"
run stage=sft zero=3 precision=bf16 "${@}"
