"""The C++ progress engine (hetccl._C.Engine, csrc/engine.h) between two real processes, over
every transport this build has: zero-copy links (shm) and message links (tcp, ucx).

What is checked, on random data against references computed independently (test_reduce):
  * copy exchange: every size class (0, 1, odd, chunk boundaries, many ring wrap-arounds);
  * reduce exchange where the memory sent is the memory reduced into (the engine's ordering
    contract: no receive touches memory before every send reading it has left), every dtype x op,
    bit-exact, both ranks identical;
  * round trip (zero-copy links): the host pair all-reduce, every dtype x op x shape;
  * the latency path (one chunk) and the bandwidth path (pipelined small chunks) give the same
    bytes on the same data;
  * several plans posted before any is waited for complete in order;
  * argument headers: a mismatch raises the same ArgMismatch text on both ranks before any data
    moves, and the engine stays usable;
  * errors: a peer that never posts -> "Timed out" naming it; a peer that dies mid-plan ->
    PeerFailure naming it, within the timeout; later posts fail at once;
  * device plans, on the emulated device (csrc/device_ops.h: streams are host threads that run
    the enqueued waits, copies and flag writes in order): many plans issued before any stream
    work ran (issue never waits), ring wrap-around, both copy streams, message-link staging;
    an argument mismatch found asynchronously breaks the engine and releases the streams;
  * the direct device path (device memory handed to a transport that takes it, UCX): the same
    device cases with every byte going through isend_device/irecv_device (stats prove it), the
    stream held until the data has landed, mixed host and device plans on one link, and the
    refusals (a transport without device memory, a plan receiving into memory it sends).
"""
from __future__ import annotations

import functools
import os
import time
import traceback

import pytest
import torch

from hetccl import checks, tuning
from hetccl._core import _C
from hetccl.launch import spawn
from test_reduce import DTYPES, OPS, _rand, _reference, _same
from test_transport import _barrier, _connect, _opts

NAMES = _C.transport_names()
TIMEOUT_MS = 15_000
COPY_SIZES = [0, 1, 4099, (1 << 20) + 3, 5 << 20]
# (give elements of rank 0, keep elements of rank 0); rank 1 mirrors them
SHAPES = [(0, 0), (1, 0), (0, 1), (1, 1), (1000, 1001), (70_001, 69_999), (300_000, 300_001)]


def _engine(t, rank, force_chunk=0, direct=False):
    peer = 1 - rank
    return _C.Engine({peer: t}, rank, 1, [peer], [[0], [1]], [0, 1], checks.FIELD_NAMES,
                     1 << 20, 8, 8, tuning.HOST, tuning.DEVICE, tuning.MESSAGE, force_chunk, False,
                     [peer] if direct else [])


def _post(e, items, tag, op=None, dtype="uint8", roundtrip=False, chunk=0, timeout=TIMEOUT_MS,
          header=None, error="", wait_check=True, what="test", streams=None):
    check = header is not None
    dev = streams is not None
    return e.post(items, tag << 16, 13, op or "sum", dtype, op is not None, roundtrip, chunk,
                  timeout, what, check, list(header or []), checks.MASK_ALL, error, True,
                  (tag << 16) | 0xFFFF, wait_check, dev, 0, streams[0] if dev else 0,
                  streams[1] if dev else 0)


def _b(t):
    return t.numel() * t.element_size()


def _exchange_cases(e, rank, peer, tag0):
    """Copy exchange over every size, then reduce-in-place exchange over every dtype x op."""
    out = {}
    tag = tag0
    for n in COPY_SIZES:
        mine = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n + rank),
                             dtype=torch.uint8)
        theirs = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n + peer),
                               dtype=torch.uint8)
        got = torch.empty(n, dtype=torch.uint8)
        tag += 1
        e.wait(_post(e, [(peer, True, mine.data_ptr(), n), (peer, False, got.data_ptr(), n)], tag))
        out[f"copy/{n}"] = "ok" if torch.equal(got, theirs) else "wrong bytes"
    for dname, dtype in DTYPES.items():
        for op in OPS:
            n = 200_003
            a = _rand(dtype, n, 11)
            b = _rand(dtype, n, 12)
            x = (a if rank == 0 else b).clone()
            tag += 1
            # the same memory is sent and reduced into: the engine must send every chunk of x
            # before the peer's chunk of the same range is reduced into it
            e.wait(_post(e, [(peer, True, x.data_ptr(), _b(x)), (peer, False, x.data_ptr(), _b(x))],
                         tag, op=op, dtype=dname))
            ref = _reference(op, a, b) if rank == 0 else _reference(op, b, a)
            out[f"reduce/{dname}/{op}"] = "ok" if _same(x, ref) else "wrong result"
    return out, tag


