"""UCX transport: build check and UCX-specific behaviour, two processes on this host.

The generic transport contract is covered for "ucx" by tests/test_transport.py (parametrised
over _C.transport_names()). This file adds what only UCX has: the build must include it whenever
the libucx wheel is installed; the secret handshake; and both UCX transport families available
here, tcp over loopback and shared memory (posix/sysv/cma, which UCX cannot watch for peer
failure: the transport's own pid check or a failed cma read must report a dead peer).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import time

import numpy as np
import pytest

from hetccl import _C
from hetccl.launch import spawn

SECRET = "0123456789abcdef0123456789abcdef"
# UCX reads UCX_* itself.
VARIANTS = {
    "tcp": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"},
    "shm": {"UCX_TLS": "posix,sysv,cma,self"},
    # three lanes, each a UCX context with its own threads (option lane_threads)
    "tcp-lanethreads": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self", "TEST_UCX_LANES": "3"},
    # the same with messages of 128 KiB and more striped over the lanes (option stripe_bytes)
    "tcp-stripe": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self", "TEST_UCX_LANES": "3",
                   "TEST_UCX_STRIPE": str(64 << 10), "TEST_UCX_SPIN_US": "0"},
}


def _opts(secret=SECRET):
    """The transport's options in this variant: lane threads where TEST_UCX_LANES says, striped
    where TEST_UCX_STRIPE says, the progress threads' spin where TEST_UCX_SPIN_US says."""
    lanes, stripe = os.environ.get("TEST_UCX_LANES"), os.environ.get("TEST_UCX_STRIPE", "0")
    spin = os.environ.get("TEST_UCX_SPIN_US")
    return {"secret": secret, **({"spin_us": spin} if spin else {}),
            **({"lanes": lanes, "lane_threads": "on", "stripe_bytes": stripe} if lanes else {})}

needs_ucx = pytest.mark.skipif("ucx" not in _C.transport_names(),
                               reason="hetccl._C built without the UCX transport")


def test_ucx_built_when_libucx_installed():
    """A build that silently dropped UCX (CMake did not find the wheel) must fail CI, not skip."""
    if importlib.util.find_spec("libucx") is None:
        pytest.skip("libucx wheel not installed (pip install hetccl[ucx])")
    assert "ucx" in _C.transport_names(), (
        "the libucx wheel is importable but hetccl._C was built without the UCX transport: "
        "rebuild with libucx installed in the build environment (pip install --no-build-isolation) "
        "and look for 'hetccl: UCX transport: ON' in the CMake output")


# ------------------------------------------------------------------ rank bodies
def _connect(ctx, key, secret=SECRET, timeout_ms=20000):
    st = ctx.store()
    t = _C.Transport("ucx", ctx.rank, 2, _opts(secret))
    st.set(f"{key}/addr{ctx.rank}", t.address())
    addrs = [b"" if r == ctx.rank else st.get(f"{key}/addr{r}") for r in range(2)]
    t.connect(addrs, timeout_ms)
    return t, st


def exchange(ctx):
    """Both directions at once: sizes 0..16 MiB (receives posted in reverse tag order, one size
    posted only after its send completed), float32 irecv_reduce, truncation."""
    t, st = _connect(ctx, "ex")
    rank, peer = ctx.rank, 1 - ctx.rank
    if os.environ.get("TEST_UCX_STRIPE"):
        assert t.info()["stripe_bytes"] == os.environ["TEST_UCX_STRIPE"], t.info()
    if os.environ.get("TEST_UCX_SPIN_US"):  # no spin: every message after a sleep
        assert t.info()["spin_us"] == os.environ["TEST_UCX_SPIN_US"], t.info()
    sizes = [0, 1, 4097, 1 << 20, 16 << 20]
    outs = [np.full(n, (rank + 1) * 3 + i, np.uint8) for i, n in enumerate(sizes)]
    ins = [np.zeros(n + 8, np.uint8) for n in sizes]
    rr = {i: t.irecv(peer, ins[i].ctypes.data, ins[i].nbytes, 100 + i)
          for i in reversed(range(len(sizes) - 1))}
    _C.wait_all([t.isend(peer, o.ctypes.data, o.nbytes, 100 + i) for i, o in enumerate(outs)], 30000)
    last = len(sizes) - 1  # its send completed before the receive exists (stashed message)
    rr[last] = t.irecv(peer, ins[last].ctypes.data, ins[last].nbytes, 100 + last)
    for i, n in enumerate(sizes):
        assert rr[i].wait(30000) == n
        assert (ins[i][:n] == (peer + 1) * 3 + i).all() and (ins[i][n:] == 0).all()
    dst = np.ones(100003, np.float32)
    src = np.arange(100003, dtype=np.float32) * (rank + 1)
    r = t.irecv_reduce(peer, dst.ctypes.data, dst.nbytes, 7, "sum", "float32")
    t.isend(peer, src.ctypes.data, src.nbytes, 7).wait(30000)
    r.wait(30000)
    assert np.array_equal(dst, 1 + np.arange(100003, dtype=np.float32) * (peer + 1))
    small = np.zeros(10, np.uint8)
    r = t.irecv(peer, small.ctypes.data, small.nbytes, 8)
    t.isend(peer, src.ctypes.data, 11, 8).wait(30000)
    with pytest.raises(_C.MessageTruncated, match="11-byte message"):
        r.wait(30000)
    st.set(f"ex/done{rank}", "1")
    st.wait([f"ex/done{peer}"])
    t.close()
    return "ok"


