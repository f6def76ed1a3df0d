#!/usr/bin/env bash
# A one- or two-node SLURM cluster in a folder, to try vitexp's cluster path and to test it
# (tests/slurm_cluster.py):
#   bash scripts/local_slurm.sh start DIR [--nodes 2]   # prints: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/local_slurm.sh stop DIR
# One node (the default): slurmctld and slurmd run on this host (`hostname -s`). Two nodes: slurmctld on
# this host, slurmd `node1` and `node2` each in network, UTS and mount namespaces of its own: its own
# hostname, its own address on a bridge made for the cluster, the nodes' names resolved through DIR/hosts
# bind-mounted over /etc/hosts inside its namespaces only (the machine's /etc/hosts is not touched). A
# job on node2 sees node2 as its hostname and finds node1 by name, as on two machines.
# State, spool and logs live in DIR, beside a munged of the cluster's own (its key and socket in DIR), on
# ports free when it starts; one partition, `local`, the default. `stop` ends the jobs and the daemons
# and removes the namespaces, the bridge and its links. Needs Debian's slurm-wlm and munge (apt-get
# install -y slurm-wlm munge), iproute2 and util-linux for two nodes, and root (slurmd starts jobs as
# their user). No cgroups: proctrack/linuxproc, task/none; jobs can be requeued (JobRequeue=1).
set -euo pipefail
usage() { echo "usage: $0 start DIR [--nodes 1|2] | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
conf="$dir/slurm.conf"
net="$dir/network"  # the two-node cluster's bridge, subnet and namespaces, read by `stop`
nodes=1
if [ $# -gt 2 ]; then
  [ "$action" = start ] && [ $# -eq 4 ] && [ "$3" = --nodes ] || usage
  case "$4" in 1|2) nodes=$4 ;; *) echo "$0: --nodes is 1 or 2, not '$4'" >&2; exit 2 ;; esac
fi

stop() {
  if [ -f "$conf" ] && [ -f "$dir/slurmctld.pid" ]; then  # jobs first, so no step outlives its daemons
    SLURM_CONF="$conf" scancel --full --quiet --partition=local 2>/dev/null || true
    for _ in $(seq 20); do
      [ -z "$(SLURM_CONF="$conf" squeue --noheader 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for pidfile in "$dir"/slurmd*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$pidfile"
  done
  if [ -f "$net" ]; then
    # shellcheck disable=SC1090
    . "$net"
    for ns in $namespaces; do
      # whatever still runs in a node's namespaces (a step SLURM did not end) goes with them
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns delete "$ns" 2>/dev/null || true  # the veth pair goes with its inner end
    done
    for link in $links; do ip link delete "$link" 2>/dev/null || true; done  # torn down late otherwise
    ip link delete "$bridge" 2>/dev/null || true
    rm -f "$net"
  fi
}

# Two nodes: a bridge holding this host's address on a 10.x.y.0/24 that no route of this host uses,
# and one network namespace per node linked to it by a veth pair; names derive from DIR, so two clusters
# never share them. Traffic between the nodes crosses the bridge: on a host whose firewall filters
# bridged packets (br_netfilter with a FORWARD policy of DROP, as Docker sets it), it must be let through.
make_network() {
  local tag ns i
  tag=$(printf '%s' "$dir" | md5sum | cut -c1-6)
  bridge="vxb$tag"
  subnet=$(python3 - "$tag" <<'PY'
import ipaddress, random, subprocess, sys
routes = subprocess.run(["ip", "-o", "-4", "route", "show"], capture_output=True, text=True).stdout
used = [ipaddress.ip_network(w, strict=False) for w in routes.split() if "/" in w and w[0].isdigit()]
rng = random.Random(sys.argv[1])
while True:
    net = ipaddress.ip_network(f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 250)}.0/24")
    if not any(net.overlaps(u) for u in used):
        print(str(net.network_address).rsplit(".", 1)[0])
        break
PY
)
  namespaces="" links=""
  for i in $(seq "$nodes"); do namespaces="$namespaces vitexp-$tag-$i" links="$links vx$tag$i"; done
  printf 'bridge=%s\nsubnet=%s\nnamespaces="%s"\nlinks="%s"\n' "$bridge" "$subnet" "$namespaces" "$links" \
    > "$net"
  ip link add "$bridge" type bridge
  ip addr add "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  i=0
  for ns in $namespaces; do
    i=$((i + 1))
    ip netns add "$ns"
    ip link add "vx$tag$i" type veth peer name "vx${tag}n$i"
    ip link set "vx${tag}n$i" netns "$ns"
    ip link set "vx$tag$i" master "$bridge"
    ip link set "vx$tag$i" up
    # nsenter --net keeps the host's /sys (`ip netns exec` mounts a fresh one, which hides
    # /sys/fs/cgroup, and slurmd then refuses to start)
    nsenter --net="/run/netns/$ns" ip addr add "$subnet.1$i/24" dev "vx${tag}n$i"
    nsenter --net="/run/netns/$ns" ip link set "vx${tag}n$i" up
    nsenter --net="/run/netns/$ns" ip link set lo up
  done
  {
    echo "127.0.0.1 localhost"
    echo "$subnet.1 $(hostname -s)"
    for i in $(seq "$nodes"); do echo "$subnet.1$i node$i"; done
  } > "$dir/hosts"
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
if [ "$nodes" = 2 ]; then
  for tool in ip nsenter unshare; do
    command -v "$tool" >/dev/null || { echo "$0: two nodes need $tool (iproute2, util-linux)" >&2; exit 1; }
  done
fi
stop  # a cluster left in DIR by an earlier start
# a start that fails part way (a step of `set -e`, nodes that never come up) leaves nothing behind
trap 'status=$?; if [ "$status" != 0 ]; then stop; fi; exit "$status"' EXIT
host=$(hostname -s)
rm -rf "$dir/state" "$dir/spool"  # no job or node state of an earlier start
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
# CPUs, sockets, cores and memory as slurmd finds them (a node line must match its host)
hw=$(slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')
if [ "$nodes" = 1 ]; then
  ctld_addr=127.0.0.1
  node_lines="NodeName=$host NodeAddr=127.0.0.1 ${hw}State=UNKNOWN"
  partition_nodes=$host
  select=CR_CPU
else
  make_network
  ctld_addr="$subnet.1"
  node_lines=$(for i in $(seq "$nodes"); do echo "NodeName=node$i NodeAddr=$subnet.1$i ${hw}State=UNKNOWN"; done)
  partition_nodes="node[1-$nodes]"
  select=CR_CPU,CR_LLN  # the least loaded node first: a sweep's jobs spread over the nodes
fi
cat > "$conf" <<EOF
# A $nodes-node cluster written by scripts/local_slurm.sh
ClusterName=vitexp
SlurmctldHost=$host($ctld_addr)
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
SelectTypeParameters=$select
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
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
$node_lines
PartitionName=local Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$conf"
slurmctld -i
if [ "$nodes" = 1 ]; then
  slurmd
else
  i=0
  for ns in $namespaces; do
    i=$((i + 1))
    # the node's own hostname and /etc/hosts (unshare --mount keeps the bind private to it); slurmd
    # forks into the background, and its jobs inherit the node's namespaces
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
      sh -c "hostname node$i && mount --bind '$dir/hosts' /etc/hosts && exec slurmd -N node$i"
  done
fi
for _ in $(seq 60); do
  states=$(sinfo --noheader --Node --format=%t 2>/dev/null || true)
  up=$(printf '%s\n' "$states" | grep -cE '^(idle|mix|alloc)' || true)
  if [ "$up" = "$nodes" ]; then echo "export SLURM_CONF=$conf"; exit 0; fi
  sleep 0.5
done
echo "$0: the nodes did not come up (states: ${states:-none}); logs in $dir/log" >&2
exit 1
