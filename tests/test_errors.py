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


def _any_source_then_other_sizes(ctx, first: int):
    """Rank 0 receives from any source (ranks 1 and 2 could both send); rank `first`'s message
    wins. The other rank then sends larger messages with the same tag, which rank 0 receives by
    source and from any source: the receive posted to it for the first one must not take them
    (it is withdrawn as if never posted; before, the larger messages overran it: a size
    error)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=30))
    other = 3 - first
    out = {}
    if ctx.rank == 0:
        y = torch.zeros(10)  # smaller than the other rank's later messages
        src = dist.recv(y, src=None, tag=7)
        out["first"] = "ok" if src == first and bool((y == 1).all()) else f"src {src} {y[:2]}"
        dist.barrier()
        z = torch.zeros(50)
        dist.recv(z, src=other, tag=7)
        out["by_source"] = "ok" if bool((z == 2).all()) else f"{z[:2]}"
        u = torch.zeros(30)
        src = dist.recv(u, src=None, tag=7)
        out["any_again"] = "ok" if src == other and bool((u == 3).all()) else f"src {src} {u[:2]}"
    elif ctx.rank == first:
        dist.send(torch.ones(10), 0, tag=7)
        dist.barrier()
    else:
        dist.barrier()
        dist.send(torch.full((50,), 2.0), 0, tag=7)
        dist.send(torch.full((30,), 3.0), 0, tag=7)
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("split,first,transport", [("1+1+1", 1, "shm"), ("1+1+1", 1, "tcp"),
                                                   ("2+1", 2, "auto")])
def test_any_source_leaves_no_receive_posted(split, first, transport):
    """1+1+1: the leftover receive is at a cross-vendor peer (shm; tcp between emulated
    hosts). 2+1: rank 2's message wins and the leftover is at rank 1, rank 0's same-vendor
    peer, linked by shared memory for host tensors on one host (bridge.group_links)."""
    env = {"HETCCL_TRANSPORT": transport}
    if transport == "tcp":
        env["HETCCL_EMULATE_HOSTS"] = "1"
    per_rank = spawn(_any_source_then_other_sizes, 3, args=(first,), vendors=split,
                     timeout=120, env=env)
    bad = {k: v for k, v in per_rank[0].items() if v != "ok"}
    assert len(per_rank[0]) == 3 and not bad, per_rank[0]


def _message_before_orderly_close(ctx):
    """Rank 0 sends and leaves at once (destroy_process_group); rank 1 receives only after rank
    0's transport has closed. The message arrived whole before the close: it must be
    delivered, not failed with "closed the connection" (a rank that finished its part of the
    last collective may close before its peer has posted the receive of its last message)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=30))
    out = {}
    if ctx.rank == 0:
        dist.send(torch.full((5000,), 4.0), 1, tag=3)
        dist.destroy_process_group()
        return out
    time.sleep(2)
    y = torch.zeros(5000)
    try:
        dist.recv(y, 0, tag=3)
        out["delivered"] = "ok" if bool((y == 4).all()) else f"wrong {y[:2]}"
    except Exception as e:  # noqa: BLE001
        out["delivered"] = f"{type(e).__name__}: {e}"
    try:
        dist.recv(y, 0, tag=3)  # nothing more was sent: fails naming the closed peer
        out["next_fails"] = "received a message that was never sent"
    except Exception as e:  # noqa: BLE001
        out["next_fails"] = "ok" if "closed" in str(e) else f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_message_that_arrived_before_an_orderly_close_is_delivered(transport):
    env = {"HETCCL_TRANSPORT": transport}
    if transport == "tcp":
        env["HETCCL_EMULATE_HOSTS"] = "1"
    per_rank = spawn(_message_before_orderly_close, 2, vendors="1+1", timeout=120, env=env)
    assert per_rank[1] == {"delivered": "ok", "next_fails": "ok"}, per_rank[1]