def _roundtrip_cases(e, rank, peer, tag0):
    out = {}
    tag = tag0
    for dname, dtype in DTYPES.items():
        for op in OPS:
            for si, (g0, k0) in enumerate(SHAPES):
                n = g0 + k0
                a = _rand(dtype, n, 1000 + si)
                b = _rand(dtype, n, 2000 + si)
                x = (a if rank == 0 else b).clone()
                give, keep = (x[:g0], x[g0:]) if rank == 0 else (x[g0:], x[:g0])
                tag += 1
                items = [i for i in [(peer, True, give.data_ptr(), _b(give)),
                                     (peer, False, keep.data_ptr(), _b(keep))] if i[3]]
                e.wait(_post(e, items, tag, op=op, dtype=dname, roundtrip=True,
                             chunk=tuning.ROUNDTRIP_CHUNK if si % 2 else 4096))
                ref = torch.cat([_reference(op, b[:g0], a[:g0]), _reference(op, a[g0:], b[g0:])])
                out[f"roundtrip/{dname}/{op}/{si}"] = "ok" if _same(x, ref) else "wrong result"
    return out, tag


def _paths_agree(t, rank, peer, tag0, st, name):
    """The latency path (one chunk) and the bandwidth path (4 KiB chunks) on the same data."""
    res = []
    for k, force in enumerate((1 << 30, 4096)):
        e = _engine(t, rank, force_chunk=force) if force != 1 << 30 else _engine(t, rank)
        x = _rand(torch.float32, 50_001, 5 + rank)
        e.wait(_post(e, [(peer, True, x.data_ptr(), _b(x)), (peer, False, x.data_ptr(), _b(x))],
                     tag0 + k, op="sum", dtype="float32"))
        res.append(x)
        e.close()
    return "ok" if _same(res[0], res[1]) else "latency and bandwidth paths differ"


def _many_in_flight(e, rank, peer, tag0):
    """Eight plans posted before any wait; waited in reverse order."""
    xs = [torch.full((30_000 + k,), float(rank + k)) for k in range(8)]
    ids = [_post(e, [(peer, True, x.data_ptr(), _b(x)), (peer, False, x.data_ptr(), _b(x))],
                 tag0 + k, op="sum", dtype="float32") for k, x in enumerate(xs)]
    for i in reversed(ids):
        e.wait(i)
    ok = all(bool((x == float(2 * k + 1)).all()) for k, x in enumerate(xs))
    return "ok" if ok else "wrong"


def _header_mismatch(e, rank, peer, tag0):
    h = [1, 100 + rank, 1, 1, -1, 1]  # element counts differ
    x = torch.ones(10)
    try:
        _post(e, [(peer, True, x.data_ptr(), 40), (peer, False, x.data_ptr(), 40)], tag0,
              op="sum", dtype="float32", header=h)
        return "no error", ""
    except _C.ArgMismatch as err:
        text = str(err)
    # still usable: a correct plan right after
    y = torch.full((1000,), float(rank))
    e.wait(_post(e, [(peer, True, y.data_ptr(), 4000), (peer, False, y.data_ptr(), 4000)],
                 tag0 + 1, op="sum", dtype="float32", header=[1, 1000, 1, 1, -1, 1]))
    ok = "number of elements differs across ranks (ranks [0]: 100; ranks [1]: 101)" in text
    return ("ok" if ok and bool((y == 1.0).all()) else f"text/usable wrong: {text}"), text


