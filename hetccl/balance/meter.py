"""The re-planning Balancer (and ThroughputMeter, a plain samples/s moving average).

The Balancer fits a step-time model per rank (hetccl/balance/model.py: fixed cost + cost per
sample, robust to noise), exchanges the models, and re-plans only when the predicted step time
of the best plan is shorter than that of the current plan by more than the measurement noise
and more than ``min_gain`` (hysteresis)."""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

from .model import StepModel, StepTimeFitter
from .planner import Plan, plan_microbatches
from .timing import HostTimer, default_timer

logger = logging.getLogger("hetccl.balance")


class ThroughputMeter:
    """Exponential moving average of this rank's compute throughput (samples/s).

    A plain measurement utility; the Balancer does not use it (samples/s hides the fixed cost
    per step, see hetccl/balance/model.py).

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



class Balancer:
    """Measures every rank's step time, exchanges fitted models, keeps one plan on all ranks.

        bal = Balancer(global_batch, max_micro)          # after init_process_group
        sampler = BalancedBatchSampler(dataset, bal.plan)
        for micro_batches in sampler:                    # one optimizer step
            bal.begin_step()
            ...forward/backward of this rank's micro-batches (no waiting on other ranks)...
            changed = bal.end_step()                     # collective: all ranks call it
            ...gradient all-reduce, optimizer step...
            if changed: sampler.set_plan(bal.plan)

    or, in a plain loop, replace end_step + all-reduce by
    ``changed = allreduce_gradients(model, balancer=bal)``, which closes the timing and carries
    the models inside the gradient all-reduce (no extra collective).

    Measuring. begin_step()/end_step(n) time this rank's local compute of n samples (default:
    its share of the plan) with ``timer``: by default CUDA events on the current stream when
    CUDA is in use in this process (non-blocking; a measurement arrives when its end event has
    completed), else the host clock (``clock``, for tests). Do not time waits on other ranks:
    with DDP run every micro-batch under no_sync() and use allreduce_gradients(), or call
    end_step() before the last micro-batch's backward, or time forwards only (ForwardTimer,
    what the Trainer and DeepSpeed integrations do). The first ``warmup_steps`` steps and the
    first ``settle_steps`` steps after this rank's sample count changed are not used (one-time
    costs: allocator growth, kernel selection, compilation). A model counts once it rests on
    ``min_count`` (3) measurements: a single one cannot tell a spike from a slow device.

    Modelling. Each rank fits t(n) = fixed + per_sample * n (+ ``overhead`` per micro-batch,
    given) to its last ``window`` measurements, robustly (StepTimeFitter). Before the samples
    a rank gets vary, the slope comes from a prior: a fraction ``prior_fixed`` (default 0) of
    the time is fixed.

    Exchange and decision. end_step() (every ``sync_every`` steps) all-gathers the models
    (StepModel.VECTOR_LEN = 9 float64 per rank) over ``group``; every rank then holds the same models and computes the
    same plan (the planner is deterministic). The plan is an equal split until every rank
    holding samples has a model. Afterwards the best plan under the models replaces the
    current one only if its predicted step time is shorter by more than ``min_gain`` (relative,
    default 0.03) AND by more than ``confidence`` (default 3) standard errors of the two
    predictions (hysteresis): measurement noise never moves the plan, a fixed cost per step
    does not make the rank with fewer samples look slower, and a uniform slow-down of all
    ranks changes nothing. end_step returns True when the adopted allocation changed.
    ``last_decision`` records the predicted times and gain of the latest decision.

    A rank that processed 0 samples keeps its last model; a rank never measured counts as the
    slowest known one. Planning options passed to plan_microbatches: max_micro (memory cap
    per micro-batch; set_max_micro() changes it), micro_batch, overhead, micro_steps (a fixed
    number of micro-batches per rank, e.g. the HF Trainer's gradient_accumulation_steps, or
    "lockstep": the same number on every rank, chosen by the planner, for DeepSpeed
    ZeRO-2/3), min_samples.
    ``threshold`` is the old name of min_gain. rank/world_size override what torch.distributed
    says (e.g. a data-parallel group's rank).

    Trust region: a fitted line is reliable near the sample counts it was measured at. A new
    plan gives rank r between n_lo / ``trust`` and n_hi * ``trust`` samples (default 2; its
    measured range [n_lo, n_hi], widened to include its current count), so large moves happen
    in a few steps, each checked by new measurements, and a slope fitted over a narrow range
    cannot send all samples elsewhere at once. ``trust=None`` turns it off.
    """

    def __init__(self, global_batch: int, max_micro: Sequence[int] | int, group=None,
                 threshold: float | None = None, micro_batch: int | None = None,
                 initial_speeds: Sequence[float] | None = None, *,
                 initial_models: Sequence[StepModel] | None = None,
                 min_gain: float = 0.03, confidence: float = 3.0,
                 overhead: Sequence[float] | float = 0.0, micro_steps: int | None = None,
                 min_samples: int = 0, sync_every: int = 1, warmup_steps: int = 1,
                 settle_steps: int = 1, min_count: int = 3, window: int = 32,
                 prior_fixed: float = 0.0, trust: float | None = 2.0,
                 timer=None, device=None, clock: Callable[[], float] | None = None,
                 rank: int | None = None, world_size: int | None = None):
        import torch.distributed as dist

        self.group = group
        self._dist = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank(group) if self._dist else 0
        if world_size is None:
            world_size = dist.get_world_size(group) if self._dist else 1
        self.rank, self.world_size = int(rank), int(world_size)
        W = self.world_size
        if not 0 <= self.rank < W:
            raise ValueError(f"rank {self.rank} outside world of {W}")
        self.global_batch = int(global_batch)
        self.max_micro = max_micro
        self.micro_batch = micro_batch
        self.overhead = overhead
        self.micro_steps = micro_steps
        self.min_samples = int(min_samples)
        self.min_gain = float(threshold if threshold is not None else min_gain)
        if not self.min_gain >= 0:
            raise ValueError("min_gain (threshold) must be >= 0")
        self.confidence = float(confidence)
        self.sync_every = max(1, int(sync_every))
        self.warmup_steps = max(0, int(warmup_steps))
        self.settle_steps = max(0, int(settle_steps))
        self.min_count = max(1, int(min_count))
        if trust is not None and not trust > 1.0:
            raise ValueError("trust must be > 1 (or None)")
        self.trust = trust
        ov = overhead if isinstance(overhead, (int, float)) else overhead[self.rank]
        self.fitter = StepTimeFitter(window, prior_fixed=prior_fixed, per_micro=float(ov))
        self._device = device
        self.timer = timer if timer is not None else (HostTimer(clock) if clock else None)
        self.steps = 0
        self.replans = 0
        self._last_n: int | None = None
        self._settle = 0
        self.last_decision: dict = {}
        self.history: list[tuple[int, Plan]] = []   # (step, plan) each time a plan is adopted
        self.models: list[StepModel | None] = [None] * W
        if initial_models is not None and initial_speeds is not None:
            raise ValueError("give initial_speeds or initial_models, not both")
        if initial_speeds is not None:
            if len(initial_speeds) != W:
                raise ValueError(f"initial_speeds has {len(initial_speeds)} entries for {W} ranks")
            initial_models = [StepModel.from_speed(float(s)) for s in initial_speeds]
        if initial_models is not None:
            if len(initial_models) != W:
                raise ValueError(f"initial_models has {len(initial_models)} entries for {W} ranks")
            self.models = list(initial_models)
            self._measured = True
            self.plan = self._make(self.models)
        else:
            self._measured = False
            self.plan = self._make([StepModel.from_speed(1.0)] * W)
        self.history.append((0, self.plan))

    # -- planning ----------------------------------------------------------------------------
    def _make(self, models: Sequence[StepModel], bounds=None) -> Plan:
        return plan_microbatches(self.global_batch, None, self.max_micro, self.micro_batch,
                                 self.overhead, fixed=[m.fixed for m in models],
                                 per_sample=[m.per_sample for m in models],
                                 micro_steps=self.micro_steps, min_samples=self.min_samples,
                                 bounds=bounds)

    def trust_region(self, models: Sequence[StepModel | None]) -> list[tuple[int, int]] | None:
        """Per rank, the samples a new plan may give it: [n_lo / trust, n_hi * trust] around
        the range its measurements cover (and always the current plan's count), so that a
        line fitted over a narrow range is never extrapolated far in one move; unlimited
        for ranks without measurements."""
        if self.trust is None:
            return None
        B, out = self.global_batch, []
        for r, m in enumerate(models):
            cur = self.plan.samples(r)
            if m is None or m.count == 0 or m.n_hi <= 0:
                out.append((0, B))
                continue
            lo = min(cur, math.floor(m.n_lo / self.trust))
            hi = max(cur, math.ceil(m.n_hi * self.trust))
            out.append((lo, min(hi, B)))
        return out

    def predict(self, plan: Plan, models: Sequence[StepModel] | None = None
                ) -> tuple[float, float, int]:
        """(modelled step time, its standard error, bottleneck rank) of ``plan`` under
        ``models`` (default: the current ones; unknown ranks count as the slowest known)."""
        models = self._filled(self.models) if models is None else list(models)
        ov = self.overhead if not isinstance(self.overhead, (int, float)) \
            else [float(self.overhead)] * self.world_size
        best, se, arg = 0.0, 0.0, -1
        for r, m in enumerate(models):
            n = plan.samples(r)
            if n == 0:
                continue
            k = plan.num_micro(r) if plan.micro_steps is None else plan.micro_steps
            t = m.time(n) + ov[r] * k
            if t > best:
                best, se, arg = t, m.level_se(), r
        return best, se, arg

    def _filled(self, models):
        known = [m for m in models if m is not None]
        if not known:
            return [StepModel.from_speed(1.0)] * self.world_size
        n_avg = max(1.0, self.global_batch / self.world_size)
        slowest = max(known, key=lambda m: m.time(n_avg))
        return [m if m is not None else slowest for m in models]

    def set_max_micro(self, max_micro: Sequence[int] | int) -> bool:
        """Change the memory caps (e.g. after measuring them). Re-plans at once when the current
        plan breaks a new cap (returns True if the allocation changed). Same call on every
        rank with the same caps."""
        self.max_micro = max_micro
        caps = [max_micro] * self.world_size if isinstance(max_micro, int) else list(max_micro)
        fits = all(all(b <= caps[r] for b in self.plan.per_rank[r])
                   for r in range(self.world_size))
        if fits:
            return False            # the current plan respects the new caps: keep it
        new = self._make(self._filled(self.models))
        changed = new.per_rank != self.plan.per_rank
        self.plan = new
        if changed:
            self.replans += 1
            self.history.append((self.steps, new))
        return changed

    # -- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.timer is None:
            self.timer = default_timer(self._device)
        self.timer.start()

    def end_step(self, n_samples: int | None = None, exchange: bool = True) -> bool:
        """Close this rank's timing of ``n_samples`` (default: plan.samples(rank)), then, every
        sync_every steps, exchange models (collective) and re-plan if needed.

        exchange=False only closes the timing: the caller then carries model_slots() in a
        SUM all-reduce it does anyway and passes models_from_slots(result) to update() (what
        allreduce_gradients(..., balancer=bal) does: no extra collective per step)."""
        if n_samples is None:
            n_samples = self.plan.samples(self.rank)
            micro = self.plan.num_micro(self.rank)
        else:
            n_samples = int(n_samples)
            micro = self.plan.num_micro(self.rank) if n_samples == self.plan.samples(self.rank) \
                else 0
        if self.plan.micro_steps is not None and n_samples > 0:
            micro = self.plan.micro_steps
        if self._last_n is not None and n_samples != self._last_n:
            self._settle = self.settle_steps
        self._last_n = n_samples
        use = self.steps >= self.warmup_steps and self._settle == 0
        if self._settle > 0:
            self._settle -= 1
        if self.timer is None:
            raise RuntimeError("Balancer.end_step() without begin_step()")
        self.timer.stop((n_samples, micro, use))
        self.collect()
        self.steps += 1
        if not exchange or not self.sync_due:
            return False
        return self.update(self._gather())

    def collect(self, wait: bool = False) -> None:
        """Feed completed timings to this rank's fitter (end_step does it)."""
        if self.timer is None:
            return
        for (n, micro, use), secs in self.timer.poll(wait):
            if use:
                self.fitter.add(n, secs, micro)

    @property
    def sync_due(self) -> bool:
        """Whether the step just closed is one whose models are exchanged (same on all ranks)."""
        return self.steps > 0 and self.steps % self.sync_every == 0

    @property
    def local_model(self) -> StepModel | None:
        return self.fitter.model()

    def model_slots(self) -> list[float]:
        """world_size * StepModel.VECTOR_LEN values: this rank's model vector in its own slot, zeros elsewhere;
        SUM-all-reduced over the group it holds every rank's model (zeros: none)."""
        k = StepModel.VECTOR_LEN
        v = [0.0] * (self.world_size * k)
        m = self.fitter.model()
        if m is not None:
            v[self.rank * k:(self.rank + 1) * k] = m.to_vector()
        return v

    def models_from_slots(self, values: Sequence[float]) -> list[StepModel | None]:
        k = StepModel.VECTOR_LEN
        if len(values) != self.world_size * k:
            raise ValueError(f"{len(values)} values for {self.world_size} ranks x {k}")
        return [StepModel.from_vector(values[r * k:(r + 1) * k]) for r in range(self.world_size)]

    def _gather(self) -> list[StepModel | None]:
        """Every rank's model, in group rank order: one all_gather of a float64 vector on the
        group's collective device."""
        m = self.fitter.model()
        if not self._dist or self.world_size == 1:
            return [m]
        import torch
        import torch.distributed as dist

        from .scaling import _coll_device
        dev = _coll_device(self.group)
        vec = m.to_vector() if m is not None else [0.0] * StepModel.VECTOR_LEN
        t = torch.tensor(vec, dtype=torch.float64, device=dev)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return [StepModel.from_vector(o.tolist()) for o in out]

    @property
    def speeds(self) -> list[float | None]:
        """Marginal samples/s of every rank's model (1 / per_sample; None: no model)."""
        return [m.speed if m is not None else None for m in self.models]

    # -- decision (pure; identical inputs on every rank give identical plans) ---------------
    def update(self, models: Sequence) -> bool:
        """Take every rank's current model (a StepModel, a throughput in samples/s, or None:
        unchanged/unknown) and re-plan if the predicted gain is real (class docstring).
        Returns True when the adopted plan's allocation changed."""
        if len(models) != self.world_size:
            raise ValueError(f"{len(models)} models for {self.world_size} ranks")
        for r, v in enumerate(models):
            if isinstance(v, StepModel):
                m = v
            elif v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
                m = StepModel.from_speed(float(v))
            else:
                m = None
            if m is not None and 0 < m.count < self.min_count:
                m = None            # too few measurements yet (one may be a spike)
            if m is not None and m.per_sample >= 0 and math.isfinite(m.fixed):
                self.models[r] = m
        if not any(m is not None for m in self.models):
            return False
        if not self._measured and any(self.models[r] is None and self.plan.samples(r) > 0
                                      for r in range(self.world_size)):
            return False   # wait until every rank with work has reported
        cur = self._filled(self.models)
        self._measured = True
        new = self._make(cur, self.trust_region(self.models))
        t_cur, se_cur, _ = self.predict(self.plan, cur)
        t_new, se_new, _ = self.predict(new, cur)
        gain = t_cur - t_new
        noise = math.sqrt(se_cur ** 2 + se_new ** 2)
        need = max(self.min_gain * t_cur, self.confidence * noise)
        adopt = new.per_rank != self.plan.per_rank and gain > need
        self.last_decision = {"step": self.steps, "current": self.plan.counts(),
                              "best": new.counts(), "t_current": t_cur, "t_best": t_new,
                              "gain": gain, "needed": need, "adopted": adopt}
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("hetccl balance step %d: %s models %s", self.steps, self.last_decision,
                         [str(m) for m in cur])
        if not adopt:
            return False
        logger.info("hetccl balance step %d: plan %s -> %s (predicted %.4g -> %.4g s)",
                    self.steps, self.plan.counts(), new.counts(), t_cur, t_new)
        self.plan = new
        self.replans += 1
        self.history.append((self.steps, new))
        return True
