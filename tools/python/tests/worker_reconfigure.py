"""torch's fault-tolerance surface on the tutti backend, one process of four (RANK = its
"slot"): groups made with enable_reconfigure=True, reconfigured through torch's own API to
membership after membership. Each member posts its handle in the store; everyone builds the
same ordered list and calls dist._reconfigure. Data are small integers, so every sum is exact.

Cases, in order: calls before the first reconfigure raise; basic; send/recv; identity (the
fast path) with an in-flight call of the old membership failing; shrinking out the last rank,
then a middle one; scaling back up; a late joiner (a new group instance); splitting into two
groups and merging them in a new order; after abort(); after a timeout, with an abort hook;
a reused uuid; a failed reconfigure, then one over the members that came; abort() during a
reconfigure; after shutdown(); a member on this host whose process has ended; new_group on a
reconfigured world. Prints "RECONFIGURE OK" at the end."""

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

import tutti.torch  # noqa: F401 - registers the backend
from tutti.torch import ProcessGroupTutti, TuttiError

SLOT = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
T = datetime.timedelta(seconds=30)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), N, SLOT == 0,
                      timeout=T)


def sync(name):
    store.set(f"sync/{name}/{SLOT}", "1")
    store.wait([f"sync/{name}/{k}" for k in range(N)], T)


def reconfigure(pg, name, slots, uuid, use_set=False, late=0.0, timeout=20.0):
    """Members `slots` (in this order) go on as membership `uuid`; others only post. Returns
    how long the reconfigure took here; `late`: call it that many seconds after the others."""
    store.set(f"handle/{name}/{SLOT}", pg.get_reconfigure_handle())
    if SLOT not in slots:
        return None
    handles = [bytes(store.get(f"handle/{name}/{s}")).decode() for s in slots]
    time.sleep(late)
    t = time.monotonic()
    dist._reconfigure(uuid=uuid, handles=set(handles) if use_set else handles, group=pg,
                      timeout=datetime.timedelta(seconds=timeout)).wait()
    assert pg.get_error() == ErrorType.SUCCESS
    if not use_set:
        assert (pg.rank(), pg.size()) == (slots.index(SLOT), len(slots)), (pg.rank(), slots)
    took = time.monotonic() - t
    print(f"slot {SLOT} {name} {pg._path} {took * 1e3:.1f} ms", flush=True)
    return took


def allreduce(pg, want):
    t = torch.tensor([float(SLOT + 1)] * 5)
    if pg is dist.group.WORLD:
        dist.all_reduce(t, group=pg)
    else:
        # A group torch did not make (the late joiner's) is called directly.
        pg.allreduce([t]).wait()
    assert t.tolist() == [float(want)] * 5, (t, want)


def total(slots):
    return sum(s + 1 for s in slots)


dist.init_process_group("tutti", store=store, rank=SLOT, world_size=N, timeout=T,
                        enable_reconfigure=True)
pg = dist.group.WORLD
assert pg.supports_reconfigure and dist._supports_reconfigure(pg)
assert pg.get_error() == ErrorType.SUCCESS

# Before the first reconfigure: no members, every call raises at once.
try:
    allreduce(pg, 0)
    raise AssertionError("a collective before the first reconfigure ran")
except TuttiError as e:
    assert "reconfigure" in str(e), e

# Basic: all four, by list.
ALL = list(range(N))
reconfigure(pg, "basic", ALL, 1)
assert pg._path == "new", pg._path
allreduce(pg, total(ALL))

# Send/recv around the ring.
buf = torch.zeros(3, dtype=torch.int64)
send = dist.isend(torch.tensor([SLOT] * 3, dtype=torch.int64), (SLOT + 1) % N, group=pg)
dist.recv(buf, (SLOT - 1) % N, group=pg)
send.wait()
assert buf.tolist() == [(SLOT - 1) % N] * 3, buf