def _device_cases(e, rank, peer, tag0, dev=None):
    """Device plans on the emulated device: issue many, then let the streams run. dev: the
    (ops, S, Sd) of an earlier call on the same engine."""
    if dev is None:
        ops = _C.device_ops("emulated")
        e.set_device_ops(ops)
        S, Sd = ops.emulated_stream(), ops.emulated_stream()
    else:
        ops, S, Sd = dev
    plans0 = e.stats().get("plans_device", 0)
    checks0 = e.stats().get("checks_async", 0)
    out = {}
    sizes = [1, 4099, 3 << 20, 20 << 20]  # the last wraps the 8-slot rings several times
    xs, gots = [], []
    t0 = time.monotonic()
    for k, n in enumerate(sizes * 2):
        x = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(k * 2 + rank),
                          dtype=torch.uint8)
        got = torch.zeros(n, dtype=torch.uint8)
        _post(e, [(peer, True, x.data_ptr(), n), (peer, False, got.data_ptr(), n)], tag0 + k,
              header=[1, n, 6, 0, -1, 2], wait_check=k < len(sizes), streams=(S, Sd))
        xs.append(x)
        gots.append(got)
    out["device/issue_s"] = time.monotonic() - t0
    ops.synchronize(S)
    ops.synchronize(Sd)
    deadline = time.monotonic() + 30
    while e.stats().get("plans_device", 0) < plans0 + len(xs) and time.monotonic() < deadline:
        time.sleep(0.01)
    for k, n in enumerate(sizes * 2):
        theirs = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(k * 2 + peer),
                               dtype=torch.uint8)
        out[f"device/{k}/{n}"] = "ok" if torch.equal(gots[k], theirs) else "wrong bytes"
    # the first plan of each size is checked before data moves, the repeat asynchronously
    out["device/async_checks"] = "ok" if e.stats().get("checks_async", 0) - checks0 == \
        len(sizes) else f"stats {e.stats()}"
    return out, (ops, S, Sd)


def _broken_after_streams(e, ops, S, Sd, within_s: float = 10) -> str:
    """Both streams return (the engine releases every wait when it breaks); then e.broken()
    once it is set, or "" after within_s."""
    ops.synchronize(S)
    ops.synchronize(Sd)
    deadline = time.monotonic() + within_s
    while not e.broken() and time.monotonic() < deadline:
        time.sleep(0.01)
    return e.broken()


def _device_async_mismatch(e, rank, peer, tag0, dev):
    """A mismatch found after issue: the engine breaks, the streams are released, the next post
    raises the same error."""
    ops, S, Sd = dev
    n = 1 << 20
    x = torch.ones(n + rank, dtype=torch.uint8)
    got = torch.zeros(n + rank, dtype=torch.uint8)
    _post(e, [(peer, True, x.data_ptr(), n + rank), (peer, False, got.data_ptr(), n + rank)], tag0,
          header=[1, n + rank, 6, 0, -1, 2], wait_check=False, streams=(S, Sd))
    msg = _broken_after_streams(e, ops, S, Sd)
    try:
        _post(e, [(peer, True, x.data_ptr(), 4)], tag0 + 1)
        later = "no error"
    except _C.CommError as err:
        later = str(err)
    ok = "number of elements differs" in msg and later == msg
    return "ok" if ok else f"broken={msg!r} later={later!r}"


