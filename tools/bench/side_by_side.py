#!/usr/bin/env python3
"""tutti's collbench, Open MPI (over TCP, and with its defaults) and torch's gloo, side by
side, interleaved.

    python3 tools/bench/side_by_side.py [--rounds 3] [--colls allreduce,broadcast]
                                        [--worlds 2,4] [--sizes 8,2M,64M] [--seconds 0.3]
                                        [--gloo PYTHON|none] [--mpi tcp,shm]
                                        [--tutti-env TUTTI_SHM=0]

Installs Open MPI from the distribution's packages when `mpicc` is missing (Debian/Ubuntu:
openmpi-bin, libopenmpi-dev; needs root), builds `tools/bench/mpi/mpibench.c` into
target/mpibench and `collbench` (release) unless present, then runs every point (collective ×
world × size) for both in every round, alternating which goes first, and prints per point the
median over rounds of the mean time per call averaged over ranks (the statistic every harness
reports: collbench's `time` column, mpibench's mean), busbw by nccl-tests' formulas, and the
ratio of tutti's busbw to the best peer's (above 1: tutti faster), and the median over rounds of
that ratio taken within each round (the three run back to back there, so a drift of the
machine between rounds moves it less). Each peer is compared with tutti's call of the same
kind: Open MPI's broadcast works in place and its other calls out of place; torch's
all_reduce and broadcast work in place and its all_gather out of place. collbench times both
modes in one run; the table shows tutti in Open MPI's mode (`tutti_us`) and in gloo's
(`tutti_g_us`), which differ for allreduce only. Open MPI runs twice (`--mpi`): forced onto
TCP (`--mca btl tcp,self`, column `mpi`), and with its own defaults (column `mpi_shm`: on one
host its shared-memory transport, `vader`), the peers of tutti's TCP and shared-memory links.
`--tutti-env` adds variables to collbench's environment (`TUTTI_SHM=0`: tutti over TCP alone).
collbench times calls of about 10 µs or less in groups (`-m`) that span about 20 µs, one clock
reading per group, as mpibench and gloo_bench time their whole loop with one.
gloo (torch.distributed, CPU tensors, `gloo_bench.py`)
runs where a Python with torch is found (`--gloo`, else $TUTTI_TORCH_PYTHON, else
~/.cache/tutti/venv-torch, as CI makes it) and for the collectives gloo has on CPU (allreduce,
allgather, broadcast). All run for about the same time per point.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


# Calls shorter than this are timed in aggregated iterations (`run_tutti`).
AGG_SPAN = 20e-6


def size_of(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def ensure_mpi():
    if shutil.which("mpicc") and shutil.which("mpirun"):
        return
    if os.geteuid() != 0:
        sys.exit("side_by_side: mpicc is missing; install Open MPI (openmpi-bin, libopenmpi-dev)")
    subprocess.run(["apt-get", "update"], check=False, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "openmpi-bin", "libopenmpi-dev"], check=True,
                   stdout=subprocess.DEVNULL)


def build_mpibench():
    """Open MPI installed if missing, and target/mpibench built from its source if stale."""
    ensure_mpi()
    os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
    mb = os.path.join(ROOT, "target", "mpibench")
    src = os.path.join(ROOT, "tools", "bench", "mpi", "mpibench.c")
    if not os.path.exists(mb) or os.path.getmtime(mb) < os.path.getmtime(src):
        subprocess.run(["mpicc", "-O2", "-o", mb, src], check=True)
    return mb


def build():
    mb = build_mpibench()
    cb = os.path.join(ROOT, "target", "release", "collbench")
    if not os.path.exists(cb):
        subprocess.run(["cargo", "build", "--release", "-p", "tutti-tools", "--bin", "collbench"],
                       cwd=ROOT, check=True)
    return mb, cb


def run_mpi(mb, coll, n, size, secs, shm=False):
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    btl = [] if shm else ["--mca", "btl", "tcp,self"]
    out = subprocess.run(["mpirun", *root, "-np", str(n), *btl,
                          "--oversubscribe", mb, coll, str(size), str(size), str(secs)],
                         capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        v = line.split()
        if v and v[0].isdigit():
            if "WRONG" in line:
                sys.exit(f"side_by_side: Open MPI {coll} n={n} {size} B gave a wrong result")
            return int(v[0]), float(v[1]) * 1e-6
    sys.exit(f"side_by_side: mpibench printed nothing:\n{out.stdout}\n{out.stderr}")


def mpi_bytes(n, size):
    """The bytes mpibench moves for S = `size`: whole floats, at least one per rank, a multiple
    of n; collbench is given the same."""
    count = max(size // 4, n)
    return (count - count % n) * 4


GLOO_COLLS = ("allreduce", "allgather", "broadcast")
# The collectives each peer runs in place (MPI_Bcast; torch's all_reduce and broadcast); the
# others out of place. Each peer is compared with tutti's call of the same kind.
IN_PLACE = {"mpi": ("broadcast",), "gloo": ("allreduce", "broadcast")}
# Which of tutti's results each peer is compared with.
TUTTI_AS = {"mpi": "tutti", "mpi_shm": "tutti", "gloo": "tutti_g"}
PEERS = ("mpi", "mpi_shm", "gloo")


def find_gloo(arg):
    if arg == "none":
        return None
    cands = [arg, os.environ.get("TUTTI_TORCH_PYTHON"),
             os.path.expanduser("~/.cache/tutti/venv-torch/bin/python")]
    for c in cands:
        if c and os.path.exists(c):
            ok = subprocess.run([c, "-c", "import torch.distributed"], capture_output=True)
            if ok.returncode == 0:
                return c
    print("# gloo: no Python with torch found; gloo not measured", file=sys.stderr)
    return None


def run_gloo(py, coll, n, size, secs):
    script = os.path.join(ROOT, "tools", "bench", "gloo_bench.py")
    out = subprocess.run([py, script, coll, str(n), str(size), str(secs)],
                         capture_output=True, text=True, timeout=600)
    v = out.stdout.split()
    if out.returncode != 0 or len(v) < 2:
        sys.exit(f"side_by_side: gloo_bench failed:\n{out.stdout}\n{out.stderr}")
    return int(v[-2]), float(v[-1]) * 1e-6


def run_tutti(cb, coll, n, size, secs, probe, env):
    # As many calls as fit in `secs`, from the time of one probe run. Calls shorter than
    # AGG_SPAN are timed in groups of `-m` back to back (collbench reads the clock once per
    # timed iteration, about 10-25 ns; mpibench and gloo_bench time their whole loop), so that
    # small calls are compared like for like.
    t = max(probe.get((coll, n, size), 1e-3), 1e-7)
    calls = max(5, min(2000000, int(secs / t)))
    agg = max(1, min(calls // 5, int(AGG_SPAN / t)))
    iters = max(5, calls // agg)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        b = str(mpi_bytes(n, size))
        out = subprocess.run([cb, coll, "-b", b, "-e", b, "-n", str(iters), "-m", str(agg),
                              "-w", "3", "-c", "0", "--np", str(n), "-J", f.name],
                             capture_output=True, text=True, timeout=600, env=env)
        if out.returncode != 0:
            sys.exit(f"side_by_side: collbench failed:\n{out.stdout}\n{out.stderr}")
        row = json.load(open(f.name))["runs"][0]["rows"][0]
    # tutti in each peer's mode (see IN_PLACE).
    t = row["ip" if coll in IN_PLACE["mpi"] else "oop"]["time_us"] * 1e-6
    t_gloo = row["ip" if coll in IN_PLACE["gloo"] else "oop"]["time_us"] * 1e-6
    probe[(coll, n, size)] = t
    return row["bytes"], t, t_gloo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--colls", default="allreduce,allgather,reduce_scatter,alltoall,broadcast")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="8,2M,64M")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--gloo", default="", help="Python with torch for gloo, or none")
    ap.add_argument("--mpi", default="tcp,shm", help="Open MPI runs: tcp, shm (its defaults), both")
    ap.add_argument("--tutti-env", default="", help="VAR=VALUE,... for collbench")
    a = ap.parse_args()
    tenv = dict(os.environ)
    for kv in filter(None, a.tutti_env.split(",")):
        k, _, v = kv.partition("=")
        tenv[k] = v
    mpis = [("mpi" if m == "tcp" else "mpi_shm") for m in filter(None, a.mpi.split(","))]
    mb, cb = build()
    gloo = find_gloo(a.gloo)
    colls = a.colls.split(",")
    worlds = [int(x) for x in a.worlds.split(",")]
    sizes = [size_of(x) for x in a.sizes.split(",")]
    res = {}
    probe = {}
    for r in range(a.rounds):
        for coll in colls:
            for n in worlds:
                for size in sizes:
                    order = ["tutti", *mpis] + (["gloo"] if gloo and coll in GLOO_COLLS else [])
                    if r % 2 == 1:
                        order.reverse()
                    for who in order:
                        if who in ("mpi", "mpi_shm"):
                            b, t = run_mpi(mb, coll, n, size, a.seconds, who == "mpi_shm")
                        elif who == "gloo":
                            b, t = run_gloo(gloo, coll, n, size, a.seconds)
                        else:
                            b, t, t_gloo = run_tutti(cb, coll, n, size, a.seconds, probe, tenv)
                            res.setdefault((coll, n, size, "tutti_g"), []).append((b, t_gloo))
                        res.setdefault((coll, n, size, who), []).append((b, t))
        print(f"# round {r + 1} of {a.rounds} done", file=sys.stderr)
    print(f"# {a.rounds} rounds interleaved; median time per call (mean over ranks), busbw GB/s;"
          " tutti_us in Open MPI's mode (in place for broadcast, out of place otherwise),"
          " tutti_g_us in gloo's (in place for allreduce and broadcast); ratio: the smaller of"
          " each peer's median time over tutti's in that peer's mode; per-round: the median over"
          " rounds of that ratio within each round")
    print(f"# {'collective':<15} {'n':>2} {'bytes':>10} {'tutti_us':>10} {'tutti_g_us':>10} "
          f"{'mpi_us':>10} {'mpi_shm_us':>10} {'gloo_us':>10} {'tutti_bw':>9} {'mpi_bw':>9} "
          f"{'mpishm_bw':>9} {'gloo_bw':>9} {'ratio':>6} {'per-round':>9}")
    for coll in colls:
        for n in worlds:
            for size in sizes:
                t = {}
                for who in ("tutti", "tutti_g", *PEERS):
                    v = res.get((coll, n, size, who))
                    if v:
                        t[who] = statistics.median(x[1] for x in v)
                b = mpi_bytes(n, size)
                bw = {w: b / x * FACTOR[coll](n) / 1e9 for w, x in t.items()}
                # Each peer against tutti in that peer's mode.
                ratio = min(t[w] / t[TUTTI_AS[w]] for w in PEERS if w in t)
                # Per round: the same, the three run back to back.
                per_round = [
                    min(res[(coll, n, size, w)][r][1] / res[(coll, n, size, TUTTI_AS[w])][r][1]
                        for w in PEERS if (coll, n, size, w) in res)
                    for r in range(a.rounds)
                ]
                cell = lambda w, f: f.format(t[w] * 1e6) if w in t else f"{'-':>10}"
                bcell = lambda w: f"{bw[w]:>9.3f}" if w in bw else f"{'-':>9}"
                print(f"  {coll:<15} {n:>2} {size:>10} {cell('tutti', '{:>10.1f}')} "
                      f"{cell('tutti_g', '{:>10.1f}')} "
                      f"{cell('mpi', '{:>10.1f}')} {cell('mpi_shm', '{:>10.1f}')} "
                      f"{cell('gloo', '{:>10.1f}')} "
                      f"{bcell('tutti')} {bcell('mpi')} {bcell('mpi_shm')} {bcell('gloo')} "
                      f"{ratio:>6.2f} {statistics.median(per_round):>9.2f}")


if __name__ == "__main__":
    main()
