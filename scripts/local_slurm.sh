#!/usr/bin/env bash
# A one-node SLURM cluster in a folder, to try vitexp's cluster path and to test it (tests/slurm_cluster.py):
#   bash scripts/local_slurm.sh start DIR    # prints: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/local_slurm.sh stop DIR
# slurmctld and slurmd run on this host (`hostname -s`) with their state, spool and logs in DIR, beside a
# munged of their own (its key and socket in DIR), on ports free when it starts; one partition, `local`,
# the default. Needs Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge), and root (slurmd
# starts jobs as their user). No cgroups: proctrack/linuxproc, task/none; jobs can be requeued (JobRequeue=1).
set -euo pipefail
usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
conf="$dir/slurm.conf"

stop() {
  if [ -f "$conf" ] && [ -f "$dir/slurmctld.pid" ]; then  # jobs first, so no step outlives its daemons
    SLURM_CONF="$conf" scancel --full --quiet --partition=local 2>/dev/null || true
    for _ in $(seq 20); do
      [ -z "$(SLURM_CONF="$conf" squeue --noheader 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for daemon in slurmd slurmctld munged; do
    pidfile="$dir/$daemon.pid"
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$pidfile"
  done
}

if [ "$action" = stop ]; then
  stop
  exit 0
fi
[ "$action" = start ] || usage
for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is not installed: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "$0: slurmd must run as root" >&2; exit 1; }
stop  # a cluster left in DIR by an earlier start
host=$(hostname -s)
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
chmod 700 "$dir/munge"
[ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
socket="$dir/munge/munge.socket"
munged --force --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
read -r ctld_port node_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
# CPUs, sockets, cores and memory as slurmd finds them (the node line must match the host)
hw=$(slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')
cat > "$conf" <<EOF
# A one-node cluster written by scripts/local_slurm.sh
ClusterName=vitexp
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$node_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket,cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
KillWait=10
MinJobAge=600
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 ${hw}State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$conf"
slurmctld -i
slurmd
for _ in $(seq 60); do
  state=$(sinfo --noheader --format=%t 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) echo "export SLURM_CONF=$conf"; exit 0 ;; esac
  sleep 0.5
done
echo "$0: the node did not come up (state: ${state:-none}); logs in $dir/log" >&2
exit 1
