"""Micro-batch planner: split a fixed global batch over data-parallel ranks of unequal speed.

Cost model
----------
Rank r processes n_r > 0 samples in

    cost_r(n) = fixed_r + n * per_sample_r + overhead_r * k_r(n)        (cost_r(0) = 0)

seconds: fixed_r is the rank's fixed cost per step (kernel launches, optimizer, anything that
does not grow with the batch), per_sample_r its cost per sample (1 / speed_r when the plan is
made from speeds), overhead_r an optional cost per micro-batch and k_r(n) its number of
micro-batches: ceil(n / m_r) with m_r its micro-batch size (memory cap ``max_micro[r]`` or the
fixed ``micro_batch``), or exactly ``micro_steps`` for frameworks that run the same number of
micro-batches on every rank (HF Trainer, DeepSpeed ZeRO-2/3). The step ends when the slowest
rank ends, so the planner solves

    minimise   max_r cost_r(n_r)
    subject to sum_r n_r = global_batch,  n_r integer,
               lo_r <= n_r <= hi_r

with hi_r = 0 where the rank cannot take samples (speed <= 0, cap 0), hi_r = micro_steps * m_r
when the number of micro-batches is fixed (the memory cap then bounds the samples), and
lo_r = min_samples (e.g. the Trainer's one sample per micro-batch). A plan that cannot exist
(the caps hold fewer samples than the global batch, a rank that must take samples cannot,
...) raises ValueError saying which constraint and what to change.

Memory caps bound the *micro-batch* size: without micro_steps a rank takes any number of
samples as ceil(n_r / m_r) micro-batches (gradient accumulation), the fewest the cap allows.

Optimality (why the integer plan is exact, not "within one micro-batch")
------------------------------------------------------------------------
Every cost_r is non-decreasing in n (fixed, per_sample, overhead >= 0; +inf above hi_r).
Greedy: start from an allocation n0 with lo_r <= n0_r and max_r cost_r(n0_r) <= T* (T* = the
optimal value) and hand out the remaining samples one at a time, each to the rank whose *next*
sample would finish earliest, argmin_r cost_r(n_r + 1) (ties: lowest rank). Claim: the result
is optimal.

Proof. (1) The values chosen are non-decreasing: after a pick of value v, only the picked
rank's candidate changes, to cost_r(n_r + 2) >= v, and every other candidate was already >= v.
(2) So the final maximum is M = max(max_r cost_r(n0_r), v_last). If M = max cost(n0) <= T*, the
plan is optimal. Otherwise M = v_last; let n be the allocation just before the last pick
(sum B - 1). Any feasible allocation m (sum B) has some rank with m_r >= n_r + 1 (pigeonhole),
hence max_r cost_r(m_r) >= cost_r(n_r + 1) >= v_last = M, because v_last was the minimum
candidate. Thus no allocation beats M. QED. (tests/test_balance_planner.py checks it against
exhaustive search over all allocations on small cases, with fixed costs, overheads, caps,
fixed micro-batch counts and lower bounds.)

Start allocation: let cnt(T) = sum_r clip(maxn_r(T), lo_r, hi_r), maxn_r(T) the largest n with
cost_r(n) <= T (closed form per micro-batch count). cnt is non-decreasing; bisection finds
T_lo with cnt(T_lo) < B. Then T* > T_lo (an allocation with max cost <= T_lo would have
n_r <= maxn_r(T_lo), so sum <= cnt(T_lo) < B), and every feasible allocation has
n_r >= lo_r, so T* >= cost_r(lo_r): n0 = clip(maxn(T_lo), lo, hi) has max cost <= T*. Only the
samples whose cost lies between T_lo and the bisection's upper end (about one per rank) are left
to the greedy, so the planner runs in O(world * 64) steps whatever B is.

``Plan.optimal`` is True for plans from plan_microbatches (False for hand-built ones). The model
is what the Balancer fits from measured step times (hetccl/balance/model.py); the *real* step
time is optimal up to the error of that fit.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Plan:
    """Micro-batch plan of one step.

    per_rank[r]   micro-batch sizes of rank r, in order (empty list: the rank has no samples;
                  it must still join the gradient all-reduce, contributing zeros).
    global_batch  total samples of the step (= sum of all sizes).
    est_step_time modelled step time: max over ranks of cost_r(samples(r)) (seconds when the
                  model is in seconds; inf when a rank holds samples it cannot process).
    lower_bound   the modelled step time of the continuous relaxation (fractional samples, no
                  micro-batch rounding): B / sum(speeds) for a pure per-sample model;
                  est_step_time / lower_bound >= 1 is the price of integrality.
    optimal       True when the sample allocation is proved to minimise est_step_time over all
                  integer allocations (see module docstring).
    speeds, max_micro, micro_batch, overhead, fixed, micro_steps, min_samples: the inputs the
                  plan was made from (speeds = 1 / per-sample cost).
    """
    per_rank: list[list[int]]
    global_batch: int
    est_step_time: float = math.nan
    lower_bound: float = math.nan
    optimal: bool = False
    speeds: tuple[float, ...] = field(default=(), compare=False)
    max_micro: tuple[int, ...] = field(default=(), compare=False)
    micro_batch: int | None = field(default=None, compare=False)
    overhead: tuple[float, ...] = field(default=(), compare=False)
    fixed: tuple[float, ...] = field(default=(), compare=False)
    micro_steps: int | None = field(default=None, compare=False)
    min_samples: int = field(default=0, compare=False)

    def __post_init__(self):
        total = sum(sum(m) for m in self.per_rank)
        if total != self.global_batch:
            raise ValueError(f"plan sizes sum to {total}, not global_batch={self.global_batch}")
        if any(s <= 0 for m in self.per_rank for s in m):
            raise ValueError("micro-batch sizes must be positive (use an empty list for a rank "
                             "without samples)")

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    def samples(self, rank: int) -> int:
        return sum(self.per_rank[rank])

    def counts(self) -> list[int]:
        """Samples of every rank."""
        return [self.samples(r) for r in range(self.world_size)]

    def num_micro(self, rank: int) -> int:
        return len(self.per_rank[rank])

    def offsets(self) -> list[int]:
        """First sample index of each rank within the global batch (ranks in order)."""
        out, acc = [], 0
        for m in self.per_rank:
            out.append(acc)
            acc += sum(m)
        return out

    def shares(self) -> list[float]:
        return [self.samples(r) / self.global_batch if self.global_batch else 0.0
                for r in range(self.world_size)]

    def efficiency(self) -> float:
        """Modelled efficiency lower_bound / est_step_time (1.0 = perfectly balanced)."""
        if not self.est_step_time or math.isinf(self.est_step_time):
            return 0.0 if self.global_batch else 1.0
        return self.lower_bound / self.est_step_time

    def __str__(self) -> str:
        return (f"Plan(B={self.global_batch}, samples={self.counts()}, "
                f"micro={self.per_rank}, est={self.est_step_time:.4g}, lb={self.lower_bound:.4g}, "
                f"optimal={self.optimal})")


def _per_rank(x, world: int, name: str, cast):
    if isinstance(x, (int, float)):
        return [cast(x)] * world
    x = [cast(v) for v in x]
    if len(x) != world:
        raise ValueError(f"{name} has {len(x)} entries for {world} ranks")
    return x


def split_micro(n: int, size: int, fixed: bool, count: int | None = None) -> list[int]:
    """Split n samples into micro-batches: ceil(n/size) of them, sizes as even as possible
    (larger ones first) or, when ``fixed``, all equal to ``size`` except the last; with
    ``count``, min(count, n) micro-batches of sizes as even as possible."""
    if n <= 0:
        return []
    if count is not None:
        k = min(int(count), n)
    elif fixed:
        return [size] * (n // size) + ([n % size] if n % size else [])
    else:
        k = -(-n // size)
    q, rem = divmod(n, k)
    return [q + 1] * rem + [q] * (k - rem)


class _Costs:
    """cost_r(n) and its inverse maxn_r(T) for the planner's model (module docstring)."""

    def __init__(self, fixed, per_sample, overhead, m, micro_steps, lo, hi):
        self.a, self.b, self.c, self.m = fixed, per_sample, overhead, m
        self.k, self.lo, self.hi = micro_steps, lo, hi

    def micro(self, r: int, n: int) -> int:
        if n <= 0:
            return 0
        return self.k if self.k is not None else -(-n // self.m[r])

    def cost(self, r: int, n: int) -> float:
        if n <= 0:
            return 0.0
        if n > self.hi[r]:
            return math.inf
        return self.a[r] + self.b[r] * n + self.c[r] * self.micro(r, n)

    def maxn(self, r: int, T: float) -> int:
        """Largest n in [0, hi_r] with cost_r(n) <= T."""
        hi = self.hi[r]
        if hi <= 0 or T < self.cost(r, 1):
            return 0
        if self.cost(r, hi) <= T:
            return hi
        a, b, c = self.a[r], self.b[r], self.c[r]
        if self.k is not None:
            if b <= 0:
                return hi          # cost does not grow with n (and cost(1) <= T)
            n = math.floor((T - a - c * self.k) / b)
        else:
            m = self.m[r]
            if b <= 0:             # cost grows by c per micro-batch only
                j = math.floor((T - a) / c) if c > 0 else hi
                n = j * m
            else:
                j0 = max(1, math.ceil(((T - a) / (b + c / m)) / m))
                n = 0
                for j in (j0 - 1, j0, j0 + 1):
                    if j < 1:
                        continue
                    nj = min(j * m, math.floor((T - a - c * j) / b))
                    if nj > (j - 1) * m:
                        n = max(n, nj)
        n = max(0, min(hi, n))
        while n > 0 and self.cost(r, n) > T:         # float round-off
            n -= 1
        while n < hi and self.cost(r, n + 1) <= T:
            n += 1
        return n

    def relaxed(self, r: int, T: float) -> float:
        """Fractional samples rank r finishes by T without micro-batch rounding (lower bound)."""
        hi = self.hi[r]
        if hi <= 0:
            return 0.0
        a, b, c = self.a[r], self.b[r], self.c[r]
        rate_den = b + (c / self.m[r] if self.k is None else 0.0)
        base = a + (c * self.k if self.k is not None else 0.0)
        if T <= base:
            return 0.0
        if rate_den <= 0:
            return float(hi)
        return min(float(hi), (T - base) / rate_den)


def _relaxed_bound(C: _Costs, W: int, B: int) -> float:
    """Smallest T with sum_r relaxed_r(T) >= B: relaxed_r is 0 up to base_r, then grows with
    slope 1 / den_r until it reaches hi_r (piecewise linear; walked over its breakpoints)."""
    ev = []                                   # (T, slope change, jump)
    for r in range(W):
        hi = C.hi[r]
        if hi <= 0:
            continue
        den = C.b[r] + (C.c[r] / C.m[r] if C.k is None else 0.0)
        base = C.a[r] + (C.c[r] * C.k if C.k is not None else 0.0)
        if den <= 0:
            ev.append((base, 0.0, float(hi)))
        else:
            ev.append((base, 1.0 / den, 0.0))
            ev.append((base + hi * den, -1.0 / den, 0.0))
    ev.sort()
    val, slope, t_prev = 0.0, 0.0, 0.0
    need = B * (1 - 1e-12)                    # float round-off at the breakpoints
    for t, ds, jump in ev:
        nxt = val + slope * (t - t_prev)
        if nxt >= need and slope > 0:
            return min(t, t_prev + (B - val) / slope)
        val, t_prev = nxt, t
        if val + jump >= need:
            return t
        val += jump
        slope += ds
    return t_prev if slope <= 0 else t_prev + (B - val) / slope


def _explain_infeasible(B, W, lo, hi, caps, usable, micro_steps, min_samples):
    if sum(hi) < B:
        if micro_steps is not None:
            k_need = None
            if any(u and c > 0 for u, c in zip(usable, caps)):
                k_need = -(-B // max(1, sum(c for u, c in zip(usable, caps) if u)))
            return (f"global batch {B} does not fit: with {micro_steps} micro-batches per rank "
                    f"and micro-batch caps {caps} the ranks hold at most {hi} = {sum(hi)} "
                    f"samples per step. Raise the number of micro-batches per step "
                    f"(gradient accumulation) to >= {k_need}, raise the caps, or lower the "
                    f"global batch.")
        return (f"global batch {B} does not fit: ranks that can take samples hold at most "
                f"{hi} samples")
    if sum(lo) > B:
        return (f"global batch {B} is smaller than the {sum(lo)} samples the ranks must take "
                f"(min_samples={min_samples} per rank: {lo}); raise the global batch or lower "
                f"the number of micro-batches per step")
    bad = [r for r in range(W) if lo[r] > hi[r]]
    return (f"ranks {bad} must take at least {[lo[r] for r in bad]} samples but can take at "
            f"most {[hi[r] for r in bad]} (speed <= 0, micro-batch cap 0, or cap x "
            f"micro_steps too small: caps {[caps[r] for r in bad]})")


def plan_microbatches(global_batch: int, speeds: Sequence[float] | None,
                      max_micro: Sequence[int] | int, micro_batch: int | None = None,
                      overhead: Sequence[float] | float = 0.0, *,
                      fixed: Sequence[float] | float = 0.0,
                      per_sample: Sequence[float] | None = None,
                      micro_steps: int | str | None = None, min_samples: int = 0,
                      bounds: Sequence[tuple[int, int]] | None = None) -> Plan:
    """Optimal micro-batch plan for a fixed global batch (see the module docstring).

    global_batch  samples per optimizer step over all data-parallel ranks.
    speeds        throughput of each rank (samples/s, any common unit; per-sample cost
                  1 / speed); <= 0 or non-finite: the rank gets no samples. Give either speeds
                  or ``per_sample`` (seconds per sample; inf/nan: the rank gets no samples).
    max_micro     largest micro-batch each rank fits in memory (an int: same for all); 0: the
                  rank gets no samples.
    micro_batch   None: each rank uses ceil(n_r / max_micro[r]) micro-batches of sizes as even
                  as possible; an int: every micro-batch has this size except possibly each
                  rank's last (it must not exceed any usable rank's cap: ValueError).
    overhead      fixed seconds per micro-batch of each rank; default 0.
    fixed         fixed seconds per step of each rank that holds samples; default 0.
    micro_steps   every rank holding samples runs exactly this many micro-batches (or n_r
                  of size 1 when n_r is smaller); its cap then bounds n_r <= micro_steps * cap.
                  "lockstep": the same number k on every rank, k chosen by the planner: the
                  fastest plan over all k (frameworks whose every micro-batch is a collective,
                  e.g. DeepSpeed ZeRO-2/3; Plan.micro_steps holds the k chosen).
    min_samples   every usable rank takes at least this many samples.
    bounds        optional (lo, hi) samples per rank, intersected with the constraints above
                  (the Balancer's trust region); the plan is optimal within them.
    """
    if micro_steps == "lockstep":
        return _lockstep(global_batch, speeds, max_micro, overhead, fixed, per_sample,
                         min_samples, bounds)
    B = int(global_batch)
    if B < 0:
        raise ValueError("global_batch must be >= 0")
    if (speeds is None) == (per_sample is None):
        raise ValueError("give exactly one of speeds and per_sample")
    if per_sample is None:
        sp = [float(s) for s in speeds]
        W = len(sp)
        if W == 0:
            raise ValueError("speeds is empty")
        ok_speed = [math.isfinite(s) and s > 0 for s in sp]
        b = [1.0 / s if ok else math.inf for s, ok in zip(sp, ok_speed)]
    else:
        b = [float(x) for x in per_sample]
        W = len(b)
        if W == 0:
            raise ValueError("per_sample is empty")
        ok_speed = [math.isfinite(x) and x >= 0 for x in b]
        sp = [1.0 / x if ok and x > 0 else (math.inf if ok else 0.0)
              for x, ok in zip(b, ok_speed)]
    caps = _per_rank(max_micro, W, "max_micro", int)
    ov = _per_rank(overhead, W, "overhead", float)
    fx = _per_rank(fixed, W, "fixed", float)
    if any(c < 0 for c in caps) or any(not (o >= 0) for o in ov) or \
            any(not (f >= 0) or math.isinf(f) for f in fx):
        raise ValueError("max_micro, overhead and fixed must be finite and >= 0")
    min_samples = int(min_samples)
    if min_samples < 0:
        raise ValueError("min_samples must be >= 0")
    usable = [ok_speed[r] and caps[r] > 0 for r in range(W)]
    if micro_batch is not None:
        micro_batch = int(micro_batch)
        if micro_batch <= 0:
            raise ValueError("micro_batch must be positive")
        too_big = [r for r in range(W) if caps[r] > 0 and micro_batch > caps[r]]
        if too_big:
            raise ValueError(f"micro_batch={micro_batch} exceeds max_micro of ranks {too_big} "
                             f"({[caps[r] for r in too_big]})")
    if micro_steps is not None:
        micro_steps = int(micro_steps)
        if micro_steps <= 0:
            raise ValueError("micro_steps must be positive")
        if micro_batch is not None:
            raise ValueError("give micro_batch or micro_steps, not both")
    m = [micro_batch if micro_batch is not None else max(c, 1) for c in caps]
    if B > 0 and not any(usable):
        raise ValueError(f"no rank can take samples: speeds={sp}, max_micro={caps} "
                         f"(every rank has speed <= 0 or a micro-batch cap of 0)")
    hi = [(B if micro_steps is None else min(B, micro_steps * caps[r])) if usable[r] else 0
          for r in range(W)]
    lo = [min_samples if usable[r] else 0 for r in range(W)]
    if bounds is not None:
        if len(bounds) != W:
            raise ValueError(f"bounds has {len(bounds)} entries for {W} ranks")
        for r, (bl, bh) in enumerate(bounds):
            if usable[r]:
                lo[r] = max(lo[r], int(bl))
                hi[r] = min(hi[r], int(bh))
    if B > 0 and (sum(hi) < B or sum(lo) > B or any(l > h for l, h in zip(lo, hi))):
        raise ValueError(_explain_infeasible(B, W, lo, hi, caps, usable, micro_steps,
                                             min_samples))
    C = _Costs(fx, b, ov, m, micro_steps, lo, hi)

    n = [0] * W
    if B > 0:
        def cnt(T):
            return sum(max(lo[r], C.maxn(r, T)) for r in range(W))
        t_lo, t_hi = 0.0, max(C.cost(r, hi[r]) for r in range(W))
        c_lo = cnt(t_lo)
        if c_lo >= B:
            n = list(lo)
        else:
            # until few samples lie between the two ends (the greedy places those exactly)
            c_hi = cnt(t_hi)
            for _ in range(200):
                if c_hi - c_lo <= W:
                    break
                mid = 0.5 * (t_lo + t_hi)
                if not t_lo < mid < t_hi:
                    break
                c = cnt(mid)
                if c >= B:
                    t_hi, c_hi = mid, c
                else:
                    t_lo, c_lo = mid, c
            n = [max(lo[r], C.maxn(r, t_lo)) for r in range(W)]
        # Greedy for the rest: next sample to the rank that finishes it first (ties: low rank).
        heap = [(C.cost(r, n[r] + 1), r) for r in range(W) if usable[r] and n[r] < hi[r]]
        heapq.heapify(heap)
        for _ in range(B - sum(n)):
            _, r = heapq.heappop(heap)
            n[r] += 1
            if n[r] < hi[r]:
                heapq.heappush(heap, (C.cost(r, n[r] + 1), r))

    per_rank = [split_micro(n[r], m[r], micro_batch is not None, micro_steps)
                for r in range(W)]
    # continuous relaxation (lower bound of the optimum)
    lb = 0.0 if B == 0 else _relaxed_bound(C, W, B)
    return Plan(per_rank=per_rank, global_batch=B,
                est_step_time=max(C.cost(r, n[r]) for r in range(W)),
                lower_bound=lb, optimal=True, speeds=tuple(sp), max_micro=tuple(caps),
                micro_batch=micro_batch, overhead=tuple(ov), fixed=tuple(fx),
                micro_steps=micro_steps, min_samples=min_samples)


def _lockstep(B, speeds, max_micro, overhead, fixed, per_sample, min_samples, bounds) -> Plan:
    """Fastest plan over every common micro-batch count k (module docstring: each k is an
    exact plan_microbatches(micro_steps=k); larger k relaxes the caps n_r <= k * cap_r and adds
    k * overhead, so the scan stops once no cap binds (overhead 0) or once k * overhead alone
    exceeds the best time found)."""
    kw = dict(overhead=overhead, fixed=fixed, per_sample=per_sample, min_samples=min_samples,
              bounds=bounds)
    W = len(speeds if speeds is not None else per_sample)
    caps = _per_rank(max_micro, W, "max_micro", int)
    ov = _per_rank(overhead, W, "overhead", float)
    fx = _per_rank(fixed, W, "fixed", float)
    pos = [c for c in caps if c > 0]
    if not pos or int(B) == 0:
        return plan_microbatches(B, speeds, max_micro, micro_steps=1, **kw)
    k_lo = max(1, -(-int(B) // sum(pos)))
    k_hi = max(-(-int(B) // c) for c in pos)
    best, err = None, None
    for k in range(k_lo, k_hi + 1):
        try:
            p = plan_microbatches(B, speeds, max_micro, micro_steps=k, **kw)
        except ValueError as e:          # caps too small for this k, or min_samples > ...
            err = e
            continue
        if best is None or p.est_step_time < best.est_step_time * (1 - 1e-12):
            best = p
        binding = any(p.samples(r) >= k * caps[r] for r in range(W) if caps[r] > 0)
        if not binding and all(o == 0 for o in ov):
            break                         # a larger k changes nothing
        if min(f + o * (k + 1) for f, o, c in zip(fx, ov, caps) if c > 0) >= best.est_step_time:
            break                         # the per-micro-batch cost alone is already worse
    if best is None:
        raise err
    return best


def plan_cost(plan: Plan, rank: int, n: int | None = None) -> float:
    """Modelled seconds of ``rank`` for n samples (default: its share) under the inputs the
    plan was made from."""
    n = plan.samples(rank) if n is None else int(n)
    if n <= 0:
        return 0.0
    s = plan.speeds[rank]
    b = 1.0 / s if s > 0 else math.inf
    cap = plan.max_micro[rank]
    m = plan.micro_batch or max(cap, 1)
    k = plan.micro_steps if plan.micro_steps is not None else -(-n // m)
    return plan.fixed[rank] + b * n + plan.overhead[rank] * k


def equal_plan(global_batch: int, world_size: int, max_micro: Sequence[int] | int,
               micro_batch: int | None = None, micro_steps: int | None = None) -> Plan:
    """Equal split (what a homogeneous job does): the optimal plan for equal speeds; ranks with
    cap 0 get nothing, the remainder goes to the lowest ranks."""
    return plan_microbatches(global_batch, [1.0] * world_size, max_micro, micro_batch,
                             micro_steps=micro_steps)
