"""Serve a torch TCPStore and plant forged tutti entries in it, as anyone who can reach the port
could (torch's store authenticates nobody). Prints `PORT <n>` and serves until killed (at most
120 s). Used by tests/tests/torchrun.rs."""
import sys
import time
from datetime import timedelta

import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=120), wait_for_workers=False)
# tutti's keys live under /tutti-<restart>/; torch's Python client adds the leading '/'.
store.set("tutti-0/tutti/job", b"\x01\x02\x03\x04\x05\x06\x07\x08")
store.set("tutti-0/tutti/addr/0", b"127.0.0.1:9")
print(f"PORT {store.port}", flush=True)
print(f"TORCH {__import__('torch').__version__}", flush=True)
deadline = time.time() + 120
while time.time() < deadline:
    time.sleep(0.2)
sys.exit(0)
