#!/usr/bin/env bash
# The CPU demo sweep and its report: every framework through PPO at ZeRO 0/2 x LoRA off/16 (bf16), a batch
# sweep at ZeRO-2, fp16 SFT at a learning rate that must blow up (fails on purpose: the stability table), DS-Chat
# fp16 SFT at ZeRO-0 as upstream runs it and with the opt-in fix (the DeepSpeed 0.19.8 loss-scaling defect in
# the stability table), and colossalai ZeRO-3 (Gemini needs CUDA: unsupported on the CPU). 7.6 minutes on 2 CPU
# cores (measured from an empty sweep folder, with the prerequisite reward models trained on the way).
# The tiny model's numbers are runtime noise (its model state is 10-26 MiB against a 350 MiB runtime): this sweep
# shows what the harness records and reports, in minutes; scripts/glm_sweep.sh measures (glm-base, 2 ranks, repeats).
# Runs and the report land in results/sweeps/cpu-demo (re-running resumes; force=true re-runs).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
sweep() { .venv/bin/python -m bench.run -m sweep_name=cpu-demo warmup_steps=1 "$@"; }
sweep framework=dschat,colossalai,trlx stage=ppo precision=bf16 zero=0,2 lora=0,16 batch=4 steps=6
sweep framework=dschat,colossalai,trlx stage=ppo precision=bf16 zero=2 lora=0 batch=2,8 steps=6
sweep framework=dschat,colossalai,trlx stage=sft precision=fp16 zero=2 lr=1000 steps=8 "tags=[forced-failure]"
sweep framework=dschat stage=sft precision=fp16 zero=0 steps=8 framework.fix_fp16_zero0_loss_scale=false,true
sweep framework=colossalai stage=ppo precision=bf16 zero=3 steps=6
.venv/bin/python -m bench.report results/sweeps/cpu-demo
