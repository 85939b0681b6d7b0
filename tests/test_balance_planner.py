"""Planner properties: exact sums, caps, optimality against exhaustive search, stability."""
import itertools
import math
import random
import time

import pytest

from hetccl.balance import Plan, equal_plan, plan_microbatches, split_micro


def _cost(n, s, m, o):
    if n == 0:
        return 0.0
    if s <= 0 or m == 0:
        return math.inf
    return n / s + o * math.ceil(n / m)


def allocations(B, W):
    """Every split of B samples over W ranks (n_r >= 0, sum = B)."""
    for head in itertools.product(range(B + 1), repeat=W - 1):
        last = B - sum(head)
        if last >= 0:
            yield list(head) + [last]


def brute_force(B, speeds, caps, micro_batch=None, overhead=None):
    """min over all allocations (n_r >= 0, sum = B) of max_r cost_r(n_r)."""
    W = len(speeds)
    overhead = overhead or [0.0] * W
    m = [micro_batch if micro_batch is not None and c > 0 else c for c in caps]
    best = math.inf
    for alloc in allocations(B, W):
        best = min(best, max(_cost(n, speeds[r], m[r], overhead[r]) for r, n in enumerate(alloc)))
    return best


def check_structure(plan, B, caps, micro_batch=None):
    assert plan.global_batch == B
    assert sum(plan.samples(r) for r in range(plan.world_size)) == B
    off = plan.offsets()
    assert off == [sum(plan.samples(q) for q in range(r)) for r in range(plan.world_size)]
    for r, mbs in enumerate(plan.per_rank):
        n = plan.samples(r)
        assert plan.num_micro(r) == len(mbs)
        assert all(0 < b <= caps[r] for b in mbs)
        size = micro_batch if micro_batch is not None else caps[r]
        assert len(mbs) == (math.ceil(n / size) if n else 0)   # fewest micro-batches
        if micro_batch is not None:
            assert all(b == micro_batch for b in mbs[:-1])
        elif mbs:
            assert max(mbs) - min(mbs) <= 1                    # as even as possible


