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


def _p2p_after_timed_out_recv(ctx, nbytes):
    """Rank 1's recv from rank 0 times out (rank 0 has not sent yet); rank 0 sends afterwards.
    The transport must never write into that tensor after the failed wait -- the caller may
    have freed it, and a stale write into freed memory corrupts or crashes the process (seen
    with a recv that had timed out). Observed here by keeping the tensor: it stays zero. And
    the group keeps working: a p2p message of another tag and an all_reduce arrive intact."""
    import gc
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    n = nbytes // 4
    out = {}
    if ctx.rank == 1:
        y = torch.zeros(n)
        w = dist.irecv(y, 0, tag=5)
        try:
            w.wait(timeout=timedelta(seconds=1))
            out["timed_out"] = "no: the recv completed"
        except Exception as e:  # noqa: BLE001
            out["timed_out"] = "ok" if "imed out" in str(e) else f"{type(e).__name__}: {e}"
        del w
        gc.collect()
        dist.barrier()  # rank 0 sends only now
        z = torch.zeros(1000)
        dist.recv(z, 0, tag=6)
        out["later_message"] = "ok" if bool((z == 7).all()) else f"wrong: {z[:3].tolist()}"
        out["stale_buffer_untouched"] = "ok" if not bool(y.any()) else \
            "written after its wait had failed"
    else:
        dist.barrier()
        dist.send(torch.full((n,), 3.0), 1, tag=5)
        dist.send(torch.full((1000,), 7.0), 1, tag=6)
    x = torch.full((100,), float(ctx.rank + 1))
    dist.all_reduce(x)
    out["all_reduce"] = "ok" if bool((x == 3).all()) else f"wrong: {x[:3].tolist()}"
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_timed_out_recv_never_writes_into_freed_memory(transport):
    per_rank = spawn(_p2p_after_timed_out_recv, 2, args=(32 << 20,), vendors="1+1",
                     timeout=120, env={"HETCCL_TRANSPORT": transport})
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert "timed_out" in per_rank[1] and not bad, bad


def _unmatched_self_send(ctx):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    out = {}
    w = dist.isend(torch.ones(4), ctx.rank, tag=9)
    try:
        w.wait(timeout=timedelta(seconds=1))
        out["unmatched"] = "completed without a receive"
    except Exception as e:  # noqa: BLE001
        out["unmatched"] = "ok" if "itself" in str(e) and "tag 9" in str(e) else repr(e)
    y = torch.zeros(2)  # a size mismatch at the match: both works fail, naming the sizes
    r = dist.irecv(y, ctx.rank, tag=9)
    for name, work in (("send_mismatch", w), ("recv_mismatch", r)):
        try:
            work.wait()
            out[name] = "no error"
        except ValueError as e:
            out[name] = "ok" if "16 bytes" in str(e) and "8" in str(e) else repr(e)
    x = torch.ones(3)
    dist.all_reduce(x)
    out["group_usable"] = "ok" if bool((x == ctx.world_size).all()) else "wrong"
    dist.destroy_process_group()
    return out


def test_point_to_point_with_itself_fails_clearly():
    """A send to this rank itself that no receive matches times out naming the tag; a size
    mismatch at the match fails both works naming the sizes; the group stays usable."""
    per_rank = spawn(_unmatched_self_send, 2, vendors="1+1", timeout=120)
    bad = {(r, k): v for r, res in enumerate(per_rank) for k, v in res.items() if v != "ok"}
    assert len(per_rank[0]) == 4 and not bad, bad


def _host_receive_of_failed_collective(ctx):
    """Rank 0's all_gather times out (rank 1 comes 4 s late); rank 1 then sends its part. Host
    data on message links (tcp) goes straight into the caller's tensor, so the engine must have
    withdrawn that receive when the collective failed: rank 0's output keeps its old values."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    g = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    n = 1 << 18
    out = {}
    o = torch.full((2 * n,), -1.0)
    if ctx.rank == 1:
        time.sleep(4)
    try:
        dist.all_gather_into_tensor(o, torch.full((n,), float(ctx.rank + 1)), group=g)
        out["all_gather"] = "completed"
    except Exception as e:  # noqa: BLE001
        out["all_gather"] = "timed out" if "imed out" in str(e) else repr(e)[:300]
    if ctx.rank == 0:
        time.sleep(3)  # rank 1's data has arrived by now
        stats = g.engine.stats
        out["withdrawn"] = stats.get("withdrawn_receives", 0)
        out["left_in_flight"] = stats.get("left_in_flight", 0)
        out["untouched"] = bool((o[n:] == -1).all())
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_failed_collective_withdraws_its_host_receives():
    per_rank = spawn(_host_receive_of_failed_collective, 2, vendors="1+1", timeout=120,
                     env={"HETCCL_TRANSPORT": "tcp", "HETCCL_EMULATE_HOSTS": "1",
                          "HETCCL_CHECK_ARGS": "off"})
    r0 = per_rank[0]
    assert r0["all_gather"] == "timed out", per_rank
    assert r0["withdrawn"] >= 1 and r0["left_in_flight"] == 0, per_rank
    assert r0["untouched"], f"rank 1's data was written after the collective failed: {per_rank}"
