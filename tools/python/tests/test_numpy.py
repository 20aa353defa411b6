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
    (addr, count), dt = tutti.buffer(bytearray(10))
    assert count == 10 and dt == "uint8" and addr != 0