def _cases(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        W = rng.randint(1, 4)
        B = rng.randint(0, 12 if W < 4 else 9)
        speeds = [rng.choice([0.0, rng.uniform(0.2, 5.0), float(rng.randint(1, 4))])
                  if rng.random() < 0.15 else rng.choice([rng.uniform(0.2, 5.0), float(rng.randint(1, 4))])
                  for _ in range(W)]
        caps = [rng.randint(0, 5) if rng.random() < 0.1 else rng.randint(1, 5) for _ in range(W)]
        if not any(s > 0 and c > 0 for s, c in zip(speeds, caps)):
            speeds[0], caps[0] = 1.0, max(caps[0], 1)
        yield W, B, speeds, caps, rng


def test_optimal_exhaustive_no_overhead():
    for W, B, speeds, caps, rng in _cases(1, 500):
        plan = plan_microbatches(B, speeds, caps)
        check_structure(plan, B, caps)
        assert plan.optimal
        best = brute_force(B, speeds, caps)
        assert plan.est_step_time == pytest.approx(best, rel=1e-12, abs=1e-12), (B, speeds, caps, plan)
        if B and math.isfinite(best):
            assert plan.est_step_time >= plan.lower_bound * (1 - 1e-12)


def test_optimal_exhaustive_overhead_and_fixed_micro():
    for W, B, speeds, caps, rng in _cases(2, 400):
        overhead = [rng.choice([0.0, rng.uniform(0, 2.0)]) for _ in range(W)]
        pos = [c for c in caps if c > 0]
        mb = rng.choice([None, rng.randint(1, min(pos))])
        plan = plan_microbatches(B, speeds, caps, micro_batch=mb, overhead=overhead)
        check_structure(plan, B, caps, mb)
        best = brute_force(B, speeds, caps, mb, overhead)
        assert plan.est_step_time == pytest.approx(best, rel=1e-12, abs=1e-12), \
            (B, speeds, caps, mb, overhead, plan)


def test_exhaustive_check_has_teeth():
    """Naive proportional rounding is often suboptimal: the exhaustive check catches it."""
    caught = 0
    for W, B, speeds, caps, rng in _cases(3, 300):
        if W < 2 or not all(s > 0 for s in speeds):
            continue
        S = sum(speeds)
        naive = [math.floor(B * s / S) for s in speeds]
        naive[-1] += B - sum(naive)
        t = max(_cost(n, s, c or 1, 0) for n, s, c in zip(naive, speeds, caps))
        if t > brute_force(B, speeds, [c or 1 for c in caps]) * (1 + 1e-9):
            caught += 1
    assert caught > 10


def test_proportional_and_equal():
    p = plan_microbatches(96, [1.0, 0.5], 8)
    assert [p.samples(0), p.samples(1)] == [64, 32]
    assert p.per_rank == [[8] * 8, [8] * 4] and p.est_step_time == pytest.approx(64)
    assert p.lower_bound == pytest.approx(64) and p.efficiency() == pytest.approx(1.0)
    p = plan_microbatches(96, [3.0, 3.0, 1.0, 1.0], [16, 16, 5, 5])
    assert [p.samples(r) for r in range(4)] == [36, 36, 12, 12]
    assert p.per_rank[2] == [4, 4, 4]                 # ceil(12/5)=3 micro-batches, even sizes
    e = equal_plan(10, 4, [4, 4, 0, 4])
    assert [e.samples(r) for r in range(4)] == [4, 3, 0, 3]
    f = plan_microbatches(10, [1, 1], 4, micro_batch=4)
    assert f.per_rank == [[4, 1], [4, 1]]


def test_zero_speed_and_cap_ranks_get_nothing():
    p = plan_microbatches(10, [1.0, 0.0, 2.0, float("nan")], [4, 4, 0, 4])
    assert [p.samples(r) for r in range(4)] == [10, 0, 0, 0]
    assert p.per_rank[1] == [] and p.num_micro(1) == 0
    p0 = plan_microbatches(0, [1.0, 2.0], 4)
    assert p0.per_rank == [[], []] and p0.est_step_time == 0.0
    with pytest.raises(ValueError):
        plan_microbatches(4, [0.0, 0.0], 4)
    with pytest.raises(ValueError):
        plan_microbatches(4, [1.0, 1.0], [4, 2], micro_batch=3)   # larger than a cap
    with pytest.raises(ValueError):
        Plan(per_rank=[[1], [2]], global_batch=4)


def test_large_batch_fast_and_near_bound():
    rng = random.Random(5)
    speeds = [rng.uniform(0.5, 4) for _ in range(8)]
    t0 = time.perf_counter()
    p = plan_microbatches(4_000_003, speeds, [rng.randint(1, 64) for _ in range(8)])
    assert time.perf_counter() - t0 < 0.5
    assert sum(p.samples(r) for r in range(8)) == 4_000_003
    # integer loss: at most one sample of the slowest rank above the continuous bound
    assert p.est_step_time <= p.lower_bound + 1 / min(speeds) + 1e-9


def test_split_micro():
    assert split_micro(10, 4, False) == [4, 3, 3]
    assert split_micro(10, 4, True) == [4, 4, 2]
    assert split_micro(8, 4, True) == [4, 4]
    assert split_micro(0, 4, False) == []


def test_stable_under_noise():
    """1% speed noise moves each rank's share by about 2% of it, plus rounding; never more."""
    rng = random.Random(7)
    eps, B = 0.01, 1000
    for _ in range(200):
        W = rng.randint(2, 6)
        speeds = [rng.uniform(0.3, 3.0) for _ in range(W)]
        noisy = [s * (1 + rng.uniform(-eps, eps)) for s in speeds]
        a = plan_microbatches(B, speeds, 16)
        b = plan_microbatches(B, noisy, 16)
        S = sum(speeds)
        for r in range(W):
            bound = 2 * eps / (1 - eps) * B * speeds[r] / S + 4
            assert abs(a.samples(r) - b.samples(r)) <= bound
    # deterministic: same input, same plan
    assert plan_microbatches(77, [1.3, 2.1, 0.7], [5, 9, 3]) == \
        plan_microbatches(77, [1.3, 2.1, 0.7], [5, 9, 3])


# -- fixed costs, fixed micro-batch counts, lower bounds, lockstep (issue 16) ------------------
def _cost2(n, b, a, m, o, k, lo, hi):
    if n == 0:
        return 0.0 if lo == 0 else math.inf
    if n > hi or n < lo or not math.isfinite(b):
        return math.inf
    return a + n * b + o * (k if k is not None else math.ceil(n / m))


def brute_force2(B, per_sample, fixed, caps, overhead, k, min_samples, bounds=None):
    """min over all allocations of max_r cost_r(n_r); inf when none is feasible (B = 0: the
    empty plan, whatever the lower bounds)."""
    W = len(per_sample)
    if B == 0:
        return 0.0
    best = math.inf
    for alloc in allocations(B, W):
        cost = 0.0
        for r, n in enumerate(alloc):
            usable = math.isfinite(per_sample[r]) and caps[r] > 0
            lo = min_samples if usable else 0
            hi = (B if k is None else k * caps[r]) if usable else 0
            if bounds is not None and usable:
                lo, hi = max(lo, bounds[r][0]), min(hi, bounds[r][1])
            cost = max(cost, _cost2(n, per_sample[r], fixed[r], max(caps[r], 1), overhead[r],
                                    k, lo, hi))
        best = min(best, cost)
    return best


def test_optimal_exhaustive_fixed_costs_micro_steps_min_samples():
    rng = random.Random(11)
    checked = infeasible = 0
    for _ in range(500):
        W = rng.randint(1, 3 if rng.random() < 0.5 else 4)
        B = rng.randint(0, 12 if W < 4 else 8)
        per_sample = [rng.choice([math.inf, 0.0]) if rng.random() < 0.08 else rng.uniform(0.1, 3)
                      for _ in range(W)]
        fixed = [rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(W)]
        caps = [rng.randint(0, 4) if rng.random() < 0.1 else rng.randint(1, 4) for _ in range(W)]
        overhead = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(W)]
        k = rng.choice([None, 1, 2, 3])
        ms = rng.choice([0, 0, 1, 2])
        bounds = None
        if rng.random() < 0.3:
            bounds = [(rng.randint(0, 2), rng.randint(2, B + 2)) for _ in range(W)]
        best = brute_force2(B, per_sample, fixed, caps, overhead, k, ms, bounds)
        try:
            plan = plan_microbatches(B, None, caps, overhead=overhead, fixed=fixed,
                                     per_sample=per_sample, micro_steps=k, min_samples=ms,
                                     bounds=bounds)
        except ValueError as e:
            assert math.isinf(best), (B, per_sample, fixed, caps, k, ms, bounds, best)
            assert str(e)                      # explained
            infeasible += 1
            continue
        assert plan.est_step_time == pytest.approx(best, rel=1e-9, abs=1e-12), \
            (B, per_sample, fixed, caps, overhead, k, ms, bounds, plan)
        assert sum(plan.counts()) == B
        for r, mbs in enumerate(plan.per_rank):
            assert all(0 < x <= max(caps[r], 0) for x in mbs)
            if k is not None and mbs:
                assert len(mbs) == min(k, sum(mbs)) and max(mbs) - min(mbs) <= 1
        assert plan.est_step_time >= plan.lower_bound * (1 - 1e-9) - 1e-12
        checked += 1
    assert checked > 250 and infeasible > 10


