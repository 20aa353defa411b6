"""The course examples under torchrun on the tutti backend: each prints "ALL SAME" when its
parallel results equal the single-process run's (and exits non-zero otherwise)."""

import os

import pytest

from conftest import HERE, torchrun

pytest.importorskip("torch")

EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("example", ["seed001_collectives_transformer.py", "seed003_parallelism.py"])
def test_example_matches_one_process(example, n):
    rc, out = torchrun(os.path.join(EXAMPLES, example), n)
    assert rc == 0 and "ALL SAME" in out, out[-3000:]
