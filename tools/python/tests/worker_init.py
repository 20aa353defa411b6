"""One rank of a job initialised with a given init method:

    python worker_init.py METHOD RANK WORLD [ARG]

METHOD is tcp (ARG: port), file (ARG: path) or env (the environment's variables, as under
torchrun or tutti-run; RANK and WORLD are then read from it). Checks one all_reduce and one
sub-group, prints "rank R OK"."""

import os
import sys

import torch
import torch.distributed as dist

import tutti.torch  # noqa: F401

method = sys.argv[1]
if method == "env":
    dist.init_process_group("tutti")
elif method == "tcp":
    dist.init_process_group("tutti", init_method=f"tcp://127.0.0.1:{sys.argv[4]}",
                            rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
else:
    dist.init_process_group("tutti", init_method=f"file://{sys.argv[4]}",
                            rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
r, n = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
assert t.item() == n * (n + 1) / 2, t
g = dist.new_group(list(range(0, n, 2)))
if r % 2 == 0:
    t = torch.tensor([r])
    dist.all_reduce(t, group=g)
    assert t.item() == sum(range(0, n, 2)), t
dist.barrier()
dist.destroy_process_group()
print(f"rank {r} OK", flush=True)
