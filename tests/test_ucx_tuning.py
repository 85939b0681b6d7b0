"""UCX transport options of issue 28 (CPU): the copy thread, prepared device handles, the device
copy transports removed where no device memory goes to UCX, and the thread stack dump the GPU
probe uses. (Stashed copies and irecv_reduce on the copy thread, its default, are exercised by
tests/test_transport.py -k ucx; device handles need a GPU: tests/gpu_ucx_probe.py.)"""
from __future__ import annotations

import re
import threading

import pytest
import torch

from hetccl import transports
from hetccl._core import _C

pytestmark = pytest.mark.skipif("ucx" not in _C.transport_names(), reason="built without UCX")


def test_copy_exclusions():
    assert transports.ucx_copy_exclusions(True) == []
    assert sorted(transports.ucx_copy_exclusions(False)) == ["cuda_copy", "rocm_copy"]


@pytest.mark.parametrize("key", ["copy_thread", "device_prepare", "reduce_unpack"])
def test_bad_option_values_are_refused(key):
    with pytest.raises(_C.CommError, match=key):
        _C.Transport("ucx", 0, 1, {key: "maybe"})


@pytest.mark.parametrize("copy", ["on", "off"])
def test_copy_thread_option_in_info(copy):
    t = _C.Transport("ucx", 0, 1, {"copy_thread": copy})
    try:
        assert t.info()["copy_thread"] == copy
    finally:
        t.close()


def test_prepare_device_without_device_memory_is_a_no_op():
    t = _C.Transport("ucx", 0, 1, {})
    try:
        buf = torch.zeros(1024, dtype=torch.uint8)
        t.prepare_device(buf.data_ptr(), buf.numel(), "cuda")  # this UCX handles no cuda memory
        t.prepare_device(buf.data_ptr(), buf.numel(), "host")  # not a device type: ignored
        info = t.info()
        assert info["device_prepare"] == "on"
        assert info["device_handles"].startswith("0 cached"), info["device_handles"]
    finally:
        t.close()
    t = _C.Transport("ucx", 0, 1, {"device_prepare": "off"})
    try:
        assert t.info()["device_prepare"] == "off"
    finally:
        t.close()


def test_thread_stack_dump_names_the_ucx_threads(capfd):
    t = _C.Transport("ucx", 0, 1, {})
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        answered = _C.dump_thread_stacks()
    finally:
        stop.set()
        t.close()
    err = capfd.readouterr().err
    names = [ln.split()[2] for ln in err.splitlines() if ln.startswith("hetccl-stack ")]
    assert answered == len(names) >= 3, (answered, names)
    assert "hetccl-ucx" in names and "hetccl-ucx-cp" in names, names
    assert "hetccl-frame " in err


# ------------------------------------------------------------ irecv_reduce, piece by piece
# reduce_unpack (default on): a reducing receive posted before its message reduces each piece
# UCX delivers (csrc/ucx_transport.cc, reduce_unpack). With 1001-byte tcp segments the pieces
# end inside elements of every size, so the elements split between pieces are gathered too.
UNPACK_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
UNPACK_OPS = ["sum", "prod", "min", "max"]
ODD_SEGMENTS = "TCP_TX_SEG_SIZE=1001;TCP_RX_SEG_SIZE=1001"


def _reference(op, a, b):
    """op(a, b) elementwise, computed in float64 / int64 and cast back (one correctly rounded
    step; integers wrap as two's complement)."""
    wide = torch.float64 if a.is_floating_point() else torch.int64
    x, y = a.to(wide), b.to(wide)
    r = {"sum": x + y, "prod": x * y, "min": torch.minimum(x, y), "max": torch.maximum(x, y)}[op]
    return r.to(a.dtype)


def _data(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    t = getattr(torch, dtype)
    if t.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(t)
    size = torch.empty(0, dtype=t).element_size()  # integers: random bytes, the full range
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(t)


def unpack_rank(ctx, mode, config):
    import datetime

    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    t = _C.Transport("ucx", rank, 2, {"secret": "s" * 64, "bind_addr": "127.0.0.1",
                                      "reduce_unpack": mode, "ucx_config": config,
                                      "exclude_tls": "posix,sysv,xpmem,cma,knem"})
    st.set(f"a{rank}", t.address())
    t.connect([b"" if r == rank else st.get(f"a{r}") for r in range(2)], 30000)

    def barrier(key):
        st.set(f"{key}/{rank}", "1")
        st.wait([f"{key}/{r}" for r in range(2)], datetime.timedelta(seconds=30))

    wrong, tag = [], 0
    for dtype in UNPACK_DTYPES:
        for op in UNPACK_OPS:
            for n in (0, 1, 3, 20011, 300007):  # eager and rendezvous sizes
                tag += 1
                mine, theirs = _data(dtype, n, 7 * tag + rank), _data(dtype, n, 7 * tag + peer)
                acc = mine.clone()
                r = t.irecv_reduce(peer, acc.data_ptr(), acc.nbytes, tag, op, dtype)
                barrier(f"posted{tag}")  # the receive waits for its message: piece by piece
                s = t.isend(peer, mine.data_ptr(), mine.nbytes, tag)
                assert r.wait(30000) == acc.nbytes
                s.wait(30000)
                if not torch.equal(acc, _reference(op, mine, theirs)):
                    wrong.append(f"{dtype} {op} n={n}")
    # a message longer than the reducing receive fails it; the tag goes on working
    small = torch.zeros(8, dtype=torch.float32)
    r = t.irecv_reduce(peer, small.data_ptr(), small.nbytes, 9999, "sum", "float32")
    barrier("long")
    big = torch.ones(4096, dtype=torch.float32)
    s = t.isend(peer, big.data_ptr(), big.nbytes, 9999)
    with pytest.raises(_C.MessageTruncated):
        r.wait(30000)
    s.wait(30000)
    r = t.irecv_reduce(peer, small.data_ptr(), small.nbytes, 9999, "sum", "float32")
    barrier("after")
    s = t.isend(peer, big.data_ptr(), small.nbytes, 9999)
    r.wait(30000)
    s.wait(30000)
    info = t.info()["reduce_unpack"]
    barrier("done")
    t.close()
    return {"wrong": wrong, "info": info, "after_truncation": small.tolist()}


@pytest.mark.parametrize("mode,config", [("on", ""), ("on", ODD_SEGMENTS), ("off", ODD_SEGMENTS)],
                         ids=["unpack", "unpack-odd-segments", "bounce-odd-segments"])
def test_reduce_unpack_every_dtype_and_op(mode, config):
    from hetccl.launch import spawn

    for res in spawn(unpack_rank, 2, args=(mode, config), timeout=240):
        assert res["wrong"] == [], res["wrong"]
        assert res["after_truncation"] == [1.0] * 8  # zeros + ones: the failed one left nothing?
        if mode == "off":
            assert res["info"] == "off"
            continue
        # the path was taken: every message posted ahead arrived in pieces
        m = re.match(r"on: (\d+) messages in (\d+) pieces, (\d+) elements split", res["info"])
        assert m, res["info"]
        msgs, pieces, split = map(int, m.groups())
        assert msgs >= len(UNPACK_DTYPES) * len(UNPACK_OPS) * 4, res["info"]  # n > 0 at least
        assert pieces > msgs
        if config == ODD_SEGMENTS:
            assert split > 0, res["info"]
