"""The tutti backend's sparse allreduce, receive from any source and monitored barrier, under
torchrun (world ≥ 2).

Prints "EXTRAS OK" on every rank when every check held.
"""

import datetime
import sys

import torch
import torch.distributed as dist

import tutti.torch  # noqa: F401 - registers "tutti"


def fail(msg):
    print(f"rank {dist.get_rank()} FAIL {msg}", flush=True)
    sys.exit(1)


def sparse_input(r, n):
    """Rank r's 6 x 3 tensor, sparse in its rows: rows r, r+1 and 5 (shared by all)."""
    rows = sorted({r % 6, (r + 1) % 6, 5})
    idx = torch.tensor([rows], dtype=torch.int64)
    val = torch.tensor([[float(r + 1 + k), float(k), -1.0] for k in range(len(rows))])
    return torch.sparse_coo_tensor(idx, val, (6, 3))


def expect_raises(what, fn, *needles):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        if not all(s in msg for s in needles):
            fail(f"{what}: {msg!r} lacks {needles}")
        return msg
    fail(f"{what}: did not raise")


def main():
    dist.init_process_group("tutti")
    r, n = dist.get_rank(), dist.get_world_size()

    # In place by aliasing, as torch programs write it, on the even ranks only (the odd ranks
    # pass separate tensors): all_gather_into_tensor into the output's own chunk,
    # reduce_scatter_tensor out of the input's own chunk, all_to_all_single(t, t). 2**20
    # elements make 4 MiB blocks, which go in pieces.
    for count in (3, 1 << 20):
        own = slice(r * count, (r + 1) * count)
        aliased = r % 2 == 0
        mine = torch.arange(count, dtype=torch.float32) + 1000 * r
        out = torch.zeros(n * count)
        if aliased:
            out[own] = mine
            dist.all_gather_into_tensor(out, out[own])
        else:
            dist.all_gather_into_tensor(out, mine)
        want = torch.cat([torch.arange(count, dtype=torch.float32) + 1000 * q for q in range(n)])
        if not torch.equal(out, want):
            fail(f"aliased all_gather_into_tensor, count {count}")
        full = torch.arange(n * count, dtype=torch.float32) + r
        if aliased:
            dist.reduce_scatter_tensor(full[own], full)
            got = full[own]
        else:
            got = torch.empty(count)
            dist.reduce_scatter_tensor(got, full)
        base = torch.arange(n * count, dtype=torch.float32)[own]
        if not torch.equal(got, n * base + n * (n - 1) // 2):
            fail(f"aliased reduce_scatter_tensor, count {count}")
        # Element j of the block rank s sends to rank d: (s * n + d) * count + j.
        blocks = torch.arange(n * count, dtype=torch.int32) + r * n * count
        if aliased:
            dist.all_to_all_single(blocks, blocks)
            got = blocks
        else:
            got = torch.empty(n * count, dtype=torch.int32)
            dist.all_to_all_single(got, blocks)
        want = torch.cat([torch.arange(count, dtype=torch.int32) + (s * n + r) * count
                          for s in range(n)])
        if not torch.equal(got, want):
            fail(f"aliased all_to_all_single, count {count}")
    # An overlap that is not the in-place layout is refused on every rank, before anything
    # is sent, and the group stays usable.
    out = torch.zeros(n * 4)
    expect_raises("shifted alias", lambda: dist.all_gather_into_tensor(out, out[1:5]), "overlap")

    # Sparse allreduce: the coalesced sum, against the dense sum of every rank's input.
    t = sparse_input(r, n)
    dist.all_reduce(t)
    want = sum(sparse_input(q, n).to_dense() for q in range(n))
    if not t.is_sparse or not torch.equal(t.to_dense(), want):
        fail(f"sparse allreduce: got {t.to_dense().tolist()} want {want.tolist()}")
    if t.indices().shape[1] != int((want.abs().sum(1) != 0).sum()):
        fail("sparse allreduce: result not coalesced")

    # Receive from any source: rank 0 takes one message from every other rank, in whatever
    # order they come, and learns who sent each (dist.recv with no src, and irecv's work).
    if r == 0:
        senders = []
        for k in range(n - 1):
            t = torch.full((5,), -1, dtype=torch.int32)
            if k % 2 == 0:
                src = dist.recv(t)
            else:
                w = dist.irecv(t)
                w.wait()
                src = w._source_rank()
            if not torch.equal(t, torch.full((5,), 10 * src + 7, dtype=torch.int32)):
                fail(f"any-source recv from {src}: {t.tolist()}")
            senders.append(src)
        if sorted(senders) != list(range(1, n)):
            fail(f"any-source senders {senders}")
    else:
        dist.send(torch.full((5,), 10 * r + 7, dtype=torch.int32), 0)

    # A monitored barrier that everyone reaches, twice (one with wait_all_ranks).
    two = datetime.timedelta(seconds=5)
    dist.monitored_barrier(timeout=two)
    dist.monitored_barrier(timeout=two, wait_all_ranks=True)

    # Rank 1 stays away: rank 0 names it, the others hear rank 0's verdict at once.
    short = datetime.timedelta(seconds=1)
    if r == 0:
        expect_raises("absent rank", lambda: dist.monitored_barrier(timeout=short),
                      "Rank 1 failed to pass monitoredBarrier")
    elif r != 1:
        expect_raises("verdict", lambda: dist.monitored_barrier(timeout=short),
                      f"Rank {r} successfully reached monitoredBarrier",
                      "Rank 1 failed to pass")

    # The group still works afterwards.
    x = torch.full((4,), float(r + 1))
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((4,), float(n * (n + 1) // 2))):
        fail(f"allreduce after a failed monitored barrier: {x.tolist()}")

    # Only rank 0 comes: with wait_all_ranks it names every other rank; with no time, itself.
    if r == 0:
        if n > 1:
            names = ", ".join(str(q) for q in range(1, n))
            noun = "Rank" if n == 2 else "Ranks"
            expect_raises("all absent", lambda: dist.monitored_barrier(
                timeout=datetime.timedelta(seconds=0.2), wait_all_ranks=True),
                f"{noun} {names} failed to pass monitoredBarrier")
        pg = dist.new_group(list(range(n)))
        expect_raises("no time", lambda: pg.monitored_barrier(datetime.timedelta(seconds=0)),
                      "Rank 0 timed out in monitoredBarrier")
    else:
        dist.new_group(list(range(n)))
    # work.wait(timeout): rank 0's all_reduce cannot end before the others join, which they do
    # only once rank 0 says (through the store) that its check is made; its 50 ms wait raises
    # (a RuntimeError, as torch's "Operation timed out!"), the call goes on, and a wait without
    # a limit gets the exact result.
    store = dist.distributed_c10d._get_default_store()

    def after_rank_0(key):
        if r != 0:
            store.wait([key], datetime.timedelta(seconds=60))

    after_rank_0("tt-timed-wait")
    x = torch.full((1000,), float(r + 1))
    w = dist.all_reduce(x, async_op=True)
    if r == 0:
        expect_raises("timed wait", lambda: w.wait(timeout=datetime.timedelta(milliseconds=50)),
                      "rank 0", "allreduce", "did not end within")
        store.set("tt-timed-wait", "1")
    w.wait()
    if not torch.equal(x, torch.full((1000,), float(n * (n + 1) // 2))):
        fail(f"allreduce after a timed-out wait: {x[:4].tolist()}")

    # get_future does not wait for the call (DDP takes each bucket's future and goes on with
    # the backward pass): rank 0 takes it while its all_reduce cannot end and drops the work;
    # the future then completes with the exact sum, and a callback chained on it runs.
    after_rank_0("tt-future")
    x = torch.full((1000,), float(r + 1))
    fut = dist.all_reduce(x, async_op=True).get_future()
    if r == 0:
        if fut.done():
            fail("get_future waited for its all_reduce to end")
        store.set("tt-future", "1")
    total = float(n * (n + 1) // 2)
    chained = fut.then(lambda f: f.value()[0].sum().item())
    if chained.wait() != 1000 * total or not torch.equal(x, torch.full((1000,), total)):
        fail(f"the future's all_reduce: {x[:4].tolist()}")

    # A callback that starts a call and waits for that call's future, as PowerSGD's DDP hook
    # does: the callback runs on a helper thread, and another helper sets the inner future.
    def nested(f):
        inner = f.value()[0].clone()
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    x = torch.full((10,), float(r + 1))
    got = dist.all_reduce(x, async_op=True).get_future().then(nested).wait()
    if not torch.equal(got, torch.full((10,), n * total)):
        fail(f"a callback's own all_reduce: {got.tolist()}")
    dist.barrier()
    print(f"rank {r} EXTRAS OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
