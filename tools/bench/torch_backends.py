#!/usr/bin/env python3
"""torch.distributed with backend "tutti" against backend "gloo", and against collbench.

    python tools/bench/torch_backends.py [--rounds 5] [--worlds 2,4] [--sizes 8,2M,64M]
        [--colls all_reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single,broadcast]
        [--collbench target/release/collbench] [--launcher torchrun|spawn] [--json out.json]

After an untimed warm-up round, each round runs, for every world, both backends (alternating
which goes first) under torchrun (`--standalone`, env:// rendezvous, one intra-op thread each),
then collbench (`--np N`) on the same points. A torch run goes over every collective and size
in one job: float32 tensors, nccl-tests' S (the whole gathered or scattered buffer; one rank's
buffer for all_reduce and broadcast), 3 warm-up calls, the first element of one result
checked, then as many calls back to back as fit in `--secs`; it reports the mean time per call
averaged over ranks, the statistic collbench prints. collbench then runs each point with as
many iterations as tutti's torch run made in that round (at least 20) after 8 warm-up ones,
so both time the same kind of loop. Each round gives a ratio tutti / gloo and tutti-through-
torch / collbench per point; the table prints the medians over rounds of the times and of those
per-round ratios. Inside tutti's torch runs, the timed calls go in 6 blocks, each followed by a
block of the same call made on tutti's communicator directly (same processes, same tensors):
the median of those per-block ratios, the slowest rank's, is the `torch/native` column — the
binding's own cost, measured where the machine's drift cannot reach it. A collective gloo lacks
on CPU is reported as such.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLBENCH_NAME = {
    "all_reduce": ("allreduce", "ip"),
    "all_gather_into_tensor": ("allgather", "oop"),
    "reduce_scatter_tensor": ("reduce_scatter", "oop"),
    "all_to_all_single": ("alltoall", "oop"),
    "broadcast": ("broadcast", "ip"),
}


def size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BLOCKS = 6


def native_call(backend, coll, a, b):
    """The call `coll` makes, on tutti's communicator directly (blocking, no torch)."""
    if backend != "tutti":
        return None
    import torch.distributed as dist
    import tutti.torch as tt

    comm = dist.distributed_c10d._get_default_group().comm
    kw = {"a": tt._raw(a)}
    if b is not None:  # the out-of-place collectives' output
        kw["b"] = tt._raw(b)
    kind, extra = {
        "all_reduce": ("allreduce", {"op": "sum"}),
        "broadcast": ("broadcast", {"root": 0}),
        "all_gather_into_tensor": ("allgather", {}),
        "reduce_scatter_tensor": ("reduce_scatter", {"op": "sum"}),
        "all_to_all_single": ("all_to_all", {}),
    }[coll]
    kw.update(extra)
    dt = tt._dtype(a)
    return lambda: comm.run(kind, dt, async_op=False, **kw)


# -- the worker (one process per rank) --------------------------------------------------------


