#!/usr/bin/env bash
# The claims sweep: the matched pairs that decide the published claims whose knob the harness turns
# (bench/report/claims.py names each claim's knob and pairs). glm-base on 2 ranks, 128 prompt + 128 answer
# tokens, as the CPU benchmark sweep (scripts/glm_sweep.sh); each pair differs only in the claim's knob.
#
# Blocks:
#   Q  B10's memory, INT8 frozen roles: glm-base PPO at ZeRO-2 bf16, reference and reward in int8 (torchao)
#      against both unquantized, every framework (the record keeps the bytes saved and the log-prob / score
#      deviations)
#   B  the same int8 cells with bitsandbytes instead (quant_library=bitsandbytes): which library's CPU path
#      actually saves memory
#   K  B10's accuracy: the torchao pairs on the tiny model for 120 PPO steps (the reward and KL curves; the
#      claims check judges curves of 100+ steps), 1 rank
#   C  A14, DeepSpeed's all-gather bucket: DS-Chat SFT at glm-base, ZeRO-2 bf16, 2 ranks, allgather_bucket_size
#      5e8 against 5e7 (smaller than a rank's ~62 M-parameter partition, so the gather is split; at 5e8 it is
#      one call), the training phase's time per step
#   N  A13, z-score reward normalisation: reward.normalize=zscore against none, the tiny model for 120 PPO
#      steps, 1 rank, 3 seeds (the steps until the preferred-token share covers 90 % of its rise)
#   L  A15, LoRA practice: the tiny model, SFT and RM for 40 steps, 1 rank, LoRA rank 16, 3 seeds: lora_targets
#      qkv against all (each framework's default alpha), and at qkv lora_alpha 8 (rank / 2) against the default
#      (the quality figures: SFT's final loss, the RM's held-out accuracy; the trainable parameters)
#
# Runs land in results/sweeps/claims (re-running resumes); the report is rebuilt at the end. `BLOCKS=Q` runs
# only those blocks, `SEEDS=1,2` narrows the repeats.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
name=claims
sweep_dir=results/sweeps/$name
blocks=${BLOCKS:-Q K N C L}
seeds=${SEEDS:-1,2,3}
common=(sweep_name=$name launcher.timeout_s=3600)
glm_base=(model=glm-base launcher.nproc=2 prompt_len=128 answer_len=128 batch=2 warmup_steps=1 stage_steps.rm=5)
# one Hydra multirun per call; each run's closing save is deleted (0.4-0.5 GB each at glm-base)
sweep() { .venv/bin/python -m bench.run -m "${common[@]}" "$@"
          find "$sweep_dir" -mindepth 3 -maxdepth 3 -type d \( -name checkpoint -o -name checkpoints \) -prune \
            -exec rm -rf {} +; }
for block in $blocks; do
  case $block in
    Q|B) library=$([ "$block" = Q ] && echo torchao || echo bitsandbytes)
       for quant in none int8; do  # both roles together: one pair per framework
         [ "$block" = B ] && [ "$quant" = none ] && continue  # block Q's unquantized cells
         extra=(); [ "$quant" = int8 ] && extra=(quant_library=$library)
         sweep "${glm_base[@]}" framework=dschat,colossalai,trlx stage=ppo steps=4 precision=bf16 zero=2 lora=0 \
           seed=$seeds reference.quant=$quant reward.quant=$quant "${extra[@]}"
       done ;;
    K) for quant in none int8; do
         extra=(); [ "$quant" = int8 ] && extra=(quant_library=torchao)
         sweep model=tiny launcher.nproc=1 framework=dschat,colossalai,trlx stage=ppo steps=120 precision=bf16 \
           zero=2 lora=0 seed=$seeds reference.quant=$quant reward.quant=$quant "${extra[@]}"
       done ;;
    C) sweep "${glm_base[@]}" framework=dschat stage=sft steps=6 precision=bf16 zero=2 lora=0 seed=$seeds \
         ds.allgather_bucket_size=50000000,500000000 ;;
    N) sweep model=tiny launcher.nproc=1 framework=dschat,colossalai,trlx stage=ppo steps=120 precision=bf16 \
         zero=2 lora=0 seed=$seeds reward.normalize=none,zscore ;;
    L) lora=(model=tiny launcher.nproc=1 framework=dschat,colossalai,trlx stage=sft,rm steps=40 precision=bf16 zero=2
             lora=16 seed=$seeds)
       sweep "${lora[@]}" lora_targets=qkv,all
       sweep "${lora[@]}" lora_targets=qkv lora_alpha=8 ;;
    *) echo "unknown block $block (known: Q B K N C L)" >&2; exit 2 ;;
  esac
done
.venv/bin/python -m bench.report "$sweep_dir"
