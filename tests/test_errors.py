"""Bad input across vendors: a clear error on every rank, never a hang or a wrong result."""
from __future__ import annotations

import pytest

from hetccl.launch import spawn

import error_cases


@pytest.mark.parametrize("split,links", [("2+1", "auto"), ("2+1", "off"), ("2+2", "auto"),
                                         ("4+4", "auto")])
def test_bad_input_errors_on_every_rank(split, links):
    """links: HETCCL_GROUP_LINKS (2+1 on one host: the check over the same-vendor links, or
    with them off the native all-gather inside the vendor group)."""
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(error_cases.run, world, vendors=split, timeout=300,
                     env={"HETCCL_GROUP_LINKS": links})
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert len(per_rank[0]) >= 8
    assert not bad, "\n".join(f"rank {r} {k}: {v}" for (r, k), v in sorted(bad.items()))


def _init_with_settings(ctx):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    try:
        dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=30))
        dist.all_reduce(torch.ones(4))
        return "no error"
    except ValueError as e:
        return str(e)


def test_settings_that_must_agree_are_checked_at_start():
    """Ranks started with different HETCCL_CHUNK_BYTES / HETCCL_HOST_KERNEL get one clear error
    naming the settings, their values and ranks (not a timeout inside a collective)."""
    per_rank = spawn(_init_with_settings, 2, vendors="1+1", timeout=120,
                     rank_env=[{"HETCCL_CHUNK_BYTES": "65536"}, {"HETCCL_HOST_KERNEL": "0"}])
    for r, msg in enumerate(per_rank):
        assert "HETCCL_CHUNK_BYTES: 65536 on ranks [0], 0 on ranks [1]" in msg, (r, msg)
        assert "HETCCL_HOST_KERNEL: true on ranks [0], false on ranks [1]" in msg, (r, msg)
    assert per_rank[0] == per_rank[1]
