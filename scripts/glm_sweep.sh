#!/usr/bin/env bash
# The curated CPU benchmark: glm-base (108.9 M parameters) on 2 ranks, 128 prompt + 128 answer tokens, batch 2, 1
# warm-up step, glibc's mmap threshold fixed at 128 KiB (memory_mmap_threshold; docs/performance.md), from a clean
# checkout at one commit (refused otherwise: curated evidence names one commit and no uncommitted code). Sized for
# one night of a 2-core machine: about 10 hours, from the run times measured at a5a0ece258c5 under glibc's own
# threshold, which the fixed one lengthens (4 MiB by up to a third; 128 KiB adds about 26 s to a ZeRO-3 rollout)
# (minutes per run, prerequisites cached: SFT 1.2, RM 3.5 (its held-out evaluation 1.8), PPO DS-Chat 6.4, coati
# 10.2, trlx 19.5, TRL about 9; ZeRO-3 about 2x, glm-large about 3x). 3 seeds where a verdict or a decision-tree
# leaf reads the cell, 1 seed where only a table, a figure or the planner's calibration (fitted on seed 1) does: the
# tree takes each framework's fastest cell among those with 3 seeds, so a single-seed cell never decides a leaf.
#
# Blocks, in the order they run (a partial night leaves the verdicts' cells done first):
#   A2  bf16 full fine-tuning at ZeRO-2, SFT, RM and PPO, every framework, 3 seeds     (A1-A3, the tree, B10's base)
#   A3  PPO at ZeRO-3: DS-Chat 3 seeds, coati (its Gemini needs CUDA: `unsupported` in seconds)   (A7)
#   B   LoRA 64 at ZeRO-2: PPO DS-Chat and coati 3 seeds, trlx 1; SFT and RM 1 seed    (A4, A8, the LoRA leaf)
#   Q   B10's memory: DS-Chat PPO with reference and reward in int8, torchao 3 seeds, bitsandbytes 1 (A2's
#       DS-Chat PPO is the unquantized side)
#   C   each framework's upstream precision at ZeRO-2: DS-Chat and coati fp16 (8 steps: the loss scale calibrates)
#       SFT 3 seeds, RM and PPO 1 seed, only on a CPU with native fp16 (AVX512-FP16 or AMX-FP16); trlx fp32 SFT,
#       RM and PPO 1 seed                                                            (A5, the fp16 / fp32 leaves)
#   D   PPO on 1 rank, bf16 ZeRO-2, 1 seed                                            (the tree's ranks question)
#   A0  PPO at ZeRO-0, every framework, 1 seed                                        (the ZeRO tables, the planner)
#   Z   SFT and RM at ZeRO-0 (every framework) and ZeRO-3, 1 seed                     (the ZeRO tables, B3)
#   G   A14: DS-Chat SFT with allgather_bucket_size 5e8 against 5e7 (6 steps), 3 seeds
#   E   fp16 SFT at lr=1000, 1 seed, tagged forced-failure                            (the stability table)
#   F   glm-large, 1 seed: DS-Chat PPO, coati and trlx SFT                           (the memory model's other model)
#   P   bench.perf: SFT bf16 ZeRO-2 against the plain-PyTorch reference, 3 rounds     (the perf example)
# and the claims pairs on the tiny model (1 rank, bf16 ZeRO-2, 3 seeds), the claims example:
#   K   B10's accuracy: DS-Chat with reference and reward in int8 (torchao) against none, 120 PPO steps
#   N   A13: DS-Chat with reward.normalize=zscore against none, 120 PPO steps (steps until the reward rises)
#   L   A15: LoRA 16 on qkv against all targets, and at qkv lora_alpha 8 against the default, SFT and RM 40 steps
#
# Runs land in results/sweeps/glm-base-<commit> and claims-<commit>; re-running at the same commit resumes
# (finished cells are kept). `BLOCKS="A2 A3"` runs only those blocks. After every Hydra multirun the finished
# records are copied to results/pending/<sweep>/ (kept by git), and a sweep starts by copying them back: a sweep
# that spans several sessions (or machines) commits that folder when it stops and resumes from it. At the end
# (every block run) the records become results/examples/glm-base and results/examples/claims, the perf run
# results/examples/perf-glm-base-sft, their reports are rebuilt by this checkout's code and the pending folders
# removed. Each run's
# closing save is deleted (0.4-0.5 GB at glm-base; the prerequisite models stay in results/cache). Block P's
# bench.perf runs, once all finished, are copied (records and perf.md) to results/pending/perf-glm-base-sft-<commit>/,
# and a later session skips the block and gets them back from there.
#
# `bash scripts/glm_sweep.sh --dry-run` prints every cell the sweep would run, each checked by this checkout's
# `bench.run --dry-run` (and bench.perf's), and writes nothing: no worktree, no pending copies, no examples.
#
# The runs come from a clean git worktree of the commit, on one host type (scripts/curated_tree.sh): COMMIT=<sha>
# runs the sweep at that commit whatever is checked out (default HEAD, which must then be clean), so a sweep that
# spans sessions finishes at the commit it began at while the branch moves on; the log of each session's host is
# results/pending/host-<commit>.log, then hosts.log in the examples.
set -euo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
cd "${SWEEP_TREE:-$scripts/..}"
export OMP_NUM_THREADS=1
here=$(pwd)
SCRIPT=glm_sweep.sh
# shellcheck source=scripts/curated_tree.sh
source "$scripts/curated_tree.sh"
python=${PYTHON:-$here/.venv/bin/python}
dry=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    *) echo "glm_sweep.sh: unknown argument $arg; allowed: --dry-run (settings are environment variables:" \
         "COMMIT, BLOCKS, PYTHON, NEW_HOST, SLOW_BF16)" >&2; exit 2 ;;
  esac
