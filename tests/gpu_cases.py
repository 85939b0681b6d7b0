"""Rank-side GPU checks (tests/test_gpu.py): CUDA tensors across emulated vendors."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def run(ctx) -> dict:
    import hetccl

    dev = torch.device("cuda", ctx.rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    rank, world = ctx.rank, ctx.world_size
    pg = dist.group.WORLD
    out = {}
    out["is_hetccl_group"] = isinstance(pg, hetccl.HetcclProcessGroup)
    # emulated vendors share nothing but host memory: no native (NCCL) communicator between
    # the two groups, shm bridge between the ranks
    out["native_comm_across_groups"] = pg.engine.local is not None
    out["bridge_kinds"] = sorted(set(pg.engine.bridge.kind_of.values()))

    def inputs(n, dtype, seed):
        return [torch.randn(n, generator=torch.Generator().manual_seed(seed + r),
                            dtype=torch.float64) for r in range(world)]

    errs = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n in (1, 1001, (8 << 20) // 2 + 7, 64 << 20 >> 2):
            xs = inputs(n, dtype, n)
            x = xs[rank].to(dtype).to(dev)
            dist.all_reduce(x)
            ref = torch.stack([v.to(dtype).double() for v in xs]).sum(0)
            errs[f"all_reduce/{dtype}/{n}"] = (x.double().cpu() - ref).abs().max().item() / max(1, ref.abs().max().item()) <= tol
            y = xs[rank].to(dtype).to(dev)
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
            errs[f"all_reduce_max/{dtype}/{n}"] = torch.equal(
                y.cpu(), torch.stack([v.to(dtype) for v in xs]).max(0).values)
        n = 3 << 20
        xs = inputs(n, dtype, 7)
        big = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(big, xs[rank].to(dtype).to(dev))
        errs[f"all_gather/{dtype}"] = torch.equal(big.cpu(), torch.cat([v.to(dtype) for v in xs]))
        full = inputs(world * n, dtype, 11)
        o = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(o, full[rank].to(dtype).to(dev))
        ref = torch.stack([v.to(dtype).double() for v in full]).sum(0)[rank * n:(rank + 1) * n]
        errs[f"reduce_scatter/{dtype}"] = (o.double().cpu() - ref).abs().max().item() <= tol * 4
        b = xs[rank].to(dtype).to(dev) if rank == 1 else torch.zeros(n, dtype=dtype, device=dev)
        dist.broadcast(b, src=1)
        errs[f"broadcast/{dtype}"] = torch.equal(b.cpu(), xs[1].to(dtype))
    out["correct"] = errs

    # stream semantics: the collective waits for work queued before it on the caller's
    # stream, returns without blocking the host, and wait() orders the caller's stream after it
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
    x.fill_(rank + 1.0)  # queued behind the sleep
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    issue_s = time.perf_counter() - t0
    work.wait()
    wait_s = time.perf_counter() - t0
    y = x * 2  # on the caller's stream, after wait()
    torch.cuda.synchronize()
    out["stream"] = {"issue_s": issue_s, "wait_s": wait_s,
                     "value_ok": bool((y == 2 * sum(r + 1.0 for r in range(world))).all())}
    # a device that differs across ranks is a clear error on every rank
    z = torch.ones(8) if rank == 0 else torch.ones(8, device=dev)
    try:
        dist.all_reduce(z)
        out["device_mismatch"] = "no error"
    except ValueError as e:
        out["device_mismatch"] = "ok" if "device type" in str(e) else str(e)
    out["zero_copy_bytes"] = pg.engine.stats["zero_copy_bytes"]
    out["staged_bytes"] = pg.engine.stats["staged_bytes"]
    out["raw_runtime"] = pg.engine.stats.get("raw_runtime")
    dist.destroy_process_group()
    return out
