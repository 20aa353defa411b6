"""The torch-free API (tutti.Comm) on numpy arrays and bytearrays at worlds 1–4."""

import pytest

from conftest import processes

pytest.importorskip("numpy")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_on_numpy_arrays(n):
    outs = processes("worker_numpy.py", n)
    for r, (rc, out) in enumerate(outs):
        assert rc == 0 and "ALL OK" in out, f"rank {r}: {out[-2000:]}"


def test_bad_buffers_are_refused_before_anything_is_sent():
    import numpy as np

    import tutti

    with pytest.raises(TypeError):
        tutti.buffer(np.zeros(3, np.complex64))
    with pytest.raises(ValueError):
        tutti.buffer(np.zeros((4, 4), np.float32)[:, 1])
    ro = np.zeros(3, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError):
        tutti.buffer(ro)
    (addr, count), dt, _ = tutti.buffer(bytearray(10))
    assert count == 10 and dt == "uint8" and addr != 0
    with pytest.raises(ValueError):
        tutti.buffer(b"read only")
    (addr, count), dt, owner = tutti.buffer(b"read only", writable=False)
    assert count == 9 and dt == "uint8" and owner is not None


def test_numpy_callers_never_import_torch():
    # The buffer check asks torch only when it is already imported (a tensor cannot exist
    # before): a numpy caller does not pay torch's import on its first collective.
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, tutti\n"
        "assert tutti.buffer(np.zeros(4, np.float32))[1] == 'float32'\n"
        "assert tutti.buffer(bytearray(3))[1] == 'uint8'\n"
        "assert 'torch' not in sys.modules, 'tutti imported torch for a numpy array'\n"
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    print('OK'); raise SystemExit\n"
        "(addr, count), dt, _ = tutti.buffer(torch.zeros(5, dtype=torch.float64))\n"
        "assert (count, dt) == (5, 'float64') and addr != 0\n"
        "print('OK')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
