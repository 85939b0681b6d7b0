"""torch.distributed semantics across emulated vendors (issue 15): all_gather_coalesced's
layout, BAND/BOR/BXOR, sparse all-reduce and DDP with a sparse embedding, receive from any
source, torch's timeout wording, monitored_barrier, the backend name C++ callers see, the vendor
split with the rank passed to init_process_group, and the start line (tests/semantics_cases.py).
"""
from __future__ import annotations

import functools

import pytest

from hetccl.launch import spawn

import semantics_cases


@functools.lru_cache(maxsize=None)
def results(split: str) -> dict[str, dict[int, str]]:
    world = sum(int(x) for x in split.split("+"))
    # HETCCL_VENDOR_SPLIT, not per-rank HETCCL_VENDOR: the ranks find their label from the rank
    # they pass to init_process_group (semantics_cases.run_all removes RANK first).
    per_rank = spawn(semantics_cases.run_all, world, env={"HETCCL_VENDOR_SPLIT": split},
                     timeout=300)
    merged: dict[str, dict[int, str]] = {}
    for r, res in enumerate(per_rank):
        for case, verdict in res.items():
            merged.setdefault(case, {})[r] = verdict
    return merged


@pytest.mark.parametrize("split", ["1+1", "2+1", "1+1+1"])
def test_semantics(split):
    res = results(split)
    assert {"all_gather_coalesced/k=1", "bitwise/all", "sparse/all_reduce",
            "sparse/ddp_embedding", "any_source/all_to_all", "any_source/then_named",
            "timeout/wording", "monitored_barrier", "passthrough/identity", "refusal/one_rank",
            "refusal/at_the_call_on_one_rank", "work/exception_while_running",
            "avg/near_the_top_of_half_ranges",
            "vendor_split_without_RANK", "start_line", "lifetime/async_released",
            "lifetime/sync_released"} <= set(res)
    failed = {case: v for case, v in res.items() if any(x != "ok" for x in v.values())}
    assert not failed, "\n".join(
        f"{case}: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(vs.items()) if v != "ok")
        for case, vs in sorted(failed.items()))


@pytest.mark.parametrize("split,hosts", [("1+1", ""), ("2+1", ""), ("1+1", "1")])
def test_p2p_semantics(split, hosts):
    """Point-to-point works as torch documents them, across vendors (shared memory; with
    hosts emulated, tcp): posting order decides which receive gets which message whatever is
    waited first; futures complete without wait(); is_completed() means the data is there; a
    receive that timed out does not swallow the next message; Work.wait(timeout) raises once
    the timeout passes and the collective still completes (semantics_cases.py)."""
    world = sum(int(x) for x in split.split("+"))
    env = {"HETCCL_VENDOR_SPLIT": split, **({"HETCCL_EMULATE_HOSTS": hosts} if hosts else {})}
    per_rank = spawn(semantics_cases.run_p2p, world, env=env, timeout=180)
    assert set(per_rank[0]) == {"p2p/any_source_open_then_named", "p2p/future_and_is_completed",
                                "p2p/timeout_then_recv", "work/wait_with_timeout"}
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert not bad, "\n".join(f"rank {r} {k}: {v}" for (r, k), v in sorted(bad.items()))


@pytest.mark.parametrize("split", ["1+1+1", "2+1+1"])
def test_three_groups_agree_bit_for_bit(split):
    """With three or more vendor groups off the all-linked path (hosts emulated: tcp), every
    rank's all_reduce result has the same bits (the groups' sums are folded in group order),
    small (flat) and large (hier) tensors alike."""
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(semantics_cases.run_bitwise_agreement, world,
                     env={"HETCCL_VENDOR_SPLIT": split, "HETCCL_EMULATE_HOSTS": "1"}, timeout=180)
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert per_rank[0] and not bad, bad


def test_vendor_split_needs_a_rank(monkeypatch):
    """HETCCL_VENDOR_SPLIT without RANK and without a rank from the backend: a clear error, not
    a silent 'rank 0' that would put every process in one vendor group."""
    from hetccl import vendor

    monkeypatch.delenv("HETCCL_VENDOR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("HETCCL_VENDOR_SPLIT", "2+1")
    with pytest.raises(ValueError, match="RANK"):
        vendor.detect_vendor()
    assert [vendor.detect_vendor(rank=r) for r in range(3)] == ["v0", "v0", "v1"]
    with pytest.raises(ValueError, match="covers 3 ranks"):
        vendor.detect_vendor(rank=5)
    monkeypatch.setenv("RANK", "2")  # a launcher's RANK is the process's identity
    assert vendor.detect_vendor(rank=0) == "v1"


def test_timeout_wording_unit():
    from hetccl._core import CommTimeout
    from hetccl.backend import torch_timeout_wording

    e = torch_timeout_wording(CommTimeout("hetccl: timed out after 5 ms waiting for peer rank 1"))
    assert isinstance(e, CommTimeout) and isinstance(e, RuntimeError)
    assert str(e) == "hetccl: Timed out after 5 ms waiting for peer rank 1"
    assert str(torch_timeout_wording(CommTimeout("deadline passed"))) == \
        "Timed out: deadline passed"
    other = ValueError("timed out")
    assert torch_timeout_wording(other) is other
