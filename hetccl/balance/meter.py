"""Throughput measurement (ThroughputMeter) and the re-planning Balancer."""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from .planner import Plan, plan_microbatches


class ThroughputMeter:
    """Exponential moving average of this rank's compute throughput (samples/s).

    start(); ...compute n samples...; stop(n). ``rate`` is None until the first measurement,
    then rate <- (1 - ema) * rate + ema * (n / seconds): ``ema`` is the weight of the newest
    step (1.0: no smoothing). stop(0) or a zero-length interval leaves the rate unchanged.

    Time only the *local compute* (forward/backward of this rank's micro-batches), not the
    gradient all-reduce or anything else that waits for other ranks: a fast rank that waits for
    a slow one would otherwise measure the slow rank's speed, and the planner would never move
    work. On GPUs, synchronize the device (torch.cuda.synchronize()) before stop(), or measure
    with device events and feed the seconds to add().
    """

    def __init__(self, ema: float = 0.5, clock: Callable[[], float] = time.perf_counter):
        if not 0.0 < ema <= 1.0:
            raise ValueError("ema must be in (0, 1]")
        self.ema = float(ema)
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.rate: float | None = None
        self.last_rate: float | None = None
        self.count = 0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = self.clock()

    def stop(self, n_samples: int) -> float | None:
        """End the interval opened by start(); returns the smoothed rate."""
        if self._t0 is None:
            raise RuntimeError("ThroughputMeter.stop() without start()")
        dt = self.clock() - self._t0
        self._t0 = None
        return self.add(dt, n_samples)

    def add(self, seconds: float, n_samples: int) -> float | None:
        """Feed one measured interval directly (e.g. from device event timers)."""
        if n_samples > 0 and seconds > 0 and math.isfinite(seconds):
            inst = n_samples / seconds
            self.last_rate = inst
            self.rate = inst if self.rate is None else (1 - self.ema) * self.rate + self.ema * inst
            self.count += 1
        return self.rate