def wrong_secret(ctx):
    try:
        _connect(ctx, "ws", secret=SECRET if ctx.rank == 0 else "not-the-secret")
    except _C.CommTimeout as e:
        return f"timeout instead of a rejection: {e}"
    except _C.CommError as e:
        msg = str(e)
        ok = "wrong group secret" in msg and f"peer rank {1 - ctx.rank}" in msg
        return "ok" if ok else f"unclear rejection: {msg}"
    return "connected with a wrong secret"


# The victim is a plain subprocess of rank 1 (killing a spawn rank would fail the spawn): it
# plays rank 1 of the transport, posts a 64 MiB send and waits to be killed.
VICTIM = r"""
import json, sys, time, numpy as np
from hetccl import _C
t = _C.Transport("ucx", 1, 2, json.loads(sys.argv[1]))
sys.stdout.write("ADDR " + t.address().decode() + "\n"); sys.stdout.flush()
t.connect([sys.stdin.readline().strip().encode(), b""], 20000)
buf = np.ones(64 << 20, np.uint8)
t.isend(0, buf.ctypes.data, buf.nbytes, 5)
sys.stdout.write("SENDING\n"); sys.stdout.flush()
time.sleep(600)
"""


def _line(p, prefix):
    """The victim's next stdout line that starts with prefix (EOF: the victim died)."""
    for line in p.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"victim exited before printing {prefix!r}")


def killed(ctx):
    """The peer dies with a 64 MiB send in flight; a pending receive that only the failure can
    end must fail with PeerFailure naming rank 1 within seconds (tcp: UCX's error callback;
    shm: a failed cma read or the transport's pid check), and so must a later send."""
    import subprocess
    import sys

    st = ctx.store()
    if ctx.rank == 1:
        import json
        p = subprocess.Popen([sys.executable, "-c", VICTIM, json.dumps(_opts())],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            # UCX writes its own warnings to stdout (UCX_LOG_FILE): skip lines that are not ours
            st.set("kill/addr1", _line(p, "ADDR ")[5:])
            p.stdin.write(st.get("kill/addr0").decode() + "\n")
            p.stdin.flush()
            assert _line(p, "SENDING") == "SENDING"
            st.wait(["kill/posted"])
            time.sleep(0.05)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        return "ok"
    t = _C.Transport("ucx", 0, 2, _opts())
    st.set("kill/addr0", t.address())
    t.connect([b"", st.get("kill/addr1")], 20000)
    buf = np.zeros(64 << 20, np.uint8)
    never = t.irecv(1, buf.ctypes.data, buf.nbytes, 6)  # never sent: only the failure ends it
    st.set("kill/posted", "1")
    t0 = time.monotonic()
    try:
        never.wait(10000)
        verdict = "receive completed"
    except _C.PeerFailure as e:
        verdict = "ok" if "peer rank 1" in str(e) else f"error does not name rank 1: {e}"
    except _C.CommError as e:
        verdict = f"expected PeerFailure, got {type(e).__name__}: {e}"
    took = time.monotonic() - t0
    if verdict == "ok" and took > 3.0:
        verdict = f"failure noticed only after {took:.1f} s"
    try:
        t.isend(1, buf.ctypes.data, 8, 9).wait(2000)
        if verdict == "ok":
            verdict = "a send to the dead peer succeeded"
    except _C.PeerFailure:
        pass
    t.close()
    return verdict


# ------------------------------------------------------------------ tests
@needs_ucx
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exchange(variant):
    assert spawn(exchange, 2, env=VARIANTS[variant], timeout=120) == ["ok", "ok"]


@needs_ucx
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_wrong_secret_rejected(variant):
    assert spawn(wrong_secret, 2, env=VARIANTS[variant], timeout=60) == ["ok", "ok"]


@needs_ucx
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peer_killed(variant):
    assert spawn(killed, 2, env=VARIANTS[variant], timeout=90) == ["ok", "ok"]
