"""Point-to-point messages of device data through the C++ engine (PlanSpec::message,
csrc/engine_messages.cc) between two real processes, over every transport this build has, on
the emulated device (streams are host threads that run the enqueued waits, copies and flag
writes in order: csrc/device_ops.h).

What is checked, on random data:
  * many messages of every size class, both directions, issued before any stream work ran
    (issuing never waits), arrive intact;
  * matching is the transports' rule, FIFO per (peer, tag): two messages of one tag arrive in
    posting order, and receives of two tags posted in the opposite order to the sends match
    by tag;
  * a message is wire-identical to a host message of its tag: a device send is received by a
    plain Transport.irecv, a plain Transport.isend by a device receive;
  * messages are independent of the plans on the link: a rank that posts a collective plan
    before its message and a peer that posts them the other way round both complete;
  * a send and a receive with the same peer in either order do not wait for each other (the
    pattern isend/irecv to one neighbour, posted alike on both ranks);
  * more messages in flight than one page of flag words (the slots grow);
  * a size mismatch breaks the receiving engine with a message naming both sizes, and its
    stream is released (never a hang);
  * a message sent just before its engine closes still arrives (close drains: Engine.drain).
"""
from __future__ import annotations

import functools
import time
import traceback

import pytest
import torch

from hetccl import tags
from hetccl._core import _C
from hetccl.launch import spawn
from test_engine import TIMEOUT_MS, _engine, _post
from test_transport import _connect, _opts

NAMES = _C.transport_names()
SIZES = [0, 1, 4099, (1 << 20) + 3, 5 << 20]


def _msg(e, peer, send, t, tag, S, what="p2p"):
    return e.post([(peer, send, t.data_ptr(), t.numel() * t.element_size())], tags.p2p(tag), 0,
                  "sum", "uint8", False, False, 0, TIMEOUT_MS, what, False, [], 0, "", False, 0,
                  False, True, 0, S, 0, message=True)


