"""DDP and FSDP2 over hetccl with mixed emulated vendors reproduce a single-process run.

Tolerance: fp32 training for 5 SGD steps against a float64 reference; the only differences
are summation order and fp32 rounding, bounded well below 1e-4 for these magnitudes."""
from __future__ import annotations

import pytest
import torch

from hetccl.launch import spawn

import training_cases


@pytest.mark.parametrize("runner,split", [("run_ddp", "2+1"), ("run_fsdp2", "1+1")])
def test_matches_reference(runner, split):
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(getattr(training_cases, runner), world, vendors=split, timeout=300)
    ref = training_cases.reference_params()
    init = [p.detach() for p in training_cases.make_model().parameters()]
    for r, params in enumerate(per_rank):
        assert len(params) == len(ref)
        for got, want, p0 in zip(params, ref, init):
            assert not torch.allclose(want, p0), "reference did not train"
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, r=r: f"rank {r}: {m}")
