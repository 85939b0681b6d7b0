"""Rank-side training runs for tests/test_training.py: DDP and FSDP2 over hetccl with mixed
emulated vendors must end with the parameters of a single-process full-batch reference."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 5
GLOBAL_BATCH = 24
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 33), nn.Tanh(),
                         nn.Linear(33, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def reference_params() -> list[torch.Tensor]:
    model = make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x.double()), y.double())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().float() for p in model.parameters()]


def _init(ctx):
    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))


def _train_shards(model, ctx) -> None:
    """STEPS of SGD, each rank on its equal slice of the global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per = GLOBAL_BATCH // ctx.world_size
    for step in range(STEPS):
        x, y = batch(step)
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        loss = nn.functional.mse_loss(model(x[sl]), y[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()


def run_ddp(ctx) -> list[torch.Tensor]:
    _init(ctx)
    model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.01)
    _train_shards(model, ctx)
    out = [p.detach().clone() for p in model.module.parameters()]
    dist.destroy_process_group()
    return out


def run_fsdp2(ctx) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(ctx)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_shards(model, ctx)
    out = [p.full_tensor().detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    return out
