"""tutti: collectives over TCP or QUIC for Python.

Two ways in:

* ``import tutti.torch`` registers the torch.distributed backend ``"tutti"``:
  ``dist.init_process_group("tutti")`` under torchrun, tutti-run, srun or mpirun.
* :class:`Comm` runs collectives on any writable buffer (numpy arrays, bytearrays, CPU torch
  tensors) without torch: ``Comm.from_env()`` reads the same environment as torchrun sets.

Buffers are used in place, never copied: contiguous, in host memory, of a dtype tutti reduces
(float32, float64, float16, bfloat16, int8, uint8, int32, int64).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, List, Optional, Sequence

from . import _dtypes, _tutti
from ._tutti import TuttiError, Work

__all__ = ["Comm", "TuttiError", "WaitTimeout", "Work"]


class WaitTimeout(TuttiError, TimeoutError):
    """A wait with a timeout ended before its collective did. The collective goes on and still
    uses its buffers: wait for it again (or let the group's timeout end it)."""


def _wait(native: Work, timeout_s: Optional[float]) -> bool:
    try:
        return native.wait(timeout_s)
    except TimeoutError as e:  # the native half's, for a call still running
        raise WaitTimeout(str(e)) from None

_NUMPY_DTYPES = {
    "f4": "float32",
    "f8": "float64",
    "f2": "float16",
    "i1": "int8",
    "u1": "uint8",
    "i4": "int32",
    "i8": "int64",
}


def _torch_dtype_name(t: Any) -> Optional[str]:
    # A tensor exists only once torch is imported: a numpy caller never pays torch's import
    # (a second or more, and hundreds of MB) on its first collective.
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        return None
    names = _dtypes.torch_names()
    if t.dtype not in names:
        raise TypeError(f"tutti cannot reduce {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"tutti works on CPU tensors; this one is on {t.device}")
    if not t.is_contiguous():
        raise ValueError("tutti needs a contiguous tensor (call .contiguous())")
    return names[t.dtype]


def buffer(x: Any, writable: bool = True) -> tuple[tuple[int, int], str, Any]:
    """``((address, element count), dtype name, owner)`` of a contiguous host buffer.

    Accepts CPU torch tensors, objects with ``__array_interface__`` (numpy arrays) and buffers
    (bytearray, memoryviews; ``bytes`` and other read-only buffers only with ``writable=False``):
    uint8. ``owner`` holds the memory at ``address``: keep it referenced for as long as the
    address is used. For a bytearray or memoryview it also holds an export of the buffer, so the
    object cannot be resized (Python raises ``BufferError``) while a call uses it. Nothing is
    copied, except a read-only buffer other than ``bytes`` and numpy arrays: that one is read
    through one copy, which ``owner`` is.
    """
    name = _torch_dtype_name(x)
    if name is not None:
        return (x.data_ptr(), x.numel()), name, x
    ai = getattr(x, "__array_interface__", None)
    if ai is not None:
        if ai.get("strides") is not None:
            raise ValueError("tutti needs a C-contiguous array")
        addr, readonly = ai["data"]
        if writable and readonly:
            raise ValueError("tutti needs a writable array here")
        typestr = ai["typestr"]
        if typestr[0] not in "<|=" and typestr[1:] not in ("i1", "u1"):
            raise ValueError(f"tutti needs native byte order, not {typestr}")
        kind = _NUMPY_DTYPES.get(typestr[1:])
        if kind is None:
            raise TypeError(f"tutti cannot reduce arrays of {typestr}")
        count = 1
        for d in ai["shape"]:
            count *= d
        return (addr, count), kind, x
    if type(x) is bytes:
        if writable:
            raise ValueError("tutti needs a writable buffer here, not bytes")
        if not x:
            return (0, 0), "uint8", x
        # A c_char_p of a bytes object points into the object itself (no copy) and holds it.
        p = ctypes.c_char_p(x)
        return (ctypes.cast(p, ctypes.c_void_p).value, len(x)), "uint8", p
    mv = memoryview(x)
    if not mv.c_contiguous:
        raise ValueError("tutti needs a C-contiguous buffer")
    if mv.readonly:
        if writable:
            raise ValueError("tutti needs a writable buffer here")
        mv = memoryview(bytearray(mv))
    raw = mv.cast("B")
    n = raw.nbytes
    if n == 0:
        return (0, 0), "uint8", x
    # The ctypes array holds `raw`, which holds the export (and the copy, if one was made).
    held = (ctypes.c_char * n).from_buffer(raw)
    return (ctypes.addressof(held), n), "uint8", held


class Comm:
    """A communicator: this process's place in a group, and the group's connections.

    Every collective is called by every rank of the group in the same order. With
    ``async_op=True`` a call returns a :class:`Work` at once (``wait()`` releases the GIL);
    keep the buffers untouched and alive until then. Errors raise :class:`TuttiError` naming
    this rank, the peer and the operation; the communicator is unusable afterwards.
    """

    def __init__(self, native: "_tutti.Comm"):
        self._c = native

    @staticmethod
    def from_env() -> "Comm":
        """Rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or TUTTI_STORE)."""
        return Comm(_tutti.Comm.from_env())

    @property
    def rank(self) -> int:
        return self._c.rank

    @property
    def size(self) -> int:
        return self._c.size

    def links(self) -> List[str]:
        """How this rank's link to each rank goes, by rank: ``"shm"`` (shared memory, between
        ranks of one host), ``"tcp"`` or ``"quic"`` (the network), ``"unconnected"`` (no call
        has needed it yet: links connect on first use), ``"-"`` for this rank."""
        return list(self._c.links())

    def split(self, ranks: Sequence[int]) -> Optional["Comm"]:
        """A sub-communicator over ``ranks`` (called by every rank; ``None`` outside it)."""
        c = self._c.split(sorted(ranks))
        return None if c is None else Comm(c)

    def _run(self, kind, dtype, a=None, b=None, async_op=False, keep=(), **kw):
        w = self._c.run(kind, dtype, a=a, b=b, async_op=async_op, **kw)
        if w is None:
            return None
        return _Held(w, keep)

    def allreduce(self, buf, op: str = "sum", async_op: bool = False):
        """Reduce ``buf`` over the ranks in place (sum, prod, min, max, avg)."""
        a, dt, ka = buffer(buf)
        return self._run("allreduce", dt, a=a, op=op, async_op=async_op, keep=(ka,))

    def broadcast(self, buf, root: int = 0, async_op: bool = False):
        """``root``'s ``buf`` to every rank, in place."""
        a, dt, ka = buffer(buf)
        return self._run("broadcast", dt, a=a, root=root, async_op=async_op, keep=(ka,))

    def reduce(self, buf, op: str = "sum", root: int = 0, async_op: bool = False):
        """The reduction lands in ``root``'s ``buf``."""
        a, dt, ka = buffer(buf)
        return self._run("reduce", dt, a=a, op=op, root=root, async_op=async_op, keep=(ka,))

    def allgather(self, inp, out, async_op: bool = False):
        """Every rank's ``inp`` concatenated in rank order into ``out`` (size × len(inp))."""
        a, dt, ka = buffer(inp, writable=False)
        b, dt2, kb = buffer(out)
        _same(dt, dt2)
        return self._run("allgather", dt, a=a, b=b, async_op=async_op, keep=(ka, kb))

    def reduce_scatter(self, inp, out, op: str = "sum", async_op: bool = False):
        """Reduce ``inp`` (size × len(out)) over the ranks; block ``rank`` lands in ``out``."""
        a, dt, ka = buffer(inp, writable=False)
        b, dt2, kb = buffer(out)
        _same(dt, dt2)
        return self._run(
            "reduce_scatter", dt, a=a, b=b, op=op, async_op=async_op, keep=(ka, kb)
        )

    def all_to_all(self, inp, out, send_counts=None, recv_counts=None, async_op: bool = False):
        """Block ``j`` of ``inp`` goes to rank ``j``; block ``i`` of ``out`` comes from rank ``i``.
        Equal blocks unless counts (elements per rank) are given."""
        a, dt, ka = buffer(inp, writable=False)
        b, dt2, kb = buffer(out)
        _same(dt, dt2)
        if send_counts is None and recv_counts is None:
            return self._run("all_to_all", dt, a=a, b=b, async_op=async_op, keep=(ka, kb))
        return self._run(
            "all_to_all_v",
            dt,
            a=a,
            b=b,
            counts=(list(send_counts), list(recv_counts)),
            async_op=async_op,
            keep=(ka, kb),
        )

    def gather(self, inp, out=None, root: int = 0, async_op: bool = False):
        """Every rank's ``inp`` into ``root``'s ``out`` (size × len(inp)); others pass none."""
        a, dt, ka = buffer(inp, writable=False)
        b, kb = (0, 0), None
        if out is not None:
            b, dt2, kb = buffer(out)
            _same(dt, dt2)
        return self._run("gather", dt, a=a, b=b, root=root, async_op=async_op, keep=(ka, kb))

    def scatter(self, out, inp=None, root: int = 0, async_op: bool = False):
        """Block ``rank`` of ``root``'s ``inp`` (size × len(out)) into every rank's ``out``."""
        b, dt, kb = buffer(out)
        a, ka = (0, 0), None
        if inp is not None:
            a, dt2, ka = buffer(inp, writable=False)
            _same(dt, dt2)
        return self._run("scatter", dt, a=a, b=b, root=root, async_op=async_op, keep=(ka, kb))

    def barrier(self, async_op: bool = False):
        """Return once every rank has called it."""
        return self._run("barrier", "uint8", async_op=async_op)

    def send(self, buf, dst: int, tag: int = 0, async_op: bool = False):
        """Send ``buf`` to ``dst`` (which receives with the same tag)."""
        return self.batch([(buf, dst, tag)], [], async_op=async_op)

    def recv(self, buf, src: Optional[int], tag: int = 0, async_op: bool = False):
        """Receive into ``buf`` from ``src``. With ``src=None``, from whichever rank sends
        first under ``tag``: returns that rank (or, with ``async_op``, a work whose
        ``source_rank()`` says it once waited for)."""
        if src is not None:
            return self.batch([], [(buf, src, tag)], async_op=async_op)
        a, ka = _bytes(buf, True)
        w = self._run("recv_any", "uint8", a=a, root=tag, async_op=True, keep=(ka,))
        if async_op:
            return w
        w.wait()
        return w.source_rank()

    def batch(self, sends, recvs, async_op: bool = False):
        """Post every ``(buf, peer, tag)`` send and receive at once; return when all are done
        (no ordering deadlock between them)."""
        s = [(peer, tag, _bytes(buf, False)) for buf, peer, tag in sends]
        r = [(peer, tag, _bytes(buf, True)) for buf, peer, tag in recvs]
        keep = tuple(k for _, _, (_, k) in s) + tuple(k for _, _, (_, k) in r)
        s = [(peer, tag, a) for peer, tag, (a, _) in s]
        r = [(peer, tag, a) for peer, tag, (a, _) in r]
        return self._run("batch", "uint8", sends=s, recvs=r, async_op=async_op, keep=keep)


_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
          "int32": 4, "int64": 8}


def _bytes(buf, writable: bool) -> tuple[tuple[int, int], Any]:
    """``((address, bytes), owner)`` of ``buf``, as :func:`buffer`."""
    (addr, count), dt, owner = buffer(buf, writable=writable)
    return (addr, count * _SIZES[dt]), owner


def _same(a: str, b: str) -> None:
    if a != b:
        raise TypeError(f"input is {a} but output is {b}")


class _Held:
    """A :class:`Work` that keeps its buffers alive until it was waited for."""

    def __init__(self, work: Work, keep):
        self._w = work
        self._keep = keep

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the call ended; raise its error. With ``timeout`` (seconds), raise
        :class:`WaitTimeout` if it has not ended by then (it goes on, holding its buffers)."""
        try:
            ok = _wait(self._w, timeout)
        except WaitTimeout:
            raise
        except BaseException:
            self._keep = None
            raise
        self._keep = None
        return ok

    def is_completed(self) -> bool:
        return self._w.is_completed()

    def source_rank(self) -> Optional[int]:
        """For a receive from any source: the sender's rank, once waited for."""
        return self._w.source_rank()

    def __del__(self):
        # Dropped unwaited: the job may still use the buffers, so wait before they can go.
        if self._keep is not None:
            try:
                self._w.wait()
            except Exception:
                pass

    def is_success(self) -> bool:
        return self._w.is_success()

    def exception(self):
        return self._w.exception()
