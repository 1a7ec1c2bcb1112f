#!/usr/bin/env bash
# A CPU rung of the memory model: `bash scripts/cpu_rung.sh MODEL`, MODEL llama-base (124.7 M parameters; RMSNorm,
# SwiGLU, rotary positions, an untied head) or glm-base (GPT-2-shaped with GLM's proportions, 108.9 M), on 2 ranks,
# 128 prompt + 128 answer tokens, 4 steps with 1 warm-up step, seed 1: SFT, RM and PPO of DS-Chat, ColossalChat and
# trlx (the engine frameworks with a memory model; `torch` below runs the reference's rung) in each of the
# calibration's regimes: full fine-tuning at ZeRO-2, LoRA
# 64 at ZeRO-2 and full fine-tuning at ZeRO-3, each with batch 2 and with batch 4 (two configurations of a regime,
# so leaving one out leaves the other to fit on, and a pair the calibration's batch shares are fitted on; coati's
# Gemini needs CUDA: its ZeRO-3 is `unsupported` in seconds). Both rungs have this one design, so the calibration
# fitted on them pools like with like; the glm-base rung stands beside the glm-base sweep (scripts/glm_sweep.sh,
# the report's evidence), which would take ten hours to measure again under a new setting.
# Each precision's rung runs under the glibc mmap threshold its shipped calibration was fitted at, so that this
# command regenerates what ships (adapters/<framework>/memory_calibration.json, one fit per setting): bf16 at
# glibc's own threshold (the llama-base rung at 44980ef06ab6), fp32 fixed at 128 KiB, glibc's own starting value,
# never raised (memory_mmap_threshold, docs/performance.md "The allocator setting" and "A lower threshold"): every
# activation is then mapped and returned at its free, and the host peaks follow the live tensors. MMAP_THRESHOLD
# (glibc, or bytes) runs a rung under another setting, into a folder of its own (-mmap<setting>), never over a
# shipped one. glibc's own threshold rises to the size of tensors freed
# earlier, which made trlx's ZeRO-3 PPO peaks fall from batch 2 to 4; the 4 MiB the a49bc134e77c rung was measured
# at sits inside the rungs' tensor sizes, so a tensor class crosses it as the batch doubles and the slack moved
# with the batch (the misses left out there). A run may take up to 3 hours (launcher.timeout_s; trlx's ZeRO-3 PPO
# in fp32 at 128 KiB ran past the hour it had before, on an AMD EPYC with AVX512-BF16). Run time: llama-base 1.5 hours at a49bc134e77c at 4 MiB on the host
# type with AMX (one session); 128 KiB adds about 26 s to each ZeRO-3 rollout (faults of the gathered weights,
# measured on the AVX2 host: scripts/diagnostics/rollout_cost.py), about 18 minutes to the rung (an estimate); a CPU without
# native bf16 matrix instructions runs the bf16 cells 15-19x slower.
# The runs come from a clean git worktree of one commit, on one host type (scripts/curated_tree.sh): COMMIT=<sha>
# runs the rung at that commit whatever is checked out (default HEAD, which must then be clean), so a rung that
# spans sessions finishes at the commit it began at while the branch moves on. Re-running at the same commit
# resumes: finished cells are kept, and after every multirun the records are copied to results/pending/<rung>/
# (kept by git, with host-<rung>.log, the host of each session; <rung> is llama-base-<commit> or
# glm-base-rung-<commit>) so that a rung spanning sessions or machines resumes from them (a stopped session copies
# the runs it finished too: the resumed rung skips what finished and runs the rest).
# When every cell is done they become results/examples/llama-base or results/examples/glm-base-rung (hosts.log and
# the report beside them) and, once both rungs are there, the accuracy is printed: the planner's physics with each
# framework's calibration, fitted on both rungs, every configuration predicted by a fit that left it out:
#   python -m bench.plan.calibrate results/examples/glm-base-rung results/examples/llama-base \
#     --select 'model.name=[glm-base,llama-base]' --select seed=1 --select memory_mmap_threshold=<the rung's> --dry-run
# The shipped bf16 fit is refitted from the records git keeps by the command docs/planner.md shows (over
# results/examples/glm-base, glm-base-amx and llama-base); `COMMIT=44980ef06ab6 bash scripts/cpu_rung.sh llama-base`
# measures its llama-base records again.
#
# `bash scripts/cpu_rung.sh MODEL fp32` runs the same design in fp32 (precision=fp32: native on every x86-64 CPU,
# so a host without AVX512-BF16 or AMX-BF16, where the bf16 cells would take 15-19x the time, can measure a rung).
# Its rungs are apart: llama-base-fp32 and glm-base-rung-fp32 in pending/ and examples/, never pooled with bf16's.
# Once its llama-base rung is measured the accuracy printed is that rung's, fitted alone, every configuration
# left out; once both fp32 rungs are, the pooled fit's.
#
# `bash scripts/cpu_rung.sh MODEL [fp32] torch` runs the same design for the plain-PyTorch reference (framework=torch:
# DDP, ZeroRedundancyOptimizer, FSDP2; adapters/reference/memory.py) as a rung of its own (llama-base-fp32-torch),
# measured at its own commit beside the three frameworks' rung, and fitted on its own.
#
# `bash scripts/cpu_rung.sh MODEL [fp32] [torch] --dry-run` prints every cell, each checked by `bench.run --dry-run`;
# nothing runs.
set -euo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
cd "${SWEEP_TREE:-$scripts/..}"
export OMP_NUM_THREADS=1
here=$(pwd)
python=${PYTHON:-$here/.venv/bin/python}
SCRIPT=cpu_rung.sh
# shellcheck source=scripts/curated_tree.sh
source "$scripts/curated_tree.sh"
dry=0
model=""
precision=""
frameworks=dschat,colossalai,trlx
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    torch) frameworks=torch ;;
    llama-base|glm-base) [ -z "$model" ] || { echo "cpu_rung.sh: one model, not $model and $arg" >&2; exit 2; }
                         model=$arg ;;
    bf16|fp32) [ -z "$precision" ] || { echo "cpu_rung.sh: one precision, not $precision and $arg" >&2; exit 2; }
               precision=$arg ;;
    *) echo "cpu_rung.sh: unknown argument $arg; allowed: llama-base or glm-base (the rung's model), bf16" \
         "(the default) or fp32 (the rung's precision), torch (the reference's rung), --dry-run (settings are" \
         "environment variables: COMMIT, PYTHON, NEW_HOST, SLOW_BF16)" >&2; exit 2 ;;
  esac
