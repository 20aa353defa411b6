#!/usr/bin/env python3
"""Randomized kill soak: how fast, and how well, survivors name a rank that dies.

Each round starts WORLD collbench ranks with torchrun-style variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), picks a transport (shared memory, TCP alone or QUIC), a collective, a size, a victim and a moment at
random, then sends SIGKILL (or, one round in five, SIGSTOP) to the victim. It measures the time
until every survivor has exited on its own, and checks that each survivor's error names the
victim. A round where a survivor is still running after --hang seconds counts as a hang (the
survivors are then killed). Prints one line per round and a summary table (median and worst
per transport and signal). Not part of CI: a benchmark of failure handling.

With --launcher PATH (tutti-run), each round starts the ranks under that launcher instead, so
its notice to the survivors counts too; the victim is found among the launcher's children by
its RANK, and the survivors' errors are read from the launcher's prefixed output.

    cargo build --release -p tutti-tools
    python3 tools/bench/kill_soak.py --rounds 100
    python3 tools/bench/kill_soak.py --rounds 100 --launcher target/release/tutti-run
"""

import argparse
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

COLLS = ["allreduce", "allgather", "alltoall", "broadcast", "reduce_scatter"]
SIZES = ["8", "4K", "1M", "16M"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def names(err, victim, me):
    """Whether a survivor's error text names the victim (its own `rank ME:` prefixes aside)."""
    text = re.sub(rf"\brank {me}:", "", err)
    return re.search(rf"\branks? {victim}\b", text) is not None


def transport_env(transport):
    """The variables for a transport of the soak: `shm` is TCP with its links through shared
    memory (the default on one host), `tcp` TCP alone (`TUTTI_SHM=0`), `quic` QUIC alone
    (`TUTTI_SHM=0`: a QUIC job's ranks of one host otherwise link through shared memory)."""
    if transport == "shm":
        return {"TUTTI_TRANSPORT": "tcp", "TUTTI_SHM": "1"}
    if transport == "tcp":
        return {"TUTTI_TRANSPORT": "tcp", "TUTTI_SHM": "0"}
    return {"TUTTI_TRANSPORT": transport, "TUTTI_SHM": "0"}


class Direct:
    """WORLD ranks started by this script with torchrun-style variables."""

    def __init__(self, cmd, world, transport):
        port = free_port()
        self.procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       **transport_env(transport))
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True))

    def pid(self, r):
        return self.procs[r].pid if self.procs[r].poll() is None else None

    def running(self, r):
        return self.procs[r].poll() is None

    def finish(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        return {r: p.communicate()[1] for r, p in enumerate(self.procs)}


def gone(pid):
    """True once `pid` has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Launched:
    """WORLD ranks started by tutti-run; they are found among its children by RANK."""

    def __init__(self, cmd, world, transport, launcher):
        env = dict(os.environ, **transport_env(transport))
        self.launcher = subprocess.Popen([launcher, "--nproc", str(world), "--grace", "5", "--"]
                                         + cmd, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)
        self.pids = {}
        deadline = time.monotonic() + 10
        while len(self.pids) < world and time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            for k in kids:
                try:
                    with open(f"/proc/{k}/environ", "rb") as f:
                        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                    self.pids[int(env[b"RANK"])] = k
                except (OSError, KeyError, ValueError):
                    pass
            time.sleep(0.01)

    def pid(self, r):
        return self.pids.get(r)

    def running(self, r):
        return r in self.pids and not gone(self.pids[r])

    def finish(self):
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGINT)
            try:
                self.launcher.wait(10)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
        errs = {}
        for line in self.launcher.communicate()[1].splitlines():
            m = re.match(r"\[(\d+)\] (.*)", line)
            if m:
                errs[int(m.group(1))] = errs.get(int(m.group(1)), "") + m.group(2) + "\n"
        return errs


def round_(rng, binary, world, hang, launcher, colls=COLLS, sizes=SIZES):
    transport = rng.choice(["shm", "tcp", "quic"])
    coll, size = rng.choice(colls), rng.choice(sizes)
    victim = rng.randrange(world)
    sig = signal.SIGSTOP if rng.random() < 0.2 else signal.SIGKILL
    delay = rng.uniform(0.3, 1.5)
    cmd = [binary, coll, "-b", size, "-e", size, "-n", "1000000", "-w", "1", "-c", "0"]
    job = Launched(cmd, world, transport, launcher) if launcher else Direct(cmd, world, transport)
    time.sleep(delay)
    pid = job.pid(victim)
    if pid is None or not job.running(victim):
        job.finish()
        return None  # the victim was gone before the signal (start-up failure)
    os.kill(pid, sig)
    t0 = time.monotonic()
    survivors = [r for r in range(world) if r != victim]
    hung = False
    while any(job.running(r) for r in survivors):
        if time.monotonic() - t0 > hang:
            hung = True
            break
        time.sleep(0.005)
    elapsed = time.monotonic() - t0
    if sig == signal.SIGSTOP:
        os.kill(pid, signal.SIGCONT)
    errs = job.finish()
    errs = {r: errs.get(r, "") for r in range(world)}
    named = all(names(errs[r], victim, r) for r in survivors)
    sig_name = "SIGSTOP" if sig == signal.SIGSTOP else "SIGKILL"
    line = f"{transport:4} {sig_name} {coll:14} {size:>3} victim {victim}: {elapsed:6.3f} s"
    line += " HANG" if hung else ""
    line += "" if named else " MISNAMED"
    print(line, flush=True)
    if not named:
        for r in survivors:
            last = errs[r].strip().splitlines()[-1:] or ["(no output)"]
            print(f"    rank {r}: {last[0][:300]}", flush=True)
    return transport, sig_name, elapsed, hung, named


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hang", type=float, default=60.0, help="seconds before a round is a hang")
    ap.add_argument("--bin", default="target/release/collbench")
    ap.add_argument("--launcher", help="start each round's ranks under this tutti-run")
    ap.add_argument("--colls", default=",".join(COLLS), help="collectives to draw from")
    ap.add_argument("--sizes", default=",".join(SIZES), help="sizes to draw from")
    a = ap.parse_args()
    if not os.path.exists(a.bin):
        sys.exit(f"{a.bin} not found: cargo build --release -p tutti-tools")
    rng = random.Random(a.seed)
    colls, sizes = a.colls.split(","), a.sizes.split(",")
    runs = (round_(rng, a.bin, a.world, a.hang, a.launcher, colls, sizes) for _ in range(a.rounds))
    results = [r for r in runs if r]
    print("\n| transport | signal | rounds | median | worst | error names the victim | hangs |")
    print("|---|---|---|---|---|---|---|")
    for t in ["shm", "tcp", "quic"]:
        for s in ["SIGKILL", "SIGSTOP"]:
            rs = [r for r in results if r[0] == t and r[1] == s]
            if not rs:
                continue
            times = [r[2] for r in rs]
            name = {"shm": "TCP + shared memory", "tcp": "TCP alone"}.get(t, t.upper())
            print(f"| {name} | {s} | {len(rs)} | {statistics.median(times):.2f} s | "
                  f"{max(times):.2f} s | {sum(r[4] for r in rs)} / {len(rs)} | "
                  f"{sum(r[3] for r in rs)} |")


if __name__ == "__main__":
    main()