def _earlier_plan_mismatch(e, rank, peer, tag0, dev):
    """HETCCL_CHECK_ARGS=async: a device plan whose ranks disagree (here on the root, as a
    broadcast whose ranks name different roots: each rank sends, none receives) returns before
    its headers are compared, and its peer's data stays in the ring; the next plan, whose own
    headers agree, meets that data. The verdict must still name what differs (the earlier
    plan's headers), on both ranks -- not a bare chunk-size complaint."""
    ops, S, Sd = dev
    x = torch.ones(64, dtype=torch.uint8)
    _post(e, [(peer, True, x.data_ptr(), 64)], tag0, header=[4, 64, 6, 0, rank, 2],
          wait_check=False, streams=(S, Sd))
    y = torch.ones(4000, dtype=torch.uint8)
    got = torch.zeros(4000, dtype=torch.uint8)
    try:
        _post(e, [(peer, True, y.data_ptr(), 4000), (peer, False, got.data_ptr(), 4000)],
              tag0 + 1, header=[1, 4000, 6, 1, -1, 2], wait_check=False, streams=(S, Sd))
    except _C.CommError as err:  # the first plan's headers were compared already: refused
        return "ok" if "root differs" in str(err) else f"second post: {err}"
    msg = _broken_after_streams(e, ops, S, Sd)
    return "ok" if "root differs" in msg else f"broken={msg!r}"


def _verdict_before_next_call(e, rank, peer, tag0, dev):
    """HETCCL_CHECK_ARGS=async, a broadcast whose ranks name different roots (each sends, none
    receives), rank 1 issuing it 0.5 s late: rank 0's stream must not pass the plan before its
    headers are compared (the verdict word, csrc/engine.h), so once the rank has synchronized
    its stream its next post raises the mismatch. Without that wait rank 0's stream finished
    with its copy, its next collective was issued on a healthy engine, and that one's receives
    were released with stale data when the engine broke under it: a wrong value, no error
    (the GPU suite's test_bad_input_async_checks 1+1+1 root)."""
    ops, S, Sd = dev
    if rank == 1:
        time.sleep(0.5)
    x = torch.ones(64, dtype=torch.uint8)
    t0 = time.monotonic()
    _post(e, [(peer, True, x.data_ptr(), 64)], tag0, header=[4, 64, 6, 0, rank, 2],
          wait_check=False, streams=(S, Sd))
    ops.synchronize(S)
    ops.synchronize(Sd)
    waited = time.monotonic() - t0
    y = torch.ones(4000, dtype=torch.uint8)
    got = torch.zeros(4000, dtype=torch.uint8)
    try:
        _post(e, [(peer, True, y.data_ptr(), 4000), (peer, False, got.data_ptr(), 4000)],
              tag0 + 1, header=[1, 4000, 6, 1, -1, 2], wait_check=False, streams=(S, Sd))
    except _C.CommError as err:
        return "ok" if "root differs" in str(err) else f"next post: {err}"
    ops.synchronize(S)  # its copies land in `got` before it is freed
    ops.synchronize(Sd)
    return (f"the next post was accepted after the stream passed the mismatching plan "
            f"({waited:.2f} s after its issue)")


def _mixed_wait_mismatch(e, rank, peer, tag0, dev):
    """Rank 0 holds its data for the check (wait_check), rank 1 does not (HETCCL_CHECK_ARGS=async
    on its device tensors): rank 0 raises the mismatch at the call, and both engines end broken
    with that text, so neither rank's next call waits for the other (checks.py's contract)."""
    ops, S, Sd = dev
    n = 4096 + rank
    x = torch.ones(n, dtype=torch.uint8)
    got = torch.zeros(n, dtype=torch.uint8)
    raised = ""
    try:
        _post(e, [(peer, True, x.data_ptr(), n), (peer, False, got.data_ptr(), n)], tag0,
              header=[1, n, 6, 0, -1, 2], wait_check=rank == 0, streams=(S, Sd))
    except _C.ArgMismatch as err:
        raised = str(err)
    msg = _broken_after_streams(e, ops, S, Sd)
    want = "number of elements differs across ranks (ranks [0]: 4096; ranks [1]: 4097)"
    if rank == 0 and want not in raised:
        return f"rank 0 did not raise at the call: {raised!r}"
    if rank == 1 and raised:
        return f"rank 1 raised at the call although it did not wait: {raised!r}"
    return "ok" if want in msg else f"broken={msg!r}"


