# Sourced by the scripts whose runs become curated evidence (scripts/glm_sweep.sh, scripts/cpu_rung.sh): what
# makes their records evidence of one thing. They come from a clean git worktree of one commit, and from one host
# type. The calling script sets SCRIPT (its name, for messages), here (the folder it runs in), python and full
# (the commit's full hash) before it calls these.

# curated_worktree SCRIPT_PATH ARGS...: called in the checkout, hands the run to a worktree of $full under
# results/worktrees/, with its ignored results/ subfolders linked to this checkout's. The worktree runs the
# checkout's SCRIPT_PATH, with this checkout's .venv: which cells run is the sweep's design, not the measured
# code, and the records name the worktree's commit. Every record reads its code state when it starts, so editing
# or committing in this checkout while the sweep runs changes nothing it records. COMMIT=<sha> runs at that
# commit whatever is checked out (default HEAD, which must then be clean), so a sweep that spans sessions
# finishes at the commit it began at while the branch moves on. The worktree's own pending folder is a tracked
# path there: the sweep's copies go to this checkout's (CURATED_ROOT).
curated_worktree() {
  local script=$1 tree sub
  shift
  if [ -z "${COMMIT:-}" ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "$SCRIPT: the tree has uncommitted changes; commit them (or name COMMIT=<sha>): curated runs come" \
      "from a clean checkout at one commit" >&2
    git status --short --untracked-files=no >&2
    exit 2
  fi
  tree=results/worktrees/${full:0:12}
  git worktree prune  # a worktree whose folder went with an earlier machine's results/ is registered no more
  [ -d "$tree" ] || git worktree add --detach "$tree" "$full"
  mkdir -p results/sweeps results/perf results/pending "results/cache/${full:0:12}"
  for sub in sweeps perf; do  # ignored folders: the worktree stays a clean checkout of the commit
    [ -L "$tree/results/$sub" ] || ln -s "$here/results/$sub" "$tree/results/$sub"
  done
  # the prerequisite models (PPO's SFT and reward models) are cached per commit: their cache key is the
  # configuration, not the code, so a shared cache would hand a curated PPO run models an earlier commit trained
  [ -L "$tree/results/cache" ] || ln -s "$here/results/cache/${full:0:12}" "$tree/results/cache"
  exec env -u COMMIT PYTHON="$python" CURATED_ROOT="$here/results" SWEEP_TREE="$here/$tree" \
    bash "$here/$script" "$@"
}

# curated_worktree_is_clean: in the worktree, nobody edits it; a change there would go unrecorded
curated_worktree_is_clean() {
  if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "$SCRIPT: the worktree $here has uncommitted changes; remove it (git worktree remove --force)" >&2
    exit 2
  fi
}

# The host the runs come from. The records name their host, but a5a0ece258c5's records name it by CPU name,
# cores and memory only, and two hosts of this workplace with one name differ in their matrix instructions (one
# has AMX and AVX512-FP16, one neither). A sweep that spans sessions therefore keeps a log of the host each
# session ran on and refuses a host other than the one it began on: cells from two host types are not repeats of
# one thing. NEW_HOST=ok runs on anyway (the log says what ran where); use it only for cells whose comparisons
# all run on the new host.
host_fingerprint() {
  local isa="" flags flag
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for flag in avx512_bf16 avx512_fp16 amx_bf16 amx_fp16 amx_int8; do  # environment.MATRIX_FLAGS's order
    [[ $flags == *" $flag "* ]] && isa=${isa:+$isa+}$flag
  done
  awk -F': *' -v cpus="$(getconf _NPROCESSORS_ONLN)" -v isa="${isa:-no native 16-bit matrix ISA}" \
    '/^model name/ && !n {n=$2} /^cpu family/ && !f {f=$2} /^model\t/ && !m {m=$2} /^stepping/ && !s {s=$2}
     END {printf "%s (family %s model %s stepping %s) x %s, %s\n", n, f, m, s, cpus, isa}' /proc/cpuinfo
}

# native_bf16_guard: the curated cells are bf16, and a CPU without native bf16 matrix instructions sends torch's
# bf16 matrix products down a slow path: hours become days, and the times are an emulation's. Refused unless
# SLOW_BF16=ok. The instructions are bench.measure.native_half's (the runs' own check), read with the calling
# checkout's code (scripts/..: a worktree of an older commit may predate the module). CPUINFO names the file the
# flags are read from (default /proc/cpuinfo; tests hand it a made-up CPU).
native_bf16_guard() {
  [ "${SLOW_BF16:-}" = ok ] && return
  local why
  why=$(cd "$scripts/.." && "$python" -m bench.measure.native_half bf16 --cpuinfo "${CPUINFO:-/proc/cpuinfo}" 2>&1) \
    && return
  echo "$SCRIPT: $why: the bf16 cells would take that many times the hours and time an emulation. Run on a host" \
    "with them, or set SLOW_BF16=ok" >&2
  exit 2
}

# host_guard LOG LABEL COUNT [PRECISION]: refuses a CPU without native bf16 (native_bf16_guard) when the cells are
# bf16 (PRECISION, default bf16; fp32 is native on every CPU) and this host unless it is the one LOG's first
# session ran on (or NEW_HOST=ok), then logs this session when the script ends, a stopped one's too: the time,
# LABEL (what it ran), the runs it added (COUNT is a command that prints how many records there are), the host and
# the kernel.
host_guard() {
  host_log=$1 host_label=$2 host_count=$3
  [ "${4:-bf16}" = fp32 ] || native_bf16_guard
  here_host=$(host_fingerprint)
  local first
  first=$([ -f "$host_log" ] && grep -m1 -oP '(?<=\thost: )[^\t]*' "$host_log" || true)
  if [ -n "$first" ] && [ "$first" != "$here_host" ] && [ "${NEW_HOST:-}" != ok ]; then
    echo "$SCRIPT: this host ($here_host) is not the one the sweep at ${full:0:12} began on ($first;" \
      "$host_log): its cells would not be repeats of the others. Run it there, start a sweep at a new commit," \
      "or set NEW_HOST=ok for cells whose comparisons all run here" >&2
    exit 2
  fi
  host_records_before=$($host_count)
  trap log_session EXIT
}

log_session() {
  local now
  now=$($host_count)
  printf '%s\t%s (%s runs added)\thost: %s\tkernel: %s\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "$host_label" \
    "$((now - host_records_before))" "$here_host" "$(uname -r)" >> "$host_log"
}