def _valid(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


class Balancer:
    """Measures every rank's throughput, exchanges it and keeps one plan on all ranks.

        bal = Balancer(global_batch, max_micro)          # after init_process_group
        sampler = BalancedBatchSampler(dataset, bal.plan)
        for micro_batches in sampler:                    # one optimizer step
            bal.begin_step()
            ...forward/backward of this rank's micro-batches (no waiting on other ranks)...
            changed = bal.end_step(bal.plan.samples(bal.rank))   # collective: all ranks call it
            ...gradient all-reduce, optimizer step...
            if changed: sampler.set_plan(bal.plan)

    or, in a plain loop, replace end_step + all-reduce by
    ``changed = allreduce_gradients(model, balancer=bal)``, which closes the timing and carries
    the rates inside the gradient all-reduce (no extra collective).

    With DDP, the last micro-batch's backward waits for the other ranks: call end_step()
    before it, or run every micro-batch under no_sync() and use allreduce_gradients().

    ``plan`` is an equal split until every rank holding samples has measured a speed (or the
    plan from ``initial_speeds``). end_step() is a collective over ``group`` (every
    ``sync_every`` steps): each rank contributes its smoothed rate via all_gather, so
    all ranks see the same rate vector and compute the same plan (the planner is
    deterministic). It re-plans when the first full set of speeds arrives and afterwards when
    some rank's *share* of the total speed, rate_r / sum(rates), moved by more than
    ``threshold`` (relative) from the share the current plan assumed; a uniform slow-down of all
    ranks changes nothing. end_step returns True when it adopted a plan whose allocation
    differs from the previous one (the caller then switches sampler, accumulation steps, ...).

    A rank that processed 0 samples keeps its last known rate; a rate never measured counts as
    the slowest known rate. Extra keyword arguments: overhead (per-micro-batch seconds for the
    planner's cost model), sync_every, warmup_steps (default 1: the first step's timing, which
    carries one-time costs such as allocator growth, kernel selection or compilation, is not
    used; end_step still takes part in the exchange), clock (for the meter; tests),
    rank/world_size (override what torch.distributed says, e.g. a data-parallel group's rank).

    The exchange is one all_gather of a float64 tensor on the group's collective device (CPU,
    or the current CUDA device for NCCL/RCCL groups).
    """

    def __init__(self, global_batch: int, max_micro: Sequence[int] | int, group=None,
                 threshold: float = 0.1, ema: float = 0.5, micro_batch: int | None = None,
                 initial_speeds: Sequence[float] | None = None, *,
                 overhead: Sequence[float] | float = 0.0, sync_every: int = 1,
                 warmup_steps: int = 1,
                 clock: Callable[[], float] = time.perf_counter,
                 rank: int | None = None, world_size: int | None = None):
        import torch.distributed as dist

        self.group = group
        self._dist = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank(group) if self._dist else 0
        if world_size is None:
            world_size = dist.get_world_size(group) if self._dist else 1
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_batch = int(global_batch)
        self.max_micro = max_micro
        self.micro_batch = micro_batch
        self.overhead = overhead
        self.threshold = float(threshold)
        self.sync_every = max(1, int(sync_every))
        self.warmup_steps = max(0, int(warmup_steps))
        self.meter = ThroughputMeter(ema, clock=clock)
        self.steps = 0
        self.replans = 0
        self.history: list[tuple[int, Plan]] = []   # (step, plan) each time a plan is adopted
        W = self.world_size
        if initial_speeds is not None:
            if len(initial_speeds) != W:
                raise ValueError(f"initial_speeds has {len(initial_speeds)} entries for {W} ranks")
            self.speeds: list[float | None] = [float(s) for s in initial_speeds]
            self._ref = list(self.speeds)
            self._measured = True
            self.plan = self._make(self.speeds)
        else:
            self.speeds = [None] * W
            self._ref = [1.0] * W
            self._measured = False
            self.plan = self._make(self._ref)
        self.history.append((0, self.plan))

    def _make(self, speeds) -> Plan:
        return plan_microbatches(self.global_batch, speeds, self.max_micro, self.micro_batch,
                                 self.overhead)

    # -- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.meter.start()

    def end_step(self, n_samples: int | None = None, exchange: bool = True) -> bool:
        """Close this rank's timing of ``n_samples`` (default: plan.samples(rank)), then, every
        sync_every steps, exchange rates (collective) and re-plan if needed.

        exchange=False only closes the timing: the caller then carries rate_slots() in a
        SUM all-reduce it does anyway and passes the result to update() (what
        allreduce_gradients(..., balancer=bal) does: no extra collective per step)."""
        if n_samples is None:
            n_samples = self.plan.samples(self.rank)
        if self.steps < self.warmup_steps:
            self.meter.stop(0)          # warm-up step: timed but not counted
        else:
            self.meter.stop(n_samples)
        self.steps += 1
        if not exchange or not self.sync_due:
            return False
        return self.update(self._gather(self.meter.rate))

    @property
    def sync_due(self) -> bool:
        """Whether the step just closed is one whose rates are exchanged (same on all ranks)."""
        return self.steps > 0 and self.steps % self.sync_every == 0

    def rate_slots(self) -> list[float]:
        """World-size vector with this rank's smoothed rate at its own index and 0.0 elsewhere:
        SUM-all-reduced over the group it becomes every rank's rate (0.0: not measured)."""
        v = [0.0] * self.world_size
        v[self.rank] = float(self.meter.rate) if _valid(self.meter.rate) else 0.0
        return v

    def _gather(self, rate: float | None) -> list[float | None]:
        """Every rank's rate, in group rank order: one all_gather of a float64 tensor on the
        group's collective device (NaN stands for "not measured")."""
        if not self._dist or self.world_size == 1:
            return [rate]
        import torch
        import torch.distributed as dist

        from .scaling import _coll_device
        dev = _coll_device(self.group)
        t = torch.tensor([math.nan if rate is None else float(rate)], dtype=torch.float64,
                         device=dev)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        vals = [float(o.item()) for o in out]
        return [None if math.isnan(v) else v for v in vals]

    # -- decision (pure; identical inputs on every rank give identical plans) ---------------
    def drift(self, speeds: Sequence[float]) -> float:
        """Largest relative change of a rank's speed share versus the current plan's."""
        S, R = sum(speeds), sum(self._ref)
        worst = 0.0
        for s, ref in zip(speeds, self._ref):
            a, b = s / S, ref / R
            worst = max(worst, abs(a - b) / b if b > 0 else (math.inf if a > 0 else 0.0))
        return worst

    def update(self, rates: Sequence[float | None]) -> bool:
        """Take every rank's current smoothed rate (None: not measured) and re-plan if needed.
        Returns True when the adopted plan's allocation changed."""
        if len(rates) != self.world_size:
            raise ValueError(f"{len(rates)} rates for {self.world_size} ranks")
        for r, v in enumerate(rates):
            if _valid(v):
                self.speeds[r] = float(v)
        known = [s for s in self.speeds if s is not None]
        if not known:
            return False
        if not self._measured and any(self.speeds[r] is None and self.plan.samples(r) > 0
                                      for r in range(self.world_size)):
            return False   # wait until every rank with work has reported
        cur = [s if s is not None else min(known) for s in self.speeds]
        if self._measured and self.drift(cur) <= self.threshold:
            return False
        new = self._make(cur)
        self._ref = cur
        self._measured = True
        changed = new.per_rank != self.plan.per_rank
        self.plan = new
        if changed:
            self.replans += 1
            self.history.append((self.steps, new))
        return changed