def test_lockstep_is_fastest_over_every_count():
    rng = random.Random(12)
    for _ in range(200):
        W = rng.randint(2, 3)
        B = rng.randint(1, 14)
        per_sample = [rng.uniform(0.1, 3) for _ in range(W)]
        fixed = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(W)]
        caps = [rng.randint(1, 5) for _ in range(W)]
        overhead = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(W)]
        p = plan_microbatches(B, None, caps, overhead=overhead, fixed=fixed,
                              per_sample=per_sample, micro_steps="lockstep")
        best = min(brute_force2(B, per_sample, fixed, caps, overhead, k, 0)
                   for k in range(1, B + 1))
        assert p.est_step_time == pytest.approx(best, rel=1e-9), (B, per_sample, fixed, caps)
        k = p.micro_steps
        assert all(len(m) == min(k, sum(m)) for m in p.per_rank)


def test_lockstep_gives_ranks_the_same_count_and_respects_caps():
    p = plan_microbatches(16, [3.0, 1.0], 4, micro_steps="lockstep")
    assert p.counts() == [12, 4] and p.micro_steps == 3
    assert p.per_rank == [[4, 4, 4], [2, 1, 1]]


def test_memory_caps_bound_micro_batches_and_impossible_cases_are_explained():
    # a 16 GB card (cap 2) next to an 80 GB one (cap 12): the small card runs more, smaller
    # micro-batches; the plan is the same optimum as without caps (caps bound micro-batches)
    p = plan_microbatches(32, [1.0, 1.0], [12, 2])
    assert p.counts() == [16, 16] and max(p.per_rank[1]) <= 2 and len(p.per_rank[1]) == 8
    # with a fixed number of micro-batches (HF Trainer: gradient_accumulation_steps) the cap
    # bounds the samples: at most 2 x 2 on rank 1, the rest goes to rank 0
    q = plan_microbatches(32, [1.0, 1.0], [16, 2], micro_steps=2)
    assert q.counts() == [28, 4] and q.per_rank == [[14, 14], [2, 2]]
    with pytest.raises(ValueError, match=r"micro-batches per step \(gradient accumulation\) to >= 3"):
        plan_microbatches(40, [1.0, 1.0], [12, 2], micro_steps=2)
    with pytest.raises(ValueError, match="min_samples=2"):
        plan_microbatches(3, [1.0, 1.0], 8, min_samples=2)
    with pytest.raises(ValueError, match="no rank can take samples"):
        plan_microbatches(3, [1.0, 1.0], [0, 0])
    with pytest.raises(ValueError, match=r"ranks \[1\] must take at least"):
        plan_microbatches(6, [1.0, 1.0], [8, 1], micro_steps=1, min_samples=2)
