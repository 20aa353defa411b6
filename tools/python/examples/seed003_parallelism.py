"""The lecture's data, tensor and pipeline parallel samples on the "tutti" backend.

    torchrun --nproc-per-node 4 tools/python/examples/seed003_parallelism.py [--backend tutti]

The three samples as the lecture writes them — `dist.all_reduce(param.grad, op=AVG)` for data
parallel, `dist.all_gather` of activation shards for tensor parallel, `dist.send`/`dist.recv`
of micro-batches for pipeline parallel — with the backend name the only change, and each
checked against the same model run in one process: rank 0 prints both and whether they agree.
The parameters are made from one seed on every rank (tensor parallel takes each rank's
column block of the full weights), so the single-process run is the same model.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

BATCH, DIM, LAYERS, STEPS, MICRO = 16, 32, 4, 3, 4


def full_params(num_layers):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(DIM, DIM, generator=g) / DIM ** 0.5 for _ in range(num_layers)]


def summarize(t):
    return f"{tuple(t.shape)} sum={t.sum().item():.6f}"


def data_parallelism(rank, world, data):
    # Each rank's slice of the batch; every rank holds all parameters.
    local = data[rank * (BATCH // world):(rank + 1) * (BATCH // world)]
    params = [p.clone().requires_grad_() for p in full_params(LAYERS)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for step in range(STEPS):
        x = local
        for param in params:
            x = F.gelu(x @ param)
        loss = x.square().mean()
        loss.backward()
        # Sync gradients across workers (the only difference from single-process training)
        for param in params:
            dist.all_reduce(tensor=param.grad, op=dist.ReduceOp.AVG, async_op=False)
        optimizer.step()
        optimizer.zero_grad()
    return params


def data_parallelism_reference(data):
    params = [p.clone().requires_grad_() for p in full_params(LAYERS)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(STEPS):
        x = data
        for param in params:
            x = F.gelu(x @ param)
        x.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return params


def tensor_parallelism(rank, world, data):
    local_dim = DIM // world
    # Each rank gets its column block of every weight (1/world of the parameters).
    params = [p[:, rank * local_dim:(rank + 1) * local_dim].contiguous() for p in full_params(LAYERS)]
    x = data
    for i in range(LAYERS):
        x = F.gelu(x @ params[i])  # batch x local_dim
        activations = [torch.empty(BATCH, local_dim) for _ in range(world)]
        dist.all_gather(tensor_list=activations, tensor=x, async_op=False)
        x = torch.cat(activations, dim=1)  # batch x DIM
    return x


def forward_reference(data):
    x = data
    for p in full_params(LAYERS):
        x = F.gelu(x @ p)
    return x


def pipeline_parallelism(rank, world, data):
    local_layers = LAYERS // world
    local_params = full_params(LAYERS)[rank * local_layers:(rank + 1) * local_layers]
    micro = BATCH // MICRO
    if rank == 0:
        micro_batches = list(data.chunk(chunks=MICRO, dim=0))
    else:
        micro_batches = [torch.empty(micro, DIM) for _ in range(MICRO)]
    outputs = []
    for x in micro_batches:
        if rank - 1 >= 0:
            dist.recv(tensor=x, src=rank - 1)
        for param in local_params:
            x = F.gelu(x @ param)
        if rank + 1 < world:
            dist.send(tensor=x.contiguous(), dst=rank + 1)
        outputs.append(x)
    return torch.cat(outputs) if rank == world - 1 else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tutti")
    backend = ap.parse_args().backend
    if backend == "tutti":
        import tutti.torch  # noqa: F401 - registers the backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1))
    ok = True

    params = data_parallelism(rank, world, data)
    ref = data_parallelism_reference(data)
    same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(params, ref))
    ok &= same
    if rank == 0:
        print(f"[data_parallelism] {world} ranks: params {[summarize(p.detach()) for p in params][:2]}")
        print(f"[data_parallelism] 1 process : params {[summarize(p.detach()) for p in ref][:2]} -> {'same' if same else 'DIFFERENT'}")

    x = tensor_parallelism(rank, world, data)
    want = forward_reference(data)
    same = torch.allclose(x, want, rtol=1e-5, atol=1e-6)
    ok &= same
    if rank == 0:
        print(f"[tensor_parallelism] {world} ranks: activations {summarize(x)}")
        print(f"[tensor_parallelism] 1 process : activations {summarize(want)} -> {'same' if same else 'DIFFERENT'}")

    if LAYERS % world == 0:
        y = pipeline_parallelism(rank, world, data)
        if rank == world - 1:
            same = torch.allclose(y, want, rtol=1e-5, atol=1e-6)
            ok &= same
            print(f"[pipeline_parallelism] {world} stages: output {summarize(y)}; 1 process: "
                  f"{summarize(want)} -> {'same' if same else 'DIFFERENT'}")
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if flag.item():
        raise SystemExit(f"rank {rank}: a parallel result differs from the single-process one")
    if rank == 0:
        print("ALL SAME")


if __name__ == "__main__":
    main()
