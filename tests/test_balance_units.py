"""Single-process tests: meter, Balancer decisions, sampler coverage, loss scaling, emulation."""
import random
import time

import pytest
import torch

from hetccl.balance import (BalancedBatchSampler, Balancer, Plan, ThroughputMeter, loss_scale,
                            micro_loss_scales, plan_microbatches, step_indices, token_loss_scale)
from hetccl.balance.emulate import emulated_work, slow_down


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_meter_ema():
    c = FakeClock()
    m = ThroughputMeter(ema=0.5, clock=c)
    assert m.rate is None
    m.start(); c.t += 1.0; m.stop(10)
    assert m.rate == pytest.approx(10)
    m.start(); c.t += 1.0; m.stop(20)
    assert m.rate == pytest.approx(15)
    m.start(); c.t += 1.0; m.stop(0)          # nothing processed: unchanged
    assert m.rate == pytest.approx(15)
    m.reset()
    assert m.rate is None
    with pytest.raises(RuntimeError):
        m.stop(1)


def test_balancer_decisions():
    b = Balancer(60, [8, 8, 8], rank=0, world_size=3, threshold=0.1)
    assert [b.plan.samples(r) for r in range(3)] == [20, 20, 20]      # equal until known
    assert not b.update([None, 2.0, 3.0])                               # rank 0 not yet known
    assert b.update([1.0, 2.0, 3.0])
    assert [b.plan.samples(r) for r in range(3)] == [10, 20, 30]
    rng = random.Random(0)
    for _ in range(50):                                                 # noise < threshold
        assert not b.update([s * (1 + rng.uniform(-0.03, 0.03)) for s in (1.0, 2.0, 3.0)])
    assert not b.update([0.5, 1.0, 1.5])                                # uniform slow-down
    assert b.update([1.0, 2.0, 1.5])                                    # rank 2 drifted
    assert [b.plan.samples(r) for r in range(3)] == [13, 27, 20]
    assert b.replans == 2 and len(b.history) == 3


def test_balancer_zero_sample_rank_and_initial_speeds():
    b = Balancer(12, 4, rank=1, world_size=3, initial_speeds=[10.0, 10.0, 0.1])
    assert b.plan.samples(2) == 0
    # rank 2 never measures (no samples): it keeps its last speed; no re-plan from that
    assert not b.update([10.0, 10.5, None])
    # unknown speeds count as the slowest known one
    b2 = Balancer(4, 4, rank=0, world_size=5)          # equal split: rank 4 has 0 samples
    assert b2.plan.samples(4) == 0
    assert b2.update([1.0, 1.0, 4.0, 4.0, None])
    assert [b2.plan.samples(r) for r in range(5)] == [0, 0, 2, 2, 0]
    assert b2.speeds[4] is None and b2.plan.samples(4) == 0


def test_balancer_single_process_with_meter():
    c = FakeClock()
    b = Balancer(32, 8, clock=c)
    assert b.rank == 0 and b.world_size == 1
    b.begin_step(); c.t += 5.0
    assert not b.end_step()                    # warm-up step: not measured
    assert b.local_model is None
    b.begin_step(); c.t += 0.5
    assert not b.end_step()                    # one rank: the plan never changes
    m = b.local_model
    assert m.count == 1 and m.time(32) == pytest.approx(0.5)
    assert m.speed == pytest.approx(64)         # one point: prior (no fixed cost) slope
    assert b.speeds == [None]                   # not yet used: fewer than min_count points
    b0 = Balancer(32, 8, clock=c, warmup_steps=0)
    b0.begin_step(); c.t += 0.25
    b0.end_step(16)
    assert b0.local_model.time(16) == pytest.approx(0.25)
    with pytest.raises(RuntimeError):
        Balancer(32, 8, clock=c).end_step()     # end without begin


