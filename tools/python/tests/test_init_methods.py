"""init_process_group("tutti") with every init method torch offers, and under tutti-run."""

import os
import subprocess
import sys

import pytest

from conftest import HERE, free_port

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER = os.path.join(HERE, "worker_init.py")


def run_all(cmds, env=None, timeout=180):
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for c in cmds]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("n", [2, 3])
def test_tcp_init_method(n):
    port = str(free_port())
    outs = run_all([[sys.executable, WORKER, "tcp", str(r), str(n), port] for r in range(n)])
    for r, (rc, out) in enumerate(outs):
        assert rc == 0 and f"rank {r} OK" in out, out[-2000:]


@pytest.mark.parametrize("n", [2, 3])
def test_file_init_method(n, tmp_path):
    path = str(tmp_path / "rendezvous")
    outs = run_all([[sys.executable, WORKER, "file", str(r), str(n), path] for r in range(n)])
    for r, (rc, out) in enumerate(outs):
        assert rc == 0 and f"rank {r} OK" in out, out[-2000:]


def test_under_tutti_run():
    exe = os.path.join(ROOT, "target", "release", "tutti-run")
    if not os.path.exists(exe):
        # In CI (and in the README's order) tutti-run is built before these tests: never skip there.
        if os.environ.get("CI"):
            pytest.fail("target/release/tutti-run is missing: cargo build --release -p tutti-tools")
        pytest.skip("build tutti-run first: cargo build --release -p tutti-tools")
    p = subprocess.run([exe, "--nproc", "3", "--", sys.executable, WORKER, "env", "0", "0"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:]
    for r in range(3):
        assert f"rank {r} OK" in p.stdout, p.stdout[-2000:]
