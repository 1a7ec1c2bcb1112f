#!/usr/bin/env bash
# The Llama-shaped CPU rung of the memory model: llama-base (124.7 M parameters; RMSNorm, SwiGLU, rotary
# positions, an untied head) on 2 ranks, 128 prompt + 128 answer tokens, 4 steps with 1 warm-up step, seed 1:
# SFT, RM and PPO of DS-Chat, ColossalChat and trlx (the frameworks with a memory model) in each of the
# calibration's regimes: full fine-tuning at ZeRO-2, LoRA 64 at ZeRO-2 and full fine-tuning at ZeRO-3, each with
# batch 2 and with batch 4 (two configurations of a regime, so leaving one out leaves the other to fit on, and a
# pair the calibration's batch shares are fitted on; coati's Gemini needs CUDA: its ZeRO-3 is `unsupported` in
# seconds). glibc's mmap threshold is fixed at 4 MiB (memory_mmap_threshold, docs/performance.md "The allocator
# setting"): the host peaks then follow the live tensors instead of the threshold glibc raises as it frees, which
# made trlx's ZeRO-3 PPO peaks fall from batch 2 to 4. Run time: 1.75 hours at 44980ef06ab6 under glibc's own
# threshold (trlx's PPO 56 minutes of it); the fixed threshold makes steps 13-30 % slower.
# The runs come from a clean git worktree of one commit, on one host type (scripts/curated_tree.sh): COMMIT=<sha>
# runs the rung at that commit whatever is checked out (default HEAD, which must then be clean), so a rung that
# spans sessions finishes at the commit it began at while the branch moves on. Re-running at the same commit
# resumes: finished cells are kept, and after every multirun the records are copied to
# results/pending/llama-base-<commit>/ (kept by git, with host-llama-base-<commit>.log, the host of each
# session) so that a rung spanning sessions or machines resumes from them (a stopped session copies the runs it
# finished too: the resumed rung skips what finished and runs the rest).
# When every cell is done they become results/examples/llama-base (hosts.log and the report beside them), and
# the accuracy is printed: the planner's physics with each framework's calibration, fitted on the glm-base
# records and these, every configuration predicted by a fit that left it out (the stored calibration's own fit,
# docs/planner.md):
#   python -m bench.plan.calibrate results/examples/glm-base results/examples/glm-base-amx \
#     results/examples/llama-base --select 'model.name=[glm-base,llama-base]' --select seed=1 --dry-run
#
# `bash scripts/llama_rung.sh --dry-run` prints every cell, each checked by `bench.run --dry-run`; nothing runs.
set -euo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
cd "${SWEEP_TREE:-$scripts/..}"
export OMP_NUM_THREADS=1
here=$(pwd)
python=${PYTHON:-$here/.venv/bin/python}
SCRIPT=llama_rung.sh
# shellcheck source=scripts/curated_tree.sh
source "$scripts/curated_tree.sh"
dry=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    *) echo "llama_rung.sh: unknown argument $arg; allowed: --dry-run (settings are environment variables:" \
         "COMMIT, PYTHON, NEW_HOST)" >&2; exit 2 ;;
  esac
done
full=$(git rev-parse --verify --quiet "${COMMIT:-HEAD}^{commit}") || {
  echo "llama_rung.sh: COMMIT=${COMMIT:-HEAD} is not a commit of this repository" >&2; exit 2; }
commit=${full:0:12}
name=llama-base-$commit
dir=results/sweeps/$name
cells=(
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=0 batch=2"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=0 batch=4"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=3 lora=0 batch=2"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=3 lora=0 batch=4"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=64 batch=2"
  "framework=dschat,colossalai,trlx stage=sft,rm,ppo zero=2 lora=64 batch=4"
)
common=(model=llama-base launcher.nproc=2 precision=bf16 prompt_len=128 answer_len=128 steps=4 warmup_steps=1
        stage_steps.rm=5 seed=1 memory_mmap_threshold=4194304 launcher.timeout_s=3600 sweep_name="$name")
if [ "$dry" = 1 ]; then
  for cell in "${cells[@]}"; do
    # shellcheck disable=SC2086 # each cell is a list of overrides
    printf '%q ' -m "${common[@]}" $cell
    echo
  done | "$python" -m bench.run.dry_run
  exit
fi
[ -n "${CURATED_ROOT:-}" ] || curated_worktree scripts/llama_rung.sh "$@"
curated_worktree_is_clean
curated=$CURATED_ROOT  # the calling checkout's results/: pending/ and examples/ live there
pending=$curated/pending/$name
count_records() { { find "$dir" -name record.json 2>/dev/null || true; } | wc -l; }
host_guard "$curated/pending/host-$name.log" "rung: llama-base" count_records
keep_records() { mkdir -p "$pending" && (cd "$dir" && find . -name record.json -exec cp --parents {} "$pending/" \;); }
trap 'keep_records; log_session' EXIT
mkdir -p "$dir"
if [ -d "$pending" ]; then  # resume from the records a session before this one kept
  (cd "$pending" && find . -name record.json -exec cp -n --parents {} "$here/$dir/" \;)
fi
for cell in "${cells[@]}"; do
  # shellcheck disable=SC2086
  "$python" -m bench.run -m "${common[@]}" $cell
  find "$dir" -mindepth 3 -maxdepth 3 -type d \( -name checkpoint -o -name checkpoints \) -prune -exec rm -rf {} +
  keep_records
done
example=$curated/examples/llama-base
rm -rf "$example" && mkdir -p "$example"
(cd "$dir" && find . -name record.json -exec cp --parents {} "$example/" \;)
rm -rf "$pending"
trap - EXIT && log_session
mv "$host_log" "$example/hosts.log"
(cd "$curated/.." && "$python" -m bench.report "$example" --out "$example/report")
# the accuracy with the calling checkout's code (the current physics), not the measured commit's
# (refused while the glm-base examples were measured under another floor rule or allocator setting: measure them
# again with scripts/glm_sweep.sh at this commit before committing either rung)
cd "$curated/.." && "$python" -m bench.plan.calibrate results/examples/glm-base results/examples/glm-base-amx \
  results/examples/llama-base --select 'model.name=[glm-base,llama-base]' --select seed=1 \
  --select memory_mmap_threshold=4194304 --dry-run
