"""Run torchft's own integration tests (``torchft/manager_integ_test.py``, from the installed
torchft-nightly) with tutti's process group where they use gloo's. No torchft source is edited:
before the tests run, this script replaces, in that module only,

* ``ProcessGroupGloo`` (torchft's wrapper, which builds a gloo group on every quorum) with a
  tutti group made for reconfigure on one store this process serves, and
* ``dist.ProcessGroup`` / ``dist.ProcessGroupGloo`` (the "native" cases: a torch group with a
  gloo backend made with ``enable_reconfigure=True``) with a tutti group made for reconfigure
  on the store the test hands them.

Usage: ``python torchft_driver.py [--gloo] [TEST ...]``: without names, the DDP cases the
tutti tests check (healthy, recovery sync/async/native, skip-init-sync, multi-rank recovery);
``--gloo`` runs them with gloo, as the control. Exits non-zero when a test fails.

One race of the test module's own is closed in both modes (``_serialize_draws``): its replicas
are threads of one process, sharing torch's global generator. Each seeds it and builds its
model under the module's ``INIT_LOCK``, but the training loop draws its inputs from the same
generator without that lock, before the first quorum, so one replica's draw can land inside
the other's model init. With ``init_sync=False`` (skip-init-sync) nothing heals that, and the
replicas end with different weights whatever the backend (seen once in CI: ``layers.0.weight``
equal, ``layers.0.bias`` not). The loop's draws now take ``INIT_LOCK`` too.

``python torchft_driver.py --resiliency [--gloo]`` runs instead the allreduce cases of
torchft's multi-group resiliency test (``process_group_test.py``, ``NormalGlooMultiPgTest``:
three ranks as threads; the last one shuts its group down, the others' next allreduce must
fail), with tutti's group made in place of torchft's gloo wrapper (``_create_pg``), and prints
how long each case took.
"""

import datetime
import sys
import types
import unittest

import torch.distributed as dist

import tutti.torch  # noqa: F401 - registers the backend
from tutti.torch import ProcessGroupTutti

DEFAULT = [
    "test_ddp_healthy",
    "test_ddp_recovery_0_async_quorum",
    "test_ddp_recovery_1_sync_quorum",
    "test_ddp_recovery_2_native_async_quorum",
    "test_ddp_recovery_3_native_sync_quorum",
    "test_ddp_skip_init_sync",
    "test_ddp_recovery_multi_rank",
]

TIMEOUT = datetime.timedelta(seconds=60)


class _NativeTutti(ProcessGroupTutti):
    """What the native cases build with ``dist.ProcessGroup(store, rank, size)``: a tutti group
    made for reconfigure. The gloo backend they then register on it is not used."""

    def _set_default_backend(self, backend_type) -> None:
        pass

    def _register_backend(self, device, backend_type, backend) -> None:
        pass


def _substitute(mit) -> None:
    # One store for the groups torchft's wrapper would have made: every replica runs as a
    # thread of this process, and each membership rendezvouses under keys of its own.
    shared = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def gloo_wrapper(*args, **kwargs):
        # A connection of its own: a torch store client serves one blocking wait at a time.
        client = dist.TCPStore("localhost", shared.port, is_master=False, wait_for_workers=False)
        return ProcessGroupTutti.reconfigurable(dist.PrefixStore("torchft-wrapper", client),
                                                timeout=TIMEOUT)

    def native_group(store, rank, size):
        return _NativeTutti.reconfigurable(store, rank, size, TIMEOUT)

    shim = types.SimpleNamespace()
    shim.__dict__.update({k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    shim.ProcessGroup = _Factory(native_group, dist.ProcessGroup.BackendType)
    shim.ProcessGroupGloo = lambda *a, **k: None
    mit.dist = shim
    mit.ProcessGroupGloo = gloo_wrapper


def _serialize_draws(mit) -> None:
    """Makes the test module's training loops draw from torch's global generator under the
    ``INIT_LOCK`` its model inits hold (see the module docstring)."""
    lock = mit.INIT_LOCK
    real = mit.torch

    def locked(fn):
        def draw(*args, **kwargs):
            with lock:
                return fn(*args, **kwargs)
        return draw

    class Torch:
        rand = staticmethod(locked(real.rand))
        randint = staticmethod(locked(real.randint))

        def __getattr__(self, name):
            return getattr(real, name)

    mit.torch = Torch()


class _Factory:
    """Called like ``dist.ProcessGroup``; its other attributes (``BackendType``, and the
    ``reconfigure`` the tests look for) are torch's."""

    def __init__(self, make, backend_type):
        self._make = make
        self.BackendType = backend_type

    def __call__(self, *args, **kwargs):
        return self._make(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(dist.ProcessGroup, name)


def _resiliency(gloo: bool) -> int:
    import time

    import torchft.process_group_test as pgt

    cls = pgt.NormalGlooMultiPgTest
    if not gloo:
        def create(klass, backend):
            client = dist.TCPStore("localhost", klass.store.port, is_master=False,
                                   wait_for_workers=False)
            return ProcessGroupTutti.reconfigurable(dist.PrefixStore("tutti", client),
                                                    timeout=TIMEOUT)

        cls._create_pg = classmethod(create)
    names = [n for n in dir(cls) if n.startswith("test_collective_with_resiliency")
             and "allreduce" in n]
    failed = 0
    for name in names:
        suite = unittest.TestSuite([cls(name)])
        t = time.monotonic()
        result = unittest.TextTestRunner(verbosity=0).run(suite)
        took = time.monotonic() - t
        ok = result.wasSuccessful()
        failed += not ok
        print(f"RESILIENCY {name} {'ok' if ok else 'FAILED'} {took:.3f} s", flush=True)
    return 1 if failed else 0


def main(argv) -> int:
    gloo = "--gloo" in argv
    if "--resiliency" in argv:
        return _resiliency(gloo)
    names = [a for a in argv if not a.startswith("--")] or DEFAULT
    import torchft.manager_integ_test as mit

    _serialize_draws(mit)
    if not gloo:
        _substitute(mit)
    suite = unittest.TestSuite(mit.ManagerIntegTest(n) for n in names)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    # Proof that tutti's groups ran the cases (a substitution that missed would leave gloo's).
    print(f"TUTTI RECONFIGURES {_RECONFIGURES[0]} SKIPPED {len(result.skipped)}", flush=True)
    return 0 if result.wasSuccessful() and not result.skipped else 1


# Reconfigures that completed on tutti groups in this process.
_RECONFIGURES = [0]
_original_connect = ProcessGroupTutti._connect


def _counting_connect(self, work, *args):
    _original_connect(self, work, *args)
    if work.is_success():
        _RECONFIGURES[0] += 1


ProcessGroupTutti._connect = _counting_connect


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
