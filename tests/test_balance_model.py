"""Step-time model (fixed + per-sample cost) and the Balancer's decisions on simulated ranks.

The simulations run W Balancers in one process, each with its own fake clock advanced by the
true step time of its rank (fixed_r + per_sample_r * n) times multiplicative noise, and exchange
the fitted models the way end_step() does (every rank gets the same list). Noise levels are
those seen on real hardware for small steps (3-8 %), plus occasional large spikes.
"""
import math
import random

import pytest

from hetccl.balance import (Balancer, StepModel, StepTimeFitter, fit_line, plan_cost,
                            plan_microbatches)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(true, B, steps, *, noise=0.05, spikes=0.0, seed=0, caps=8, rate_models=False,
             change=None, **kw):
    """Run len(true) Balancers for ``steps`` steps; true[r] = (fixed_s, per_sample_s).
    change: {step: new true list}. rate_models: exchange samples/s of the last step instead
    of fitted models (the pre-issue-16 behaviour, as a control). Returns the per-step counts
    and the balancers."""
    rng = random.Random(seed)
    W = len(true)
    clocks = [Clock() for _ in range(W)]
    bals = [Balancer(B, caps, rank=r, world_size=W, clock=clocks[r], **kw) for r in range(W)]
    counts = []
    last = [None] * W
    for step in range(steps):
        if change and step in change:
            true = change[step]
        plan = bals[0].plan
        assert all(b.plan == plan for b in bals)                 # one plan on every rank
        counts.append(plan.counts())
        for r, b in enumerate(bals):
            n = plan.samples(r)
            b.begin_step()
            t = true[r][0] + true[r][1] * n if n else 0.0
            f = 1 + rng.gauss(0, noise)
            if spikes and rng.random() < spikes:
                f *= 1.5 + rng.random()
            clocks[r].t += t * max(f, 0.2)
            b.end_step(n, exchange=False)
            if n and step >= 1:
                last[r] = n / (t * max(f, 0.2))
        models = [b.local_model for b in bals] if not rate_models else list(last)
        for b in bals:
            b.update(models)
    return counts, bals


def optimum(true, B, caps=8):
    return plan_microbatches(B, None, caps, fixed=[a for a, _ in true],
                             per_sample=[b for _, b in true])


# -- the fit ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_fixed_and_per_sample(seed):
    rng = random.Random(seed)
    a, b = 0.020, 0.001                    # 20 ms per step + 1 ms per sample
    ns = [rng.randint(4, 32) for _ in range(32)]
    ts = [(a + b * n) * (1 + rng.gauss(0, 0.05)) for n in ns]
    for i in rng.sample(range(32), 3):     # three spikes (GC, allocator growth...)
        ts[i] *= 3.0
    m = fit_line(ns, ts)
    assert m.fixed == pytest.approx(a, rel=0.2) and m.per_sample == pytest.approx(b, rel=0.15)
    # the robust weights matter: plain least squares on the same data is pulled by the spikes
    plain = fit_line(ns, ts, huber=math.inf)
    err = abs(m.fixed - a) + abs(m.per_sample - b) * 16
    err_plain = abs(plain.fixed - a) + abs(plain.per_sample - b) * 16
    assert err_plain > 2 * err
    # a samples/s figure is no model of this rank: it depends on n by a factor of ~2
    assert 32 / (a + 32 * b) > 1.9 * (4 / (a + 4 * b))


def test_fit_single_n_uses_the_prior_and_stays_exact_there():
    m = fit_line([8] * 6, [0.010] * 6)
    assert m.time(8) == pytest.approx(0.010)
    assert m.fixed == 0.0 and m.per_sample == pytest.approx(0.010 / 8)   # prior_fixed=0
    m2 = fit_line([8] * 6, [0.010] * 6, prior_fixed=0.5)
    assert m2.time(8) == pytest.approx(0.010) and m2.fixed == pytest.approx(0.005)
    # data outweighs the prior as soon as n varies
    m3 = fit_line([8, 8, 8, 9, 9, 9], [0.010, 0.010, 0.010, 0.0101, 0.0101, 0.0101])
    assert m3.per_sample == pytest.approx(0.0001, rel=0.05) and m3.fixed == pytest.approx(0.0092, rel=0.01)
    # physical: no negative costs
    m4 = fit_line([2, 4, 6], [0.010, 0.009, 0.008])
    assert m4.fixed >= 0 and m4.per_sample >= 0
    assert fit_line([], []) is None and fit_line([0], [1.0]) is None


def test_fitter_tracks_a_speed_change():
    f = StepTimeFitter(window=32)
    rng = random.Random(3)
    for i in range(20):
        n = 8 + i % 3
        f.add(n, (0.01 + 0.001 * n) * (1 + rng.gauss(0, 0.02)))
    assert f.model().time(9) == pytest.approx(0.019, rel=0.03)
    f.add(9, 0.019 * 1.05)                          # one spike-free outlier: kept, no shift
    for i in range(2):                               # the device became 2x slower...
        f.add(9, 0.038)
    assert f.shifts == 0                             # (two in a row may be spikes)
    f.add(9, 0.038)
    assert f.shifts == 1 and len(f) == 3
    assert f.model().time(9) == pytest.approx(0.038, rel=0.01)


def test_model_vector_roundtrip():
    m = StepModel(0.01, 0.002, n_ref=8.5, level_var=1e-8, slope_var=1e-9, count=7, noise=1e-4,
                  n_lo=4, n_hi=12)
    assert StepModel.from_vector(m.to_vector()) == m
    assert StepModel.from_vector([0.0] * StepModel.VECTOR_LEN) is None
    with pytest.raises(ValueError):
        StepModel.from_vector([1.0, 2.0])