# Identity: the same members in the same order take the fast path. A receive of the old
# membership that nobody will match fails when the reconfigure starts.
sync("identity")
pending = dist.irecv(torch.zeros(1), (SLOT + 1) % N, group=pg) if SLOT == 0 else None
reconfigure(pg, "identity", ALL, 2)
assert pg._path == "kept", pg._path
if pending is not None:
    try:
        pending.wait()
        raise AssertionError("a receive of the old membership completed")
    except TuttiError as e:
        assert "reconfigur" in str(e), e
allreduce(pg, total(ALL))

# Shrinking out the last rank, then a middle one (kept in order: the fast path).
sync("shrink")
kept = [0, 1, 2]
reconfigure(pg, "shrink-last", kept, 3)
if SLOT in kept:
    assert pg._path == "kept"
    allreduce(pg, total(kept))
sync("shrink-last")
kept2 = [0, 2]
reconfigure(pg, "shrink-middle", kept2, 4)
if SLOT in kept2:
    assert pg._path == "kept"
    allreduce(pg, total(kept2))
sync("shrink-middle")

# Scaling back up: members from three different memberships build a new mesh.
reconfigure(pg, "up", ALL, 5)
assert pg._path == "new"
allreduce(pg, total(ALL))
sync("up")

# A late joiner: slot 3 replaces its group with a new instance, which arrives 1 s late.
if SLOT == 3:
    # The store the others rendezvous in: the one torch handed the backend (its prefix).
    pg3 = ProcessGroupTutti.reconfigurable(pg._store, 0, 1, T)
    took = reconfigure(pg3, "late", ALL, 6, late=1.0)
    old, pg = pg, pg3
else:
    took = reconfigure(pg, "late", ALL, 6)
    assert took >= 0.5, took
allreduce(pg, total(ALL))
sync("late")

