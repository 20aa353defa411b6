"""The torch-free API on numpy arrays and bytearrays: run as N processes with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; prints "ALL OK" per rank."""

import os
import sys

import numpy as np

import tutti


def data(r, seed, n, dtype):
    rng = np.random.default_rng(1000 * seed + r)
    return rng.integers(0, 4, n).astype(dtype)


def check(name, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        print(f"FAIL {name}: got {got[:8]} want {want[:8]}", flush=True)
        sys.exit(1)


def main():
    c = tutti.Comm.from_env()
    r, n = c.rank, c.size
    for dt in [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64]:
        for m in [1, 13, 100_000]:
            x = data(r, 1, m, dt)
            c.allreduce(x)
            check(f"allreduce {dt}", x, sum(data(q, 1, m, dt) for q in range(n)).astype(dt))
            x = data(r, 2, m, dt)
            c.allreduce(x, op="max")
            check(f"allreduce max {dt}", x, np.max([data(q, 2, m, dt) for q in range(n)], axis=0))
            x = data(r, 3, m, dt)
            c.broadcast(x, root=n - 1)
            check(f"broadcast {dt}", x, data(n - 1, 3, m, dt))
            out = np.empty(m * n, dt)
            c.allgather(data(r, 4, m, dt), out)
            check(f"allgather {dt}", out, np.concatenate([data(q, 4, m, dt) for q in range(n)]))
            out = np.empty(m, dt)
            c.reduce_scatter(data(r, 5, m * n, dt), out)
            full = sum(data(q, 5, m * n, dt) for q in range(n)).astype(dt)
            check(f"reduce_scatter {dt}", out, full[r * m:(r + 1) * m])
            out = np.empty(m * n, dt)
            c.all_to_all(data(r, 6, m * n, dt), out)
            check(f"all_to_all {dt}", out,
                  np.concatenate([data(q, 6, m * n, dt)[r * m:(r + 1) * m] for q in range(n)]))
            out = np.empty(m * n, dt) if r == 0 else None
            c.gather(data(r, 7, m, dt), out, root=0)
            if r == 0:
                check(f"gather {dt}", out, np.concatenate([data(q, 7, m, dt) for q in range(n)]))
            out = np.empty(m, dt)
            c.scatter(out, data(0, 8, m * n, dt) if r == 0 else None, root=0)
            check(f"scatter {dt}", out, data(0, 8, m * n, dt)[r * m:(r + 1) * m])
    # uneven all-to-all: rank r sends j + 1 elements to rank j
    send = [j + 1 for j in range(n)]
    recv = [r + 1] * n
    out = np.empty(sum(recv), np.int64)
    c.all_to_all(data(r, 9, sum(send), np.int64), out, send, recv)
    off = sum(send[:r])
    check("all_to_all_v", out, np.concatenate([data(q, 9, sum(send), np.int64)[off:off + r + 1]
                                               for q in range(n)]))
    # in place by aliasing, on the odd ranks only: allgather into the output's own block,
    # reduce_scatter out of the input's own block, all_to_all on one buffer
    m = 1001
    own = slice(r * m, (r + 1) * m)
    out = np.zeros(m * n, np.int32)
    if r % 2:
        out[own] = data(r, 10, m, np.int32)
        c.allgather(out[own], out)
    else:
        c.allgather(data(r, 10, m, np.int32), out)
    check("aliased allgather", out, np.concatenate([data(q, 10, m, np.int32) for q in range(n)]))
    full = data(r, 11, m * n, np.int32)
    if r % 2:
        c.reduce_scatter(full, full[own])
        got = full[own]
    else:
        got = np.empty(m, np.int32)
        c.reduce_scatter(full, got)
    want = sum(data(q, 11, m * n, np.int32) for q in range(n)).astype(np.int32)[own]
    check("aliased reduce_scatter", got, want)
    x = data(r, 12, m * n, np.int32)
    if r % 2:
        c.all_to_all(x, x)
        got = x
    else:
        got = np.empty(m * n, np.int32)
        c.all_to_all(x, got)
    check("aliased all_to_all", got,
          np.concatenate([data(q, 12, m * n, np.int32)[own] for q in range(n)]))
    # async, with the GIL released while waiting
    x = np.ones(1 << 20, np.float32)
    w = c.allreduce(x, async_op=True)
    w.wait()
    check("async allreduce", x, np.full(1 << 20, n, np.float32))
    # bytearrays: point to point around the ring
    if n > 1:
        mine = bytearray(bytes([r]) * 1000)
        got = bytearray(1000)
        c.batch([(mine, (r + 1) % n, 5)], [(got, (r - 1) % n, 5)])
        assert got == bytearray(bytes([(r - 1) % n]) * 1000), got[:4]
    # from any source: the last rank takes one message from every other rank, learning who
    if n > 1:
        if r == n - 1:
            seen = []
            for _ in range(n - 1):
                buf = np.zeros(3, np.int32)
                src = c.recv(buf, None, tag=6)
                check("recv from any source", buf, np.full(3, 100 + src, np.int32))
                seen.append(src)
            assert sorted(seen) == list(range(n - 1)), seen
        else:
            c.send(np.full(3, 100 + r, np.int32), n - 1, tag=6)
    # read-only inputs: bytes (read in place), a read-only memoryview (read through a copy
    # that must live as long as the call: 1 MiB, so a freed copy is unmapped and the send
    # would fail), a read-only numpy array; blocking and async, the caller's own reference
    # to the input dropped before the wait
    big = 1 << 20
    for mk in [lambda b: b, lambda b: memoryview(b), lambda b: np.frombuffer(b, np.uint8)]:
        out = bytearray(big * n)
        c.allgather(mk(bytes([r + 1]) * big), out)
        for q in range(n):
            assert out[q * big] == q + 1 and out[(q + 1) * big - 1] == q + 1, (q, out[q * big])
        out = bytearray(big * n)
        w = c.allgather(mk(bytes([r + 7]) * big), out, async_op=True)
        junk = [bytearray(big) for _ in range(8)]  # reuse whatever memory was freed
        w.wait()
        del junk
        assert all(out[q * big] == q + 7 and out[(q + 1) * big - 1] == q + 7 for q in range(n))
    if n > 1:
        got = bytearray(1000)
        w = c.batch([(bytes([r]) * 1000, (r + 1) % n, 8)], [(got, (r - 1) % n, 8)],
                    async_op=True)
        try:
            got.extend(b"x")  # the call holds an export: the buffer cannot move under it
            print("FAIL a bytearray in use by an unwaited call was resized", flush=True)
            sys.exit(1)
        except BufferError:
            pass
        w.wait()
        assert got == bytearray(bytes([(r - 1) % n]) * 1000), got[:4]
        got.extend(b"x")  # released by the wait
    # a timed wait, then two threads wait for one work: none returns before it ended. The
    # others join rank 0's call only once rank 0 has timed out waiting (a file says so), and
    # 0.3 s after that, so it cannot end early.
    if n > 1:
        import threading
        import time

        go = f"/tmp/tutti-test-go-{os.environ['MASTER_PORT']}"
        x = np.full(1 << 16, r + 1, np.int64)
        if r != 0:
            until = time.monotonic() + 60
            while not os.path.exists(go):
                assert time.monotonic() < until, "rank 0 never timed out its wait"
                time.sleep(0.01)
            time.sleep(0.3)
        w = c.allreduce(x, async_op=True)
        if r == 0:
            # a timed wait that ends first raises, and the call goes on
            t = time.monotonic()
            try:
                w.wait(0.05)
                print("FAIL a timed wait returned before its call ended", flush=True)
                sys.exit(1)
            except tutti.WaitTimeout as e:
                assert isinstance(e, RuntimeError) and isinstance(e, TimeoutError), type(e)
                assert "rank 0" in str(e) and "allreduce" in str(e), str(e)
            assert time.monotonic() - t >= 0.05
            open(go, "w").close()
        seen = []

        def waiter():
            ok = w.wait()
            seen.append((ok, int(x[0]), int(x[-1])))

        ts = [threading.Thread(target=waiter) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        total = n * (n + 1) // 2
        assert seen == [(True, total, total)] * 2, seen
        c.barrier()
        if r == 0:
            os.remove(go)
    # a sub-communicator of the even ranks
    evens = c.split(range(0, n, 2))
    if r % 2 == 0:
        x = np.array([r], np.int64)
        evens.allreduce(x)
        check("split", x, np.array([sum(range(0, n, 2))], np.int64))
    else:
        assert evens is None
    c.barrier()
    # With nothing set, ranks of one host link through shared memory (links connect on first
    # use: some may not be connected yet, none goes through a socket).
    links = c.links()
    assert len(links) == n and links[r] == "-", links
    kinds = set(links) - {"-"}
    want = {"tcp", "unconnected"} if os.environ.get("TUTTI_SHM") == "0" else {"shm", "unconnected"}
    assert kinds <= want, f"rank {r}'s links: {links}"
    if n > 1:
        assert "shm" in kinds or os.environ.get("TUTTI_SHM") == "0", f"rank {r}'s links: {links}"
    print(f"rank {r} ALL OK", flush=True)


if __name__ == "__main__":
    main()