# -- no drift on equal devices ---------------------------------------------------------------
@pytest.mark.parametrize("W,B", [(2, 16), (4, 64)])
def test_no_drift_equal_devices_fixed_cost_dominant(W, B):
    """Identical devices, 95 % of the step fixed (a small model on a GPU), 5 % noise and
    spikes: every one of 150 steps stays within one sample of the even split."""
    true = [(0.010, 0.00005)] * W
    for seed in range(3):
        counts, bals = simulate(true, B, 150, noise=0.05, spikes=0.03, seed=seed)
        worst = max(abs(c - B // W) for step in counts for c in step)
        assert worst <= 1, (seed, counts[-5:])
        assert bals[0].replans == 0


def test_samples_per_second_models_drift():
    """Control: the same run with samples/s per rank (what the balancer did before) walks
    away from the even split, so the test above can fail."""
    true = [(0.010, 0.00005)] * 2
    worst = 0
    for seed in range(3):
        counts, _ = simulate(true, 16, 150, noise=0.05, spikes=0.03, seed=seed,
                             rate_models=True, min_gain=0.0, confidence=0.0)
        worst = max(worst, max(abs(c - 8) for step in counts for c in step))
    assert worst >= 3


# -- convergence on unequal devices ----------------------------------------------------------
@pytest.mark.parametrize("gap", [2.0, 3.0])
@pytest.mark.parametrize("fixed_share", [0.0, 0.3])
@pytest.mark.parametrize("W", [2, 4])
def test_converges_on_unequal_devices(gap, fixed_share, W):
    """Half the ranks `gap` times slower, a fixed cost of `fixed_share` of an even step, 5 %
    noise: the plan reaches 6 % of the optimal step time within a few steps (the first plan
    needs 3 measured steps; large moves go through the trust region) and ends within the
    3 % hysteresis of it, without oscillating."""
    B = 24 * W
    b = 0.001
    a = fixed_share * b * B / W / (1 - fixed_share)
    slow = max(1, W // 2)
    true = [(a, b)] * (W - slow) + [(a * gap, b * gap)] * slow
    opt = optimum(true, B)

    def t(c):
        return max((a_ + b_ * n) if n else 0.0 for (a_, b_), n in zip(true, c))

    firsts = []
    for seed in range(5):
        counts, bals = simulate(true, B, 40, noise=0.05, seed=seed)
        assert t(bals[0].plan.counts()) <= opt.est_step_time * 1.04, (bals[0].plan, opt)
        firsts.append(next(i for i, c in enumerate(counts) if t(c) <= 1.06 * opt.est_step_time))
        assert bals[0].replans <= 6
        # once there, it stays there
        assert all(t(c) <= 1.06 * opt.est_step_time for c in counts[firsts[-1]:])
    assert sorted(firsts)[2] <= 8 and max(firsts) <= 30, firsts
    # the equal split is far from it (so reaching it means something)
    assert t([B // W] * W) >= 1.3 * opt.est_step_time


def test_follows_a_device_that_slows_down():
    true = [(0.002, 0.001)] * 2
    later = [(0.002, 0.001), (0.006, 0.003)]
    counts, bals = simulate(true, 32, 40, noise=0.03, seed=2, change={15: later})
    assert all(c == [16, 16] for c in counts[:15])
    assert counts[-1] == optimum(later, 32).counts()


def test_balancer_gain_hysteresis_and_uniform_slowdown():
    b = Balancer(60, [60, 60, 60], rank=0, world_size=3, min_gain=0.05)
    assert b.plan.counts() == [20, 20, 20]
    assert not b.update([None, 2.0, 3.0])               # rank 0 not yet known
    assert b.update([1.0, 2.0, 3.0])                    # samples/s: pure per-sample models
    assert b.plan.counts() == [10, 20, 30]
    assert not b.update([0.5, 1.0, 1.5])                # uniform slow-down: same plan
    assert not b.update([1.0, 2.0, 2.8])                # best plan only 3.6 % faster
    assert b.last_decision["gain"] > 0 and not b.last_decision["adopted"]
    assert b.update([1.0, 2.0, 2.5])                    # 8 % faster: adopted
    assert b.plan.counts() == [11, 22, 27]
    # noisy models: a gain within 3 standard errors is ignored even above min_gain
    m = lambda t, se: StepModel(0.0, t / 20, n_ref=20, level_var=se ** 2, count=8)  # noqa: E731
    b2 = Balancer(40, 40, rank=0, world_size=2, min_gain=0.01)
    b2.update([m(1.0, 0.001), m(1.0, 0.001)])
    assert not b2.update([m(1.0, 0.05), m(1.1, 0.05)])
    assert b2.update([m(1.0, 0.001), m(1.1, 0.001)])


def test_fixed_cost_model_plans_beat_proportional():
    """Fixed cost per step changes the optimum: the planner uses it (exact, not ~)."""
    true = [(0.010, 0.001), (0.002, 0.002)]        # rank 0: large fixed cost
    p = plan_microbatches(40, None, 40, fixed=[0.010, 0.002], per_sample=[0.001, 0.002])
    prop = plan_microbatches(40, [1000.0, 500.0], 40)        # ignores fixed costs
    t = lambda c: max(a + b * n for (a, b), n in zip(true, c))  # noqa: E731
    assert t(p.counts()) < t(prop.counts())
    assert plan_cost(p, 0) == pytest.approx(0.010 + 0.001 * p.samples(0))
