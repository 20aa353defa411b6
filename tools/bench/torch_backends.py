#!/usr/bin/env python3
"""torch.distributed with backend "tutti" against backend "gloo", and against collbench.

    python tools/bench/torch_backends.py [--rounds 3] [--worlds 2,4] [--sizes 8,2M,64M]
        [--colls all_reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single,broadcast]
        [--collbench target/release/collbench] [--json out.json]

After an untimed warm-up round, each round runs, for every world, both backends (alternating which goes first) and collbench
(`--np N`) over every collective and size. A torch run starts N processes on 127.0.0.1
(`init_method=tcp://`, one intra-op thread each), float32 tensors, nccl-tests' S (the whole
gathered or scattered buffer; one rank's buffer for all_reduce and broadcast), 3 warm-up calls,
the first element of one result checked, then as many calls back to back as fit in 0.3 s; it
reports the mean time per call averaged over ranks, the statistic collbench prints. Prints the
median over rounds per point, the ratio tutti / gloo (time, below 1 = tutti faster) and
tutti-through-torch / collbench. A collective gloo lacks on CPU is reported as such.
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


# -- the worker (one process per rank) --------------------------------------------------------


def worker(rank, n, backend, colls, sizes, secs, port, q):
    import torch
    import torch.distributed as dist

    if backend == "tutti":
        import tutti.torch  # noqa: F401
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
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
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                one()
            per = torch.tensor([(time.perf_counter() - t0) / iters])
            dist.all_reduce(per)
            out[(coll, s)] = per.item() / n * 1e6
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def run_torch(backend, n, colls, sizes, secs):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, n, backend, colls, sizes, secs, port, q))
             for r in range(n)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            sys.exit(f"torch_backends: a {backend} rank exited with {p.exitcode}")
    return res


def run_collbench(exe, n, coll, s):
    name, mode = COLLBENCH_NAME[coll]
    # At least one float per rank, as the torch runs use.
    s = max(s - s % (4 * n), 4 * n)
    cmd = [exe, name, "-b", str(s), "-e", str(s), "-n", "20", "-w", "3", "--np", str(n)]
    if s < (1 << 20):
        cmd[cmd.index("-n") + 1] = "2000"
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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="8,2M,64M")
    ap.add_argument("--colls", default=",".join(COLLBENCH_NAME))
    ap.add_argument("--secs", type=float, default=0.3)
    ap.add_argument("--collbench", default=os.path.join(ROOT, "target", "release", "collbench"))
    ap.add_argument("--json")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds first (the first processes of a run are often slow)")
    a = ap.parse_args()
    worlds = [int(x) for x in a.worlds.split(",")]
    sizes = [size(x) for x in a.sizes.split(",")]
    colls = a.colls.split(",")
    times = {}
    for _ in range(a.warmup):
        for n in worlds:
            for backend in ("gloo", "tutti"):
                run_torch(backend, n, colls[:1], sizes[-1:], 0.05)
    for rnd in range(a.rounds):
        for n in worlds:
            order = ["gloo", "tutti"] if (rnd + n) % 2 == 0 else ["tutti", "gloo"]
            for backend in order:
                for k, v in run_torch(backend, n, colls, sizes, a.secs).items():
                    times.setdefault((backend, n) + k, []).append(v)
            if os.path.exists(a.collbench):
                for coll in colls:
                    for s in sizes:
                        times.setdefault(("collbench", n, coll, s), []).append(
                            run_collbench(a.collbench, n, coll, s))
        print(f"# round {rnd + 1} of {a.rounds} done", file=sys.stderr, flush=True)

    def med(key):
        v = times.get(key)
        if not v:
            return None
        if isinstance(v[0], str):
            return v[0]
        return statistics.median(v)

    print(f"# torch.distributed {a.rounds} interleaved rounds, medians of the mean µs per call")
    print(f"# {'coll':<24} {'n':>2} {'bytes':>10} {'gloo':>12} {'tutti':>12} {'collbench':>10} "
          f"{'tutti/gloo':>10} {'tutti/cb':>9}")
    rows = []
    for coll in colls:
        for n in worlds:
            for s in sizes:
                g, t, c = med(("gloo", n, coll, s)), med(("tutti", n, coll, s)), med(("collbench", n, coll, s))
                gs = g if isinstance(g, str) else f"{g:12.1f}"
                tg = "-" if isinstance(g, str) or g is None else f"{t / g:10.2f}"
                tc = "-" if c is None else f"{t / c:9.2f}"
                print(f"  {coll:<24} {n:>2} {s:>10} {gs[:12]:>12} {t:12.1f} "
                      f"{'-' if c is None else f'{c:10.1f}':>10} {tg:>10} {tc:>9}")
                rows.append({"coll": coll, "n": n, "bytes": s, "gloo": g, "tutti": t, "collbench": c})
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"rounds": a.rounds, "rows": rows, "all": {str(k): v for k, v in times.items()}}, f)


if __name__ == "__main__":
    main()
