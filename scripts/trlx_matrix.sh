#!/usr/bin/env bash
# The Trlx acceptance matrix: SFT -> RM -> PPO (stage=pipeline) on plain accelerate (zero=0) and accelerate's
# DeepSpeed plugin (zero=2, 3) x fp32/bf16/fp16 x LoRA off/on (LoRA uses the peft reference, no LoRA the
# hydra one), then PPO with the full-copy reference on each engine. About 15 minutes on 2 CPU cores.
# Records land in results/sweeps/<time>/<overrides>/record.json. Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
run() { .venv/bin/python -m bench.run -m framework=trlx steps=4 warmup_steps=1 "$@"; }
run stage=pipeline zero=0,2,3 precision=fp32,bf16,fp16 lora=0,8 "${@}"
run stage=ppo zero=0,2,3 framework.reference=full "${@}"