def rank_main(ctx, name):
    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    res = {}
    t = _C.Transport(name, rank, 2, _opts())
    _connect(t, st, "main", rank)
    e = _engine(t, rank)

    def attempt(key, fn):
        try:
            r = fn()
            if isinstance(r, dict):
                res.update(r)
            else:
                res[key] = r
        except BaseException:  # noqa: BLE001
            res[key] = traceback.format_exc()

    state = {"tag": 100}

    def exch():
        out, state["tag"] = _exchange_cases(e, rank, peer, state["tag"])
        return out

    attempt("exchange", exch)
    if t.zc_supported:
        def rt():
            out, state["tag"] = _roundtrip_cases(e, rank, peer, state["tag"] + 1)
            return out
        attempt("roundtrip", rt)
    attempt("in_flight", lambda: _many_in_flight(e, rank, peer, 700))
    hdr = {}

    def mism():
        verdict, hdr["text"] = _header_mismatch(e, rank, peer, 800)
        return verdict
    attempt("header_mismatch", mism)
    res["header_text"] = hdr.get("text", "")
    dev = {}

    def devc():
        out, dev["d"] = _device_cases(e, rank, peer, 1000)
        res["device_issue_s"] = out.pop("device/issue_s")
        return out
    attempt("device", devc)
    if "d" in dev:
        attempt("device_async_mismatch",
                lambda: _device_async_mismatch(e, rank, peer, 1100, dev["d"]))
    _barrier(st, "done/main", rank)  # nobody closes before both have their verdicts
    e.close()
    t.close()
    # a fresh pair: the mismatch above left the rings out of step, as a failed collective does
    t2 = _C.Transport(name, rank, 2, _opts())
    _connect(t2, st, "fresh", rank)
    attempt("paths_agree", lambda: _paths_agree(t2, rank, peer, 900, st, name))
    t2.close()
    ops = _C.device_ops("emulated")

    def on_fresh_engine(key, case, tag0):
        """case(e, rank, peer, tag0, dev) on a fresh transport pair and engine (each mismatch
        case leaves its rings out of step)."""
        t = _C.Transport(name, rank, 2, _opts())
        _connect(t, st, key, rank)
        e = _engine(t, rank)
        e.set_device_ops(ops)
        attempt(case.__name__.lstrip("_"), lambda: case(
            e, rank, peer, tag0, (ops, ops.emulated_stream(), ops.emulated_stream())))
        _barrier(st, f"done/{key}", rank)  # nobody closes before both have their verdicts
        e.close()
        t.close()

    on_fresh_engine("mixed", _mixed_wait_mismatch, 1200)
    on_fresh_engine("earlier", _earlier_plan_mismatch, 1300)
    on_fresh_engine("verdict", _verdict_before_next_call, 1400)
    return res


@functools.lru_cache(maxsize=None)
def _run(name):
    return spawn(rank_main, 2, args=(name,), timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_engine_paths(name):
    per_rank = _run(name)
    for r, res in enumerate(per_rank):
        bad = {k: v for k, v in res.items()
               if v != "ok" and k not in ("header_text", "device_issue_s")}
        assert not bad, f"{name} rank {r}: " + "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
        assert any(k.startswith("reduce/") for k in res)
        assert any(k.startswith("device/") for k in res)
        # eight device plans (48 MiB each way) were issued without waiting for the streams
        assert res["device_issue_s"] < 5.0, res["device_issue_s"]
    assert per_rank[0]["header_text"] == per_rank[1]["header_text"]


# ------------------------------------------------------------------ failures
def _failure_rank(ctx, name, how):
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    t = _C.Transport(name, rank, 2, _opts())
    _connect(t, st, "f", rank)
    e = _engine(t, rank)
    x = torch.ones(8 << 20)  # 32 MiB: many chunks in flight when the peer goes
    if rank == 1:
        if how == "die":
            # start the transfer, then die in the middle of it
            _post(e, [(peer, True, x.data_ptr(), _b(x))], 5)
            time.sleep(0.05)
            os._exit(3)
        time.sleep(4)  # "silent": never posts
        return "slept"
    t0 = time.monotonic()
    try:
        e.wait(_post(e, [(peer, False, x.data_ptr(), _b(x))], 5, timeout=2500))
        return "no error"
    except _C.CommError as err:
        took = time.monotonic() - t0
        kind = type(err).__name__
        later = "no error"
        try:
            _post(e, [(peer, True, x.data_ptr(), 4)], 6)
        except _C.CommError as err2:
            later = str(err2)
        return {"kind": kind, "msg": str(err), "took": took, "later": later}
    finally:
        e.close()
        t.close()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["silent", "die"])