done
precision=${precision:-bf16}
suffix=$([ "$precision" = bf16 ] || echo "-$precision")$([ "$frameworks" != torch ] || echo "-torch")
[ -n "$model" ] || { echo "cpu_rung.sh: name the rung's model: llama-base or glm-base" >&2; exit 2; }
full=$(git rev-parse --verify --quiet "${COMMIT:-HEAD}^{commit}") || {
  echo "cpu_rung.sh: COMMIT=${COMMIT:-HEAD} is not a commit of this repository" >&2; exit 2; }
commit=${full:0:12}
# glm-base's own names are the sweep's (results/pending/glm-base-<commit>, results/examples/glm-base): its rung
# keeps apart from them
# the setting each precision's shipped fit was measured under; another one (MMAP_THRESHOLD) names its own folder
shipped=$([ "$precision" = bf16 ] && echo glibc || echo 131072)
setting=${MMAP_THRESHOLD:-$shipped}
[[ "$setting" = glibc || "$setting" =~ ^[0-9]+$ ]] || {
  echo "cpu_rung.sh: MMAP_THRESHOLD=$setting: allowed: glibc (its own threshold) or a number of bytes" >&2; exit 2; }
threshold=$([ "$setting" = glibc ] && echo null || echo "$setting")
mmap=()  # glibc's own threshold is the run's default (memory_mmap_threshold: null)
[ "$setting" = glibc ] || mmap=(memory_mmap_threshold="$setting")
[ "$setting" = "$shipped" ] || suffix="$suffix-mmap$setting"
case $model in
  llama-base) rung=llama-base$suffix ;;
  glm-base) rung=glm-base-rung$suffix ;;
