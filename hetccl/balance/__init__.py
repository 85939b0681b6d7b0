"""Heterogeneity-aware micro-batch balancing (docs/balancing.md).

Fast and slow data-parallel ranks get different numbers of samples of one fixed global batch so
that they finish together, and losses are scaled so that the update equals a homogeneous run's.

    plan_microbatches   optimal integer split of a global batch for per-rank step-time models
                        (fixed + per-sample cost), memory caps and micro-batch constraints
    Plan                the split (micro-batch sizes per rank) and its modelled step time
    StepModel, StepTimeFitter, fit_line: per-rank step time, fitted robustly from measurements
    HostTimer, CudaEventTimer, ForwardTimer: step timers (device events on GPUs)
    Balancer            measure, exchange models, re-plan when the predicted gain is real
    probe_max_micro, gather_max_micro: largest micro-batch that fits in memory, per rank
    BalancedBatchSampler per-step micro-batches of this rank following the plan
    loss_scale, micro_loss_scales, token_loss_scale, allreduce_gradients: exact gradients
    ThroughputMeter     a plain samples/s moving average (not used by the Balancer)
    plan_stages, StageDevice, LayerMemory, StagePlan: pipeline stage planner (which layers
                        each stage holds, from per-layer time on each stage's device and memory)
    emulate             TEST ONLY: slower devices (GPU work on CUDA, sleep on CPU)
"""
from .memory import gather_max_micro, probe_max_micro
from .meter import Balancer, ThroughputMeter
from .model import StepModel, StepTimeFitter, fit_line
from .planner import Plan, equal_plan, plan_cost, plan_microbatches, split_micro
from .sampler import BalancedBatchSampler, load, step_indices
from .stages import (LayerMemory, StageDevice, StagePlan, StagePlanError, even_split,
                     plan_stages)
from .scaling import allreduce_gradients, loss_scale, micro_loss_scales, token_loss_scale
from .timing import CudaEventTimer, ForwardTimer, HostTimer, default_timer

__all__ = [
    "Plan", "plan_microbatches", "equal_plan", "split_micro", "plan_cost",
    "StepModel", "StepTimeFitter", "fit_line",
    "HostTimer", "CudaEventTimer", "ForwardTimer", "default_timer",
    "ThroughputMeter", "Balancer",
    "probe_max_micro", "gather_max_micro",
    "BalancedBatchSampler", "step_indices", "load",
    "loss_scale", "micro_loss_scales", "token_loss_scale", "allreduce_gradients",
    "plan_stages", "StageDevice", "LayerMemory", "StagePlan", "StagePlanError", "even_split",
]