def test_engine_failures(name, how):
    res = spawn(_failure_rank, 2, args=(name, how), timeout=120, may_die=[1])[0]
    assert isinstance(res, dict), res
    if how == "silent":
        assert res["kind"] == "CommTimeout", res
        assert "Timed out" in res["msg"] and "peer rank 1" in res["msg"], res
    else:
        assert res["kind"] in ("PeerFailure", "CommTimeout"), res
        assert "rank 1" in res["msg"], res
        if name == "shm":  # pid liveness: noticed well within the timeout
            assert res["kind"] == "PeerFailure" and res["took"] < 2.0, res
    assert res["later"] == res["msg"], res  # the engine stays broken with the first error


# ------------------------------------------------------------------ direct device path
def _direct_rank(ctx, variant):
    """The device cases over the direct path (UCX's isend_device/irecv_device; the emulated
    device's memory is host memory, which UCX detects as such), then a host plan on the same
    link, then the device cases again: positions and flag words stay in step across kinds."""
    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    res = {}
    t = _C.Transport("ucx", rank, 2, _opts(lanes=2))
    _connect(t, st, "direct", rank)
    e = _engine(t, rank, direct=True)
    try:
        out, dev = _device_cases(e, rank, peer, 1000)
        res["issue_s"] = out.pop("device/issue_s")
        res.update(out)
        y = torch.full((100_000,), float(rank + 1))
        e.wait(_post(e, [(peer, True, y.data_ptr(), _b(y)), (peer, False, y.data_ptr(), _b(y))],
                     1200, op="sum", dtype="float32"))
        res["host_between"] = "ok" if bool((y == 3.0).all()) else "wrong"
        out2, _ = _device_cases(e, rank, peer, 1300, dev)
        out2.pop("device/issue_s")
        res.update({f"again/{k}": v for k, v in out2.items()})
        res["stats"] = dict(e.stats())
        res["async_mismatch"] = _device_async_mismatch(e, rank, peer, 1500, dev)
    except BaseException:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    e.close()
    t.close()
    return res


@pytest.mark.skipif("ucx" not in NAMES, reason="hetccl._C built without the UCX transport")
def test_engine_device_direct():
    per_rank = spawn(_direct_rank, 2, args=("tcp",), env={"UCX_NET_DEVICES": "lo"}, timeout=300)
    for r, res in enumerate(per_rank):
        stats = res.pop("stats", {})
        issue = res.pop("issue_s", None)
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"rank {r}: " + "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
        # every device byte went straight to the transport; none through the staging slots
        assert stats.get("msg_device_direct_bytes", 0) > 0, stats
        assert stats.get("msg_device_direct_bytes_in", 0) > 0, stats
        assert stats.get("msg_device_bytes", 0) == 0 and stats.get("msg_device_bytes_in", 0) == 0
        assert issue is not None and issue < 5.0, issue  # issue never waited for the data