done
full=$(git rev-parse --verify --quiet "${COMMIT:-HEAD}^{commit}") || {
  echo "glm_sweep.sh: COMMIT=${COMMIT:-HEAD} is not a commit of this repository" >&2; exit 2; }
if [ "$dry" = 1 ]; then
  echo "dry run: the sweep at ${full:0:12} would run from results/worktrees/${full:0:12}; its cells, checked with" \
    "this checkout's code:"
  if [ -z "${COMMIT:-}" ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "dry run: the real sweep would refuse this tree: it has uncommitted changes"
  fi
  CURATED_ROOT=$here/results
  dry_lines=$(mktemp)
  trap 'rm -f "$dry_lines"' EXIT
fi
[ -n "${CURATED_ROOT:-}" ] || curated_worktree scripts/glm_sweep.sh "$@"
[ "$dry" = 1 ] || curated_worktree_is_clean
curated=$CURATED_ROOT  # the calling checkout's results/: pending/ and examples/ live there
commit=${full:0:12}
all_blocks="A2 A3 B Q C D A0 Z G E F P K N L"
blocks=${BLOCKS:-$all_blocks}
# Two sweeps: glm-base (blocks A2-F, and P's perf runs beside it) and the tiny model's claims pairs (K, N, L)
for kind in glm-base claims; do
  [ "$dry" = 1 ] && break
  mkdir -p "results/sweeps/$kind-$commit"
  if [ -d "$curated/pending/$kind-$commit" ]; then  # resume from the records a session before this one kept
    (cd "$curated/pending/$kind-$commit" && find . -name record.json \
       -exec cp -n --parents {} "$here/results/sweeps/$kind-$commit/" \;)
  fi
done
# bench.perf's runs (block P) are kept the same way once all of them finished; a sweep resumed from pending/ gets
# them back (what the curated perf example copies: its records and perf.md)
perf_kept=$curated/pending/perf-glm-base-sft-$commit
if [ "$dry" = 0 ] && [ -d "$perf_kept" ]; then
  mkdir -p "results/perf/glm-base-sft-$commit" && (cd "$perf_kept" && find . -type f \
    -exec cp -n --parents {} "$here/results/perf/glm-base-sft-$commit/" \;)
fi
if [ "$dry" = 0 ]; then
  count_records() {  # folders a sweep has not made yet count none (find's error is not the sweep's)
    { find results/sweeps/glm-base-$commit results/sweeps/claims-$commit results/perf/glm-base-sft-$commit \
        -name record.json 2>/dev/null || true; } | wc -l
  }
  host_guard "$curated/pending/host-$commit.log" "blocks: ${BLOCKS:-$all_blocks}" count_records
fi
# glibc's mmap threshold fixed at 128 KiB for the glm-base cells, as on the CPU rungs (scripts/cpu_rung.sh) that
# feed the memory model's calibration: one allocator setting for all the curated glm-base and llama-base runs (the
# sweep begun at a49bc134e77c ran at 4 MiB, that commit's setting: resumed at that commit it stays there)
common=(prompt_len=128 answer_len=128 batch=2 warmup_steps=1 stage_steps.rm=5 memory_mmap_threshold=131072)
all=dschat,colossalai,trlx,trl
three=dschat,colossalai,trlx
two=dschat,colossalai
# sweep KIND OVERRIDES...: one Hydra multirun into results/sweeps/KIND-<commit> (a key may appear once per call);
# then each run's closing save is deleted and the finished records are copied to the pending folder
sweep() { local kind=$1; shift
          local dir=results/sweeps/$kind-$commit pending=$curated/pending/$kind-$commit
          if [ "$dry" = 1 ]; then  # checked together at the end, in one process
            printf '%q ' -m sweep_name="$kind-$commit" launcher.timeout_s=3600 "$@" >> "$dry_lines"
            echo >> "$dry_lines"; return
          fi
          "$python" -m bench.run -m sweep_name="$kind-$commit" launcher.timeout_s=3600 "$@"
          find "$dir" -mindepth 3 -maxdepth 3 -type d \( -name checkpoint -o -name checkpoints \) -prune \
            -exec rm -rf {} +
          mkdir -p "$pending" && (cd "$dir" && find . -name record.json -exec cp --parents {} "$pending/" \;); }
# glm MODEL RANKS OVERRIDES...: a cell of the glm-base benchmark
glm() { local model=$1 ranks=$2; shift 2; sweep glm-base "${common[@]}" model="$model" launcher.nproc="$ranks" "$@"; }
# tiny OVERRIDES...: a claims pair on the tiny model, 1 rank (A13's and B10's 120-step curves, A15's LoRA quality)
tiny() { sweep claims model=tiny launcher.nproc=1 precision=bf16 zero=2 "$@"; }
for block in $blocks; do
  echo "== block $block ($(date -u +%H:%M:%S) UTC)"
  case $block in
    A2) for stage in sft rm ppo; do
          glm glm-base 2 framework=$all stage=$stage steps=4 precision=bf16 zero=2 lora=0 seed=1,2,3
        done ;;
    A3) glm glm-base 2 framework=$two stage=ppo steps=4 precision=bf16 zero=3 lora=0 seed=1,2,3 ;;
    B)  glm glm-base 2 framework=$two stage=ppo steps=4 precision=bf16 zero=2 lora=64 seed=1,2,3
        glm glm-base 2 framework=trlx stage=ppo steps=4 precision=bf16 zero=2 lora=64 seed=1
        glm glm-base 2 framework=$three stage=sft,rm steps=4 precision=bf16 zero=2 lora=64 seed=1 ;;
    Q)  glm glm-base 2 framework=dschat stage=ppo steps=4 precision=bf16 zero=2 lora=0 seed=1,2,3 \
          reference.quant=int8 reward.quant=int8 quant_library=torchao
        glm glm-base 2 framework=dschat stage=ppo steps=4 precision=bf16 zero=2 lora=0 seed=1 \
          reference.quant=int8 reward.quant=int8 quant_library=bitsandbytes ;;
    C)  # 8 fp16 steps: DeepSpeed's and ColossalAI's loss scale (2^16, halved per overflow) calibrates within the
        # stability rules' allowance. A CPU without AVX512-FP16 or AMX-FP16 runs torch's fp16 matrix products
        # through a slow path (fp16 GEMM 75x slower than fp32 on such a host, measured at glm-base's shapes): there
        # the fp16 cells would time an emulation, not the framework, and take hours, so they are left out and
        # the report finds no fp16 evidence from this host type
        # the choice is made once per sweep (fp16-cells in its pending folder) so that a resumed sweep runs the
        # cells it began with
        fp16_choice=$curated/pending/glm-base-$commit/fp16-cells
        if [ "$dry" = 0 ] && [ ! -f "$fp16_choice" ]; then
          mkdir -p "$(dirname "$fp16_choice")"
          grep -qwE 'avx512_fp16|amx_fp16' /proc/cpuinfo && echo run > "$fp16_choice" || echo "left out" > "$fp16_choice"
        fi
        if { [ "$dry" = 1 ] && grep -qwE 'avx512_fp16|amx_fp16' /proc/cpuinfo; } \
           || { [ "$dry" = 0 ] && [ "$(cat "$fp16_choice")" = run ]; }; then
          glm glm-base 2 framework=$two stage=sft steps=8 precision=fp16 zero=2 lora=0 seed=1,2,3
          glm glm-base 2 framework=$two stage=rm,ppo steps=8 precision=fp16 zero=2 lora=0 seed=1
        else
          echo "block C: fp16 cells left out (no avx512_fp16 or amx_fp16 in /proc/cpuinfo: fp16 GEMMs emulated)"
        fi
        glm glm-base 2 framework=trlx stage=sft,rm,ppo steps=4 precision=fp32 zero=2 lora=0 seed=1 ;;
    D)  glm glm-base 1 framework=$three stage=ppo steps=4 precision=bf16 zero=2 lora=0 seed=1 ;;
    A0) glm glm-base 2 framework=$all stage=ppo steps=4 precision=bf16 zero=0 lora=0 seed=1 ;;
    Z)  glm glm-base 2 framework=$all stage=sft,rm steps=4 precision=bf16 zero=0 lora=0 seed=1
        glm glm-base 2 framework=$three stage=sft,rm steps=4 precision=bf16 zero=3 lora=0 seed=1 ;;
    G)  glm glm-base 2 framework=dschat stage=sft steps=6 precision=bf16 zero=2 lora=0 seed=1,2,3 \
          ds.allgather_bucket_size=50000000,500000000 ;;
    E)  glm glm-base 2 framework=$three stage=sft steps=4 precision=fp16 zero=2 lora=0 lr=1000 seed=1 \
          "tags=[forced-failure]" ;;
    F)  glm glm-large 2 framework=dschat stage=ppo steps=4 precision=bf16 zero=2 lora=0 seed=1
        glm glm-large 2 framework=colossalai,trlx stage=sft steps=4 precision=bf16 zero=2 lora=0 seed=1 ;;
    P)  if [ "$dry" = 0 ] && [ -f "$perf_kept/perf.md" ]; then  # bench.perf has no resume: its finished rounds are kept
          echo "block P: done in an earlier session (its records: $perf_kept)"
        else
          "$python" -m bench.perf $([ "$dry" = 1 ] && echo --dry-run) --rounds 3 --name "glm-base-sft-$commit" model=glm-base launcher.nproc=2 stage=sft \
            precision=bf16 zero=2 lora=0 prompt_len=128 answer_len=128 batch=2 steps=4 warmup_steps=1 \
            stage_steps.rm=5
          if [ "$dry" = 0 ]; then
            mkdir -p "$perf_kept" && (cd "results/perf/glm-base-sft-$commit" && find . \( -name record.json -o -name perf.md \) \
              -exec cp --parents {} "$perf_kept/" \;)
          fi
        fi ;;
    K)  tiny framework=dschat stage=ppo steps=120 lora=0 seed=1,2,3 reference.quant=none reward.quant=none
        tiny framework=dschat stage=ppo steps=120 lora=0 seed=1,2,3 reference.quant=int8 reward.quant=int8 \
          quant_library=torchao ;;
    N)  tiny framework=dschat stage=ppo steps=120 lora=0 seed=1,2,3 reward.normalize=none,zscore ;;
    L)  tiny framework=$three stage=sft,rm steps=40 lora=16 seed=1,2,3 lora_targets=qkv,all
        tiny framework=$three stage=sft,rm steps=40 lora=16 seed=1,2,3 lora_targets=qkv lora_alpha=8 ;;
    *)  echo "unknown block $block (blocks: $all_blocks)" >&2; exit 2 ;;
  esac
