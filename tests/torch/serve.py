"""Serve a torch TCPStore on 127.0.0.1 with the libuv server (argument `libuv`) or the classic
one (`classic`); print `PORT <n>` and `TORCH <version>`, then serve until killed (at most 120 s).
Used by tests/tests/torchrun.rs."""
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

libuv = sys.argv[1] == "libuv"
store = dist.TCPStore(
    "127.0.0.1", 0, 1, True, timedelta(seconds=120), wait_for_workers=False, use_libuv=libuv
)
print(f"PORT {store.port}", flush=True)
print(f"TORCH {torch.__version__} libuv={store.libuvBackend}", flush=True)
deadline = time.time() + 120
while time.time() < deadline:
    time.sleep(0.2)