# ------------------------------------------------------------------ message bound (UCX)
def _message_limit_rank(ctx, lanes):
    """Each rank publishes its own bound (a page and a bit, two and a half pages): both take
    the smaller, whole pages (Transport::message_limit); the engine cuts host data on the link
    into equal page-rounded chunks under it (the engine's counts of sent host chunks), and
    every copy and reduce case still gives the reference's bytes."""
    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    res = {}
    t = _C.Transport("ucx", rank, 2, _opts(lanes=lanes, lane_threads="on",
                                           max_message=4096 + 100 if rank == 0 else 10240))
    _connect(t, st, f"limit{lanes}", rank)
    res["limit"] = t.message_limit(peer)
    res["own"] = t.info()["max_message"]
    res["spin_us"] = t.info()["spin_us"]  # a setting, not summed over lanes
    e = _engine(t, rank)
    try:
        x = _rand(torch.float32, 10_000, 40 + rank)  # 40000 bytes: 10 chunks of 4096 (the last 3136)
        before = dict(e.stats())
        y = x.clone()
        e.wait(_post(e, [(peer, True, y.data_ptr(), _b(y)), (peer, False, y.data_ptr(), _b(y))],
                     10, op="sum", dtype="float32"))
        after = dict(e.stats())
        res["chunks"] = after["msg_host_chunks"] - before.get("msg_host_chunks", 0)
        res["largest"] = after["msg_host_chunk_max"]
        other = _rand(torch.float32, 10_000, 40 + peer)
        res["sum"] = "ok" if _same(y, _reference("sum", x, other) if rank == 0 else
                                   _reference("sum", other, x)) else "wrong result"
        out, _ = _exchange_cases(e, rank, peer, 100)
        res.update(out)
    except BaseException:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    _barrier(st, f"limit{lanes}/done", rank)
    e.close()
    t.close()
    return res


@pytest.mark.skipif("ucx" not in NAMES, reason="hetccl._C built without the UCX transport")
@pytest.mark.parametrize("lanes", [1, 2])
def test_engine_message_limit(lanes):
    per_rank = spawn(_message_limit_rank, 2, args=(lanes,),
                     env={"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}, timeout=300)
    for r, res in enumerate(per_rank):
        assert res.pop("own") == ("4096" if r == 0 else "8192"), (r, res)
        assert res.pop("limit") == 4096, (r, res)
        assert res.pop("spin_us") == "50", (r, res)
        assert res.pop("chunks") == 10 and res.pop("largest") == 4096, (r, res)
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"rank {r}: " + "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))


def test_engine_direct_refusals():
    """A direct link needs a transport that takes device memory; a direct device plan must not
    receive into memory it sends. Both refused with errors naming what is wrong, before any data
    moves (no peer needed)."""
    tcp = _C.Transport("tcp", 0, 2, _opts())
    with pytest.raises(_C.CommError, match="needs a message transport that takes device memory; "
                                           "tcp does not"):
        _engine(tcp, 0, direct=True)
    tcp.close()
    if "ucx" not in NAMES:
        pytest.skip("hetccl._C built without the UCX transport")
    u = _C.Transport("ucx", 0, 2, _opts())
    assert u.device_direct
    e = _engine(u, 0, direct=True)
    ops = _C.device_ops("emulated")
    e.set_device_ops(ops)
    S = ops.emulated_stream()
    x = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(_C.CommError, match="receives into memory it also sends"):
        _post(e, [(1, True, x.data_ptr(), 4096), (1, False, x.data_ptr() + 1024, 1024)], 5,
              streams=(S, S))
    assert e.broken() == ""  # refused before anything moved: the engine is still usable
    e.close()
    u.close()


def _withdraw_rank(ctx, name):
    """Rank 0 posts a checked plan whose peer never sends its header: after the timeout the
    engine withdraws the plan's header receive (Transport.cancel) instead of keeping the plan
    until close; rank 1 only waits."""
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    t = _C.Transport(name, rank, 2, _opts())
    _connect(t, st, "w", rank)
    e = _engine(t, rank)
    x = torch.ones(1024)
    try:
        if rank == 1:
            time.sleep(3)
            return None
        hdr = checks.header("all_reduce", x.numel(), x.dtype, "sum", -1, x.device)
        try:
            e.wait(_post(e, [(peer, False, x.data_ptr(), _b(x))], 7, timeout=1000, header=hdr))
            return {"error": None}
        except _C.CommError as err:
            return {"error": str(err), "stats": dict(e.stats())}
    finally:
        e.close()
        t.close()


@pytest.mark.parametrize("name", NAMES)
def test_failed_plan_withdraws_its_header_receive(name):
    res = spawn(_withdraw_rank, 2, args=(name,), timeout=120)[0]
    assert res["error"] and "Timed out" in res["error"], res
    assert res["stats"].get("cancelled_receives", 0) == 1, res["stats"]
