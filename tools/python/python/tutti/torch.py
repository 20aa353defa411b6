"""The torch.distributed backend ``"tutti"``.

``import tutti.torch`` registers it; then ``dist.init_process_group("tutti")`` works wherever
gloo does (torchrun, tutti-run, srun, mpirun; ``env://``, ``tcp://``, ``file://``): the backend
rendezvouses through the store torch hands it, whatever kind it is.

Construction: a Python subclass of ``torch.distributed.ProcessGroup`` returned by an
``extended_api`` creator. torch routes every collective of a Python process group to its
methods (``all_gather_into_tensor`` to ``all_gather_single``, ``reduce_scatter_tensor`` to
``reduce_scatter_single``), and the extended creator hands over the new group's global ranks
and name, so a sub-group (``new_group``) is carved out of the world's connections by its
members alone. Batched point to point (``batch_isend_irecv``) is coalesced into one tutti
batch through ``_start_coalescing``/``_end_coalescing``.

Tensors are read and written in place when contiguous; a non-contiguous one goes through a
contiguous copy. The list forms (``all_gather``, ``reduce_scatter``, ``all_to_all``,
``gather``, ``scatter``) stage through one flat buffer, as gloo does.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import ipaddress
import json
import os
import queue
import re
import secrets
import socket
import sys
import threading
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

try:
    from torch._C._distributed_c10d import ErrorType as _ErrorType
except ImportError:  # a torch before the fault-tolerance API: the same names, for get_error
    import enum

    _ErrorType = enum.Enum("ErrorType", "SUCCESS TIMEOUT COMM_ERROR REMOTE_ERROR")

from . import WaitTimeout, _dtypes, _tutti, _wait
from ._tutti import TuttiError

__all__ = ["ProcessGroupTutti", "TuttiError"]

_DTYPES = _dtypes.torch_names()

_OPS = [
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.PRODUCT, "prod"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.AVG, "avg"),
]


def _op(op) -> str:
    for k, name in _OPS:
        if op == k:
            return name
    raise ValueError(f"the tutti backend has no reduction {op} (SUM, AVG, PRODUCT, MIN, MAX)")


def _dtype(t: torch.Tensor) -> str:
    if not t.is_cpu:
        raise ValueError(f"the tutti backend works on CPU tensors; this one is on {t.device}")
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"the tutti backend cannot reduce {t.dtype}") from None


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel())


class _Work(dist.Work):
    """A tutti collective as torch sees it: ``wait()`` blocks without the GIL, then copies
    staged results out; it keeps the tensors alive until then."""

    def __init__(self, native, keep=(), after: Optional[Callable[[], None]] = None, result=None,
                 completer: Optional["_Completer"] = None, owner=None):
        super().__init__()
        self._native = native
        # (the group; the communicator this work ran on), both weakly (a communicator must not
        # outlive its group through a work kept until the interpreter exits): the group is
        # told when the work fails, to run its abort hooks, if that communicator is its own.
        self._owner = owner
        self._completer = completer
        self._keep = keep
        self._after = after
        self._result = result
        self._done = native is None and after is None
        # The caller's thread and the futures' thread may finish a work at once: one of them
        # copies the results out.
        self._lock = threading.Lock()

    def _finish(self, timeout_s: Optional[float] = None) -> None:
        if self._done:
            return
        with self._lock:
            if self._done:
                return
            if self._native is not None:
                try:
                    _wait(self._native, timeout_s)
                except TuttiError as e:
                    group = self._owner[0]() if self._owner is not None else None
                    comm = self._owner[1]() if self._owner is not None else None
                    if group is not None and comm is not None and not isinstance(e, WaitTimeout):
                        group._failed(comm)
                    raise
            if self._after is not None:
                self._after()
            self._done = True
            self._keep = ()
            self._after = None

    def wait(self, timeout=None) -> bool:
        # torch passes a timedelta; zero (its default) means no limit. Past the limit this
        # raises WaitTimeout (a RuntimeError, as torch's "Operation timed out!", and a
        # TimeoutError); the collective goes on and keeps its tensors.
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self._finish(timeout or None)
        return True

    def is_completed(self) -> bool:
        return self._done or (self._native is not None and self._native.is_completed())

    def is_success(self) -> bool:
        if not self.is_completed():
            return False
        return self._native is None or self._native.is_success()

    def exception(self):
        if self._native is not None:
            msg = self._native.exception()
            return TuttiError(msg) if msg else None
        return None

    def result(self):
        return self._result

    # torch asks the work of a receive from any source which rank sent (after `wait`).
    def _source_rank(self) -> int:
        self._finish()
        src = self._native.source_rank() if self._native is not None else None
        if src is None:
            raise RuntimeError("this work is not a receive from any source")
        return src

    def get_future(self) -> Future:
        # Completed by a helper thread when the call ends, so the caller goes on meanwhile
        # (DDP takes each bucket's future and goes on with the backward pass). The helper holds
        # this work until then, so dropping it does not wait.
        fut: Future = Future()
        if self._done or self._completer is None:
            _settle(self, fut)
        else:
            self._completer.put(self, fut)
        return fut

    def __del__(self):
        # Dropped unwaited: wait, so the tensors outlive the job that uses them.
        if not self._done:
            try:
                self._finish()
            except Exception:
                pass


class _Unready:
    """The communicator of a group that has none (before its first reconfigure, while one
    runs, after one failed): every call raises why; abort and timeouts have nothing to do."""

    def __init__(self, rank: int, why: str):
        self._rank = rank
        self._why = why

    def run(self, *args, **kwargs):
        raise TuttiError(f"rank {self._rank}: {self._why}")

    split_keyed = run

    def failure(self):
        return None

    def abort(self, reason: str) -> None:
        pass

    def set_timeout(self, timeout_s: float) -> None:
        pass


class _Reconfigure(dist.Work):
    """The work ``reconfigure`` returns: ends when the new membership is connected (or could
    not be); ``wait()`` raises why it could not."""

    def __init__(self):
        super().__init__()
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None
        self._lock = threading.Lock()

    def _settle(self, error: Optional[BaseException]) -> None:
        with self._lock:
            self._error = error
            self._event.set()
            fut = self._future
        if fut is not None:
            _set_future(fut, error)

    def wait(self, timeout=None) -> bool:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not self._event.wait(timeout or None):
            raise WaitTimeout(f"reconfigure did not end within {timeout:.3f} s; it goes on")
        if self._error is not None:
            raise TuttiError(str(self._error)) from self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return []

    def get_future(self) -> Future:
        fut: Future = Future()
        with self._lock:
            if not self._event.is_set():
                self._future = fut
                return fut
        _set_future(fut, self._error)
        return fut


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _set_future(fut: Future, error: Optional[BaseException]) -> None:
    if error is None:
        fut.set_result([])
    else:
        fut.set_exception(TuttiError(str(error)))


def _contig(t: torch.Tensor):
    """``(contiguous tensor to hand over, copy back after)``."""
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, (lambda: t.copy_(c))


def _chain(*fs):
    fs = [f for f in fs if f is not None]
    if not fs:
        return None

    def run():
        for f in fs:
            f()

    return run


class ProcessGroupTutti(dist.ProcessGroup):
    """A torch process group whose collectives run on a tutti communicator.

    It implements torch's fault-tolerance surface (``supports_reconfigure``,
    ``get_reconfigure_handle``, ``reconfigure``, ``abort``, ``get_error``, abort hooks,
    ``set_timeout``): see :meth:`reconfigure` and docs/python.md."""

    supports_coalescing = True

    def __init__(self, comm, rank: int, size: int, store=None, timeout_s: float = 0.0):
        super().__init__(rank, size)
        self._comm = comm
        self._rank, self._size = rank, size
        self._store = store
        self._timeout_s = timeout_s
        self._monitored = 0
        self._coalescing: Optional[tuple[list, list, list]] = None
        self._futures = _Completer()
        self._me = weakref.ref(self)
        # Reconfigure: this instance's id (in its handle), the uuids it has used, the current
        # membership (its uuid and members' instance ids, in rank order; None for the world
        # made at start-up, whose members' ids nobody exchanged), why the last reconfigure
        # failed (an ErrorType), the abort hooks and whether they ran for this membership.
        self._instance = secrets.token_hex(16)
        self._uuids: set[int] = set()
        self._generation: Optional[int] = None
        self._members: Optional[list[str]] = None
        self._reconfigure_error = None
        self._abort_hooks: dict[int, Callable[[], None]] = {}
        self._hooks_ran = False
        self._path: Optional[str] = None
        self._connecting: Optional[int] = None
        self._lock = threading.Lock()
        _GROUPS.add(self)

    @classmethod
    def reconfigurable(cls, store, rank: int = 0, size: int = 1,
                       timeout: Optional[datetime.timedelta] = None) -> "ProcessGroupTutti":
        """A group with no members yet, as ``init_process_group(..., enable_reconfigure=True)``
        makes: collectives raise until :meth:`reconfigure` has connected one. ``store`` is
        shared by every process that may ever be a member (each new membership rendezvouses
        in it under keys of its own); ``rank`` and ``size`` are what ``rank()`` and ``size()``
        answer until then. For frameworks that build the process group object themselves
        (torchft's ``Manager(pg=...)``)."""
        t = timeout.total_seconds() if timeout else 0.0
        return cls(_Unready(rank, "this group has no members yet (created for reconfigure): "
                            "call reconfigure() first"), rank, size, store, t)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "tutti"

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # torch's destroy_process_group calls this on every group it destroys.
    def shutdown(self) -> None:
        """Close this group: its futures' helpers end, and its connections close once no other
        group shares them (the peers then see this rank gone at once, instead of at their
        timeout). Calls afterwards raise; a group made for reconfigure can be reconfigured."""
        self._futures.close()
        with self._lock:
            self._connecting = None
            self._comm = _Unready(self._rank, "this process group was shut down")

    # -- fault tolerance: abort, errors, reconfigure -----------------------------------------

    @property
    def supports_reconfigure(self) -> bool:
        # A new membership rendezvouses in the store this group was made with.
        return self._store is not None

    @property
    def supports_abort_hooks(self) -> bool:
        return True

    def register_abort_hook(self, hook_id: int, hook: Callable[[], None]) -> None:
        """Run ``hook()`` when a call of this group fails on a timeout or an error; once per
        membership. tutti has stopped the group by then (every pending call failed, the peers
        told): the hook runs before the failed call raises. ``abort()`` itself runs none."""
        self._abort_hooks[hook_id] = hook

    def unregister_abort_hook(self, hook_id: int) -> None:
        self._abort_hooks.pop(hook_id, None)

    def _failed(self, comm) -> None:
        # A call on `comm` failed. A fatal failure stopped that communicator already (tutti
        # fails every pending call and tells the peers, which is the abort); if it is still
        # this group's, run the hooks once.
        if not self._abort_hooks:
            return
        f = comm.failure()
        if f is None or f[0] == "aborted":
            return
        with self._lock:
            if self._hooks_ran or comm is not self._comm:
                return
            self._hooks_ran = True
            hooks = list(self._abort_hooks.values())
        for h in hooks:
            try:
                h()
            except Exception as e:  # noqa: BLE001 - a hook's failure must not hide the cause
                print(f"tutti: an abort hook raised {e!r}", file=sys.stderr)

    def abort(self) -> None:
        """Stop this group here, at once: every pending call and every later one fails with an
        error, and the peers are told; a reconfigure in progress ends with an error. The group
        stays reconfigurable."""
        with self._lock:
            comm = self._comm
            if self._connecting is not None:
                # The reconfigure's helper sees this at its next look at the store and ends
                # with an error; its membership, if it connects meanwhile, is dropped.
                self._connecting = None
                self._comm = _Unready(self._rank, "the process group was aborted during a "
                                      "reconfigure: reconfigure again with a fresh uuid")
                self._reconfigure_error = _ErrorType.COMM_ERROR
        comm.abort(f"rank {self._rank}: the process group was aborted (ProcessGroup.abort)")

    def get_error(self):
        """``ErrorType.SUCCESS`` while the current membership works (or none exists yet),
        ``TIMEOUT`` after a call or a reconfigure ran past its time, ``REMOTE_ERROR`` when a
        peer failed or aborted and said so, ``COMM_ERROR`` after anything else (a lost
        connection, ``abort()``, a failed reconfigure)."""
        if self._reconfigure_error is not None:
            return self._reconfigure_error
        f = self._comm.failure()
        if f is None:
            return _ErrorType.SUCCESS
        return {"timeout": _ErrorType.TIMEOUT, "remote": _ErrorType.REMOTE_ERROR}.get(
            f[0], _ErrorType.COMM_ERROR)

    def set_timeout(self, timeout) -> None:
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        self._timeout_s = t
        self._comm.set_timeout(t)

    def get_reconfigure_handle(self) -> str:
        """This group instance's handle: a random id (unique to this object), the host and the
        process, as JSON. It carries no secret; members find each other through the store the
        group was made with."""
        return json.dumps({"tutti": 1, "id": self._instance, "host": socket.gethostname(),
                           "pid": os.getpid()}, separators=(",", ":"))

    def reconfigure(self, opts) -> "_Reconfigure":
        """Go on over the members whose handles ``opts.handles`` names: a list gives the ranks
        by position, a set is ordered by handle. Every in-flight call of the old membership
        fails now; the new one connects in the background (the returned work ends when it
        has, and raises if it could not, within ``opts.timeout`` or the group's timeout).
        Members that were all in this group's current membership, in the same order, go on
        through tutti's own reconfigure (no new rendezvous); anything else (a newcomer, a new
        order, two groups merged) rendezvouses a new mesh in the store. ``opts.uuid`` must be
        fresh: a uuid this group used before is refused.

        Raises ValueError at once for a reused uuid, a handle that is not a tutti group's, a
        handle named twice, or handles without this group's own."""
        uuid = int(opts.uuid)
        handles = opts.handles
        if isinstance(handles, (set, frozenset)):
            handles = sorted(handles)
        members, where, hosts, pids = [], [], [], []
        for h in handles:
            try:
                d = json.loads(h)
                members.append(str(d["id"]))
                hosts.append(str(d.get("host", "?")))
                pids.append(d["pid"] if isinstance(d.get("pid"), int) else None)
                where.append(f"{d.get('host', '?')} pid {d.get('pid', '?')}")
            except (ValueError, TypeError, KeyError):
                raise ValueError(f"reconfigure: {h!r} is not a tutti process group's handle") from None
        if len(set(members)) != len(members):
            raise ValueError("reconfigure: a handle is named twice")
        if self._instance not in members:
            raise ValueError("reconfigure: the handles do not include this group's own "
                             "(get_reconfigure_handle())")
        if self._store is None:
            raise ValueError("reconfigure: this group was made without a store to rendezvous in")
        with self._lock:
            if uuid in self._uuids:
                raise ValueError(f"reconfigure: uuid {uuid} was used before by this group; "
                                 "pass a fresh one every time")
            self._uuids.add(uuid)
            # The reconfigure whose result counts: a later one, or abort(), supersedes it.
            self._connecting = uuid
            old, old_members, generation = self._comm, self._members, self._generation
            if isinstance(old, _Unready):
                # No working membership to keep (none yet, a failed or aborted reconfigure,
                # shut down): a new rendezvous.
                old_members = None
            self._comm = _Unready(self._rank, f"reconfigure (uuid {uuid}) is in progress: wait "
                                  "for the work it returned")
            self._reconfigure_error = None
        # Every call of the old membership fails now.
        old.abort(f"rank {self._rank}: reconfiguring (uuid {uuid})")
        t = opts.timeout
        timeout_s = t.total_seconds() if isinstance(t, datetime.timedelta) and t else 0.0
        timeout_s = timeout_s or self._timeout_s or 1800.0
        work = _Reconfigure()
        threading.Thread(
            target=self._connect, name="tutti-reconfigure", daemon=True,
            args=(work, uuid, members, where, hosts, pids, old, old_members, generation,
                  timeout_s),
        ).start()
        return work

    def _connect(self, work, uuid, members, where, hosts, pids, old, old_members, generation,
                 timeout_s):
        me = members.index(self._instance)
        n = len(members)
        # Keys of this membership alone: a uuid shared by several groups (torchft passes one
        # per quorum to each of them) cannot collide.
        digest = hashlib.sha256("\n".join(members).encode()).hexdigest()[:16]
        space = f"tutti/reconfigure/{uuid}/{digest}/"
        try:
            store = dist.PrefixStore(space, self._store)
            # The fast path needs every member to be in one current membership, in order:
            # each says what it sees, and it is taken only if all say the same.
            view, kept = "new", None
            if old_members is not None and all(m in old_members for m in members):
                kept = [old_members.index(m) for m in members]
                if kept == sorted(kept):
                    view = f"{generation}:{','.join(map(str, kept))}"
            store.set(f"view/{me}", view)
            keys = [f"view/{k}" for k in range(n)]
            # Polled, not one blocking wait: abort() or a later reconfigure ends it at once,
            # and the store's connection stays free for the caller's own requests.
            end = time.monotonic() + timeout_s
            nap = 0.002
            here = socket.gethostname()
            while not store.check(keys):
                if self._connecting != uuid:
                    raise RuntimeError(f"reconfigure (uuid {uuid}) was aborted or superseded")
                if time.monotonic() >= end:
                    missing = [where[k] for k in range(n) if not store.check([keys[k]])]
                    raise TimeoutError(
                        f"rank {me} of the new membership (uuid {uuid}): members {missing} did "
                        f"not reach reconfigure within {timeout_s:.1f} s")
                # A member on this host whose process has ended will never come: say so now.
                gone = [where[k] for k in range(n) if hosts[k] == here and pids[k] is not None
                        and not _alive(pids[k]) and not store.check([keys[k]])]
                if gone:
                    raise RuntimeError(
                        f"rank {me} of the new membership (uuid {uuid}): members {gone} are on "
                        f"this host and their processes have ended; reconfigure without them")
                time.sleep(nap)
                nap = min(nap * 2, 0.05)
            views = [bytes(store.get(k)).decode() for k in keys]
            # The connect gets what is left of the timeout.
            left = max(end - time.monotonic(), 0.001)
            if view != "new" and all(v == view for v in views):
                path = "kept"
                new = old.reconfigure(uuid & 0xFFFF_FFFF_FFFF_FFFF, kept, left)
            else:
                path = "new"
                if len(set(hosts)) > 1:
                    # Across hosts: a secret every member was given, and the interface tutti
                    # picks by itself (MASTER_ADDR, under torchft, is the replica group's own).
                    kind, secret = _secret(None, across_hosts=True)
                    ip = None
                else:
                    master = os.environ.get("MASTER_ADDR")
                    kind, secret = _secret(master)
                    ip = _master_ip(master)
                if kind == "file":
                    secret = os.path.join(_tutti.local_secret_dir(), f"reconfigure-{uuid}-{digest}.secret")
                new = _tutti.Comm.on_store(
                    me, n, _StoreAdapter(store), f"torch store, {space}", kind, secret, ip,
                    self._timeout_s or timeout_s, left)
            if self._timeout_s:
                new.set_timeout(self._timeout_s)
            if me == 0 and (path == "kept" or os.environ.get("TUTTI_CONNECT") != "lazy"):
                # Every member read the views before it connected, and rank 0's full mesh is
                # up only once all of them have: the views are no longer needed.
                for k in keys:
                    try:
                        store.delete_key(k)
                    except Exception:  # noqa: BLE001 - tidying only
                        break
        except Exception as e:  # noqa: BLE001 - handed to the work's waiter
            # A deadline the store wait or the connect ran out of (tutti's rendezvous errors say
            # "within …" or "in time").
            timed_out = isinstance(e, TimeoutError) or bool(re.search(r"\bwithin\b|\bin time\b", str(e)))
            with self._lock:
                if self._connecting == uuid:
                    self._connecting = None
                    self._comm = _Unready(self._rank, f"reconfigure (uuid {uuid}) failed: {e}; "
                                          "reconfigure again with a fresh uuid")
                    self._reconfigure_error = (_ErrorType.TIMEOUT if timed_out
                                               else _ErrorType.COMM_ERROR)
            work._settle(e)
            return
        with self._lock:
            current = self._connecting == uuid
            if current:
                self._connecting = None
                self._comm, self._rank, self._size = new, me, n
                self._members, self._generation = members, uuid
                # Which way the last reconfigure went: "kept" (tutti's own, over the members'
                # connections' store and secret) or "new" (a new rendezvous).
                self._path = path
                self._reconfigure_error = None
                self._hooks_ran = False
        if not current:
            # abort(), or a later reconfigure, came first: this membership is not used.
            new.abort(f"rank {me}: reconfigure (uuid {uuid}) was superseded")
            work._settle(RuntimeError(f"reconfigure (uuid {uuid}) was aborted or superseded "
                                      "before it completed"))
            return
        work._settle(None)

    # torch keeps a group's name on its C++ backends, which a Python group has none of; it
    # reads the name back when it destroys the group.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    @property
    def comm(self) -> "_tutti.Comm":
        return self._comm

    def __repr__(self) -> str:
        return f"ProcessGroupTutti(rank={self.rank()}, size={self.size()})"

    # torch asks a group for the backend of a device (batch_isend_irecv reads
    # `supports_coalescing` from it); a Python group is its own backend.
    def _get_backend(self, device=None):
        return self

    # torch asks which devices a group serves before a monitored barrier, and refuses a group
    # that names none, which a Python group registers by default. It also asks before it
    # attaches its flight recorder, which files entries under a name that only a C++ backend
    # can give, and skips a group that names no device: that caller gets none.
    @property
    def _device_types(self):
        if sys._getframe(1).f_code.co_name == "_maybe_attach_flight_recorder":
            return []
        return [torch.device("cpu")]

    def _run(self, kind, dtype, keep, after=None, result=None, opts=None, **kw) -> Optional[_Work]:
        # torch says in the options whether the caller waits at once (`asyncOp` False, set by
        # every collective since 2.14): then the call runs here, without the hand-off to the
        # worker thread (after the worker's earlier jobs, so the order stays the program's), and
        # returns no work: torch's callers of that form take None as "already done" (gloo's
        # "synced at the C++ level"), and a Work object would cost a microsecond per call.
        if opts is not None and getattr(opts, "asyncOp", True) is False:
            comm = self._comm
            try:
                comm.run(kind, dtype, async_op=False, **kw)
            except TuttiError:
                self._failed(comm)
                raise
            if after is not None:
                after()
            return None
        w = self._comm.run(kind, dtype, async_op=True, **kw)
        return _Work(w, keep, after, result, self._futures, (self._me, weakref.ref(self._comm)))

    # -- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        try:
            op = _op(opts.reduceOp)
        except AttributeError:
            # torch's other forms: `allreduce(tensors, ReduceOp.SUM)`, `allreduce(tensor, op)`.
            red, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = red
            op = _op(red)
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
        # The common form, one contiguous dense tensor and a caller that waits at once, goes
        # straight to the native call: every attribute read costs here (see docs/python.md).
        if len(tensors) == 1 and getattr(opts, "asyncOp", True) is False:
            t = tensors[0]
            if t.is_contiguous() and not t.is_sparse:
                comm = self._comm
                try:
                    comm.run("allreduce", _dtype(t), _raw(t), op=op, async_op=False)
                except TuttiError:
                    self._failed(comm)
                    raise
                return None
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        works = []
        for t in tensors:
            c, back = _contig(t)
            works.append(self._run("allreduce", _dtype(c), (t, c), back, tensors, a=_raw(c), op=op, opts=opts))
        return works[-1] if len(works) == 1 else _All(works, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts or dist.AllreduceOptions())

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        t = tensors[opts.rootTensor if hasattr(opts, "rootTensor") else 0]
        c, back = _contig(t)
        return self._run(
            "reduce", _dtype(c), (t, c), back, tensors, a=_raw(c), op=_op(opts.reduceOp),
            root=opts.rootRank, opts=opts)

    def broadcast(self, tensors, opts=None):
        if isinstance(opts, int):
            # torch's other form: `broadcast(tensor or tensors, root)`.
            root, opts = opts, dist.BroadcastOptions()
            opts.rootRank = root
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
        opts = opts or dist.BroadcastOptions()
        works = []
        for t in tensors:
            c, back = _contig(t)
            works.append(
                self._run("broadcast", _dtype(c), (t, c), back, tensors, a=_raw(c), root=opts.rootRank, opts=opts)
            )
        return works[-1] if len(works) == 1 else _All(works, tensors)

    def _sparse_allreduce(self, tensors, op: str) -> _Work:
        """Sum sparse COO tensors, as gloo does: every rank's indices and values are gathered
        (padded to the largest count), concatenated and coalesced; each input becomes the
        coalesced sum."""
        if op != "sum" or len(tensors) != 1 or tensors[0].layout != torch.sparse_coo:
            raise ValueError("the tutti backend sums one sparse COO tensor at a time (SUM only)")
        t = tensors[0]
        _dtype(t)
        c = t.coalesce()
        idx, val = c.indices().contiguous(), c.values().contiguous()
        n = self.size()
        counts = torch.empty(n, dtype=torch.int64)
        self.all_gather_single(counts, torch.tensor([idx.shape[1]], dtype=torch.int64)).wait()
        most = int(counts.max())
        pidx = torch.zeros((idx.shape[0], most), dtype=torch.int64)
        pidx[:, : idx.shape[1]] = idx
        pval = torch.zeros((most, *val.shape[1:]), dtype=val.dtype)
        pval[: val.shape[0]] = val
        gidx = torch.empty((n, *pidx.shape), dtype=torch.int64)
        gval = torch.empty((n, *pval.shape), dtype=val.dtype)
        self.all_gather_single(gidx, pidx).wait()
        self.all_gather_single(gval, pval).wait()
        keep = [int(k) for k in counts]
        all_idx = torch.cat([gidx[r][:, : keep[r]] for r in range(n)], dim=1)
        all_val = torch.cat([gval[r][: keep[r]] for r in range(n)], dim=0)
        total = torch.sparse_coo_tensor(all_idx, all_val, t.shape).coalesce()
        t.copy_(total)
        return _Work(None, (), None, [t])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier that says who did not come, as gloo's does: every rank checks in with
        rank 0 through the job's store, and rank 0 names the first rank (or, with
        ``wait_all_ranks``, every rank) that did not check in before ``timeout``; then it
        releases the others, or tells them it failed. It runs through the store, not the
        group's connections, so a failed monitored barrier leaves the group usable."""
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the store this group was created with")
        if timeout is None:
            timeout = datetime.timedelta(minutes=30)
        limit = timeout.total_seconds()
        seq = self._monitored
        self._monitored += 1
        base = f"tutti/monitored_barrier/{seq}/"
        rank, n = self.rank(), self.size()
        start = time.monotonic()

        def wait(key: str, grace: float = 0.0) -> bool:
            left = limit + grace - (time.monotonic() - start)
            if left <= 0:
                return False
            try:
                self._store.wait([key], datetime.timedelta(seconds=left))
                return True
            except Exception as e:  # noqa: BLE001 - torch raises its store errors on timeout
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    return False
                raise

        if rank != 0:
            self._store.set(f"{base}in/{rank}", b"1")
            # Rank 0 answers by the deadline: wait a little past it to hear its verdict.
            if not wait(f"{base}out", grace=min(limit, 1.0) + 0.5):
                raise RuntimeError(
                    f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                    f"while waiting for send/recv from rank 0: no answer in {limit * 1e3:.0f} ms"
                )
            verdict = bytes(self._store.get(f"{base}out")).decode()
            if verdict != "ok":
                raise RuntimeError(
                    f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                    f"while waiting for send/recv from rank 0: {verdict}"
                )
            return _Work(None)
        missing = []
        for r in range(1, n):
            key = f"{base}in/{r}"
            # Past the deadline a rank that has checked in still passes; one that has not is
            # named (every such rank, with wait_all_ranks) or the time is up for rank 0.
            late = limit - (time.monotonic() - start) <= 0
            if late and not wait_all_ranks and not self._store.check([key]):
                msg = f"Rank 0 timed out in monitoredBarrier after {limit * 1e3:.0f} ms"
                self._store.set(f"{base}out", msg.encode())
                raise RuntimeError(msg)
            if not (self._store.check([key]) if late else wait(key)):
                missing.append(r)
                if not wait_all_ranks:
                    break
            else:
                self._store.delete_key(key)
        if missing:
            who = ", ".join(str(r) for r in missing)
            noun = "Rank" if len(missing) == 1 else "Ranks"
            msg = f"{noun} {who} failed to pass monitoredBarrier in {limit * 1e3:.0f} ms"
            self._store.set(f"{base}out", msg.encode())
            raise RuntimeError(msg)
        self._store.set(f"{base}out", b"ok")
        return _Work(None)

    # -- gathers ---------------------------------------------------------------------------

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        o, back = _contig(output)
        i = input.contiguous()
        if o.numel() != i.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: output has {o.numel()} elements, expected "
                f"{i.numel()} x {self.size()} ranks"
            )
        return self._run("allgather", _dtype(i), (output, o, i), back, output, a=_raw(i), b=_raw(o), opts=opts)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        works = []
        for outs, inp in zip(output_tensors, input_tensors):
            i = inp.contiguous()
            flat = torch.empty(i.numel() * self.size(), dtype=i.dtype)

            def after(outs=outs, flat=flat, n=i.numel()):
                for k, o in enumerate(outs):
                    o.copy_(flat[k * n:(k + 1) * n].view_as(o))

            works.append(self._run("allgather", _dtype(i), (outs, i, flat), after, output_tensors,
                                   a=_raw(i), b=_raw(flat), opts=opts))
        return works[-1] if len(works) == 1 else _All(works, output_tensors)

    def allgather_coalesced(self, output_tensor_lists, input_tensors, opts=None):
        # output_tensor_lists[rank][j] receives input j of that rank.
        works = [
            self.allgather([[per_rank[j] for per_rank in output_tensor_lists]], [inp])
            for j, inp in enumerate(input_tensors)
        ]
        return _All(works, output_tensor_lists)

    def all_gather_single_coalesced(self, output_tensors, input_tensors, opts=None):
        works = [self.all_gather_single(o, i) for o, i in zip(output_tensors, input_tensors)]
        return _All(works, output_tensors)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        i = input_tensors[0].contiguous()
        root = opts.rootRank
        if self.rank() == root:
            outs = output_tensors[0]
            flat = torch.empty(i.numel() * self.size(), dtype=i.dtype)

            def after(outs=outs, flat=flat, n=i.numel()):
                for k, o in enumerate(outs):
                    o.copy_(flat[k * n:(k + 1) * n].view_as(o))

            return self._run("gather", _dtype(i), (outs, i, flat), after, output_tensors,
                             a=_raw(i), b=_raw(flat), root=root, opts=opts)
        return self._run("gather", _dtype(i), (i,), None, output_tensors, a=_raw(i), b=(0, 0), root=root, opts=opts)

    # -- scatters --------------------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        opts = opts or dist.ReduceScatterOptions()
        o, back = _contig(output)
        i = input.contiguous()
        if i.numel() != o.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: input has {i.numel()} elements, expected "
                f"{o.numel()} x {self.size()} ranks"
            )
        return self._run("reduce_scatter", _dtype(i), (output, o, i), back, output,
                         a=_raw(i), b=_raw(o), op=_op(opts.reduceOp), opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        works = []
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([t.reshape(-1) for t in ins])
            o, back = _contig(out)
            works.append(self._run("reduce_scatter", _dtype(flat), (out, o, flat), back,
                                   output_tensors, a=_raw(flat), b=_raw(o), op=_op(opts.reduceOp), opts=opts))
        return works[-1] if len(works) == 1 else _All(works, output_tensors)

    def reduce_scatter_single_coalesced(self, output_tensors, input_tensors, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(output_tensors, input_tensors)]
        return _All(works, output_tensors)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = output_tensors[0]
        o, back = _contig(out)
        root = opts.rootRank
        if self.rank() == root:
            flat = torch.cat([t.reshape(-1) for t in input_tensors[0]])
            return self._run("scatter", _dtype(o), (out, o, flat), back, output_tensors,
                             a=_raw(flat), b=_raw(o), root=root, opts=opts)
        return self._run("scatter", _dtype(o), (out, o), back, output_tensors,
                         a=(0, 0), b=_raw(o), root=root, opts=opts)

    # -- all-to-all ------------------------------------------------------------------------

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        o, back = _contig(output)
        i = input.contiguous()
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            return self._run("all_to_all", _dtype(i), (output, o, i), back, output, a=_raw(i), b=_raw(o), opts=opts)
        row_in = i[0].numel() if i.dim() > 0 and i.shape[0] > 0 else 0
        row_out = o[0].numel() if o.dim() > 0 and o.shape[0] > 0 else 0
        ins = list(input_split_sizes) or [i.shape[0] // n] * n
        outs = list(output_split_sizes) or [o.shape[0] // n] * n
        send = [s * row_in for s in ins]
        recv = [s * row_out for s in outs]
        return self._run("all_to_all_v", _dtype(i), (output, o, i), back, output,
                         a=_raw(i), b=_raw(o), counts=(send, recv), opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors]) if input_tensors else torch.empty(0)
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat_out = torch.empty(sum(recv), dtype=flat_in.dtype)

        def after():
            off = 0
            for t, c in zip(output_tensors, recv):
                t.copy_(flat_out[off:off + c].view_as(t))
                off += c

        return self._run("all_to_all_v", _dtype(flat_in), (output_tensors, flat_in, flat_out), after,
                         output_tensors, a=_raw(flat_in), b=_raw(flat_out), counts=(send, recv), opts=opts)

    # -- barrier and point to point --------------------------------------------------------

    def barrier(self, opts=None):
        return self._run("barrier", "uint8", (), opts=opts)

    def _p2p(self, tensor: torch.Tensor, peer: int, tag: int, send: bool):
        c = tensor if send else tensor
        if not tensor.is_contiguous():
            raise ValueError("the tutti backend sends and receives contiguous tensors")
        _dtype(c)
        entry = (peer, tag & 0x7FFFFFFF, (c.data_ptr(), c.numel() * c.element_size()))
        if self._coalescing is not None:
            sends, recvs, keep = self._coalescing
            (sends if send else recvs).append(entry)
            keep.append(tensor)
            return _Work(None)
        kw = {"sends": [entry]} if send else {"recvs": [entry]}
        return self._run("batch", "uint8", (tensor,), None, [tensor], **kw)

    def send(self, tensors, dst, tag=0):
        return self._p2p(tensors[0], dst, tag, True)

    def recv(self, tensors, src, tag=0):
        return self._p2p(tensors[0], src, tag, False)

    def recv_anysource(self, tensors, tag=0):
        # Whichever rank sends first under `tag` (tutti looks for an arrived message from each
        # rank in turn, then naps, 10 µs doubling to 1 ms); the work names it.
        t = tensors[0]
        if not t.is_contiguous():
            raise ValueError("the tutti backend receives into contiguous tensors")
        _dtype(t)
        w = self._comm.run("recv_any", "uint8", a=(t.data_ptr(), t.numel() * t.element_size()),
                           root=tag & 0x7FFFFFFF, async_op=True)
        return _Work(w, (t,), None, tensors, self._futures, (self._me, weakref.ref(self._comm)))

    def _start_coalescing(self, device=None):
        self._coalescing = ([], [], [])

    def _end_coalescing(self, device=None):
        if self._coalescing is None:
            return _Work(None)
        sends, recvs, keep = self._coalescing
        self._coalescing = None
        if not sends and not recvs:
            return _Work(None)
        return self._run("batch", "uint8", tuple(keep), None, keep, sends=sends, recvs=recvs)


def _settle(work: _Work, fut: Future) -> None:
    try:
        work._finish()
        fut.set_result(work._result)
    except Exception as e:  # noqa: BLE001 - handed to the future's waiter
        fut.set_exception(e)


# Helpers per group at most: past it, futures wait their turn (a deadlock needs this many
# callbacks blocked at once).
_MAX_HELPERS = 64


class _Completer:
    """Completes the futures of one group's works: a helper thread waits for each work (without
    the GIL), copies its results out and sets its future, which runs the callbacks chained on
    it. A callback may itself start a call and wait for that call's future (PowerSGD's DDP
    hook does), so there is a helper for every future not yet set, up to `_MAX_HELPERS`: a
    future that finds every helper busy starts one more. Helpers stay for the next futures and
    end when the group is gone."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._helpers = 0
        self._unsettled = 0
        self._threads: list[threading.Thread] = []
        _COMPLETERS.add(self)

    def put(self, work: "_Work", fut: Future) -> None:
        with self._lock:
            self._unsettled += 1
            if self._unsettled > self._helpers and self._helpers < _MAX_HELPERS:
                self._helpers += 1
                t = threading.Thread(target=_complete, args=(self._q,), name="tutti-futures",
                                     daemon=True)
                t.start()
                self._threads.append(t)
        self._q.put((work, fut))

    def _settled(self) -> None:
        with self._lock:
            self._unsettled -= 1

    def close(self, timeout_s: float = 10.0) -> None:
        # A helper still inside torch's Future.set_result at finalisation is pthread_exit'ed
        # in a noexcept destructor that re-takes the GIL: std::terminate. Drain and join them.
        with self._lock:
            threads, self._threads, self._helpers = self._threads, [], 0
        for _ in threads:
            self._q.put(None)
        end = time.monotonic() + timeout_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(end - time.monotonic(), 0.0))

    def __del__(self):
        for _ in range(self._helpers):
            self._q.put(None)


# For programs that never destroy their groups (atexit runs before finalisation).
_COMPLETERS: "weakref.WeakSet[_Completer]" = weakref.WeakSet()


@atexit.register
def _close_completers() -> None:
    for c in list(_COMPLETERS):
        c.close()
    # Close every group's connections while threads may still take the GIL: a transport that
    # failed leaves an abort note in torch's store (a Python object) as it closes, and a
    # thread that asks for the GIL during finalization is ended in a way that aborts the
    # process.
    for pg in list(_GROUPS):
        with pg._lock:
            pg._connecting = None
            pg._comm = _Unready(pg._rank, "the interpreter is exiting")
    # Communicators still referenced elsewhere close later, during finalization: from now on
    # they leave no note in torch's store.
    _tutti.at_exit()


# Every group of this process, for the exit handler above.
_GROUPS: "weakref.WeakSet[ProcessGroupTutti]" = weakref.WeakSet()


def _complete(q: queue.SimpleQueue) -> None:
    # Holds a group's completer only through the work it settles, so the group can go.
    while True:
        item = q.get()
        if item is None:
            return
        work, fut = item
        del item
        try:
            _settle(work, fut)
        finally:
            work._completer._settled()
        del work, fut


class _All(_Work):
    """Several works as one."""

    def __init__(self, works, result):
        # Calls that ran at once (torch's synchronous form) left no work to wait for.
        works = [w for w in works if w is not None]
        super().__init__(None, (), None, result,
                         next((w._completer for w in works if w._completer), None))
        self._works = works
        self._done = False

    def _finish(self, timeout_s: Optional[float] = None) -> None:
        if self._done:
            return
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for w in self._works:
            # One limit for all of them; a work that has ended returns at once.
            w._finish(None if end is None else max(end - time.monotonic(), 1e-6))
        self._done = True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


# -- rendezvous ------------------------------------------------------------------------------


class _StoreAdapter:
    """torch's store as the native half asks for it."""

    def __init__(self, store):
        self._s = store

    def set(self, key: str, value: bytes) -> None:
        self._s.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self._s.wait([key], datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise TimeoutError(str(e)) from e
            raise
        return bytes(self._s.get(key))

    def add(self, key: str, delta: int) -> int:
        return int(self._s.add(key, delta))

    def delete(self, key: str) -> bool:
        return bool(self._s.delete_key(key))

    def check(self, keys) -> bool:
        return bool(self._s.check(list(keys)))


# The default group, whose communicator sub-groups are carved out of.
_WORLD: Optional[ProcessGroupTutti] = None


def _loopback(host: Optional[str]) -> bool:
    if not host:
        return True
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def _secret(master: Optional[str], across_hosts: bool = False) -> tuple[str, Optional[str]]:
    token = os.environ.get("TUTTI_TOKEN")
    if token:
        return "given", token
    path = os.environ.get("TUTTI_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return "given", f.read().strip()
    if not across_hosts and _loopback(master):
        name = "torch-{}-{}.secret".format(
            os.environ.get("MASTER_PORT", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        return "file", os.path.join(_tutti.local_secret_dir(), name)
    if os.environ.get("TUTTI_INSECURE") == "1":
        return "store", None
    why = ("the new membership spans hosts" if across_hosts
           else "this job's store is reachable from other hosts")
    raise TuttiError(
        f"{why} and there is no job secret: set "
        "TUTTI_TOKEN to the same random string on every rank (e.g. `export "
        "TUTTI_TOKEN=$(openssl rand -hex 16)`); TUTTI_INSECURE=1 runs without one"
    )


def _master_ip(master: Optional[str]) -> Optional[str]:
    if not master:
        return None
    try:
        return socket.getaddrinfo(master, None)[0][4][0]
    except OSError:
        return None


def _create(dist_opts, backend_opts=None):
    """torch's backend creator (extended API)."""
    global _WORLD
    store = dist_opts.store
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout.total_seconds() if dist_opts.timeout else 0.0
    ranks = list(getattr(dist_opts, "global_ranks_in_group", []) or [])
    if getattr(dist_opts, "enable_reconfigure", False):
        # No members until the first reconfigure (torch's "deferred" regime): nothing connects
        # now, and the group rendezvouses in this store each time it is reconfigured.
        pg = ProcessGroupTutti.reconfigurable(store, rank, size, dist_opts.timeout)
        if not ranks:
            _WORLD = pg
        return _named(pg, dist_opts)
    if _WORLD is None or not ranks:
        # The default group (torch names no ranks for it): connect through torch's store.
        master = os.environ.get("MASTER_ADDR")
        kind, secret = _secret(master)
        comm = _tutti.Comm.on_store(
            rank, size, _StoreAdapter(store), "torch store", kind, secret, _master_ip(master), timeout
        )
        _WORLD = ProcessGroupTutti(comm, rank, size, store, timeout)
        return _named(_WORLD, dist_opts)
    if _WORLD._generation is not None:
        # torch names a sub-group's members by their ranks at init, which a reconfigured world
        # no longer has.
        raise TuttiError("new_group on a reconfigured default group is not supported: its "
                         "ranks are no longer torch's global ranks; reconfigure the group you "
                         "need instead (ProcessGroupTutti.reconfigurable)")
    key = int.from_bytes(hashlib.sha256(str(dist_opts.group_id).encode()).digest()[:8], "little")
    sub = _WORLD._comm.split_keyed(sorted(ranks), key >> 1)
    if sub is None:
        return None
    return _named(ProcessGroupTutti(sub, rank, size, store, timeout), dist_opts)


def _named(pg, dist_opts):
    # torch names the groups its backends make, and looks them up by name when destroying.
    name = getattr(dist_opts, "group_id", None)
    if name is not None:
        pg._set_group_name(str(name))
    return pg


dist.Backend.register_backend("tutti", _create, extended_api=True, devices=["cpu"])
