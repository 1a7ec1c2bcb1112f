#!/usr/bin/env bash
# A real SLURM on this host, for the SLURM tests: Debian's slurm-wlm (slurmctld + slurmd, one node) and munge
# (scripts/setup.sh installs them as root with apt), configured in a folder of their own and started as root.
#
#   bash scripts/slurm_local.sh start [DIR]   write DIR/slurm.conf, start munged, slurmctld and
#                                             slurmd, wait until the node is idle; prints `export SLURM_CONF=...`
#   bash scripts/slurm_local.sh stop [DIR]    stop the three daemons started from DIR
#
# DIR defaults to /tmp/rlhf-bench-slurm. The node is this host (its `hostname -s`), with every CPU it has and one
# partition, `debug`. Processes are tracked by linuxproc and tasks bound by nothing (no cgroups: a container has
# none to give), so jobs run as plain child processes of slurmd. The machine must allow root: apt, munged --force.
set -euo pipefail

action=${1:-start}
dir=$(realpath -m "${2:-/tmp/rlhf-bench-slurm}")
host=$(hostname -s)

stop() {
  for daemon in slurmd slurmctld; do
    [ -f "$dir/$daemon.pid" ] && kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
  done
  [ -S "$dir/munge/munge.socket" ] && munged --stop --socket="$dir/munge/munge.socket" 2>/dev/null || true
  sleep 1
}

if [ "$action" = stop ]; then
  stop
  exit 0
fi
if [ "$action" != start ]; then
  echo "usage: $0 start|stop [DIR] (got '$action')" >&2
  exit 2
fi

missing=()
for binary in slurmctld slurmd srun munged; do command -v "$binary" >/dev/null || missing+=("$binary"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "slurm_local.sh: not installed: ${missing[*]}; scripts/setup.sh installs Debian's slurmctld, slurmd," \
    "slurm-client and munge as root (or: apt-get install slurmctld slurmd slurm-client munge)" >&2
  exit 2
fi

stop  # a previous start from this folder
mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
chmod 700 "$dir/munge"
# munge's own key (the package makes one); a fresh one where it is missing
key=/etc/munge/munge.key
[ -s "$key" ] || { dd if=/dev/urandom of="$key" bs=1 count=128 status=none && chmod 400 "$key"; }
munged --force --socket="$dir/munge/munge.socket" --key-file="$key" --log-file="$dir/munged.log" \
  --pid-file="$dir/munged.pid" --seed-file="$dir/munge/seed"

cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it answers OMP_NUM_THREADS where that is set
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat >"$dir/slurm.conf" <<EOF
# written by scripts/slurm_local.sh: one node, this host
ClusterName=rlhfbench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  state=$(sinfo -h -N -o %t 2>/dev/null | head -1)
  case $state in idle|mix|alloc) echo "export SLURM_CONF=$SLURM_CONF  # node $host: $state"; exit 0 ;; esac
  sleep 1
done
echo "SLURM did not come up within 60 s (node state '${state:-none}'); logs in $dir" >&2
tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
