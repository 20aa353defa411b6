#!/usr/bin/env python3
"""Two or more collbench builds (and Open MPI) on one point, interleaved, with the machine's
phase: the comparison the house rules ask for before and after a change.

    python3 tools/bench/ab.py [--rounds 8] [--mpi] [--iters "-n 200 -m 100 -w 2000"]
                              [--slow-above 250] COLL NP SIZE NAME=BINARY[,ARG...] ...

    cp target/release/collbench /tmp/cb-before      # then change, rebuild:
    python3 tools/bench/ab.py broadcast 2 8 before=/tmp/cb-before after=target/release/collbench --mpi

Each round runs every build once on the point (collective COLL, NP local ranks, SIZE bytes as
side_by_side.py gives them: whole floats, a multiple of NP), in the order given on even rounds
and reversed on odd ones, then Open MPI's mpibench with its defaults (`--mpi`); extra
collbench arguments follow the binary after commas (`fast=target/release/collbench,--algo,direct`).
Before and after each round `pingpong` (tools/bench/pingpong.c, built into target/ when
missing) measures a cache line's round trip between CPUs 0 and 1: a round is in the usual
phase when both readings are at most --slow-above nanoseconds, in the slow one when both are
above, mixed otherwise. Prints every round, then per phase each build's median time (µs, out of
place / in place, from collbench's JSON) and the median over rounds of its time over the first
build's in the same round (below 1: faster than the first). Small calls need aggregated
iterations (`-m`) to be timed as mpibench times them; the default --iters does that.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import side_by_side as sbs  # noqa: E402  (mpibench's build and runs, sizes)


def pingpong_binary():
    out = os.path.join(ROOT, "target", "pingpong")
    src = os.path.join(HERE, "pingpong.c")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        subprocess.run(["cc", "-O2", "-pthread", "-o", out, src], check=True)
    return out


def pingpong(pp):
    r = subprocess.run([pp], capture_output=True, text=True, timeout=60)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None


def run_collbench(binary, extra, coll, n, size, iters):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        out = subprocess.run([binary, coll, "-b", str(size), "-e", str(size), *iters, "-c", "0",
                              "--np", str(n), "-J", f.name, *extra],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(f"ab: {binary} failed:\n{out.stdout}\n{out.stderr}")
        row = json.load(open(f.name))["runs"][0]["rows"][0]
    return row["oop"]["time_us"], row["ip"]["time_us"]


def phase(before, after, slow):
    if before is None or after is None:
        return "unknown"
    if max(before, after) <= slow:
        return "usual"
    if min(before, after) > slow:
        return "slow"
    return "mixed"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("coll")
    ap.add_argument("np", type=int)
    ap.add_argument("size")
    ap.add_argument("builds", nargs="+", metavar="NAME=BINARY[,ARG...]")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mpi", action="store_true", help="Open MPI (its defaults) in every round")
    ap.add_argument("--iters", default="-n 200 -m 100 -w 2000",
                    help="collbench's iteration arguments")
    ap.add_argument("--slow-above", type=int, default=250,
                    help="ping-pong round trip (ns) above which the machine is in its slow phase")
    a = ap.parse_args()
    builds = []
    for b in a.builds:
        name, sep, rest = b.partition("=")
        if not sep or not rest:
            sys.exit(f"ab: '{b}' is not NAME=BINARY[,ARG...]")
        binary, *extra = rest.split(",")
        if not os.access(binary, os.X_OK):
            sys.exit(f"ab: {binary} is not an executable")
        builds.append((name, binary, extra))
    names = [b[0] for b in builds]
    if len(set(names)) != len(names) or "mpi" in names:
        sys.exit("ab: build names must differ, and 'mpi' is Open MPI's")
    size = sbs.mpi_bytes(a.np, sbs.size_of(a.size))
    iters = a.iters.split()
    pp = pingpong_binary()
    mb = sbs.build_mpibench() if a.mpi else None
    rounds = []
    for r in range(a.rounds):
        before = pingpong(pp)
        order = builds if r % 2 == 0 else builds[::-1]
        res = {}
        for name, binary, extra in order:
            res[name] = run_collbench(binary, extra, a.coll, a.np, size, iters)
        if mb:
            _, t = sbs.run_mpi(mb, a.coll, a.np, size, 0.5, shm=True)
            res["mpi"] = (t * 1e6, t * 1e6)
        after = pingpong(pp)
        ph = phase(before, after, a.slow_above)
        rounds.append((ph, res))
        cols = "  ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in res.items())
        print(f"round {r + 1}: ping-pong {before}/{after} ns ({ph}): {cols}", flush=True)
    labels = names + (["mpi"] if mb else [])
    first = names[0]
    print(f"# {a.coll}, {a.np} ranks, {size} B; µs out of place / in place (Open MPI: its one "
          f"mode); x{first}: median over rounds of the time over {first}'s in the same round")
    for ph in ("usual", "slow", "mixed", "unknown"):
        rr = [res for p, res in rounds if p == ph]
        if not rr:
            continue
        parts = []
        for k in labels:
            med = [statistics.median(x[k][m] for x in rr) for m in (0, 1)]
            rat = [statistics.median(x[k][m] / x[first][m] for x in rr) for m in (0, 1)]
            parts.append(f"{k} {med[0]:.3f}/{med[1]:.3f} (x{first} {rat[0]:.2f}/{rat[1]:.2f})")
        print(f"{ph}, {len(rr)} rounds: " + "  ".join(parts))


if __name__ == "__main__":
    main()
