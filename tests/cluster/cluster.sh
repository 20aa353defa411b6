#!/usr/bin/env bash
# A cluster on one machine: H hosts as network namespaces on a bridge, each with its own IPv4 and
# IPv6 address, a decoy interface and a docker0-like bridge (which rendezvous must never pick),
# and links shaped by rate with tc tbf in both directions. Needs root.
#
#   tests/cluster/cluster.sh up H [--rate 1gbit] [--name tt]   bring H hosts up
#   tests/cluster/cluster.sh exec I CMD...  [--name tt via TT_CLUSTER]   run CMD on host I
#   tests/cluster/cluster.sh down [--name tt]                   take everything down
#   tests/cluster/cluster.sh run H [--rate R] [--name tt] -- CMD...
#       up, run CMD once on this machine (not in a host; it uses `exec` itself), down — also
#       on failure and on Ctrl-C.
#
# Host I (0-based) is namespace NAME-hI: eth0 with 10.77.0.(I+1)/24 and fd77::(I+1)/64, lo,
# decoy0 (one end of a veth pair inside the host: up, 10.88.I.1/24 and fd88::I:1/64, leading
# nowhere) and docker0 (a bridge,
# 172.17.0.1/16, as Docker leaves one). The hosts' eth0 sit on bridge NAME-br in the root
# namespace. With --rate, each host's link is shaped to that rate both ways: htb on eth0 (what
# the host sends) and on its peer on the bridge (what it receives); the bucket holds 20 µs at
# the rate (at least 4,000 bytes). See shape() below. netem is not available in
# these kernels (nor fq_codel), so there is no added delay or loss: latency is what veth and the bridge give.
#
# Environment for CMD (run): CLUSTER_NAME, CLUSTER_HOSTS, and CLUSTER_IP4_I / CLUSTER_IP6_I.
set -euo pipefail

die() { echo "cluster: $*" >&2; exit 1; }

name="${TT_CLUSTER:-tt}"
rate=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rate) rate="$2"; shift 2 ;;
        --name) name="$2"; shift 2 ;;
        --) shift; args+=("--" "$@"); break ;;
        *) args+=("$1"); shift ;;
    esac
done
set -- "${args[@]}"
[ $# -ge 1 ] || die "usage: cluster.sh up H | exec I CMD... | down | run H -- CMD..."
cmd="$1"; shift

hosts_of() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${name}-h[0-9]+$" | sort -V || true
}

down() {
    for ns in $(hosts_of); do
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "${name}-br" 2>/dev/null || true
    # Peers left on the bridge side (deleting a namespace removes its ends).
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${name}-v[0-9]+$" || true); do
        ip link del "$l" 2>/dev/null || true
    done
}

# Shaping: an htb class at the rate whose bucket holds 20 µs at the rate (at least 4,000 bytes),
# so that even small messages leave at the link's rate, as from a real NIC. Not tbf: tbf splits
# every GSO packet larger than its bucket, and with a small bucket TCP over it runs at half the
# rate, while a large tbf bucket lets whole messages through at memory speed. One TCP stream
# through this htb class: 0.954 of 1 Gbit/s and 8.7 of 10 Gbit/s on the 2-core VM. The class
# queues in htb's default packet FIFO.
burst_of() { # rate (e.g. 1gbit, 500mbit, 10gbit) -> bytes
    local r="${1,,}" num unit mult
    num="${r%%[a-z]*}"; unit="${r#"$num"}"
    case "$unit" in
        gbit) mult=1000000000 ;; mbit) mult=1000000 ;; kbit) mult=1000 ;; bit|"") mult=1 ;;
        *) die "rate $1: use bit, kbit, mbit or gbit" ;;
    esac
    awk -v n="$num" -v m="$mult" 'BEGIN { b = n * m / 8 * 0.00002; if (b < 4000) b = 4000; printf "%d", b }'
}

shape() { # [netns] dev rate
    local pre=()
    if [ $# = 3 ]; then pre=(ip netns exec "$1"); shift; fi
    local dev="$1" rate="$2" b
    b="$(burst_of "$rate")"
    "${pre[@]}" tc qdisc replace dev "$dev" root handle 1: htb default 10
    "${pre[@]}" tc class add dev "$dev" parent 1: classid 1:10 htb rate "$rate" ceil "$rate" \
        burst "$b" cburst "$b" quantum 60000
}

up() {
    local n="$1"
    [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "between 1 and 200 hosts"
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    down
    ip link add "${name}-br" type bridge
    ip link set "${name}-br" up
    for i in $(seq 0 $((n - 1))); do
        local ns="${name}-h$i" v="${name}-v$i" e="${name}-e$i"
        ip netns add "$ns"
        # docker0 first, so that "the first interface with an address" would be the wrong one.
        ip -n "$ns" link add docker0 type bridge
        ip -n "$ns" addr add 172.17.0.1/16 dev docker0
        ip -n "$ns" link set docker0 up
        ip link add "$e" type veth peer name "$v"
        ip link set "$e" netns "$ns"
        ip -n "$ns" link set "$e" name eth0
        ip link set "$v" master "${name}-br"
        ip link set "$v" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
        ip -n "$ns" addr add "fd77::$((i + 1))/64" dev eth0 nodad
        ip -n "$ns" link set eth0 up
        # The decoy: one end of a veth pair inside the host (up, with carrier, leading nowhere).
        ip -n "$ns" link add decoy0 type veth peer name decoy1
        ip -n "$ns" addr add "10.88.$i.1/24" dev decoy0
        ip -n "$ns" addr add "fd88::$i:1/64" dev decoy0 nodad
        ip -n "$ns" link set decoy1 up
        ip -n "$ns" link set decoy0 up
        # As on a real host, the default routes leave through eth0.
        ip -n "$ns" route add default dev eth0
        ip -n "$ns" -6 route add default dev eth0
        if [ -n "$rate" ]; then
            shape "$ns" eth0 "$rate"
            shape "$v" "$rate"
        fi
    done
}

case "$cmd" in
    up) [ $# -ge 1 ] || die "up H"; up "$1"; echo "cluster $name: $1 hosts up${rate:+, links at $rate}" ;;
    down) down ;;
    exec)
        [ $# -ge 2 ] || die "exec I CMD..."
        i="$1"; shift
        exec ip netns exec "${name}-h$i" "$@"
        ;;
    run)
        [ $# -ge 3 ] && [ "$2" = "--" ] || die "run H -- CMD..."
        n="$1"; shift 2
        trap down EXIT
        trap 'exit 130' INT TERM
        up "$n"
        export CLUSTER_NAME="$name" CLUSTER_HOSTS="$n"
        for i in $(seq 0 $((n - 1))); do
            export "CLUSTER_IP4_$i=10.77.0.$((i + 1))" "CLUSTER_IP6_$i=fd77::$((i + 1))"
        done
        "$@"
        ;;
    *) die "unknown command $cmd" ;;
esac
