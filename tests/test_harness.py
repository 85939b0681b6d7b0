"""The GPU suite's recorder (tests/test_gpu_suite.py recorded(), tests/gpu_cases.py
recorded_entry) on the CPU: a rank that hangs in a case leaves that case named as still
running, and its Python stack from just before the timeout names the call it is blocked in, so
a hang on the GPU box is diagnosed from one run."""
from __future__ import annotations

import time

from collective_cases import Cases
from test_gpu_suite import recorded


def _blocked_in_here(seconds: float) -> None:
    time.sleep(seconds)


def _cases(ctx, record=None):
    c = Cases(ctx.rank, ctx.world_size, record)
    c.run("first", lambda case: None)
    c.run("second", lambda case: _blocked_in_here(600) if ctx.rank == 1 else None)
    c.run("third", lambda case: None)


def test_a_hung_rank_names_its_case_and_call():
    t0 = time.monotonic()
    cases, failure = recorded(_cases, "1+1", {}, timeout=25)
    assert time.monotonic() - t0 < 60
    assert cases["first"] == {0: "ok", 1: "ok"}
    assert cases["second"][0] == "ok"
    assert cases["second"][1].startswith("no verdict: the rank started this case"), cases["second"]
    assert cases["third"] == {0: "ok"}, cases["third"]  # rank 1 never got there
    assert failure and "rank 1" in failure and "_blocked_in_here" in failure, failure
    assert "rank 0 " not in failure.split("stacks of the ranks")[1], failure  # rank 0 finished


def _spawned(ctx):
    if ctx.rank == 1:
        _blocked_in_here(600)
    return ctx.rank


def test_spawn_timeout_names_where_each_rank_is_blocked():
    """hetccl.launch.spawn's RankTimeout (every test that spawns ranks, e.g. test_gpu_ucx.py)
    carries the Python stacks of the ranks still running: the call rank 1 is blocked in."""
    import pytest

    from hetccl.launch import RankTimeout, spawn

    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as e:
        spawn(_spawned, 2, timeout=8)
    assert time.monotonic() - t0 < 40
    text = str(e.value)
    assert "ranks [1] did not finish" in text, text
    assert "rank 1 stacks at the timeout" in text and "_blocked_in_here" in text, text
    assert "rank 0 stacks" not in text, text  # rank 0 finished
