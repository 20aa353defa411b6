"""Failures under torchrun: `kill` (rank 1 SIGKILLs itself mid-allreduce), `dtype` and
`shape` (rank 1 calls with another dtype / length). Every rank that survives writes
"RAISED <seconds> <message>" and then whether the group refuses further calls ("AGAIN …") to
its own file in the directory given as the second argument (processes sharing one stdout can
interleave their lines)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import tutti.torch  # noqa: F401
from tutti import TuttiError


def main():
    mode, outdir = sys.argv[1], sys.argv[2]
    dist.init_process_group("tutti")
    r = dist.get_rank()
    report = open(os.path.join(outdir, f"rank{r}.txt"), "w", encoding="utf-8")

    def say(line):
        report.write(line + "\n")
        report.flush()
    t0 = time.monotonic()
    try:
        if mode == "kill":
            x = torch.ones(1 << 18)
            for i in range(1000):
                if r == 1 and i == 20:
                    os.kill(os.getpid(), signal.SIGKILL)
                t0 = time.monotonic()
                dist.all_reduce(x)
        elif mode == "dtype":
            x = torch.ones(10, dtype=torch.float64 if r == 1 else torch.float32)
            dist.all_reduce(x)
        elif mode == "shape":
            x = torch.ones(11 if r == 1 else 10)
            dist.all_reduce(x)
        say(f"rank {r} NO ERROR")
        return
    except TuttiError as e:
        msg = str(e).replace("\n", " ")
        say(f"rank {r} RAISED {time.monotonic() - t0:.3f} {msg}")
    t1 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        say(f"rank {r} AGAIN no error")
    except TuttiError as e:
        say(f"rank {r} AGAIN {time.monotonic() - t1:.3f} {str(e)[:200]}")
    os._exit(3)


if __name__ == "__main__":
    main()
