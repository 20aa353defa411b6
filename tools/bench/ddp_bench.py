#!/usr/bin/env python3
"""torch DistributedDataParallel step time with backend "tutti" and "gloo", interleaved.

    python tools/bench/ddp_bench.py [--rounds 3] [--cluster RATE] [--hidden 1024] [--layers 8]
        [--batch 256] [--steps 5] [--bucket-mb 4] [--variants tutti,tutti-blocking,gloo]

Two ranks train the same MLP (`--layers` blocks of Linear(hidden, hidden) + ReLU, float32) with
DDP, one intra-op thread each; a step is zero_grad, forward, backward (DDP's bucketed
all-reduces), SGD step. After 3 warm-up steps, `--steps` steps are timed between barriers; then
as many steps under `no_sync()` (no communication) give the compute alone. Rank 0 prints both
and a checksum of the weights, which must agree across variants of one round.

With `--cluster RATE` the two ranks run on two hosts of the namespace cluster
(`tests/cluster/cluster.sh up 2 --rate RATE`, needs root), each under its own torchrun, so the
gradients cross a link of that rate; without it, both run on this host under one torchrun.

Variants: `tutti`; `gloo`; and `tutti-blocking`, tutti with `Work.get_future()` replaced by one
that waits for the call before returning (what the backend did before session 17): DDP takes each
bucket's future and goes on with the backward pass, so this control shows what overlapping the
buckets' all-reduces with the backward pass is worth. Each round runs every variant once, in an
order that rotates by round; the table gives the medians over rounds and the per-round ratios to
the first variant.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "tests", "cluster", "cluster.sh")

WORKER = r'''
import os, sys, time
import torch, torch.distributed as dist, torch.nn as nn

variant = sys.argv[1]
backend = "gloo" if variant == "gloo" else "tutti"
if backend == "tutti":
    import tutti.torch
    if variant == "tutti-blocking":
        from torch.futures import Future

        def blocking(self):
            fut = Future()
            try:
                self._finish()
                fut.set_result(self._result)
            except Exception as e:
                fut.set_exception(e)
            return fut

        tutti.torch._Work.get_future = blocking
H, L, B, N, CAP = (int(os.environ["DDPB_H"]), int(os.environ["DDPB_L"]), int(os.environ["DDPB_B"]),
                   int(os.environ["DDPB_N"]), float(os.environ["DDPB_CAP"]))
dist.init_process_group(backend)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.ReLU()) for _ in range(L)])
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(B, H, generator=torch.Generator().manual_seed(1 + dist.get_rank()))


def step():
    opt.zero_grad(set_to_none=False)
    ddp(x).square().mean().backward()
    opt.step()


for _ in range(3):
    step()
dist.barrier()
t = time.perf_counter()
for _ in range(N):
    step()
dist.barrier()
dt = (time.perf_counter() - t) / N
with ddp.no_sync():
    t = time.perf_counter()
    for _ in range(N):
        step()
    dc = (time.perf_counter() - t) / N
if dist.get_rank() == 0:
    s = sum(p.double().sum().item() for p in model.parameters())
    print(f"DDPB step_ms {dt * 1e3:.2f} compute_ms {dc * 1e3:.2f} check {s:.9f}", flush=True)
dist.destroy_process_group()
'''


def run(variant: str, args, worker: str) -> tuple[float, float, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DDPB_H=str(args.hidden), DDPB_L=str(args.layers),
               DDPB_B=str(args.batch), DDPB_N=str(args.steps), DDPB_CAP=str(args.bucket_mb))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = str(random.randint(20000, 30000))
    if args.cluster:
        # gloo picks the address its host name resolves to (loopback here) unless told.
        env.update(GLOO_SOCKET_IFNAME="eth0", TUTTI_TOKEN=os.urandom(16).hex())
        procs = [
            subprocess.Popen(
                [CLUSTER, "exec", str(i), "env", *[f"{k}={env[k]}" for k in env if
                                                   k.startswith(("DDPB_", "OMP_", "GLOO_", "TUTTI_"))],
                 *torchrun, "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
                 "--master-addr", "10.77.0.1", "--master-port", port, worker, variant],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for i in range(2)
        ]
    else:
        procs = [subprocess.Popen([*torchrun, "--standalone", "--nproc-per-node", "2", worker,
                                   variant], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for line in "".join(outs).splitlines():
        if line.startswith("DDPB ") or "] DDPB " in line:
            f = line.split("DDPB ", 1)[1].split()
            return float(f[1]), float(f[3]), f[5]
    raise SystemExit(f"{variant}: no result\n" + "".join(outs)[-3000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cluster", metavar="RATE", help="two namespace hosts, links at RATE (root)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=4)
    ap.add_argument("--variants", default="tutti,tutti-blocking,gloo")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if args.cluster:
        subprocess.run([CLUSTER, "up", "2", "--rate", args.cluster], check=True)
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(WORKER)
        os.chmod(f.name, 0o644)
        times: dict[str, list[float]] = {v: [] for v in variants}
        comp: dict[str, list[float]] = {v: [] for v in variants}
        ratios: dict[str, list[float]] = {v: [] for v in variants}
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            got = {}
            for v in order:
                got[v] = run(v, args, f.name)
                print(f"round {rnd + 1} {v}: step {got[v][0]:.1f} ms, compute alone "
                      f"{got[v][1]:.1f} ms, check {got[v][2]}", flush=True)
            if len({g[2] for g in got.values()}) != 1:
                raise SystemExit(f"the variants' weights differ: {got}")
            for v in variants:
                times[v].append(got[v][0])
                comp[v].append(got[v][1])
                ratios[v].append(got[v][0] / got[variants[0]][0])
        where = f"2 namespace hosts, {args.cluster} links" if args.cluster else "one host"
        print(f"\nDDP, 2 ranks on {where}: {args.layers} x Linear({args.hidden}), batch "
              f"{args.batch}, {args.bucket_mb} MB buckets, {args.rounds} rounds (medians)")
        print(f"| variant | step (ms) | compute alone (ms) | step / {variants[0]} (per round) |")
        print("|---|---:|---:|---|")
        for v in variants:
            rs = ", ".join(f"{r:.2f}" for r in ratios[v])
            print(f"| {v} | {statistics.median(times[v]):.1f} | "
                  f"{statistics.median(comp[v]):.1f} | {statistics.median(ratios[v]):.2f} ({rs}) |")
    finally:
        os.unlink(f.name)
        if args.cluster:
            subprocess.run([CLUSTER, "down"], check=False)


if __name__ == "__main__":
    main()
