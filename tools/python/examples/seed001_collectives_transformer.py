"""Assignment 9 on the "tutti" backend: collectives from send/recv only, and a Transformer
block in Megatron tensor parallel and Ulysses sequence parallel.

    torchrun --nproc-per-node 4 tools/python/examples/seed001_collectives_transformer.py [--backend tutti]

Task 1: `my_broadcast`, `my_allreduce`, `my_allgather`, `my_reduce_scatter` and
`my_all_to_all(scatter_dim, gather_dim)` use only `dist.send`/`dist.recv` (`isend`/`irecv`),
checked exactly against what the built-in collectives return, and the handout's written
questions' values printed by rank 0. Task 2: the block's `forward_tensor_parallel` (column-
parallel Q/K/V and FC1, row-parallel O and FC2, `dist.all_reduce`) and `forward_ulysses`
(sequence shards; heads exchanged with `dist.all_to_all`, which the gloo backend lacks on CPU)
against the single-process `forward`.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# -- Task 1: collectives from send/recv -------------------------------------------------------


def my_broadcast(tensor, src=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for r in range(world):
            if r != src:
                dist.send(tensor, r)
    else:
        dist.recv(tensor, src)
    return tensor


def my_allreduce(tensor):
    """Ring: reduce-scatter then allgather, 2(n-1) steps of one chunk each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(flat.tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i].clone(), right), dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        chunks[recv_i] += buf
    for s in range(world - 1):  # allgather
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        buf = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i].clone(), right), dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        chunks[recv_i].copy_(buf)
    return tensor


