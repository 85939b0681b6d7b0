"""`hetccl demo`: a local emulated mixed-vendor cluster on CPU, end to end.

Starts one process per rank with vendor labels from --vendors (default 2+2: two "vendors" of
two ranks each), initialises torch.distributed with backend "hetccl", then
  1. checks every collective family against a float64 reference on random data,
  2. trains a small MLP with DistributedDataParallel over hetccl and compares the final
     parameters with a single-process run on the same global batches,
  3. times a 16 MiB all-reduce,
and prints a short report. Exit status 0 only if every check passed.
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 1))


def _batch(step: int, global_batch: int):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(global_batch, 32, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    return x, y


def _train(model, steps, global_batch, rank=0, world=1, progress=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per = global_batch // world
    losses = []
    it = range(steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="training (DDP over hetccl)", file=sys.stderr, leave=False)
    for step in it:
        x, y = _batch(step, global_batch)
        sl = slice(rank * per, (rank + 1) * per)
        loss = nn.functional.mse_loss(model(x[sl]), y[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _checks(rank: int, world: int) -> dict[str, bool]:
    res = {}
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(100_003, generator=g) for _ in range(world)]
    ref = torch.stack([x.double() for x in inputs])
    x = inputs[rank].clone()
    dist.all_reduce(x)
    res["all_reduce sum"] = torch.allclose(x.double(), ref.sum(0), atol=1e-4)
    x = inputs[rank].clone().bfloat16()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    res["all_reduce max bf16"] = torch.equal(x, ref.max(0).values.bfloat16())
    x = inputs[rank].clone() if rank == world - 1 else torch.zeros(100_003)
    dist.broadcast(x, src=world - 1)
    res["broadcast"] = torch.equal(x, inputs[world - 1])
    out = torch.empty(world * 100_003)
    dist.all_gather_into_tensor(out, inputs[rank])
    res["all_gather"] = torch.equal(out, torch.cat(inputs))
    n = 100_003 // world
    y = torch.empty(n)
    dist.reduce_scatter_tensor(y, torch.cat([inputs[rank][:n * world]]))
    res["reduce_scatter"] = torch.allclose(y.double(), ref[:, :n * world].sum(0)[rank * n:(rank + 1) * n], atol=1e-4)
    a = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    b = torch.empty(world * 3)
    dist.all_to_all_single(b, a)
    res["all_to_all"] = torch.equal(b, torch.cat([torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) + 100 * s for s in range(world)]))
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    res["all_gather_object"] = objs == [{"rank": r} for r in range(world)]
    dist.barrier()
    res["barrier"] = True
    return res


def _rank_main(ctx, steps: int, global_batch: int) -> dict:
    import warnings

    import hetccl

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's API renames

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    rank, world = ctx.rank, ctx.world_size
    pg = dist.group.WORLD
    topo = pg.topo.describe() if isinstance(pg, hetccl.HetcclProcessGroup) else "one vendor"
    checks = _checks(rank, world)
    model = nn.parallel.DistributedDataParallel(_model())
    t0 = time.perf_counter()
    losses = _train(model, steps, global_batch, rank, world, progress=rank == 0)
    train_s = time.perf_counter() - t0
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    big = torch.ones(4 << 20)
    dist.all_reduce(big)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(big)
    ar_s = (time.perf_counter() - t0) / 3
    dist.destroy_process_group()
    return {"topo": topo, "checks": checks, "losses": losses, "params": params,
            "train_s": train_s, "allreduce_16mib_s": ar_s}


def main(argv: list[str] | None = None) -> int:
    from .launch import spawn

    p = argparse.ArgumentParser(prog="hetccl demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vendors", default="2+2", help="vendor split, e.g. 2+2, 1+1, 2+1, 1+2+1")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=64)
    args = p.parse_args(argv)
    world = sum(int(x) for x in args.vendors.split("+"))
    if args.global_batch % world:
        p.error(f"--global-batch must be divisible by the {world} ranks")
    print(f"hetccl demo: {world} CPU ranks, emulated vendors {args.vendors}")
    t0 = time.perf_counter()
    res = spawn(_rank_main, world, args=(args.steps, args.global_batch), vendors=args.vendors,
                timeout=600)
    ref_model = _model()
    ref_losses = _train(ref_model, args.steps, args.global_batch)
    ref = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    r0 = res[0]
    checks_ok = all(all(r["checks"].values()) for r in res)
    n_checks = sum(len(r["checks"]) for r in res)
    diff = max((r["params"] - ref).abs().max().item() for r in res)
    same = all(torch.equal(r["params"], r0["params"]) for r in res)
    train_ok = diff < 1e-4 and same
    print(f"  vendor groups      : {r0['topo']}")
    print(f"  collectives        : {n_checks} checks on {world} ranks: "
          f"{'all correct' if checks_ok else 'FAILURES'}")
    for name, ok in r0["checks"].items():
        if not all(r['checks'][name] for r in res):
            print(f"    FAILED: {name}")
    print(f"  DDP training       : {args.steps} steps, loss {r0['losses'][0]:.4f} -> "
          f"{r0['losses'][-1]:.4f} (single-process reference: {ref_losses[0]:.4f} -> "
          f"{ref_losses[-1]:.4f}), {r0['train_s']:.1f} s")
    print(f"  parameters         : max |hetccl - reference| = {diff:.2e}, ranks identical: "
          f"{same} -> {'match' if train_ok else 'MISMATCH'}")
    ar = r0["allreduce_16mib_s"]
    print(f"  16 MiB all-reduce  : {ar * 1e3:.1f} ms (busbw {16 * 2**20 / ar / 1e9 * 2 * (world - 1) / world:.2f} GB/s on this machine)")
    print(f"  total              : {time.perf_counter() - t0:.1f} s -> "
          f"{'OK' if checks_ok and train_ok else 'FAILED'}")
    return 0 if checks_ok and train_ok else 1


if __name__ == "__main__":
    sys.exit(main())
