"""Multi-process: balanced training equals a homogeneous run; Balancer re-plans identically on
every rank from speeds exchanged over torch.distributed."""
import torch

from hetccl.launch import spawn

BACKEND = "hetccl"   # "gloo" also works (vendor labels are then ignored)
VENDORS = "2+1"

N, B, STEPS, D = 240, 12, 20, 5
COLLAPSE = 8
CAPS = [3, 4, 5]
LR, MOM = 0.1, 0.9


def _speeds(step):
    """Emulated per-rank speeds (samples/s): rank 2 collapses from step COLLAPSE on, so the
    plan changes several times and rank 2 ends with no samples."""
    return [1.0, 2.0, 3.0] if step < COLLAPSE else [3.0, 2.0, 0.02]


def _data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    Y = torch.randn(N, 1, generator=g, dtype=torch.float64)
    return X, Y


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def _snap(model):
    return [p.detach().clone() for p in model.parameters()]


def _np(tensors):   # tensors through the result queue would travel as shared-memory fds
    return [t.numpy().copy() for t in tensors]


def _worker(ctx, modes):
    import torch.distributed as dist

    dist.init_process_group(BACKEND, store=ctx.store(), rank=ctx.rank,
                            world_size=ctx.world_size)
    try:
        return {mode: _train(ctx, mode) for mode in modes}
    finally:
        dist.destroy_process_group()


def _train(ctx, mode):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetccl.balance import (BalancedBatchSampler, Balancer, allreduce_gradients,
                                micro_loss_scales, token_loss_scale)

    rank, W = ctx.rank, ctx.world_size
    X, Y = _data()
    model = _model()
    net = DDP(model) if mode == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    clock = [0.0]
    bal = Balancer(B, CAPS, clock=lambda: clock[0])
    sampler = BalancedBatchSampler(N, bal.plan, seed=7)
    params, grads, plans, changed = [], [], [], []
    for step, micro in enumerate(sampler):
        plan = bal.plan
        plans.append(plan.per_rank)
        opt.zero_grad(set_to_none=True)
        bal.begin_step()
        clock[0] += plan.samples(rank) / _speeds(step)[rank]     # emulated compute time
        scales = micro_loss_scales(plan, rank)
        if mode == "naive":              # homogeneous recipe: mean over accumulation steps
            scales = [1.0 / len(micro)] * len(micro) if micro else []
        if mode == "ddp" and not micro:  # no samples: still join DDP's all-reduce
            (net(X[:1]).sum() * 0.0).backward()
        for j, (idx, sc) in enumerate(zip(micro, scales)):
            if mode == "ddp" and j < len(micro) - 1:
                with net.no_sync():
                    (F.mse_loss(net(X[idx]), Y[idx]) * sc).backward()
            else:
                (F.mse_loss(net(X[idx]), Y[idx]) * sc).backward()
        if mode == "ddp":                # speeds exchanged by Balancer's own all_gather
            replanned = bal.end_step()
        else:                            # speeds ride inside the gradient all-reduce
            replanned = allreduce_gradients(model, balancer=bal)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append(_snap(model))
        if replanned:
            sampler.set_plan(bal.plan)
            changed.append(step)
    tok = token_loss_scale(rank + 1)
    return {"params": [_np(p) for p in params], "grads": [_np(g) for g in grads], "plans": plans, "changed": changed,
            "tok": tok}


def _reference():
    import torch.nn.functional as F

    from hetccl.balance import step_indices
    X, Y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    params, grads = [], []
    for step in range(N // B):
        idx = step_indices(N, B, step, seed=7)
        opt.zero_grad()
        F.mse_loss(model(X[idx]), Y[idx]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append(_snap(model))
    return params, grads


def _close(a, b, tol=1e-12):
    return all(torch.allclose(torch.from_numpy(x), y, rtol=tol, atol=tol) for x, y in zip(a, b))


def test_balanced_training_equals_homogeneous():
    ref_params, ref_grads = _reference()
    modes = ("ddp", "allreduce", "naive")
    out = spawn(_worker, 3, args=(modes,), vendors=VENDORS, timeout=60)
    # both exchange paths (all_gather; carried in the gradient all-reduce) plan identically
    assert out[0]["ddp"]["plans"] == out[0]["allreduce"]["plans"]
    for mode in modes:
        res = [o[mode] for o in out]
        # every rank followed the same plan sequence, and it really was heterogeneous
        assert all(r["plans"] == res[0]["plans"] for r in res)
        assert all(r["changed"] == res[0]["changed"] for r in res)
        plans = res[0]["plans"]
        counts = [[sum(m) for m in p] for p in plans]
        first = res[0]["changed"][0] + 1                          # first step of a new plan
        # equal split until 3 steps are measured (step 0 is warm-up), then 1:2:3 exactly
        assert first == 4 and all(p == [[2, 2], [4], [4]] for p in plans[:first])
        assert all(c == [2, 4, 6] for c in counts[first:COLLAPSE])
        # after the collapse: the plan follows (3 outliers in a row = a speed change) and
        # rank 2 ends with no samples, through the trust region's steps
        assert counts[-1][2] == 0 and plans[-1][2] == []
        assert len(res[0]["changed"]) >= 3
        assert all(r["tok"] == 3 / 6 for r in res)               # W / (1 + 2 + 3)
        for r in res:
            ok = all(_close(g, rg) for g, rg in zip(r["grads"], ref_grads)) and \
                all(_close(p, rp) for p, rp in zip(r["params"], ref_params))
            assert ok == (mode != "naive"), mode               # the unscaled recipe must fail
