"""Rank-side GPU checks (tests/test_gpu.py): CUDA tensors across emulated vendors."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def run(ctx) -> dict:
    import hetccl

    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
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
    # issuing never waits for the data: eight 8 MiB all-reduces queued behind 0.2 s of GPU work
    # return in a few milliseconds, and the values are right once the stream gets there
    xs = [torch.full((2 << 20,), float(rank + k), device=dev) for k in range(8)]
    for v in xs:  # warm-up: buffers, streams and kernels of this size exist before timing
        dist.all_reduce(v.clone())
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    works = [dist.all_reduce(v, async_op=True) for v in xs]
    out["async_issue_s"] = time.perf_counter() - t0
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    out["async_values_ok"] = all(
        bool((v == sum(r + k for r in range(world))).all()) for k, v in enumerate(xs))

    # two groups and host collectives interleaved with device ones, issued from two threads
    import threading

    g2 = dist.new_group(list(range(world)))
    results = {}

    def worker(name, group, base):
        vals = []
        for k in range(20):
            v = torch.full((1000 + k,), float(base + rank + k), device=dev)
            w = dist.all_reduce(v, group=group, async_op=True)
            h = torch.full((7,), float(rank), dtype=torch.float64)
            dist.all_reduce(h, group=group)
            w.wait()
            vals.append(bool((v == sum(base + r + k for r in range(world))).all())
                        and bool((h == sum(range(world))).all()))
        torch.cuda.synchronize()
        results[name] = all(vals)

    ts = [threading.Thread(target=worker, args=("world", None, 0)),
          threading.Thread(target=worker, args=("g2", g2, 100))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out["concurrent_groups_ok"] = results.get("world") and results.get("g2")

    # DDP: gradients equal the average of the per-rank gradients (computed without DDP)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                              torch.nn.Linear(2048, 512)).to(dev)
    ref = [p.detach().clone() for p in net.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[dev.index],
                                                    bucket_cap_mb=1)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(64, 512, generator=g) for _ in range(world)]
    ddp(data[rank].to(dev)).square().mean().backward()
    local = []
    for r in range(world):
        m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).to(dev)
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref):
                p.copy_(q)
        m(data[r].to(dev)).square().mean().backward()
        local.append([p.grad for p in m.parameters()])
    torch.cuda.synchronize()
    errs = [(p.grad - sum(lg[i] for lg in local) / world).abs().max().item()
            for i, p in enumerate(net.parameters())]
    out["ddp_grad_err"] = max(errs)

    # arguments that differ across ranks: a clear error on every rank, the group stays usable
    z = torch.ones(8) if rank == 0 else torch.ones(8, device=dev)
    try:
        dist.all_reduce(z)
        out["device_mismatch"] = "no error"
    except ValueError as e:
        out["device_mismatch"] = "ok" if "device type" in str(e) else str(e)
    z = torch.ones(100 + rank, device=dev)
    try:
        dist.all_reduce(z)
        out["size_mismatch"] = "no error"
    except ValueError as e:
        out["size_mismatch"] = "ok" if "number of elements" in str(e) else str(e)
    z = torch.ones(77, device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    out["usable_after_errors"] = bool((z == world).all())
    out["stats"] = pg.engine.stats
    dist.destroy_process_group()
    return out
