"""Micro-batch planner: split a fixed global batch over data-parallel ranks of unequal speed.

Cost model
----------
Rank r processes n_r samples in

    cost_r(n) = n / speed_r + overhead_r * ceil(n / m_r)

seconds, where speed_r is its measured throughput (samples/s), m_r the micro-batch size it uses
(its memory cap ``max_micro[r]``, or the fixed ``micro_batch``) and overhead_r an optional fixed
cost per micro-batch (default 0: per-micro-batch overhead is then folded into the measured
speed). The step ends when the slowest rank ends, so the planner solves

    minimise   max_r cost_r(n_r)
    subject to sum_r n_r = global_batch,  n_r >= 0 integer,
               n_r = 0 where speed_r <= 0 or m_r == 0 (the rank cannot take samples).

Memory caps bound the *micro-batch* size, not the number of samples of a rank: a rank takes any
number of samples as ceil(n_r / m_r) micro-batches (gradient accumulation). For a given n_r that
is the fewest micro-batches the cap allows, so it also minimises cost_r.

Optimality (why the integer plan is exact, not "within one micro-batch")
------------------------------------------------------------------------
Every cost_r is non-decreasing in n. Greedy: start from an allocation n0 with
max_r cost_r(n0_r) <= T* (T* = the optimal value; we use n0_r = the largest n with
cost_r(n) <= L for a lower bound L <= T*, see below) and hand out the remaining samples one at a
time, each to the rank whose *next* sample would finish earliest, i.e. argmin_r cost_r(n_r + 1)
(ties: lowest rank). Claim: the result is optimal.

Proof. (1) The values chosen are non-decreasing: after a pick of value v, only the picked
rank's candidate changes, to cost_r(n_r + 2) >= v, and every other candidate was already >= v.
(2) So the final maximum is M = max(max_r cost_r(n0_r), v_last). If M = max cost(n0) <= T*, the
plan is optimal. Otherwise M = v_last; let n be the allocation just before the last pick
(sum B - 1). Any allocation m with sum B has some rank with m_r >= n_r + 1 (pigeonhole), hence
max_r cost_r(m_r) >= cost_r(n_r + 1) >= v_last = M, because v_last was the minimum candidate.
Thus no allocation beats M. QED. (tests/test_balance_planner.py checks it against exhaustive
search over all allocations on small cases.)

Lower bound L: ceil(n/m) >= n/m gives cost_r(n) >= n / s'_r with s'_r = 1/(1/speed_r +
overhead_r/m_r); some rank holds n_r >= B s'_r / S' (S' = sum s'), so T* >= L = B / S'. With
n0_r <= L s'_r we also get sum n0 <= B, and at most about one micro-batch per rank is left to
hand out greedily, so the planner is O(world * (micro-batch + log world)), independent of B.

``Plan.optimal`` is True when the allocation is proved optimal for this model (always, for plans
from plan_microbatches; False for hand-built plans). The model is exact for throughput-bound
compute; real speeds are measured and noisy, so the *real* step time is optimal only up to the
measurement error, which the Balancer's threshold re-planning tracks.
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
    est_step_time modelled step time: max over ranks of cost_r(samples(r)) (seconds when speeds
                  are in samples/s; inf when a rank holds samples at speed 0).
    lower_bound   global_batch / sum(speeds): the time of a perfectly divisible, overhead-free
                  split; est_step_time / lower_bound >= 1 is the integer/overhead loss.
    optimal       True when the sample allocation is proved to minimise est_step_time over all
                  integer allocations (see module docstring).
    speeds, max_micro, micro_batch, overhead: the inputs the plan was made from (for re-planning
                  and reporting).
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
        return (f"Plan(B={self.global_batch}, samples={[self.samples(r) for r in range(self.world_size)]}, "
                f"micro={self.per_rank}, est={self.est_step_time:.4g}, lb={self.lower_bound:.4g}, "
                f"optimal={self.optimal})")


def _per_rank(x, world: int, name: str, cast):
    if isinstance(x, (int, float)):
        return [cast(x)] * world
    x = [cast(v) for v in x]
    if len(x) != world:
        raise ValueError(f"{name} has {len(x)} entries for {world} ranks")
    return x


def split_micro(n: int, size: int, fixed: bool) -> list[int]:
    """Split n samples into ceil(n/size) micro-batches: sizes as even as possible (larger ones
    first) or, when ``fixed``, all equal to ``size`` except the last."""
    if n <= 0:
        return []
    k = -(-n // size)
    if fixed:
        return [size] * (n // size) + ([n % size] if n % size else [])
    q, rem = divmod(n, k)
    return [q + 1] * rem + [q] * (k - rem)


def plan_microbatches(global_batch: int, speeds: Sequence[float],
                      max_micro: Sequence[int] | int, micro_batch: int | None = None,
                      overhead: Sequence[float] | float = 0.0) -> Plan:
    """Optimal micro-batch plan for a fixed global batch (see the module docstring).

    global_batch  samples per optimizer step over all data-parallel ranks.
    speeds        throughput of each rank (samples/s, any common unit); <= 0 or non-finite:
                  the rank gets no samples.
    max_micro     largest micro-batch each rank fits in memory (an int: same for all); 0: the
                  rank gets no samples.
    micro_batch   None: each rank uses ceil(n_r / max_micro[r]) micro-batches of sizes as even
                  as possible; an int: every micro-batch has this size except possibly each
                  rank's last (it must not exceed any usable rank's cap: ValueError).
    overhead      optional fixed seconds per micro-batch of each rank (cost model); default 0.
    """
    B = int(global_batch)
    if B < 0:
        raise ValueError("global_batch must be >= 0")
    W = len(speeds)
    if W == 0:
        raise ValueError("speeds is empty")
    sp = [float(s) for s in speeds]
    caps = _per_rank(max_micro, W, "max_micro", int)
    ov = _per_rank(overhead, W, "overhead", float)
    if any(c < 0 for c in caps) or any(o < 0 for o in ov):
        raise ValueError("max_micro and overhead must be >= 0")
    usable = [math.isfinite(s) and s > 0 and c > 0 for s, c in zip(sp, caps)]
    if micro_batch is not None:
        micro_batch = int(micro_batch)
        if micro_batch <= 0:
            raise ValueError("micro_batch must be positive")
        too_big = [r for r in range(W) if caps[r] > 0 and micro_batch > caps[r]]
        if too_big:
            raise ValueError(f"micro_batch={micro_batch} exceeds max_micro of ranks {too_big} "
                             f"({[caps[r] for r in too_big]})")
    m = [micro_batch if micro_batch is not None else c for c in caps]
    if B > 0 and not any(usable):
        raise ValueError(f"no rank can take samples: speeds={sp}, max_micro={caps}")

    def cost(r: int, n: int) -> float:
        if n == 0:
            return 0.0
        if not usable[r]:
            return math.inf
        return n / sp[r] + ov[r] * (-(-n // m[r]))

    # Start allocation n0 with max cost <= L <= T* (module docstring).
    n = [0] * W
    if B > 0:
        eff = [1.0 / (1.0 / sp[r] + ov[r] / m[r]) if usable[r] else 0.0 for r in range(W)]
        L = B / sum(eff)
        for r in range(W):
            if not usable[r]:
                continue
            k = min(B, math.floor(L * eff[r]))
            while k > 0 and cost(r, k) > L:
                j = -(-k // m[r])                         # micro-batches at k
                lo = (j - 1) * m[r]                         # largest k with j - 1 of them
                k2 = math.floor((L - ov[r] * j) * sp[r])   # largest k with j of them that fits
                if lo < k2 < k:
                    k = k2
                elif k2 >= k:                               # float round-off
                    k -= 1
                else:
                    k = lo
            n[r] = max(k, 0)
        if sum(n) > B:  # float round-off only; fall back to a pure greedy
            n = [0] * W
    # Greedy for the rest: next sample to the rank that would finish it first (ties: low rank).
    heap = [(cost(r, n[r] + 1), r) for r in range(W) if usable[r]]
    heapq.heapify(heap)
    for _ in range(B - sum(n)):
        _, r = heapq.heappop(heap)
        n[r] += 1
        heapq.heappush(heap, (cost(r, n[r] + 1), r))

    per_rank = [split_micro(n[r], m[r], micro_batch is not None) for r in range(W)]
    S = sum(s for s, u in zip(sp, usable) if u)
    return Plan(per_rank=per_rank, global_batch=B,
                est_step_time=max(cost(r, n[r]) for r in range(W)),
                lower_bound=B / S if S > 0 else (0.0 if B == 0 else math.inf),
                optimal=True, speeds=tuple(sp), max_micro=tuple(caps),
                micro_batch=micro_batch, overhead=tuple(ov))


def equal_plan(global_batch: int, world_size: int, max_micro: Sequence[int] | int,
               micro_batch: int | None = None) -> Plan:
    """Equal split (what a homogeneous job does): the optimal plan for equal speeds; ranks with
    cap 0 get nothing, the remainder goes to the lowest ranks."""
    return plan_microbatches(global_batch, [1.0] * world_size, max_micro, micro_batch)