done
if [ "$dry" = 1 ]; then
  "$python" -m bench.run.dry_run < "$dry_lines"
  exit
fi
if [ "$blocks" = "$all_blocks" ]; then  # the whole night is done: it becomes the curated examples
  for kind in glm-base claims; do
    example=$curated/examples/$kind
    rm -rf "$example" && mkdir -p "$example"
    (cd "results/sweeps/$kind-$commit" && find . -name record.json -exec cp --parents {} "$example/" \;)
    # the report with the calling checkout's code (the current rules), not the measured commit's
    (cd "$curated/.." && "$python" -m bench.report "$example" --out "$example/report")
    rm -rf "$curated/pending/$kind-$commit"
  done
  trap - EXIT && log_session
  cp "$host_log" "$curated/examples/glm-base/hosts.log" && cp "$host_log" "$curated/examples/claims/hosts.log"
  rm -f "$host_log"
  perf=$curated/examples/perf-glm-base-sft
  find "results/perf/glm-base-sft-$commit" -type d \( -name checkpoint -o -name checkpoints \) -prune \
    -exec rm -rf {} +
  rm -rf "$perf" && mkdir -p "$perf"
  cp -r "results/perf/glm-base-sft-$commit/." "$perf/"
  rm -rf "$perf_kept"
fi
