#!/usr/bin/env python3
"""Randomized kill runs of elastic data parallel (a benchmark, not CI).

Each round starts `tutti-run --elastic --nproc N` with the `elastic_dp` example, picks a
transport, a signal (SIGKILL, or SIGSTOP one round in five), a victim and a step at random,
signals the victim when it reaches that step, and measures the time from the signal to the
first step a survivor completes on the smaller world. It checks that every survivor finishes
every step, that their weights agree, and that they equal a replay of the survivors' schedule
(`elastic_dp --schedule`); a round that runs past its deadline counts as a hang.

    cargo build --release -p tutti-tools -p tutti-parallel --example elastic_dp
    python3 tools/bench/elastic_kill.py --rounds 100 --ranks 8 --seed 1

Prints one line per round, then a table per (transport, signal): rounds, median and worst
recovery time, wrong results, hangs.
"""

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "target", "release", "tutti-run")
EXAMPLE = os.path.join(ROOT, "target", "release", "examples", "elastic_dp")


def children(parent):
    """{rank: pid} of the launcher's children (RANK from their environment)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(
                    kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv
                )
            out[int(env[b"RANK"])] = int(d)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def one_round(rng, n, steps, step_ms, transport, sig, deadline):
    env = dict(os.environ, TUTTI_TRANSPORT=transport)
    p = subprocess.Popen(
        [RUN, "--elastic", "--nproc", str(n), "--grace", "1", "--",
         EXAMPLE, "--steps", str(steps), "--step-ms", str(step_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    lines = []

    def pump():
        for line in p.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    victim = rng.randrange(n)
    at = rng.randrange(5, steps // 2)
    start = time.time()
    kill_t = None
    pids = {}
    while time.time() - start < deadline:
        if kill_t is None:
            if any(f"[{victim}] STEP {at} " in l for _, l in lines):
                pids = children(p.pid)
                kill_t = time.time()
                os.kill(pids[victim], sig)
        if p.poll() is not None:
            break
        time.sleep(0.002)
    hung = p.poll() is None
    if hung or sig == signal.SIGSTOP:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if hung:
            p.kill()
    p.wait()
    t.join(timeout=5)
    if kill_t is None:
        return None, hung, False, "the kill step never came"
    # The first step completed on the smaller world, by its own clock (t_us).
    first = None
    for _, l in lines:
        if f" world {n - 1} " in l and " t_us " in l:
            us = int(l.rsplit(" t_us ", 1)[1])
            first = us / 1e6 if first is None else min(first, us / 1e6)
    done = [l.split("DONE ", 1)[1] for _, l in lines if "DONE " in l]
    ok = len(done) == n - 1 and len(set(done)) == 1
    if ok:
        schedule = done[0].split(" schedule ")[1]
        # The replay runs in memory with the job's algorithms: direct reads, which a job's ranks
        # of one host use over TCP and QUIC alike (a float sum's bits depend on the algorithm).
        renv = dict(os.environ, TUTTI_DIRECT="1")
        ref = subprocess.run([EXAMPLE, "--schedule", schedule], capture_output=True, text=True,
                             env=renv)
        ok = ref.stdout.strip() == "DONE " + done[0]
    took = None if first is None else first - kill_t
    return took, hung, ok, f"victim {victim} at step {at}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--step-ms", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transports", default="tcp,quic")
    ap.add_argument("--deadline", type=float, default=90.0)
    a = ap.parse_args()
    for exe in (RUN, EXAMPLE):
        if not os.path.exists(exe):
            sys.exit(f"{exe} is missing: cargo build --release -p tutti-tools -p tutti-parallel "
                     "--example elastic_dp")
    rng = random.Random(a.seed)
    results = {}
    for i in range(a.rounds):
        transport = rng.choice(a.transports.split(","))
        sig = signal.SIGSTOP if rng.randrange(5) == 0 else signal.SIGKILL
        took, hung, ok, what = one_round(rng, a.ranks, a.steps, a.step_ms, transport, sig,
                                         a.deadline)
        name = signal.Signals(sig).name
        results.setdefault((transport, name), []).append((took, hung, ok))
        shown = "-" if took is None else f"{took:.3f} s"
        print(f"round {i}: {transport} {name} {what}: recovered in {shown}, "
              f"{'ok' if ok else 'WRONG'}{', HUNG' if hung else ''}", flush=True)
    print()
    print("| transport | signal | rounds | median | worst | wrong results | hangs |")
    print("|---|---|---|---|---|---|---|")
    for (transport, name), rs in sorted(results.items()):
        times = [t for t, _, _ in rs if t is not None]
        med = f"{statistics.median(times):.2f} s" if times else "-"
        worst = f"{max(times):.2f} s" if times else "-"
        wrong = sum(1 for _, _, ok in rs if not ok)
        hangs = sum(1 for _, h, _ in rs if h)
        print(f"| {transport} | {name} | {len(rs)} | {med} | {worst} | {wrong} | {hangs} |")


if __name__ == "__main__":
    main()
