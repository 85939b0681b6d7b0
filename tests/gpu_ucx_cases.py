"""Rank side of tests/test_gpu_ucx.py and of `.ci/gpu-box.sh ucx`: CUDA tensors between emulated
vendors on emulated hosts (HETCCL_EMULATE_HOSTS=1) over the UCX bridge, device memory handed to
UCX directly (HETCCL_UCX_DEVICE=auto) or staged through host memory by the engine (off).

Ranks use GPU rank % device_count, so 2+1 on a 2-GPU box puts ranks 0 and 2 on GPU 0. Without
CUDA the same cases run on host tensors with smaller sizes (tests/test_transport_choice.py runs
them so on CPU machines: the bridge's choice and UCX restrictions end to end)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def run(ctx, device: str = "auto") -> dict:
    """device: "auto" (CUDA where available, else host tensors) or "cpu" (host tensors)."""
    import hetccl

    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    rank, world = ctx.rank, ctx.world_size
    pg = dist.group.WORLD
    out: dict = {"is_hetccl_group": isinstance(pg, hetccl.HetcclProcessGroup)}
    b = pg.engine.bridge
    out["choices"] = {p: b.choices[(rank, p)].describe() for p in b.peers}
    out["device_direct"] = {p: b.device_direct[p] for p in b.peers}
    out["ucx"] = b.info.get("ucx", {})

    def inputs(n, seed):
        return [torch.randn(n, generator=torch.Generator().manual_seed(seed + r),
                            dtype=torch.float64) for r in range(world)]

    ok: dict[str, bool] = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n in (1, 1001, (8 << 20) // 2 + 7, 64 << 20 >> 2) if cuda else (1, 1001, 300_007):
            xs = inputs(n, n)
            x = xs[rank].to(dtype).to(dev)
            dist.all_reduce(x)
            ref = torch.stack([v.to(dtype).double() for v in xs]).sum(0)
            ok[f"all_reduce/{dtype}/{n}"] = bool(
                (x.double().cpu() - ref).abs().max().item() / max(1, ref.abs().max().item()) <= tol)
            y = xs[rank].to(dtype).to(dev)
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
            ok[f"all_reduce_max/{dtype}/{n}"] = torch.equal(
                y.cpu(), torch.stack([v.to(dtype) for v in xs]).max(0).values)
        n = 3 << 20 if cuda else 100_003
        xs = inputs(n, 7)
        big = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(big, xs[rank].to(dtype).to(dev))
        ok[f"all_gather/{dtype}"] = torch.equal(big.cpu(), torch.cat([v.to(dtype) for v in xs]))
        full = inputs(world * n, 11)
        o = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(o, full[rank].to(dtype).to(dev))
        ref = torch.stack([v.to(dtype).double() for v in full]).sum(0)[rank * n:(rank + 1) * n]
        ok[f"reduce_scatter/{dtype}"] = bool((o.double().cpu() - ref).abs().max().item() <= tol * 4)
        bc = xs[rank].to(dtype).to(dev) if rank == world - 1 else torch.zeros(n, dtype=dtype, device=dev)
        dist.broadcast(bc, src=world - 1)
        ok[f"broadcast/{dtype}"] = torch.equal(bc.cpu(), xs[world - 1].to(dtype))
        m = 1 << 16
        src = torch.arange(world * m, dtype=torch.float64).to(dtype).to(dev) + 1000 * rank
        dst = torch.empty_like(src)
        dist.all_to_all_single(dst, src)
        want = torch.cat([(torch.arange(world * m, dtype=torch.float64).to(dtype)
                           + 1000 * r)[rank * m:(rank + 1) * m] for r in range(world)])
        ok[f"all_to_all/{dtype}"] = torch.equal(dst.cpu(), want)
    # point to point across the vendors (last rank <-> rank 0, of different groups)
    if world > 1 and rank in (0, world - 1):
        t = torch.full((1 << 20,), float(rank), device=dev)
        if rank == 0:
            dist.send(t, dst=world - 1)
        else:
            dist.recv(t, src=0)
        ok["send_recv"] = bool((t == 0.0).all().item())
    if cuda:
        torch.cuda.synchronize()
    out["correct"] = ok
    out["stats"] = dict(pg.engine.stats)
    dist.destroy_process_group()
    return out
