#!/usr/bin/env python3
"""Run torch's own DistributedTest suite (shipped inside torch's wheel) on a backend.

    BACKEND=tutti|gloo WORLD_SIZE=2 python tools/python/tests/dist_suite.py [-k PAT[,PAT…]] [--json OUT]
    TUTTI_AS_GLOO=1 BACKEND=gloo … (the tests the suite runs only for gloo, on tutti)

The suite's `test/` driver is not in the wheel, so this is the driver: it adds "tutti" to the
suite's plugin, ddp and subgroup backend sets (so the tests gloo runs are not skipped for it),
imports `tutti.torch` (every spawned rank imports this file, so the backend is registered
there too), and runs `TestDistBackendWithSpawn` with unittest, CPU only. Some tests the suite
runs for gloo alone (its gates name the backend); with `TUTTI_AS_GLOO=1` and `BACKEND=gloo` the
gates see gloo while every process group the tests create is a tutti one (the driver maps the
backend name in `init_process_group` and `new_group`), so those tests run on tutti too. With `--json` it writes
each test's outcome (pass, fail, error, skip) and the first line of its failure.
"""

import json
import os
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "tutti")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="tutti-dist-suite-"))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if os.environ["BACKEND"] == "tutti" or os.environ.get("TUTTI_AS_GLOO") == "1":
    import tutti.torch  # noqa: F401,E402 - registers the backend

    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("tutti")

if os.environ.get("TUTTI_AS_GLOO") == "1":
    import torch.distributed.distributed_c10d as c10d  # noqa: E402

    def _as_tutti(fn):
        def wrapped(*a, **k):
            if k.get("backend") in ("gloo", dist.Backend.GLOO):
                k["backend"] = "tutti"
            elif a and a[0] in ("gloo", dist.Backend.GLOO) and fn.__name__ == "init_process_group":
                a = ("tutti",) + a[1:]
            return fn(*a, **k)

        wrapped.__name__ = fn.__name__
        return wrapped

    for name in ("init_process_group", "new_group"):
        patched = _as_tutti(getattr(c10d, name))
        setattr(c10d, name, patched)
        setattr(dist, name, patched)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.outcomes = {}

    def _name(self, test):
        return test.id().split(".")[-1]

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self.outcomes[self._name(test)] = ("pass", "")

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = ("fail", _first(err))

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self.outcomes[self._name(test)] = ("error", _first(err))

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = ("skip", str(reason)[:200])


def _first(err):
    text = str(err[1]).strip().splitlines()
    return (text[-1] if text else repr(err[0]))[:300]


def main():
    args = sys.argv[1:]
    out = None
    pattern = None
    if "--json" in args:
        i = args.index("--json")
        out = args[i + 1]
        del args[i:i + 2]
    if "-k" in args:
        i = args.index("-k")
        pattern = args[i + 1]
        del args[i:i + 2]
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [f"*{p}*" for p in pattern.split(",")]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    runner = unittest.TextTestRunner(verbosity=1, resultclass=_Recorder)
    res = runner.run(suite)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"backend": os.environ["BACKEND"], "world": os.environ["WORLD_SIZE"],
                       "torch": torch.__version__, "outcomes": res.outcomes}, f, indent=1)
    return 0


if __name__ == "__main__":
    # The suite's processes are spawned from this file's main module.
    sys.exit(main())