def worker(rank, n, backend, colls, sizes, secs, init, q):
    import torch
    import torch.distributed as dist

    if backend == "tutti":
        import tutti.torch  # noqa: F401
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=n)
    out = {}
    for coll in colls:
        for s in sizes:
            count = max(s // 4, n)
            count -= count % n
            if coll in ("all_reduce", "broadcast"):
                a, b = torch.full((count,), float(rank + 1)), None
            elif coll == "all_gather_into_tensor":
                a, b = torch.full((count // n,), float(rank + 1)), torch.empty(count)
            elif coll == "reduce_scatter_tensor":
                a, b = torch.full((count,), float(rank + 1)), torch.empty(count // n)
            else:
                a, b = torch.full((count,), float(rank + 1)), torch.empty(count)

            def one():
                if coll == "all_reduce":
                    dist.all_reduce(a)
                elif coll == "broadcast":
                    dist.broadcast(a, 0)
                elif coll == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(b, a)
                elif coll == "reduce_scatter_tensor":
                    dist.reduce_scatter_tensor(b, a)
                else:
                    dist.all_to_all_single(b, a)

            try:
                one()
            except Exception as e:  # noqa: BLE001 - a collective the backend lacks
                out[(coll, s)] = f"unsupported: {str(e).splitlines()[0][:80]}"
                dist.barrier()
                continue
            for _ in range(2):
                one()
            a.fill_(float(rank + 1))
            one()
            got = (b if b is not None else a)[0].item()
            want = {"all_reduce": n * (n + 1) / 2, "broadcast": 1.0,
                    "all_gather_into_tensor": 1.0, "reduce_scatter_tensor": n * (n + 1) / 2,
                    "all_to_all_single": 1.0}[coll]
            if got != want:
                raise SystemExit(f"{backend} {coll}: got {got}, expected {want}")
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(5):
                one()
            probe = torch.tensor([(time.perf_counter() - t0) / 5])
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            iters = max(5, int(secs / max(probe.item(), 1e-7)))
            native = native_call(backend, coll, a, b)
            # Blocks of calls through torch, alternating with blocks of the same call made on
            # tutti's communicator directly (same processes, same tensors): the binding's own
            # cost, free of the machine's drift between runs.
            block = max(1, iters // BLOCKS)
            spent, ratios = 0.0, []
            for _ in range(BLOCKS):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(block):
                    one()
                td = time.perf_counter() - t0
                spent += td
                if native is not None:
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(block):
                        native()
                    ratios.append(td / (time.perf_counter() - t0))
            per = torch.tensor([spent / (block * BLOCKS)])
            dist.all_reduce(per)
            ratio = statistics.median(ratios) if ratios else None
            if ratio is not None:
                # The slowest rank's ratio.
                rt = torch.tensor([ratio])
                dist.all_reduce(rt, op=dist.ReduceOp.MAX)
                ratio = rt.item()
            out[(coll, s)] = (per.item() / n * 1e6, block * BLOCKS, ratio)
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


class _File:
    """Where rank 0 of a torchrun job leaves its results (a queue's `put`)."""

    def __init__(self, path):
        self.path = path

    def put(self, out):
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump([[list(k), v] for k, v in out.items()], f)


def run_torch(backend, n, colls, sizes, secs, launcher):
    if launcher == "spawn":
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=worker, args=(r, n, backend, colls, sizes, secs, init, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        res = q.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                sys.exit(f"torch_backends: a {backend} rank exited with {p.exitcode}")
        return res
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", os.path.abspath(__file__), "--worker", backend,
               "--colls", ",".join(colls), "--sizes", ",".join(str(x) for x in sizes),
               "--secs", str(secs), "--out", path]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(f"torch_backends: torchrun with {backend} failed ({r.returncode}):\n"
                     f"{r.stdout[-3000:]}")
        with open(path, encoding="utf-8") as f:
            return {tuple(k): tuple(v) if isinstance(v, list) else v for k, v in json.load(f)}


def run_collbench(exe, n, coll, s, iters):
    name, mode = COLLBENCH_NAME[coll]
    # At least one float per rank, as the torch runs use.
    s = max(s - s % (4 * n), 4 * n)
    cmd = [exe, name, "-b", str(s), "-e", str(s), "-n", str(max(20, iters)), "-w", "8",
           "--np", str(n)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == str(s) and len(f) > 10:
            # size count type redop root | oop time algbw busbw #wrong | ip time algbw busbw #wrong
            return float(f[5] if mode == "oop" else f[9])
    sys.exit(f"torch_backends: no result line in collbench's output:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="8,2M,64M")
    ap.add_argument("--colls", default=",".join(COLLBENCH_NAME))
    ap.add_argument("--secs", type=float, default=0.3)
    ap.add_argument("--collbench", default=os.path.join(ROOT, "target", "release", "collbench"))
    ap.add_argument("--launcher", choices=["torchrun", "spawn"], default="torchrun")
    ap.add_argument("--json")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds first (the first processes of a run are often slow)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [size(x) for x in a.sizes.split(",")]
    colls = a.colls.split(",")
    if a.worker:
        # One rank of a torchrun job.
        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        worker(rank, n, a.worker, colls, sizes, a.secs, "env://", _File(a.out))
        return
    worlds = [int(x) for x in a.worlds.split(",")]
    times = {}
    ratios = {}
    for _ in range(a.warmup):
        for n in worlds:
            for backend in ("gloo", "tutti"):
                run_torch(backend, n, colls[:1], sizes[-1:], 0.05, a.launcher)
    have_cb = os.path.exists(a.collbench)
    for rnd in range(a.rounds):
        for n in worlds:
            order = ["gloo", "tutti"] if (rnd + n) % 2 == 0 else ["tutti", "gloo"]
            got = {b: run_torch(b, n, colls, sizes, a.secs, a.launcher) for b in order}
            for coll in colls:
                for s in sizes:
                    g, t = got["gloo"][(coll, s)], got["tutti"][(coll, s)]
                    times.setdefault(("gloo", n, coll, s), []).append(
                        g if isinstance(g, str) else g[0])
                    times.setdefault(("tutti", n, coll, s), []).append(t[0])
                    ratios.setdefault(("native", n, coll, s), []).append(t[2])
                    if not isinstance(g, str):
                        ratios.setdefault(("gloo", n, coll, s), []).append(t[0] / g[0])
                    if have_cb:
                        c = run_collbench(a.collbench, n, coll, s, t[1])
                        times.setdefault(("collbench", n, coll, s), []).append(c)
                        ratios.setdefault(("collbench", n, coll, s), []).append(t[0] / c)
        print(f"# round {rnd + 1} of {a.rounds} done", file=sys.stderr, flush=True)

    def med(d, key):
        v = d.get(key)
        if not v:
            return None
        if isinstance(v[0], str):
            return v[0]
        return statistics.median(v)

    print(f"# torch.distributed under {a.launcher}, {a.rounds} interleaved rounds: medians of the "
          "mean µs per call, and medians of the per-round ratios")
    print(f"# {'coll':<24} {'n':>2} {'bytes':>10} {'gloo':>12} {'tutti':>12} {'collbench':>10} "
          f"{'tutti/gloo':>10} {'tutti/cb':>9} {'torch/native':>12}")
    rows = []
    for coll in colls:
        for n in worlds:
            for s in sizes:
                g, t, c = (med(times, (k, n, coll, s)) for k in ("gloo", "tutti", "collbench"))
                rg, rc = med(ratios, ("gloo", n, coll, s)), med(ratios, ("collbench", n, coll, s))
                rn = med(ratios, ("native", n, coll, s))
                gs = g if isinstance(g, str) else f"{g:12.1f}"
                tg = "-" if rg is None else f"{rg:10.2f}"
                tc = "-" if rc is None else f"{rc:9.2f}"
                print(f"  {coll:<24} {n:>2} {s:>10} {gs[:12]:>12} {t:12.1f} "
                      f"{'-' if c is None else f'{c:10.1f}':>10} {tg:>10} {tc:>9} "
                      f"{'-' if rn is None else f'{rn:12.2f}':>12}")
                rows.append({"coll": coll, "n": n, "bytes": s, "gloo": g, "tutti": t,
                             "collbench": c, "tutti_over_gloo": rg, "tutti_over_collbench": rc,
                             "torch_over_native": rn})
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"rounds": a.rounds, "launcher": a.launcher, "rows": rows,
                       "all": {str(k): v for k, v in times.items()},
                       "ratios": {str(k): v for k, v in ratios.items()}}, f)


if __name__ == "__main__":
    main()
