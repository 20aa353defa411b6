#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the launcher tests: Debian's slurm-wlm and munge,
# a controller and one slurmd per node, configured in a directory of its own (nothing under
# /etc/slurm is touched). Needs root.
#
#   tests/slurm/slurm.sh install          install slurm-wlm and munge from Debian if missing
#   tests/slurm/slurm.sh up DIR           one node (this host): munged, slurmctld, slurmd
#   tests/slurm/slurm.sh up DIR NS...     one node per network namespace NS (a host of
#                                         tests/cluster/cluster.sh): the controller and
#                                         node I's slurmd run in NS I, node I is named NS
#   tests/slurm/slurm.sh down DIR         stop the daemons started with DIR
#
# After `up`, `SLURM_CONF=DIR/slurm.conf srun …` runs jobs (for a namespace cluster, from inside
# NS 0: `nsenter --net=/run/netns/NS0 srun …`). The nodes claim 16 CPUs each, so tests can start more tasks than this machine has
# cores. Daemon logs: DIR/*.log.
set -euo pipefail

die() { echo "slurm.sh: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: slurm.sh install | up DIR [NS...] | down DIR"
cmd="$1"; shift

install() {
    if command -v srun >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "slurm-wlm is not installed and this is not root: install slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq slurm-wlm munge >/dev/null
}

# munged, once for the machine (its socket is a path, so every namespace reaches it).
munge_up() {
    if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1; then
        return 0
    fi
    [ -f /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=128 of=/etc/munge/munge.key 2>/dev/null; }
    chown -R munge:munge /etc/munge 2>/dev/null || true
    chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
    else
        /usr/sbin/munged --force
    fi
    for _ in $(seq 50); do
        munge -n </dev/null >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not start"
}

# A free TCP port on this machine (for the controller).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'
}

up() {
    local dir="$1"; shift
    local nss=("$@")
    mkdir -p "$dir/state"
    dir="$(cd "$dir" && pwd)"
    munge_up
    local ctl_host ctl_addr nodes=()
    local ctl_port slurmd_port
    ctl_port="$(free_port)"
    slurmd_port="$(free_port)"
    if [ ${#nss[@]} -eq 0 ]; then
        ctl_host="$(hostname -s)"
        ctl_addr=127.0.0.1
        nodes+=("NodeName=$ctl_host NodeAddr=127.0.0.1 CPUs=16 State=UNKNOWN")
    else
        ctl_host="${nss[0]}"
        ctl_addr="$(ip -n "${nss[0]}" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)"
        for ns in "${nss[@]}"; do
            local a
            a="$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)"
            [ -n "$a" ] || die "namespace $ns has no IPv4 address on eth0"
            nodes+=("NodeName=$ns NodeAddr=$a NodeHostname=$ns CPUs=16 State=UNKNOWN")
        done
    fi
    cat >"$dir/slurm.conf" <<CONF
ClusterName=tutti
SlurmctldHost=$ctl_host($ctl_addr)
SlurmctldPort=$ctl_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
InactiveLimit=0
MinJobAge=10
SlurmctldTimeout=30
SlurmdTimeout=30
$(printf '%s\n' "${nodes[@]}")
PartitionName=tutti Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16
CONF
    export SLURM_CONF="$dir/slurm.conf"
    if [ ${#nss[@]} -eq 0 ]; then
        mkdir -p "$dir/spool-$ctl_host"
        /usr/sbin/slurmctld -f "$dir/slurm.conf" -i
        /usr/sbin/slurmd -f "$dir/slurm.conf" -N "$ctl_host"
    else
        # In a host: its network namespace alone (nsenter; `ip netns exec` would also give it a
        # fresh /sys without the cgroup file systems slurmd needs), and a host name of its own
        # (the controller checks that it runs on SlurmctldHost).
        # Node names resolve as on a real cluster (tutti finds rank 0's host by the step's
        # first node name): a hosts file of the cluster's own, bound over /etc/hosts in a
        # mount namespace of the daemons (and so of the tasks they start).
        { echo "127.0.0.1 localhost"; for ns in "${nss[@]}"; do
            echo "$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1) $ns"
        done; } >"$dir/hosts"
        local in_host='hostname "$1"; mount --bind "$2" /etc/hosts; shift 2; exec "$@"'
        nsenter --net="/run/netns/${nss[0]}" unshare --uts --mount -- bash -c "$in_host" - "${nss[0]}" "$dir/hosts" \
            /usr/sbin/slurmctld -f "$dir/slurm.conf" -i
        for ns in "${nss[@]}"; do
            mkdir -p "$dir/spool-$ns"
            nsenter --net="/run/netns/$ns" unshare --uts --mount -- bash -c "$in_host" - "$ns" "$dir/hosts" \
                /usr/sbin/slurmd -f "$dir/slurm.conf" -N "$ns"
        done
    fi
    # Ready when every node is idle.
    local want=${#nodes[@]} run=()
    [ ${#nss[@]} -eq 0 ] || run=(nsenter --net="/run/netns/${nss[0]}")
    for _ in $(seq 150); do
        local idle
        idle="$("${run[@]}" sinfo -h -o '%t %D' 2>/dev/null | awk '$1=="idle"{n+=$2} END{print n+0}')"
        [ "$idle" = "$want" ] && return 0
        sleep 0.2
    done
    "${run[@]}" sinfo >&2 || true
    tail -n 20 "$dir"/*.log >&2 || true
    die "the cluster in $dir did not come up (logs above)"
}

down() {
    local dir="$1"
    for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
        [ -f "$f" ] || continue
        kill "$(cat "$f")" 2>/dev/null || true
    done
    for _ in $(seq 50); do
        local alive=0
        for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
            [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1
        done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
        [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
    done
}

case "$cmd" in
    install) install ;;
    up) [ $# -ge 1 ] || die "usage: slurm.sh up DIR [NS...]"; install; up "$@" ;;
    down) [ $# -ge 1 ] || die "usage: slurm.sh down DIR"; down "$1" ;;
    *) die "unknown command $cmd" ;;
esac