# Split in two (one uuid each), then merge in a new order: slots 2, 3, 0, 1.
halves = [[0, 1], [2, 3]]
mine = halves[SLOT // 2]
reconfigure(pg, "split", mine, 7 + SLOT // 2)
assert pg._path == "kept"
allreduce(pg, total(mine))
sync("split")
merged = [2, 3, 0, 1]
reconfigure(pg, "merge", merged, 9, use_set=False)
assert pg._path == "new"
assert pg.rank() == merged.index(SLOT)
allreduce(pg, total(ALL))
sync("merge")

# A set of handles: the backend orders them (by handle), the same on every member.
reconfigure(pg, "set", ALL, 10, use_set=True)
ranks = torch.zeros(N, dtype=torch.int64)
pg._allgather_base(ranks, torch.tensor([SLOT])).wait()
assert sorted(ranks.tolist()) == ALL and ranks[pg.rank()] == SLOT, ranks
sync("set")

# After abort(): local and prompt; calls raise; the group reconfigures.
t = time.monotonic()
pg.abort()
took = time.monotonic() - t
assert took < 1.0, took
try:
    allreduce(pg, 0)
    raise AssertionError("a collective after abort() ran")
except TuttiError:
    pass
assert pg.get_error() != ErrorType.SUCCESS
sync("abort")
reconfigure(pg, "after-abort", ALL, 11)
assert pg.get_error() == ErrorType.SUCCESS
allreduce(pg, total(ALL))
sync("after-abort")

# A timeout: slot 0 calls alone with a 1 s limit; its abort hook runs, its error is TIMEOUT,
# and the others learn that a peer failed.
hooked = []
pg.register_abort_hook(1, lambda: hooked.append(time.monotonic()))
assert pg.supports_abort_hooks
if SLOT == 0:
    pg.set_timeout(datetime.timedelta(seconds=1))
    t = time.monotonic()
    try:
        allreduce(pg, 0)
        raise AssertionError("a lonely allreduce completed")
    except TuttiError as e:
        took = time.monotonic() - t
        assert 0.9 < took < 5, (took, str(e))
    assert hooked, "the abort hook did not run"
    assert pg.get_error() == ErrorType.TIMEOUT, pg.get_error()
    pg.set_timeout(T)
else:
    deadline = time.monotonic() + 10
    while pg.get_error() == ErrorType.SUCCESS and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pg.get_error() == ErrorType.REMOTE_ERROR, pg.get_error()
    assert not hooked
sync("timeout")
reconfigure(pg, "after-timeout", ALL, 12)
allreduce(pg, total(ALL))

# A reused uuid is refused at once, and the group goes on.
try:
    dist._reconfigure(uuid=12, handles=[pg.get_reconfigure_handle()], group=pg)
    raise AssertionError("a reused uuid was taken")
except ValueError as e:
    assert "uuid 12" in str(e), e
allreduce(pg, total(ALL))
sync("reused")

# A reconfigure that fails (slot 3 is named but never calls): the others' works raise within
# the timeout, naming it, and get_error says TIMEOUT; then the same members in the same order,
# less slot 3, go on (no membership is left to keep: a new rendezvous).
store.set(f"handle/fail/{SLOT}", pg.get_reconfigure_handle())
if SLOT != 3:
    handles = [bytes(store.get(f"handle/fail/{s}")).decode() for s in ALL]
    t = time.monotonic()
    try:
        dist._reconfigure(uuid=13, handles=handles, group=pg,
                          timeout=datetime.timedelta(seconds=2)).wait()
        raise AssertionError("a reconfigure without slot 3 completed")
    except TuttiError as e:
        took = time.monotonic() - t
        assert 1.5 < took < 6 and "did not reach reconfigure" in str(e), (took, str(e))
    assert pg.get_error() == ErrorType.TIMEOUT, pg.get_error()
    reconfigure(pg, "retry", [0, 1, 2], 14)
    assert pg._path == "new", pg._path
    allreduce(pg, total([0, 1, 2]))
sync("retry")

# abort() during a reconfigure: slot 0 calls one the others never join, and aborts it.
store.set(f"handle/mid/{SLOT}", pg.get_reconfigure_handle())
if SLOT == 0:
    handles = [bytes(store.get(f"handle/mid/{s}")).decode() for s in ALL]
    work = dist._reconfigure(uuid=15, handles=handles, group=pg)
    time.sleep(0.2)
    t = time.monotonic()
    pg.abort()
    try:
        work.wait()
        raise AssertionError("an aborted reconfigure completed")
    except TuttiError as e:
        took = time.monotonic() - t
        assert took < 1.0 and "aborted" in str(e), (took, str(e))
    assert pg.get_error() == ErrorType.COMM_ERROR, pg.get_error()
sync("mid")

# After shutdown(): calls raise; the group reconfigures (a new rendezvous).
pg.shutdown()
try:
    allreduce(pg, 0)
    raise AssertionError("a collective after shutdown() ran")
except TuttiError as e:
    assert "shut down" in str(e), e
reconfigure(pg, "after-shutdown", ALL, 16)
assert pg._path == "new", pg._path
allreduce(pg, total(ALL))
sync("shutdown")

# A member on this host whose process has ended is named at once, not at the timeout.
if SLOT == 0:
    child = subprocess.Popen(["true"])
    child.wait()
    store.set("handle/dead", json.dumps({"tutti": 1, "id": "0" * 32,
                                         "host": socket.gethostname(), "pid": child.pid}))
store.set(f"handle/with-dead/{SLOT}", pg.get_reconfigure_handle())
handles = [bytes(store.get(f"handle/with-dead/{s}")).decode() for s in ALL]
handles.append(bytes(store.get("handle/dead")).decode())
t = time.monotonic()
try:
    dist._reconfigure(uuid=17, handles=handles, group=pg,
                      timeout=datetime.timedelta(seconds=20)).wait()
    raise AssertionError("a reconfigure with a dead member completed")
except TuttiError as e:
    took = time.monotonic() - t
    assert took < 2 and "processes have ended" in str(e), (took, str(e))
sync("dead")

# torch names a sub-group's members by their ranks at init, which a reconfigured world no
# longer has: new_group says so instead of carving the wrong ranks out.
try:
    dist.new_group(ALL)
    raise AssertionError("new_group on a reconfigured world was made")
except TuttiError as e:
    assert "reconfigured" in str(e), e
sync("end")

print(f"slot {SLOT} RECONFIGURE OK", flush=True)
dist.destroy_process_group()
