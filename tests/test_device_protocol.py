"""The engine's stream protocol on the host-emulated runtime, under both comparison rules of
csrc/device_ops.h ("Flag words and positions"): CUDA's (32-bit, wrap-aware on the low half) and
HIP's (64-bit counter, unsigned), with positions that cross 2^32.

  * the runtime alone: a wait for a position just past 2^32 does not pass while the word is just
    below it (an unsigned 32-bit comparison -- HIP's hipStreamWaitValueGte on 32 bits, the old
    code -- would pass at once), and passes once the word reaches it; a write from the stream
    lands in the word in the rule's width;
  * the engine between two processes over a message link (tcp) whose positions start 40 below
    2^32: device plans of every size class (the largest wraps the 8-slot staging ring several
    times and crosses 2^32) arrive byte-exact under both rules, and an asynchronously found
    mismatch still releases every stream wait (the release writes positions past the wrap).
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

from hetccl._core import _C
from hetccl.launch import spawn
from test_engine import _device_async_mismatch, _device_cases, _engine
from test_transport import _connect, _opts

RULES = ["cuda", "hip"]
import os
BASE = int(os.environ.get("WRAP_BASE", (1 << 32) - 40))


def _word(value: int) -> torch.Tensor:
    w = torch.zeros(1, dtype=torch.int64)
    w[0] = value if value < (1 << 63) else value - (1 << 64)
    return w


def _read(w: torch.Tensor) -> int:
    return int(w[0]) & ((1 << 64) - 1)


def _set(w: torch.Tensor, rule: str, counter: int) -> None:
    """The proxy's store: the whole counter (HIP) or, as a CUDA driver sees it, the low half."""
    if rule == "hip":
        w[0] = counter if counter < (1 << 63) else counter - (1 << 64)
    else:
        w.view(torch.int32)[0] = _as_i32(counter)  # little-endian: the low half


def _as_i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


@pytest.mark.parametrize("rule", RULES)
def test_wait_across_the_wrap(rule):
    ops = _C.device_ops("emulated", rule)
    assert ops.memory_type == "host"
    S = ops.emulated_stream()
    below = (1 << 32) - 3                      # position 0xFFFFFFFD
    target = (1 << 32) + 2                     # position 2, after the wrap
    word, done = _word(below), _word(0)
    ops.wait_geq(S, word.data_ptr(), target)
    ops.write(S, done.data_ptr(), 7)
    time.sleep(0.2)
    assert _read(done) == 0, "the wait passed before the word reached the position"
    assert below & 0xFFFFFFFF >= target & 0xFFFFFFFF, "(an unsigned 32-bit comparison would pass)"
    _set(word, rule, target - 1)
    time.sleep(0.1)
    assert _read(done) == 0, "the wait passed one position early"
    _set(word, rule, target)
    ops.synchronize(S)
    assert _read(done) == 7
    # a write in the rule's width: CUDA's 32-bit write leaves the high half alone
    w = _word((5 << 32) | 1)
    ops.write(S, w.data_ptr(), (1 << 32) + 9)
    ops.synchronize(S)
    assert _read(w) == ((5 << 32) | 9 if rule == "cuda" else (1 << 32) + 9)


def test_unknown_rule_is_refused():
    with pytest.raises(_C.CommError, match="'cuda' or 'hip'"):
        _C.device_ops("emulated", "xpu")
    with pytest.raises(_C.CommError, match="known: cuda, hip, emulated"):
        _C.device_ops("rocm")


def _rank(ctx, rule):
    torch.set_num_threads(1)
    st = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    t = _C.Transport("tcp", rank, 2, _opts())
    _connect(t, st, "wrap", rank)
    e = _engine(t, rank)
    e._set_position_base(BASE)
    ops = _C.device_ops("emulated", rule)
    e.set_device_ops(ops)
    dev = (ops, ops.emulated_stream(), ops.emulated_stream())
    out, dev = _device_cases(e, rank, peer, 1000, dev)
    out.pop("device/issue_s")
    out["mismatch"] = _device_async_mismatch(e, rank, peer, 1100, dev)
    try:
        e._set_position_base(BASE)
        out["late_base"] = "accepted after plans"
    except _C.CommError as err:
        out["late_base"] = "ok" if "after the first plan" in str(err) else str(err)
    e.close()
    t.close()
    return out


@functools.lru_cache(maxsize=None)
def _run(rule):
    return spawn(_rank, 2, args=(rule,), timeout=300)


@pytest.mark.parametrize("rule", RULES)
def test_engine_device_plans_across_the_wrap(rule):
    for r, res in enumerate(_run(rule)):
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"rank {r} ({rule} rule): {bad}"
        assert len(res) >= 10, res