def _data(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def _settle(e, ops, streams, count0, want, within_s=30):
    for s in streams:
        ops.synchronize(s)
    deadline = time.monotonic() + within_s
    while e.stats().get("messages_done", 0) < count0 + want and time.monotonic() < deadline:
        if e.broken():
            return e.broken()
        time.sleep(0.005)
        for s in streams:
            ops.synchronize(s)
    got = e.stats().get("messages_done", 0) - count0
    return "" if got >= want else f"{got} of {want} messages finished"


def _sizes_both_ways(e, ops, rank, peer):
    Ssend, Srecv = ops.emulated_stream(), ops.emulated_stream()
    c0 = e.stats().get("messages_done", 0)
    outs, ins = [], []
    t0 = time.monotonic()
    for k, n in enumerate(SIZES * 2):
        got = torch.zeros(n, dtype=torch.uint8)
        x = _data(1000 * rank + k, n)
        # rank 0 posts its receive first, rank 1 its send: either order works
        if rank == 0:
            _msg(e, peer, False, got, 7, Srecv)
            _msg(e, peer, True, x, 7, Ssend)
        else:
            _msg(e, peer, True, x, 7, Ssend)
            _msg(e, peer, False, got, 7, Srecv)
        outs.append(x)
        ins.append((k, n, got))
    issue_s = time.monotonic() - t0
    bad = _settle(e, ops, [Ssend, Srecv], c0, 2 * len(ins))
    if bad:
        return {"sizes": bad}
    res = {"sizes/issue_s": issue_s}
    for k, n, got in ins:
        res[f"sizes/{k}/{n}"] = "ok" if torch.equal(got, _data(1000 * peer + k, n)) else "wrong"
    return res


def _fifo_and_tags(e, ops, rank, peer):
    """Rank 0 sends A(tag 1), B(tag 1), C(tag 2); rank 1 receives tag 2 first, then tag 1 twice."""
    S = ops.emulated_stream()
    c0 = e.stats().get("messages_done", 0)
    a, b, c = _data(1, 3000), _data(2, 3000), _data(3, 5000)
    if rank == 0:
        for t, tag in ((a, 1), (b, 1), (c, 2)):
            _msg(e, peer, True, t, tag, S)
        bad = _settle(e, ops, [S], c0, 3)
        return bad or "ok"
    gc, ga, gb = torch.zeros(5000, dtype=torch.uint8), torch.zeros(3000, dtype=torch.uint8), \
        torch.zeros(3000, dtype=torch.uint8)
    for t, tag in ((gc, 2), (ga, 1), (gb, 1)):
        _msg(e, peer, False, t, tag, S)
    bad = _settle(e, ops, [S], c0, 3)
    if bad:
        return bad
    ok = torch.equal(gc, c) and torch.equal(ga, a) and torch.equal(gb, b)
    return "ok" if ok else "messages matched out of (peer, tag) FIFO order"


def _wire_identical(e, t, ops, rank, peer):
    """A device message and a plain transport message of the same tag match each other."""
    S = ops.emulated_stream()
    c0 = e.stats().get("messages_done", 0)
    x0, x1 = _data(11, 70_001), _data(12, 333)
    if rank == 0:
        _msg(e, peer, True, x0, 21, S)          # device send -> plain irecv
        got = torch.zeros(333, dtype=torch.uint8)
        _msg(e, peer, False, got, 22, S)        # plain isend -> device recv
        bad = _settle(e, ops, [S], c0, 2)
        return bad or ("ok" if torch.equal(got, x1) else "device receive of a plain send wrong")
    got = torch.zeros(70_001, dtype=torch.uint8)
    r = t.irecv(peer, got.data_ptr(), got.numel(), tags.p2p(21))
    s = t.isend(peer, x1.data_ptr(), x1.numel(), tags.p2p(22))
    r.wait(TIMEOUT_MS)
    s.wait(TIMEOUT_MS)
    return "ok" if torch.equal(got, x0) else "plain receive of a device send wrong"


def _independent_of_plans(e, ops, rank, peer):
    """Rank 0: message send, then a host exchange plan; rank 1: the plan, then the receive."""
    S = ops.emulated_stream()
    c0 = e.stats().get("messages_done", 0)
    m = _data(31, 100_000)
    x = _data(40 + rank, 4096)
    y = torch.zeros(4096, dtype=torch.uint8)
    items = [(peer, True, x.data_ptr(), 4096), (peer, False, y.data_ptr(), 4096)]
    if rank == 0:
        _msg(e, peer, True, m, 31, S)
        e.wait(_post(e, items, 3000))
        bad = _settle(e, ops, [S], c0, 1)
    else:
        e.wait(_post(e, items, 3000))
        got = torch.zeros(100_000, dtype=torch.uint8)
        _msg(e, peer, False, got, 31, S)
        bad = _settle(e, ops, [S], c0, 1)
        if not bad and not torch.equal(got, m):
            bad = "message wrong"
    if not bad and not torch.equal(y, _data(40 + peer, 4096)):
        bad = "plan's data wrong"
    return bad or "ok"


def _many_in_flight(e, ops, rank, peer):
    """More messages posted than one page of flag-word slots (512) before any stream runs."""
    S = ops.emulated_stream()
    c0 = e.stats().get("messages_done", 0)
    n = 700
    bufs = []
    for k in range(n):
        if rank == 0:
            x = _data(5000 + k, 17)
            _msg(e, peer, True, x, 50, S)
            bufs.append(x)
        else:
            g = torch.zeros(17, dtype=torch.uint8)
            _msg(e, peer, False, g, 50, S)
            bufs.append(g)
    bad = _settle(e, ops, [S], c0, n)
    if bad or rank == 0:
        return bad or "ok"
    wrong = [k for k in range(n) if not torch.equal(bufs[k], _data(5000 + k, 17))]
    return "ok" if not wrong else f"messages {wrong[:5]} wrong"


def _size_mismatch(e, ops, rank, peer):
    S = ops.emulated_stream()
    if rank == 0:
        x = _data(60, 100)
        _msg(e, peer, True, x, 60, S)
        ops.synchronize(S)
        time.sleep(0.5)
        return "ok"
    got = torch.zeros(200, dtype=torch.uint8)
    _msg(e, peer, False, got, 60, S)
    ops.synchronize(S)  # released when the engine breaks: never a hang
    deadline = time.monotonic() + 10
    while not e.broken() and time.monotonic() < deadline:
        time.sleep(0.01)
    msg = e.broken()
    try:
        _msg(e, peer, False, got, 61, S)
        later = "no error"
    except _C.CommError as err:
        later = str(err)
    ok = "carried 100 bytes, the receiving tensor has 200" in msg and later == msg
    return "ok" if ok else f"broken={msg!r} later={later!r}"


def _send_then_close(name, st, rank, peer):
    """A message sent and the sender's engine closed at once (an isend never waited for, then
    destroy_process_group): close() drains it, so the receiver still gets it."""
    t = _C.Transport(name, rank, 2, _opts())
    _connect(t, st, "drain", rank)
    e = _engine(t, rank)
    ops = _C.device_ops("emulated")
    e.set_device_ops(ops)
    S = ops.emulated_stream()
    x = _data(70, 3 << 20)
    try:
        if rank == 0:
            _msg(e, peer, True, x, 70, S)
            drained = e.drain(10_000)
            e.close()
            return "ok" if drained else f"drain gave up: {e.broken()!r}"
        got = torch.zeros(3 << 20, dtype=torch.uint8)
        _msg(e, peer, False, got, 70, S)
        bad = _settle(e, ops, [S], 0, 1)
        e.close()
        return bad or ("ok" if torch.equal(got, x) else "message wrong")
    finally:
        t.close()


def rank_main(ctx, name):
    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    res = {}
    t = _C.Transport(name, rank, 2, _opts())
    _connect(t, st, "main", rank)
    e = _engine(t, rank)
    ops = _C.device_ops("emulated")
    e.set_device_ops(ops)

    def attempt(key, fn):
        try:
            r = fn()
            if isinstance(r, dict):
                res.update(r)
            else:
                res[key] = r
        except BaseException:  # noqa: BLE001
            res[key] = traceback.format_exc()

    attempt("sizes", lambda: _sizes_both_ways(e, ops, rank, peer))
    attempt("fifo_and_tags", lambda: _fifo_and_tags(e, ops, rank, peer))
    attempt("wire_identical", lambda: _wire_identical(e, t, ops, rank, peer))
    attempt("independent_of_plans", lambda: _independent_of_plans(e, ops, rank, peer))
    attempt("many_in_flight", lambda: _many_in_flight(e, ops, rank, peer))
    res["stats"] = {k: v for k, v in e.stats().items() if k.startswith("message")}
    attempt("size_mismatch", lambda: _size_mismatch(e, ops, rank, peer))
    e.close()
    t.close()
    attempt("send_then_close", lambda: _send_then_close(name, st, rank, peer))
    return res


@functools.lru_cache(maxsize=None)
def _run(name):
    return spawn(rank_main, 2, args=(name,), timeout=300)


@pytest.mark.parametrize("name", NAMES)
def test_device_messages(name):
    per_rank = _run(name)
    for r, res in enumerate(per_rank):
        stats = res.pop("stats")
        issue_s = res.pop("sizes/issue_s", None)
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"{name} rank {r}: " + "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
        assert any(k.startswith("sizes/") for k in res)
        # per rank: 20 (sizes) + 3 (fifo) + 1 (plans) + 700 (in flight) messages, and rank 0's
        # two of the wire case, all through the engine's message path
        assert stats["messages"] == 724 + (2 if r == 0 else 0), stats
        assert stats["messages_done"] == stats["messages"], stats
        # twenty messages up to 5 MiB were issued without waiting for the streams
        assert issue_s is not None and issue_s < 5.0, issue_s
