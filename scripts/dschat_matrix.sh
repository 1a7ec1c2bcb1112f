#!/usr/bin/env bash
# The DeepSpeed-Chat acceptance matrix as one Hydra multirun: every stage (and the pipeline) with
# ZeRO 0/2/3, fp32/bf16/fp16, LoRA off/on, a few steps each. About 30-40 minutes on 2 CPU cores.
# Records land in results/sweeps/<time>/<overrides>/record.json. Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
.venv/bin/python -m bench.run -m framework=dschat stage=sft,rm,ppo,pipeline zero=0,2,3 \
  precision=fp32,bf16,fp16 lora=0,8 steps=4 warmup_steps=1 "$@"
