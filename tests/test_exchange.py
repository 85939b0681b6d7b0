"""The host progress engine's pair kernel (hetccl._C.pair_allreduce, csrc/exchange.cc) between two
real processes over the shm transport, plus the non-blocking zero-copy calls it is built on.

Exactness: each element is reduced once, on one rank, from two representable inputs, so the
result must equal test_reduce's single-operation reference bit for bit, and both ranks must end
with identical bytes. Sizes cover empty parts, one element, uneven halves, chunk boundaries and
many ring wrap-arounds (small chunks). Error cases run on their own transports (a failed kernel
leaves its ring out of step, as a failed collective leaves the bridge).
"""
from __future__ import annotations

import functools
import hashlib
import time
import traceback

import pytest
import torch

from hetccl._core import _C
from hetccl.launch import spawn
from test_reduce import DTYPES, OPS, _rand, _reference, _same
from test_transport import _connect, _opts

# (give elements of rank 0, keep elements of rank 0, chunk bytes); rank 1 mirrors them
SHAPES = [(0, 0, 4096), (1, 0, 4096), (0, 1, 4096), (1, 1, 4096), (1000, 1001, 4096),
          (4096, 4096, 4096), (70_001, 69_999, 8192), (300_000, 300_001, 128 << 10)]
TIMEOUT_MS = 10_000


def _ptr(t):
    return t.data_ptr()


def _nbytes(t):
    return t.numel() * t.element_size()


def _run_matrix(t, rank, peer):
    """Every dtype x op x shape; returns {case: "ok" | error} and the digest of every result."""
    out, digests = {}, {}
    for dname, dtype in DTYPES.items():
        for op in OPS:
            for si, (g0, k0, chunk) in enumerate(SHAPES):
                case = f"{dname}/{op}/{si}"
                n = g0 + k0
                a = _rand(dtype, n, 1000 + si)  # rank 0's data
                b = _rand(dtype, n, 2000 + si)  # rank 1's data
                x = (a if rank == 0 else b).clone()
                # rank 0 keeps [g0, n) and gives [0, g0); rank 1 keeps [0, g0), gives [g0, n)
                give, keep = (x[:g0], x[g0:]) if rank == 0 else (x[g0:], x[:g0])
                try:
                    _C.pair_allreduce(t, peer, _ptr(give), _nbytes(give), _ptr(keep),
                                      _nbytes(keep), op, dname, chunk, 77 + si, TIMEOUT_MS)
                    # a reduced element is op(keep owner's value, other's value): owner first
                    ref0 = _reference(op, b[:g0], a[:g0])   # rank 1 reduced [0, g0)
                    ref1 = _reference(op, a[g0:], b[g0:])   # rank 0 reduced [g0, n)
                    ref = torch.cat([ref0, ref1])
                    out[case] = "ok" if _same(x, ref) else "wrong result"
                except Exception as e:  # noqa: BLE001
                    out[case] = f"{type(e).__name__}: {e}"
                    return out, digests  # the ring is out of step now: stop, do not cascade
                digests[case] = hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out, digests


def _zc_try_calls(t, st, rank, peer):
    """zc_send_try / zc_recv_try / zc_send_counts / zc_depth / zc_wait semantics."""
    depth = t.zc_depth(peer)
    assert depth == 8
    if rank == 0:
        st.wait(["zct/checked_empty"])
        acq0, rel0 = t.zc_send_counts(peer)
        slots = []
        for k in range(depth):
            p, cap = t.zc_send_try(peer)
            assert p and cap >= 16
            slots.append(p)
        assert t.zc_send_try(peer) == (0, 0)  # ring full: no wait, no error
        for k in range(depth):
            t.zc_send_commit(peer, 16, 900 + k)
        assert t.zc_send_counts(peer)[0] == acq0 + depth
        st.set("zct/committed", "1")
        # the peer releases them all; zc_wait returns once something moved
        deadline = time.monotonic() + 10
        while t.zc_send_counts(peer)[1] - rel0 < depth:
            t.zc_wait(peer, 50)
            assert time.monotonic() < deadline, "releases never seen"
    else:
        assert t.zc_recv_try(peer) == (0, 0, 0)  # nothing yet: no wait, no error
        t0 = time.monotonic()
        t.zc_wait(peer, 30)  # returns after its timeout when nothing moves
        assert time.monotonic() - t0 < 1.0
        st.set("zct/checked_empty", "1")
        st.wait(["zct/committed"])
        for k in range(depth):
            p, n, tag = t.zc_recv_try(peer)
            assert p and (n, tag) == (16, 900 + k), (p, n, tag)
            t.zc_recv_release(peer)
        assert t.zc_recv_try(peer) == (0, 0, 0)