def test_sampler_union_is_global_batch():
    N, B, W = 103, 24, 4
    rng = random.Random(1)
    plans = [plan_microbatches(B, [rng.uniform(0.1, 3) for _ in range(W)],
                               [rng.randint(1, 9) for _ in range(W)]) for _ in range(len(range(N // B)))]
    plans[1] = plan_microbatches(B, [1, 0, 1, 1], 5)                    # a rank with nothing
    samplers = [BalancedBatchSampler(N, plans[0], rank=r, world_size=W, seed=3) for r in range(W)]
    for s in samplers:
        s.set_epoch(2)
    its = [iter(s) for s in samplers]
    for step in range(N // B):
        got = []
        for r, it in enumerate(its):
            mbs = next(it)
            assert [len(m) for m in mbs] == plans[step].per_rank[r]
            got += [i for m in mbs for i in m]
        assert sorted(got) == sorted(step_indices(N, B, step, epoch=2, seed=3))
        assert got == step_indices(N, B, step, epoch=2, seed=3)          # rank order = offsets
        if step + 1 < len(plans):
            for s in samplers:
                s.set_plan(plans[step + 1])                              # applies to next step
    assert all(next(it, None) is None for it in its)
    assert len(samplers[0]) == N // B
    # epochs differ, seeds agree
    assert step_indices(N, B, 0, epoch=0, seed=3) != step_indices(N, B, 0, epoch=1, seed=3)
    with pytest.raises(ValueError):
        samplers[0].set_plan(plan_microbatches(B + 1, [1] * W, 8))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_scaling_exact_single_process():
    """Simulate W ranks with unequal micro-batches in one process; average as DDP does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    X, Y = torch.randn(20, 4, dtype=torch.float64), torch.randn(20, 1, dtype=torch.float64)
    plan = Plan(per_rank=[[3, 3, 1], [], [5, 5], [3]], global_batch=20)
    W = plan.world_size
    model.zero_grad()
    torch.nn.functional.mse_loss(model(X), Y).backward()
    ref = _grads(model)
    acc = [torch.zeros_like(g) for g in ref]
    naive = [torch.zeros_like(g) for g in ref]
    off = plan.offsets()
    for r in range(W):
        assert loss_scale(plan, r) == pytest.approx(plan.samples(r) * W / 20)
        scales = micro_loss_scales(plan, r)
        assert sum(scales) == pytest.approx(loss_scale(plan, r))
        start = off[r]
        for size, sc in zip(plan.per_rank[r], scales):
            sl = slice(start, start + size)
            start += size
            for target, mult in ((acc, sc), (naive, 1.0 / plan.num_micro(r))):
                model.zero_grad()
                (torch.nn.functional.mse_loss(model(X[sl]), Y[sl]) * mult).backward()
                for a, g in zip(target, _grads(model)):
                    a += g / W                                           # DDP: sum / W
    for a, g in zip(acc, ref):
        torch.testing.assert_close(a, g, rtol=1e-12, atol=1e-14)
    assert any(not torch.allclose(a, g) for a, g in zip(naive, ref))    # unscaled is wrong


def test_token_scaling_single_process():
    assert token_loss_scale(0) == 0.0
    assert token_loss_scale(8) == pytest.approx(1 / 8)


def test_slow_down(monkeypatch):
    with slow_down(1.0) as s:
        emulated_work(1, 0.01)
    assert s.slept == 0.0
    t0 = time.perf_counter()
    with slow_down(3.0) as s:
        emulated_work(1, 0.02)
    dt = time.perf_counter() - t0
    assert s.slept == pytest.approx(2 * s.elapsed) and dt >= 3 * 0.02
    monkeypatch.setenv("HETCCL_SLOWDOWN", "2.5")
    assert slow_down().factor == 2.5
    calls = []
    f = slow_down(lambda x: calls.append(x) or x)
    assert f(4) == 4 and calls == [4]
    monkeypatch.setenv("HETCCL_SLOWDOWN", "0.5")
    with pytest.raises(ValueError):
        slow_down()
    monkeypatch.setenv("HETCCL_SLOWDOWN", "fast")
    with pytest.raises(ValueError, match="HETCCL_SLOWDOWN"):
        slow_down()


def test_token_scaling_exact_simulated():
    """Per-token losses over ranks with unequal token counts: SUM * (W / T), averaged over W
    ranks, equals the mean over all tokens of the global batch."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(11, 4).double()
    seqs = [torch.randint(0, 11, (n,)) for n in (3, 7, 1, 5, 2, 6)]
    ranks = [[0, 1], [2], [], [3, 4, 5]]                     # rank 2 has no sequences
    W = len(ranks)
    T = sum(len(s) for s in seqs)
    emb.zero_grad()
    torch.cat([emb(s).pow(2).sum(-1) for s in seqs]).mean().backward()
    ref = emb.weight.grad.clone()
    acc = torch.zeros_like(ref)
    for r in ranks:
        emb.zero_grad()
        t_r = sum(len(seqs[i]) for i in r)
        scale = W / T                                         # token_loss_scale(t_r) on W ranks
        for i in r:                                           # one micro-batch per sequence
            (emb(seqs[i]).pow(2).sum(-1).sum() * scale).backward()
        if emb.weight.grad is not None:
            acc += emb.weight.grad / W
        assert t_r >= 0
    torch.testing.assert_close(acc, ref, rtol=1e-12, atol=1e-14)


def test_slow_down_module_slows_forward_and_backward_and_keeps_gradients():
    from hetccl.balance.emulate import slow_down_module

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10)

        def get_input_embeddings(self):
            return self.emb

        def forward(self, input_ids, labels=None):
            logits = self.out(self.emb(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.view(-1, 10), labels.view(-1))
            return {"loss": loss, "logits": logits}

    x = torch.randint(0, 10, (3, 5))
    grads = []
    for f in (1.0, 3.0):
        torch.manual_seed(0)
        m = Tiny()
        h = slow_down_module(m, f)
        m(input_ids=x, labels=x)["loss"].backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        if f > 1:
            assert h.slow["fwd"].slept > 0 and h.slow["bwd"].slept > 0   # both passes slowed
            assert h.slow["bwd"].slept == pytest.approx(2 * h.slow["bwd"].elapsed)
            h.remove()
            with torch.no_grad():
                m(input_ids=x, labels=x)                                  # hooks gone
        else:
            assert h.slow == {} and len(h) == 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)                  # identity marks


def test_probe_max_micro_finds_the_oom_threshold():
    from hetccl.balance import probe_max_micro
    calls = []

    def step(b, fits=37):
        calls.append(b)
        if b > fits:
            raise torch.OutOfMemoryError(f"{b} samples")

    assert probe_max_micro(step, 256) == 37
    assert len(calls) <= 2 * 8 + 2 and max(calls) <= 256
    assert probe_max_micro(step, 20) == 20                        # the limit fits
    assert probe_max_micro(step, 256, margin=0.1) == 33           # floor(37 * 0.9)
    assert probe_max_micro(lambda b: step(b, fits=0), 64) == 0    # nothing fits
    with pytest.raises(ValueError, match="boom"):                 # other errors propagate
        probe_max_micro(lambda b: (_ for _ in ()).throw(ValueError("boom")), 8)
    with pytest.raises(ValueError):
        probe_max_micro(step, 0)
