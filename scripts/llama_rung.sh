#!/usr/bin/env bash
# The Llama-shaped CPU rung of the memory model: llama-base (124.7 M parameters; RMSNorm, SwiGLU, rotary
# positions, an untied head) on 2 ranks, 128 prompt + 128 answer tokens, 4 steps with 1 warm-up step, seed 1:
# SFT, RM and PPO of DS-Chat, ColossalChat and trlx (the frameworks with a memory model) in each of the
# calibration's regimes: full fine-tuning at ZeRO-2 with batch 2 and with batch 4 (two configurations of one
# regime, so leaving one out leaves the other to fit on), ZeRO-3 (coati's Gemini needs CUDA: `unsupported` in
# seconds) and LoRA 64 at ZeRO-2. About 4 hours of this 2-core machine (trlx's PPO about half of it), from a
# clean tree at one commit (refused otherwise: the records name one commit). Re-running at the same commit
# resumes: finished cells are kept, and after every multirun the records are copied to
# results/pending/llama-base-<commit>/ (kept by git) so that a run spanning sessions or machines resumes from
# them. When every cell is done they become results/examples/llama-base, and the accuracy is printed: the
# planner's physics with each framework's calibration, fitted on the glm-base records and these, every
# configuration predicted by a fit that left it out:
#   python -m bench.plan.calibrate results/examples/glm-base results/examples/llama-base --select seed=1 --dry-run
#
# `bash scripts/llama_rung.sh --dry-run` prints every cell, each checked by `bench.run --dry-run`; nothing runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python=${PYTHON:-$(pwd)/.venv/bin/python}
dry=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    *) echo "llama_rung.sh: unknown argument $arg; allowed: --dry-run" >&2; exit 2 ;;
  esac
done
if [ "$dry" = 0 ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "llama_rung.sh: the tree has uncommitted changes; commit them first: the rung's records name one commit" >&2
  git status --short --untracked-files=no >&2
  exit 2
fi
commit=$(git rev-parse --short=12 HEAD)
name=llama-base-$commit
dir=results/sweeps/$name pending=results/pending/$name
cells=(
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=0 batch=2"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=0 batch=4"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=3 lora=0 batch=2"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=64 batch=2"
)
common=(model=llama-base launcher.nproc=2 precision=bf16 prompt_len=128 answer_len=128 steps=4 warmup_steps=1
        stage_steps.rm=5 seed=1 launcher.timeout_s=3600 sweep_name="$name")
if [ "$dry" = 1 ]; then
  for cell in "${cells[@]}"; do
    # shellcheck disable=SC2086 # each cell is a list of overrides
    printf '%q ' -m "${common[@]}" $cell
    echo
  done | "$python" -m bench.run.dry_run
  exit
fi
mkdir -p "$dir"
if [ -d "$pending" ]; then  # resume from the records a session before this one kept
  (cd "$pending" && find . -name record.json -exec cp -n --parents {} "$OLDPWD/$dir/" \;)
fi
for cell in "${cells[@]}"; do
  # shellcheck disable=SC2086
  "$python" -m bench.run -m "${common[@]}" $cell
  find "$dir" -mindepth 3 -maxdepth 3 -type d \( -name checkpoint -o -name checkpoints \) -prune -exec rm -rf {} +
  mkdir -p "$pending" && (cd "$dir" && find . -name record.json -exec cp --parents {} "$OLDPWD/$pending/" \;)
done
example=results/examples/llama-base
rm -rf "$example" && mkdir -p "$example"
(cd "$dir" && find . -name record.json -exec cp --parents {} "$OLDPWD/$example/" \;)
rm -rf "$pending"
"$python" -m bench.plan.calibrate results/examples/glm-base "$example" --select seed=1 --dry-run
