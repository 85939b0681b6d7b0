"""Loss / gradient scaling that makes unequal per-rank batches give a homogeneous run's update.

Goal: the gradient applied on every rank equals the gradient of the MEAN loss over the global
batch (B samples, or T tokens), exactly what a homogeneous run computes, whatever the split.

Data-parallel averaging (DDP, DeepSpeed, Megatron, HF Accelerate) all-reduces SUM and divides by
the world size W. Rank r holds n_r samples (sum n_r = B). If rank r back-propagates

    L_r = loss_scale(plan, r) * mean_{i in rank r} loss_i      with loss_scale = n_r * W / B

then the averaged gradient is (1/W) sum_r (n_r W / B) (1/n_r) sum_i grad loss_i
= (1/B) sum_{all i} grad loss_i: the global-batch mean gradient.

With gradient accumulation over the micro-batches of plan.per_rank[r] (sizes b_1..b_k, sum
n_r), back-propagate for each micro-batch j

    mean_{i in micro-batch j} loss_i * (b_j / n_r) * loss_scale(plan, r)
  = mean_{i in micro-batch j} loss_i * b_j * W / B        (micro_loss_scales(plan, r)[j])

(the b_j / n_r turns the micro-batch means into this rank's mean). Do NOT also divide by the
number of accumulation steps: frameworks that do so (DeepSpeed's engine.backward, HF
Accelerate's accumulate, Megatron's num_microbatches) must have that division undone, i.e.
multiply by num_micro(r) as well; the integrations do this.

Token-level losses (variable-length sequences): let t_r be this rank's number of loss tokens
in the step (all its micro-batches) and T = sum_r t_r. Back-propagate, per micro-batch,

    sum_{tokens in micro-batch} token_loss * token_loss_scale(t_r)     (= W / T)

which averages to (1/T) sum over all tokens: the global per-token mean. token_loss_scale is a
collective (all-reduce of t_r), so count the step's tokens before the first backward.

A rank with 0 samples has loss_scale 0 and nothing to back-propagate, but must still take part
in the gradient all-reduce: with allreduce_gradients() below it simply calls it (its grads are
zeros); with DDP it must run one forward+backward of some input with the loss multiplied by 0
so DDP's hooks fire (see the tests for an example).
"""
from __future__ import annotations

from typing import Iterable

import torch

from .planner import Plan


def loss_scale(plan: Plan, rank: int, world_size: int | None = None) -> float:
    """Multiplier of the MEAN loss over this rank's samples of one step:
    samples(rank) * world_size / global_batch (0 for a rank without samples)."""
    W = plan.world_size if world_size is None else int(world_size)
    if plan.global_batch == 0:
        return 0.0
    return plan.samples(rank) * W / plan.global_batch


def micro_loss_scales(plan: Plan, rank: int, world_size: int | None = None) -> list[float]:
    """Multiplier of each micro-batch's MEAN loss (gradient accumulation): b_j * W / B
    = (b_j / samples(rank)) * loss_scale(plan, rank)."""
    W = plan.world_size if world_size is None else int(world_size)
    return [b * W / plan.global_batch for b in plan.per_rank[rank]]


def _coll_device(group=None) -> torch.device:
    import torch.distributed as dist
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend or "rccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def token_loss_scale(local_tokens: int, group=None, device: torch.device | None = None) -> float:
    """All-reduce this rank's loss-token count of the step (collective over ``group``) and
    return W / global_tokens: multiply the SUM of per-token losses by it (0.0 if no tokens)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 1.0 / local_tokens if local_tokens else 0.0
    W = dist.get_world_size(group)
    t = torch.tensor([int(local_tokens)], dtype=torch.int64,
                     device=device or _coll_device(group))
    dist.all_reduce(t, group=group)
    total = int(t.item())
    return W / total if total else 0.0


def allreduce_gradients(params: Iterable[torch.Tensor] | torch.nn.Module, group=None,
                        average: bool = True, balancer=None) -> bool:
    """DDP-equivalent gradient synchronisation for plain loops (no DistributedDataParallel):
    missing grads become zeros (a rank without samples contributes zeros), then grads are
    all-reduced (SUM) in one flat buffer per dtype/device and divided by the world size when
    ``average`` (DDP semantics, which loss_scale assumes). Collective: every rank calls it.

    balancer: a Balancer whose step is still open (begin_step() called, end_step() not):
    closes its timing (end_step(exchange=False)), carries its model_slots() (9 values per
    rank) inside the gradient all-reduce instead of a separate exchange, and applies the
    result (Balancer.update). Returns True when the plan changed (False without a balancer)."""
    import torch.distributed as dist
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    slots = None
    if balancer is not None:
        balancer.end_step(exchange=False)
        if balancer.sync_due:
            slots = balancer.model_slots()
    if not (dist.is_available() and dist.is_initialized()):
        return balancer.update(balancer.models_from_slots(slots)) if slots is not None else False
    W = dist.get_world_size(group)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    # the models ride in a float32/float64 bucket (one non-zero term per slot: the sum is the
    # value, the same on every rank; float32 only rounds it to 7 digits)
    carrier = next((k for k in buckets if k[0] in (torch.float32, torch.float64)), None)
    rates = None
    if slots is not None and carrier is None:
        t = torch.tensor(slots, dtype=torch.float64, device=_coll_device(group))
        dist.all_reduce(t, group=group)
        rates = t.tolist()
    for key, grads in buckets.items():
        parts = [g.reshape(-1) for g in grads]
        extra = slots is not None and key == carrier
        if extra:
            parts.append(torch.tensor(slots, dtype=key[0], device=key[1]))
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=group)
        if extra:
            rates = flat[-len(slots):].tolist()
            flat = flat[:-len(slots)]
        if average:
            flat.div_(W)
        off = 0
        for g in grads:
            k = g.numel()
            g.copy_(flat[off:off + k].view_as(g))
            off += k
    if slots is not None:
        return balancer.update(balancer.models_from_slots(rates))
    return False
