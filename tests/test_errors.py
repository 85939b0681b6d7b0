"""Bad input across vendors: a clear error on every rank, never a hang or a wrong result."""
from __future__ import annotations

import pytest

from hetccl.launch import spawn

import error_cases


@pytest.mark.parametrize("split", ["2+1"])
def test_bad_input_errors_on_every_rank(split):
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(error_cases.run, world, vendors=split, timeout=240)
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert len(per_rank[0]) >= 8
    assert not bad, "\n".join(f"rank {r} {k}: {v}" for (r, k), v in sorted(bad.items()))
