#!/usr/bin/env python3
"""torch.distributed with backend "tutti" against backend "gloo", and against collbench.

    python tools/bench/torch_backends.py [--rounds 5] [--worlds 2,4] [--sizes 8,2M,64M]
        [--colls all_reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single,broadcast]
        [--collbench target/release/collbench] [--launcher torchrun|spawn] [--json out.json]

After an untimed warm-up round, each round runs, for every world, both backends (alternating
which goes first) under torchrun (`--standalone`, env:// rendezvous, one intra-op thread each).
A torch run goes over every collective and size in one job: float32 tensors, nccl-tests' S (the
whole gathered or scattered buffer; one rank's buffer for all_reduce and broadcast), 3 warm-up
calls, the first element of one result checked, then as many calls as fit in `--secs`, in 6
blocks; it reports the mean time per call averaged over ranks, the statistic collbench prints.
Inside tutti's torch job, each point also runs collbench (`--np N`, as many iterations, after 8
warm-up ones, so both time the same kind of loop): rank 0 starts it while the other ranks sleep
on the store, right before the point's timed blocks or right after them (alternating by point
and round), so the two are seconds apart and the machine's drift between them is small. Each
round gives a ratio tutti / gloo and tutti-through-torch / collbench per point; the table
prints the medians over rounds of the times and of those per-round ratios. Each timed block
through torch is paired with a block of the same call made on tutti's communicator directly
(same processes, same tensors; which of the two goes first alternates): the median over blocks
of the ratio of their times, each averaged over ranks, is the `torch/native` column — the
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


def collbench_here(rank, exe, n, coll, s, iters):
    """collbench on the point, from inside a torch job: rank 0 runs it while the other ranks
    sleep on the store until it is done. Its mean µs per call, on every rank."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"torch_backends/collbench/{coll}/{s}"
    if rank == 0:
        store.set(key, str(run_collbench(exe, n, coll, s, iters)))
    else:
        store.wait([key])
    return float(store.get(key))


# -- the worker (one process per rank) --------------------------------------------------------


def worker(rank, n, backend, colls, sizes, secs, init, q, cb=None, rnd=0):
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
            # collbench on the same point, run by rank 0 while the other ranks wait on the
            # store (asleep): right before the timed blocks when the round and the point's
            # indices add up to an even number, right after them otherwise, so the machine's
            # drift between the two is seconds.
            cb_first = (rnd + colls.index(coll) + sizes.index(s)) % 2 == 0
            cb_time = None
            if cb and cb_first:
                cb_time = collbench_here(rank, cb, n, coll, s, iters)
            # Blocks of calls through torch, alternating with blocks of the same call made on
            # tutti's communicator directly (same processes, same tensors; which goes first
            # alternates): the binding's own cost, free of the machine's drift between runs.
            block = max(1, iters // BLOCKS)

            def timed(f):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(block):
                    f()
                return time.perf_counter() - t0

            spent, ratios = 0.0, []
            for k in range(BLOCKS):
                if native is None:
                    td = timed(one)
                elif k % 2 == 0:
                    td, tn = timed(one), timed(native)
                else:
                    tn = timed(native)
                    td = timed(one)
                spent += td
                if native is not None:
                    # Averaged over ranks, as the times are.
                    both = torch.tensor([td, tn], dtype=torch.float64)
                    dist.all_reduce(both)
                    ratios.append(both[0].item() / both[1].item())
            per = torch.tensor([spent / (block * BLOCKS)])
            dist.all_reduce(per)
            ratio = statistics.median(ratios) if ratios else None
            if cb and not cb_first:
                cb_time = collbench_here(rank, cb, n, coll, s, iters)
            out[(coll, s)] = (per.item() / n * 1e6, block * BLOCKS, ratio, cb_time)
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


def run_torch(backend, n, colls, sizes, secs, launcher, cb=None, rnd=0):
    if launcher == "spawn":
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=worker,
                             args=(r, n, backend, colls, sizes, secs, init, q, cb, rnd))
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
               "--secs", str(secs), "--out", path, "--round", str(rnd)]
        if cb:
            cmd += ["--cb", cb]
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
    # Run from inside a torchrun job, collbench must not take its rank for one of the job's.
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in launch and not k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))}
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         check=True, env=env).stdout
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
    ap.add_argument("--cb", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [size(x) for x in a.sizes.split(",")]
    colls = a.colls.split(",")
    if a.worker:
        # One rank of a torchrun job.
        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        worker(rank, n, a.worker, colls, sizes, a.secs, "env://", _File(a.out), a.cb, a.round)
        return
    worlds = [int(x) for x in a.worlds.split(",")]
    times = {}
    ratios = {}
    for _ in range(a.warmup):
        for n in worlds:
            for backend in ("gloo", "tutti"):
                run_torch(backend, n, colls[:1], sizes[-1:], 0.05, a.launcher)
    have_cb = os.path.exists(a.collbench)
    cb = a.collbench if have_cb else None
    for rnd in range(a.rounds):
        for n in worlds:
            order = ["gloo", "tutti"] if (rnd + n) % 2 == 0 else ["tutti", "gloo"]
            got = {b: run_torch(b, n, colls, sizes, a.secs, a.launcher,
                                cb if b == "tutti" else None, rnd) for b in order}
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
                        c = t[3]
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