esac
name=$rung-$commit
dir=results/sweeps/$name
cells=(
  "framework=$frameworks stage=sft,rm,ppo zero=2 lora=0 batch=2"
  "framework=$frameworks stage=sft,rm,ppo zero=2 lora=0 batch=4"
  "framework=$frameworks stage=sft,rm,ppo zero=3 lora=0 batch=2"
  "framework=$frameworks stage=sft,rm,ppo zero=3 lora=0 batch=4"
  "framework=$frameworks stage=sft,rm,ppo zero=2 lora=64 batch=2"
  "framework=$frameworks stage=sft,rm,ppo zero=2 lora=64 batch=4"
)
common=(model=$model launcher.nproc=2 precision=$precision prompt_len=128 answer_len=128 steps=4 warmup_steps=1
        stage_steps.rm=5 seed=1 "${mmap[@]}" launcher.timeout_s=10800 sweep_name="$name")
if [ "$dry" = 1 ]; then
  for cell in "${cells[@]}"; do
    # shellcheck disable=SC2086 # each cell is a list of overrides
    printf '%q ' -m "${common[@]}" $cell
    echo
  done | "$python" -m bench.run.dry_run
  exit
fi
[ -n "${CURATED_ROOT:-}" ] || curated_worktree scripts/cpu_rung.sh "$@"
curated_worktree_is_clean
curated=$CURATED_ROOT  # the calling checkout's results/: pending/ and examples/ live there
pending=$curated/pending/$name
count_records() { { find "$dir" -name record.json 2>/dev/null || true; } | wc -l; }
host_guard "$curated/pending/host-$name.log" "rung: $model${suffix:+ $precision}" count_records "$precision"
keep_records() { mkdir -p "$pending" && (cd "$dir" && find . -name record.json -exec cp --parents {} "$pending/" \;); }
trap 'keep_records; log_session' EXIT
mkdir -p "$dir"
# a cell that ran past an earlier, lower launcher.timeout_s is run again: its `timeout` record would count as done
for timed_out in $(grep -lsrE --include=record.json '^  "status": "timeout"' "$dir" "$pending" || true); do
  echo "cpu_rung.sh: $timed_out timed out under an earlier limit; its cell runs again" >&2
  rm -f "$timed_out"
done
if [ -d "$pending" ]; then  # resume from the records a session before this one kept
  (cd "$pending" && find . -name record.json -exec cp -n --parents {} "$here/$dir/" \;)
fi
for cell in "${cells[@]}"; do
  # shellcheck disable=SC2086
  "$python" -m bench.run -m "${common[@]}" $cell
  find "$dir" -mindepth 3 -maxdepth 3 -type d \( -name checkpoint -o -name checkpoints \) -prune -exec rm -rf {} +
  keep_records
done
example=$curated/examples/$rung
rm -rf "$example" && mkdir -p "$example"
(cd "$dir" && find . -name record.json -exec cp --parents {} "$example/" \;)
rm -rf "$pending"
trap - EXIT && log_session
mv "$host_log" "$example/hosts.log"
(cd "$curated/.." && "$python" -m bench.report "$example" --out "$example/report")
# the accuracy with the calling checkout's code (the current physics), not the measured commit's: of the two rungs
# pooled once both are measured (bench.plan.calibrate refuses rungs of two allocator settings or floor rules), else
# of the llama-base rung fitted alone
cd "$curated/.."
rungs=()
for other in llama-base glm-base-rung; do
  if [ -d "results/examples/$other$suffix" ]; then rungs+=("results/examples/$other$suffix"); fi
done
case ${#rungs[@]} in
  2) models='[glm-base,llama-base]' ;;
  1) [ "$model" = llama-base ] || { echo "cpu_rung.sh: results/examples/llama-base$suffix is not measured yet;" \
       "the accuracy needs it"; exit 0; }
     models=llama-base ;;
esac
"$python" -m bench.plan.calibrate "${rungs[@]}" --select "model.name=$models" --select seed=1 \
  --select memory_mmap_threshold="$threshold" --select precision="$precision" --dry-run
