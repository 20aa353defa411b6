"""Helpers: run a worker under torchrun, or as N plain processes with torchrun's variables."""

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, nproc, *args, timeout=600, extra=()):
    """Run `script` under torchrun with `nproc` ranks; returns (returncode, output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *extra, os.path.join(HERE, script), *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout


def processes(script, nproc, timeout=300):
    """Run `script` as `nproc` processes with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{script} with {nproc} processes did not finish in {timeout} s")
        outs.append((p.returncode, out))
    return outs


@pytest.fixture
def has_torch():
    return pytest.importorskip("torch")
