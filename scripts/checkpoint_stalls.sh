#!/usr/bin/env bash
# What a checkpoint costs training, synchronous against overlapped: glm-base SFT on 2 ranks, bf16, ZeRO-2, every
# framework, a save every 2 of 6 steps (3 saves), checkpoint.async=false,true. Records in
# results/sweeps/checkpoint-stalls; the report's "Checkpoint stalls" table compares the stalls per save.
# About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
.venv/bin/python -m bench.run -m sweep_name=checkpoint-stalls model=glm-base launcher.nproc=2 stage=sft \
  framework=dschat,colossalai,trlx precision=bf16 zero=2 lora=0 batch=2 prompt_len=128 answer_len=128 steps=6 \
  warmup_steps=1 checkpoint.every=2 checkpoint.async=false,true launcher.timeout_s=3600
.venv/bin/python -m bench.report results/sweeps/checkpoint-stalls
