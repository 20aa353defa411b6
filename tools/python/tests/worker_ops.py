"""Every op of the tutti backend × every dtype, exact data, against single-process results.

Run under torchrun (any world size); prints one line per check and "ALL OK" at the end.
Rank r's data is a function of (r, seed) in small integers, so every rank can compute every
other rank's input and the single-process answer with torch's own ops.
"""

import sys

import torch
import torch.distributed as dist

import tutti.torch  # noqa: F401 - registers "tutti"

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def data(r, seed, shape, dtype, small=False):
    """Rank r's input: integers in [0, 4) (or {1, 2} with small, for products)."""
    g = torch.Generator().manual_seed(1000 * seed + r)
    hi = 3 if small else 4
    lo = 1 if small else 0
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def check(name, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        print(f"rank {dist.get_rank()} FAIL {name}: got {got.flatten()[:8].tolist()} want "
              f"{want.flatten()[:8].tolist()}", flush=True)
        sys.exit(1)


def reduce_ref(xs, op, dtype):
    acc = xs[0].clone()
    for x in xs[1:]:
        if op == "sum" or op == "avg":
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "max":
            acc = torch.maximum(acc, x)
    if op == "avg":
        n = len(xs)
        if dtype in (torch.float16, torch.bfloat16):
            acc = (acc.float() / n).to(dtype)
        elif dtype in FLOATS:
            acc = acc / n
        else:
            acc = torch.div(acc, n, rounding_mode="trunc")
    return acc.to(dtype)


OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


def main():
    dist.init_process_group("tutti")
    r, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "tutti"
    for dt in DTYPES:
        for shape in [(1,), (7, 3), (1000,)]:
            # all_reduce, every op
            for op in OPS:
                small = op == "prod"
                t = data(r, 1, shape, dt, small)
                dist.all_reduce(t, op=OPS[op])
                check(f"all_reduce {op} {dt} {shape}", t,
                      reduce_ref([data(q, 1, shape, dt, small) for q in range(n)], op, dt))
            # a non-contiguous tensor goes through a copy and back
            if len(shape) == 2:
                t = data(r, 2, shape, dt).t()
                dist.all_reduce(t)
                check(f"all_reduce transposed {dt}", t,
                      reduce_ref([data(q, 2, shape, dt).t() for q in range(n)], "sum", dt))
            for root in range(n):
                t = data(r, 3, shape, dt)
                dist.broadcast(t, root)
                check(f"broadcast root {root} {dt} {shape}", t, data(root, 3, shape, dt))
                t = data(r, 4, shape, dt)
                dist.reduce(t, root, op=dist.ReduceOp.MAX)
                if r == root:
                    check(f"reduce root {root} {dt}", t,
                          reduce_ref([data(q, 4, shape, dt) for q in range(n)], "max", dt))
                # gather / scatter
                inp = data(r, 5, shape, dt)
                outs = [torch.empty(shape, dtype=dt) for _ in range(n)] if r == root else None
                dist.gather(inp, outs, dst=root)
                if r == root:
                    for q in range(n):
                        check(f"gather root {root} from {q} {dt}", outs[q], data(q, 5, shape, dt))
                out = torch.empty(shape, dtype=dt)
                ins = [data(q, 6, shape, dt) + root for q in range(n)] if r == root else None
                dist.scatter(out, ins, src=root)
                check(f"scatter root {root} {dt}", out, data(r, 6, shape, dt) + root)
            # all_gather (list) and all_gather_into_tensor
            outs = [torch.empty(shape, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, data(r, 7, shape, dt))
            for q in range(n):
                check(f"all_gather {dt} from {q}", outs[q], data(q, 7, shape, dt))
            flat = torch.empty((n * shape[0],) + shape[1:], dtype=dt)
            dist.all_gather_into_tensor(flat, data(r, 8, shape, dt))
            check(f"all_gather_into_tensor {dt}", flat,
                  torch.cat([data(q, 8, shape, dt) for q in range(n)]))
            # reduce_scatter (list) and reduce_scatter_tensor
            for op in ["sum", "max", "avg"]:
                ins = [data(r, 9 + j, shape, dt) for j in range(n)]
                out = torch.empty(shape, dtype=dt)
                dist.reduce_scatter(out, ins, op=OPS[op])
                check(f"reduce_scatter {op} {dt}", out,
                      reduce_ref([data(q, 9 + r, shape, dt) for q in range(n)], op, dt))
                full = data(r, 20, (n * shape[0],) + shape[1:], dt)
                out = torch.empty(shape, dtype=dt)
                dist.reduce_scatter_tensor(out, full, op=OPS[op])
                want = reduce_ref([data(q, 20, (n * shape[0],) + shape[1:], dt) for q in range(n)],
                                  op, dt)
                check(f"reduce_scatter_tensor {op} {dt}", out, want[r * shape[0]:(r + 1) * shape[0]])
            # all_to_all (list) and all_to_all_single, equal and uneven splits
            ins = [data(r, 30 + j, shape, dt) for j in range(n)]
            outs = [torch.empty(shape, dtype=dt) for _ in range(n)]
            dist.all_to_all(outs, ins)
            for q in range(n):
                check(f"all_to_all {dt} from {q}", outs[q], data(q, 30 + r, shape, dt))
            inp = data(r, 40, (n * 2, 3), dt)
            out = torch.empty((n * 2, 3), dtype=dt)
            dist.all_to_all_single(out, inp)
            want = torch.cat([data(q, 40, (n * 2, 3), dt)[2 * r:2 * r + 2] for q in range(n)])
            check(f"all_to_all_single {dt}", out, want)
            # uneven: rank q sends j+1 rows to rank j
            send = [j + 1 for j in range(n)]
            recv = [r + 1] * n
            inp = data(r, 41, (sum(send), 2), dt)
            out = torch.empty((sum(recv), 2), dtype=dt)
            dist.all_to_all_single(out, inp, recv, send)
            parts = []
            for q in range(n):
                src = data(q, 41, (sum(send), 2), dt)
                off = sum(send[:r])
                parts.append(src[off:off + r + 1])
            check(f"all_to_all_single uneven {dt}", out, torch.cat(parts))
        print(f"rank {r} {dt} OK", flush=True)
    # async work, barrier
    t = data(r, 50, (10000,), torch.float32)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    check("async all_reduce", t,
          reduce_ref([data(q, 50, (10000,), torch.float32) for q in range(n)], "sum", torch.float32))
    dist.barrier()
    # point to point and batch_isend_irecv around the ring
    if n > 1:
        if r == 0:
            dist.send(data(0, 60, (5,), torch.int64), 1)
        elif r == 1:
            t = torch.empty(5, dtype=torch.int64)
            dist.recv(t, 0)
            check("send/recv", t, data(0, 60, (5,), torch.int64))
        s = data(r, 61, (100000,), torch.float32)
        got = torch.empty(100000)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, (r + 1) % n),
                                       dist.P2POp(dist.irecv, got, (r - 1) % n)])
        for q in reqs:
            q.wait()
        check("batch_isend_irecv", got, data((r - 1) % n, 61, (100000,), torch.float32))
    # sub-groups: pairs, and the odd ranks
    pairs = [dist.new_group([a, a + 1]) for a in range(0, n - 1, 2)]
    odds = dist.new_group(list(range(1, n, 2))) if n > 1 else None
    if r // 2 < len(pairs) and r < 2 * len(pairs):
        g = pairs[r // 2]
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t, group=g)
        a = r - r % 2
        check("new_group pair", t, torch.tensor([float(2 * a + 3)]))
    if odds is not None and r % 2 == 1:
        t = torch.tensor([r], dtype=torch.int64)
        dist.all_reduce(t, group=odds)
        check("new_group odds", t, torch.tensor([sum(range(1, n, 2))], dtype=torch.int64))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {r} ALL OK", flush=True)


if __name__ == "__main__":
    main()
