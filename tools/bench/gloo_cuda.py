#!/usr/bin/env python3
"""torch.distributed's gloo backend allreducing CUDA tensors (gloo stages them through host
memory too), timed the way collbench times tutti, for tools/gpu-check.sh.

    python3 -m torch.distributed.run --standalone --nproc_per_node N \\
        tools/bench/gloo_cuda.py --sizes 1048576,4194304 --iters 5 --json out.json

Every rank uses GPU LOCAL_RANK modulo the GPUs present (one GPU shared by all ranks is the
intended case). Per size: float32 tensors of S bytes, the first call's result checked exactly
(rank r holds r + 1 everywhere, so the sum is n(n+1)/2), `--warmup` untimed calls, then `--iters`
calls, each one bracketed by `torch.cuda.synchronize()`. The time reported is the mean per call
averaged over ranks (collbench's default statistic), with nccl-tests' algbw and busbw.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,4194304,16777216,67108864,268435456,1073741824")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for size in [int(s) for s in a.sizes.split(",") if s]:
        count = size // 4
        t = torch.full((count,), float(r + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        want = float(n * (n + 1) // 2)
        wrong = int((t != want).sum().item())
        t.zero_()
        for _ in range(a.warmup):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.barrier()
        total = 0.0
        for _ in range(a.iters):
            torch.cuda.synchronize()
            s = time.perf_counter()
            dist.all_reduce(t)
            torch.cuda.synchronize()
            total += time.perf_counter() - s
        mean = torch.tensor([total / a.iters * 1e6, float(wrong)], dtype=torch.float64)
        dist.all_reduce(mean)
        us = mean[0].item() / n
        algbw = size / us / 1e3
        row = {"bytes": size, "time_us": us, "algbw": algbw,
               "busbw": algbw * 2 * (n - 1) / n, "wrong": int(mean[1].item())}
        rows.append(row)
        if r == 0:
            print(f"gloo-cuda n={n} bytes={size} time_us={us:.1f} busbw={row['busbw']:.2f} "
                  f"wrong={row['wrong']}", flush=True)
        del t
    if r == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"nranks": n, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
