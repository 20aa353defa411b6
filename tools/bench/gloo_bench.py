#!/usr/bin/env python3
"""Time torch.distributed's gloo backend the way collbench and mpibench time theirs.

    python gloo_bench.py COLL NRANKS BYTES [SECONDS]

COLL: allreduce, allgather or broadcast (gloo on CPU has no reduce-scatter or all-to-all).
Starts NRANKS processes on 127.0.0.1, float32 tensors of BYTES (a multiple of NRANKS floats,
at least one per rank), 3 warm-up calls, then as many calls back to back as fit in SECONDS
(default 0.3; from 5 timed calls, the slowest rank's), timed as a whole. Prints
`BYTES TIME_US`: the mean time per call averaged over ranks. The first element of every result
is checked against the exact value.
"""
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def one(coll, t, out, n):
    if coll == "allreduce":
        dist.all_reduce(t)
    elif coll == "allgather":
        dist.all_gather(out, t)
    elif coll == "broadcast":
        dist.broadcast(t, 0)
    else:
        raise SystemExit(f"gloo_bench: gloo has no CPU {coll}")


def worker(rank, n, coll, nbytes, secs, init, q):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n)
    count = max(nbytes // 4, n)
    count -= count % n
    per = count // n if coll == "allgather" else count
    t = torch.full((per,), float(rank + 1))
    out = [torch.empty(per) for _ in range(n)] if coll == "allgather" else None
    for _ in range(3):
        one(coll, t, out, n)
    # Check one call's first element from a fresh input.
    t.fill_(float(rank + 1))
    one(coll, t, out, n)
    got = out[n - 1][0].item() if coll == "allgather" else t[0].item()
    want = {"allreduce": n * (n + 1) / 2, "allgather": float(n), "broadcast": 1.0}[coll]
    if got != want:
        raise SystemExit(f"gloo_bench: {coll} gave {got}, expected {want}")
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        one(coll, t, out, n)
    probe = torch.tensor([(time.perf_counter() - t0) / 5])
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    iters = max(5, int(secs / max(probe.item(), 1e-7)))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        one(coll, t, out, n)
    mean = torch.tensor([(time.perf_counter() - t0) / iters])
    dist.all_reduce(mean)
    if rank == 0:
        q.put((count * 4, mean.item() / n))
    dist.destroy_process_group()


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    coll, n, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    secs = float(sys.argv[4]) if len(sys.argv) > 4 else 0.3
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # A file store: a TCP store on a port picked beforehand can lose it to another process
    # (EADDRINUSE) on a machine running other benchmarks at the same time.
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "store")
        mp.spawn(worker, args=(n, coll, nbytes, secs, init, q), nprocs=n, join=True)
    b, t = q.get()
    print(b, f"{t * 1e6:.2f}")


if __name__ == "__main__":
    main()