def rank_main(ctx):
    import torch.distributed as dist

    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    res = {}

    def attempt(name, fn):
        try:
            r = fn()
            res[name] = "ok" if r is None else r
        except BaseException:  # noqa: BLE001
            res[name] = traceback.format_exc()

    # 1. the happy path on one shm transport: the zc calls first, so the kernel starts from a
    #    ring that other operations already moved (its counters are not at zero)
    t = _C.Transport("shm", rank, 2, _opts())
    _connect(t, st, "main", rank)
    attempt("zc_try_calls", lambda: _zc_try_calls(t, dist.PrefixStore("zct/", st), rank, peer))
    st.set(f"stage1/{rank}", res["zc_try_calls"])
    if all(st.get(f"stage1/{r}") == b"ok" for r in (0, 1)):
        matrix, digests = _run_matrix(t, rank, peer)
    else:  # the ring is out of step: a fresh pair for the matrix
        t.close()
        t = _C.Transport("shm", rank, 2, _opts())
        _connect(t, st, "main2", rank)
        matrix, digests = _run_matrix(t, rank, peer)
    res["matrix"], res["digests"] = matrix, digests
    t.close()

    # 2. errors, each on a fresh transport pair
    def fresh(key):
        tt = _C.Transport("shm", rank, 2, _opts())
        _connect(tt, st, key, rank)
        return tt

    x = torch.arange(20_000, dtype=torch.float32)

    def outcome(tt, give, keep, tag, timeout_ms):
        """'no error', or 'ErrorClass|seconds|message' of what the kernel raised."""
        t0 = time.monotonic()
        try:
            _C.pair_allreduce(tt, peer, _ptr(give), _nbytes(give), _ptr(keep), _nbytes(keep),
                              "sum", "float32", 4096, tag, timeout_ms)
            return "no error"
        except _C.CommError as e:
            return f"{type(e).__name__}|{time.monotonic() - t0:.2f}|{e}"

    def mismatched_sizes():
        tt = fresh("mis")
        give, keep = (x[:10_000], x[10_000:]) if rank == 0 else (x[:9_000], x[9_000:])
        try:
            return outcome(tt, give, keep, 5, 3000)
        finally:
            tt.close()

    def other_tag():
        tt = fresh("tag")
        give, keep = (x[:10_000], x[10_000:]) if rank == 0 else (x[10_000:], x[:10_000])
        try:
            return outcome(tt, give, keep, 5 + rank, 3000)
        finally:
            tt.close()

    def absent_peer():
        """Rank 1 never calls the kernel: rank 0 times out, naming the peer and its progress;
        then rank 1 closes and a second call on rank 0 fails with PeerFailure promptly."""
        tt = fresh("absent")
        give, keep = x[:10_000], x[10_000:]
        if rank == 1:
            st.wait(["absent/timed_out"])
            tt.close()
            st.set("absent/closed", "1")
            return "ok"
        out = [outcome(tt, give, keep, 5, 400)]
        st.set("absent/timed_out", "1")
        st.wait(["absent/closed"])
        out.append(outcome(tt, give, keep, 6, 20_000))
        tt.close()
        return out

    attempt("mismatched_sizes", mismatched_sizes)
    attempt("other_tag", other_tag)
    attempt("absent_peer", absent_peer)

    def tcp_refuses():
        tt = _C.Transport("tcp", rank, 2, _opts())
        _connect(tt, st, "tcp", rank)
        try:
            with pytest.raises(_C.CommError, match="zero-copy ring"):
                _C.pair_allreduce(tt, peer, _ptr(x), 8, _ptr(x) + 8, 8, "sum", "float32", 4096,
                                  1, 1000)
        finally:
            tt.close()

    attempt("tcp_refuses", tcp_refuses)
    return res


@functools.lru_cache(maxsize=None)
def _results():
    return spawn(rank_main, 2, timeout=240)


def _case(name):
    return [r[name] for r in _results()]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_pair_allreduce_exact(dtype, op):
    r0, r1 = _results()
    bad = {}
    for si in range(len(SHAPES)):
        case = f"{dtype}/{op}/{si}"
        for rank, r in enumerate((r0, r1)):
            if r["matrix"].get(case, "not run (an earlier case failed)") != "ok":
                bad[f"rank {rank} {case} {SHAPES[si]}"] = r["matrix"].get(case, "not run")
        if r0["digests"].get(case) != r1["digests"].get(case):
            bad[f"{case} {SHAPES[si]}"] = "ranks ended with different bytes"
    assert not bad, bad


def test_zc_try_calls():
    for rank, v in enumerate(_case("zc_try_calls")):
        assert v == "ok", f"rank {rank}:\n{v}"


def test_mismatched_sizes_raise_on_both_ranks():
    for rank, v in enumerate(_case("mismatched_sizes")):
        kind, took, msg = v.split("|", 2)
        # the rank that sees a chunk of the wrong length says so; its partner sees the same, or
        # that the peer closed (PeerFailure), or times out, all within the 3 s given
        assert kind in ("CommError", "PeerFailure", "CommTimeout"), v
        assert float(took) < 10, v
        assert "peer rank" in msg, v
    assert any("disagree" in v for v in _case("mismatched_sizes"))


def test_other_tag_is_an_error_not_a_result():
    for rank, v in enumerate(_case("other_tag")):
        kind, _, msg = v.split("|", 2)
        assert kind in ("CommError", "PeerFailure", "CommTimeout"), v
    assert any("tag" in v and "disagree" in v for v in _case("other_tag"))


def test_absent_then_closed_peer():
    v = _case("absent_peer")[0]
    assert isinstance(v, list) and len(v) == 2, v
    kind, took, msg = v[0].split("|", 2)
    assert kind == "CommTimeout" and float(took) < 5 and "peer rank 1" in msg and "sent" in msg, v
    kind, took, msg = v[1].split("|", 2)
    assert kind == "PeerFailure" and float(took) < 5 and "closed" in msg, v


def test_transport_without_zero_copy_ring_refuses():
    for rank, v in enumerate(_case("tcp_refuses")):
        assert v == "ok", f"rank {rank}:\n{v}"
