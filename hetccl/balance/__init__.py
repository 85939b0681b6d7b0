"""Heterogeneity-aware micro-batch balancing (docs/balancing.md).

Fast and slow data-parallel ranks get different numbers of samples of one fixed global batch so
that they finish together, and losses are scaled so that the update equals a homogeneous run's.

    plan_microbatches   optimal integer split of a global batch for measured speeds and caps
    Plan                the split (micro-batch sizes per rank) and its modelled step time
    ThroughputMeter     EMA of one rank's samples/s
    Balancer            measure, exchange, re-plan on drift (same plan on every rank)
    BalancedBatchSampler per-step micro-batches of this rank following the plan
    loss_scale, micro_loss_scales, token_loss_scale, allreduce_gradients: exact gradients
    emulate.slow_down   TEST ONLY: make this rank slower by HETCCL_SLOWDOWN
"""
from .meter import Balancer, ThroughputMeter
from .planner import Plan, equal_plan, plan_microbatches, split_micro
from .sampler import BalancedBatchSampler, load, step_indices
from .scaling import allreduce_gradients, loss_scale, micro_loss_scales, token_loss_scale

__all__ = [
    "Plan", "plan_microbatches", "equal_plan", "split_micro",
    "ThroughputMeter", "Balancer",
    "BalancedBatchSampler", "step_indices", "load",
    "loss_scale", "micro_loss_scales", "token_loss_scale", "allreduce_gradients",
]
