#!/usr/bin/env python3
"""Start-up of a tutti job as it grows: wall time from launch to exit, and what one rank holds.

For each N, runs `tutti-run --nproc N -- collbench allreduce -b 8 -e 64K -f 8192 -n 5 -w 1 -c 1`
(a job that starts, runs a few small allreduces and exits, so its time is start-up and
shutdown), while a sampler reads /proc every 20 ms for the collbench processes: the most file
descriptors and threads any one rank held. Variants (environment settings, e.g. `TUTTI_SHM=0`)
run interleaved with the default in every round, so their ratios come from the same minutes of
the machine.

    python3 tools/bench/startup.py --sizes 16,32,64,128,256 --rounds 3 \\
        [--variant TUTTI_SHM=0] [--bin target/release [--bin OTHER_BUILD/release]] [--timeout 300]

Several `--bin` directories (today's build and another) run interleaved too, each variant with
each build, so old and new are compared in the same minutes.

Prints one line per run (`round N variant rc wall fds threads`) and a markdown table of medians.
Exit status 1 when any run failed (its output's last lines are printed).
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time


def ranks_of(root_pid):
    """Pids of the collbench processes below root_pid (any depth)."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [root_pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            todo.append(c)
            try:
                with open(f"/proc/{c}/comm") as f:
                    if f.read().strip() == "collbench":
                        out.append(c)
            except OSError:
                pass
    return out


def sample(root_pid, stop, peak):
    while not stop.is_set():
        for p in ranks_of(root_pid):
            try:
                fds = len(os.listdir(f"/proc/{p}/fd"))
                threads = len(os.listdir(f"/proc/{p}/task"))
            except OSError:
                continue
            peak["fds"] = max(peak["fds"], fds)
            peak["threads"] = max(peak["threads"], threads)
        stop.wait(0.02)


def run(n, env_extra, bindir, args):
    env = dict(os.environ)
    env.update(env_extra)
    cmd = [
        os.path.join(bindir, "tutti-run"), "--nproc", str(n), "--",
        os.path.join(bindir, "collbench"), "allreduce", "-b", "8", "-e", "64K", "-f", "8192",
        "-n", "5", "-w", "1", "-c", "1",
    ]
    peak = {"fds": 0, "threads": 0}
    stop = threading.Event()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    th = threading.Thread(target=sample, args=(p.pid, stop, peak), daemon=True)
    th.start()
    try:
        out, _ = p.communicate(timeout=args.timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        rc = "timeout"
    wall = time.monotonic() - t0
    stop.set()
    th.join()
    return rc, wall, peak, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,32,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[],
                    help="KEY=VAL[,KEY=VAL] run interleaved with the default")
    ap.add_argument("--bin", action="append", default=[],
                    help="directory with tutti-run and collbench (repeat to compare builds)")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    bins = args.bin or ["target/release"]
    envs = [("default", {})]
    for v in args.variant:
        envs.append((v, dict(kv.split("=", 1) for kv in v.split(","))))
    variants = []
    for b in bins:
        for name, env in envs:
            label = name if len(bins) == 1 else f"{b}:{name}"
            variants.append((label, env, b))
    sizes = [int(s) for s in args.sizes.split(",")]
    res = {}
    failed = False
    for r in range(1, args.rounds + 1):
        for n in sizes:
            for name, env, bindir in variants:
                rc, wall, peak, out = run(n, env, bindir, args)
                print(f"round {r} N {n} {name} rc {rc} wall {wall:.2f} fds {peak['fds']} "
                      f"threads {peak['threads']}", flush=True)
                if rc != 0:
                    failed = True
                    print("\n".join(out.strip().splitlines()[-8:]), flush=True)
                res.setdefault((n, name), []).append((rc, wall, peak))
    print()
    print("| N | variant | wall s (median) | rounds | failed | fds of one rank | threads of one rank |")
    print("|---|---|---:|---|---:|---:|---:|")
    for n in sizes:
        for name, _, _ in variants:
            runs = res[(n, name)]
            walls = [w for _, w, _ in runs]
            bad = sum(1 for rc, _, _ in runs if rc != 0)
            fds = max(p["fds"] for _, _, p in runs)
            thr = max(p["threads"] for _, _, p in runs)
            print(f"| {n} | {name} | {statistics.median(walls):.2f} | "
                  f"{' '.join(f'{w:.2f}' for w in walls)} | {bad} | {fds} | {thr} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
