"""Every collective over the hetccl backend, on CPU, for several vendor splits, against
references (tests/collective_cases.py). One spawn per split; each case is its own test."""
from __future__ import annotations

import functools

import pytest

from hetccl.launch import spawn

import collective_cases

SPLITS = ["1+1", "2+1", "1+2+1", "2+2"]
# Small pipeline chunks so that multi-chunk paths run on test-sized tensors.
ENV = {"HETCCL_CHUNK_BYTES": "65536"}


@functools.lru_cache(maxsize=None)
def results(split: str) -> dict[str, dict[str, str]]:
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(collective_cases.run_all, world, vendors=split, env=ENV, timeout=420)
    merged: dict[str, dict[str, str]] = {}
    for r, res in enumerate(per_rank):
        for case, verdict in res.items():
            merged.setdefault(case, {})[r] = verdict
    return merged


@pytest.mark.parametrize("split", SPLITS)
def test_collectives(split):
    res = results(split)
    failed = {case: v for case, v in res.items() if any(x != "ok" for x in v.values())}
    # every family of collectives was exercised
    families = {case.split("/")[0] for case in res}
    assert {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
            "all_to_all_single", "all_to_all", "gather_scatter", "barrier",
            "object_collectives", "p2p", "coalescing_manager", "new_group"} <= families
    assert len(res) > 200
    assert not failed, f"{len(failed)} failing cases: {sorted(failed)[:40]}\n" + "\n".join(
        f"{case}: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(vs.items()) if v != "ok")
        for case, vs in sorted(failed.items())[:20])