def my_allgather(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [tensor if r == rank else torch.empty_like(tensor) for r in range(world)]
    reqs = []
    for r in range(world):
        if r != rank:
            reqs.append(dist.isend(tensor.contiguous(), r))
            reqs.append(dist.irecv(parts[r], r))
    for q in reqs:
        q.wait()
    return torch.cat(parts, dim=0)


def my_reduce_scatter(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = tensor.chunk(world, dim=0)
    out = chunks[rank].clone()
    bufs = {r: torch.empty_like(chunks[rank]) for r in range(world) if r != rank}
    reqs = []
    for r in range(world):
        if r != rank:
            reqs.append(dist.isend(chunks[r].contiguous(), r))
            reqs.append(dist.irecv(bufs[r], r))
    for q in reqs:
        q.wait()
    for r in sorted(bufs):
        out += bufs[r]
    return out


def my_all_to_all(tensor, scatter_dim, gather_dim):
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [c.contiguous() for c in tensor.chunk(world, dim=scatter_dim)]
    recvs = [sends[r] if r == rank else torch.empty_like(sends[r]) for r in range(world)]
    reqs = []
    for r in range(world):
        if r != rank:
            reqs.append(dist.isend(sends[r], r))
            reqs.append(dist.irecv(recvs[r], r))
    for q in reqs:
        q.wait()
    return torch.cat(recvs, dim=gather_dim)


def task1(rank, world):
    g = torch.Generator().manual_seed(7)
    full = torch.randint(-8, 8, (world, 2 * world, 3), generator=g).float()  # exact sums
    x = full[rank].clone()
    y = x.clone()
    dist.broadcast(y, 1 % world)
    assert torch.equal(my_broadcast(x.clone(), src=1 % world), y)
    y = x.clone()
    dist.all_reduce(y)
    assert torch.equal(my_allreduce(x.clone()), y) and torch.equal(y, full.sum(0))
    assert torch.equal(my_allgather(x), torch.cat(list(full)))
    out = torch.empty(2, 3)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(my_reduce_scatter(x), out)
    a2a = my_all_to_all(torch.arange(4 * world * world).float().view(1, world, world, 4) + 100 * rank, 2, 1)
    assert a2a.shape == (1, world * world, 1, 4)
    want = torch.cat([(torch.arange(4 * world * world).float().view(1, world, world, 4) + 100 * q)
                      .chunk(world, 2)[rank] for q in range(world)], dim=1)
    assert torch.equal(a2a, want)
    # The handout's questions, answered by running them.
    q1 = my_broadcast(torch.tensor([10.0 * (rank + 1)]), src=1 % world)
    q2 = my_allreduce(torch.tensor([rank + 1.0]))
    q3 = my_allgather(torch.tensor([rank, rank + 10.0]))
    return q1.item(), q2.item(), q3.tolist()


# -- Task 2: a Transformer block in tensor and Ulysses sequence parallel ---------------------


class BasicTransformerBlock(nn.Module):
    def __init__(self, d_model=32, n_heads=4, d_ff=64):
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)

    def attention(self, q, k, v):
        # q, k, v: [b, s, heads, head_dim] -> [b, s, heads, head_dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        w = (q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)).softmax(-1)
        return (w @ v).transpose(1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, s, self.n_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.o_proj(self.attention(q, k, v).reshape(b, s, self.d_model))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def init_tensor_parallel_shards(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        d, f = self.d_model // world, self.fc1.out_features // world
        rows = slice(rank * d, (rank + 1) * d)
        self.q_proj_shard = self.q_proj.weight[rows]  # column parallel: output rows
        self.k_proj_shard = self.k_proj.weight[rows]
        self.v_proj_shard = self.v_proj.weight[rows]
        self.o_proj_shard = self.o_proj.weight[:, rows]  # row parallel: input columns
        self.fc1_shard = self.fc1.weight[rank * f:(rank + 1) * f]
        self.fc1_bias_shard = self.fc1.bias[rank * f:(rank + 1) * f]
        self.fc2_shard = self.fc2.weight[:, rank * f:(rank + 1) * f]

    def forward_tensor_parallel(self, x):
        world = dist.get_world_size()
        b, s, _ = x.shape
        heads = self.n_heads // world
        h = self.ln1(x)
        q, k, v = (F.linear(h, w).view(b, s, heads, self.head_dim)
                   for w in (self.q_proj_shard, self.k_proj_shard, self.v_proj_shard))
        attn = F.linear(self.attention(q, k, v).reshape(b, s, heads * self.head_dim), self.o_proj_shard)
        dist.all_reduce(attn)
        x = x + attn
        m = F.linear(F.gelu(F.linear(self.ln2(x), self.fc1_shard, self.fc1_bias_shard)), self.fc2_shard)
        dist.all_reduce(m)
        return x + m + self.fc2.bias

    def forward_ulysses(self, x_shard):
        world = dist.get_world_size()
        b, s_local, _ = x_shard.shape
        h = self.ln1(x_shard)
        qkv = []
        for p in (self.q_proj, self.k_proj, self.v_proj):
            t = p(h).view(b, s_local, self.n_heads, self.head_dim)
            # [b, s/N, heads, hd] -> [b, s, heads/N, hd]: heads scattered, sequence gathered
            ins = [c.contiguous() for c in t.chunk(world, dim=2)]
            outs = [torch.empty_like(ins[0]) for _ in range(world)]
            dist.all_to_all(outs, ins)
            qkv.append(torch.cat(outs, dim=1))
        a = self.attention(*qkv)  # [b, s, heads/N, hd]
        ins = [c.contiguous() for c in a.chunk(world, dim=1)]
        outs = [torch.empty_like(ins[0]) for _ in range(world)]
        dist.all_to_all(outs, ins)  # back: [b, s/N, heads, hd]
        a = torch.cat(outs, dim=2).reshape(b, s_local, self.d_model)
        x = x_shard + self.o_proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def task2(rank, world):
    torch.manual_seed(0)
    block = BasicTransformerBlock()
    x = torch.randn(2, 4 * world, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y_ref = block(x)
        block.init_tensor_parallel_shards()
        y_tp = block.forward_tensor_parallel(x)
        s = x.shape[1] // world
        y_ul = block.forward_ulysses(x[:, rank * s:(rank + 1) * s])
    tp = (y_tp - y_ref).abs().max().item()
    ul = (y_ul - y_ref[:, rank * s:(rank + 1) * s]).abs().max().item()
    return tp, ul


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tutti")
    backend = ap.parse_args().backend
    if backend == "tutti":
        import tutti.torch  # noqa: F401 - registers the backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    q1, q2, q3 = task1(rank, world)
    tp, ul = task2(rank, world)
    worst = torch.tensor([tp, ul])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    lines = [None] * world
    dist.all_gather_object(lines, f"rank {rank}: Q1 y={q1}  Q2 sum={q2}  Q3 y={q3}")
    if rank == 0:
        print("Task 1: every my_* collective equals the built-in one (exact)")
        for line in lines:
            print("  " + line)
        print(f"Task 2: max |y_tp - y_ref| = {worst[0]:.2e}, max |y_ulysses - y_ref| = {worst[1]:.2e}")
    dist.destroy_process_group()
    if worst.max().item() > 1e-5:
        raise SystemExit("a parallel forward differs from the single-process one")
    if rank == 0:
        print("ALL SAME")


if __name__ == "__main__":
    main()
