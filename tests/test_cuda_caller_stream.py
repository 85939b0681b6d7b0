"""hetccl.device.cuda.current_stream: the caller's stream as the C API route takes it on every
call (one torch Stream object per (device, raw handle), from torch's raw-stream binding). Runs
on the CPU machine with the bindings faked; the GPU suite runs the real ones (face_capi mode)."""
from __future__ import annotations

import types

import torch

from hetccl.device import cuda as compat  # the CUDA seam's stream helpers


def test_current_cuda_stream_caches_per_handle(monkeypatch):
    state = {"dev": 0, "handle": 111, "made": 0}

    def fake_current_stream(index):
        state["made"] += 1
        return types.SimpleNamespace(cuda_stream=state["handle"], index=index, n=state["made"])

    monkeypatch.setattr(compat, "_RAW_STREAM", lambda index: state["handle"])
    monkeypatch.setattr(compat, "_GET_DEVICE", lambda: state["dev"])
    monkeypatch.setattr(compat, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", fake_current_stream)
    s1, h1 = compat.current_stream(0)
    s2, h2 = compat.current_stream(0)
    assert (h1, h2) == (111, 111) and s1 is s2 and state["made"] == 1  # made once, then cached
    state["handle"] = 222  # the caller switched streams: another object, its own handle
    s3, h3 = compat.current_stream(0)
    assert h3 == 222 and s3 is not s1 and s3.cuda_stream == 222 and state["made"] == 2
    s4, _ = compat.current_stream(1)  # another device: its own entry
    assert s4.index == 1 and state["made"] == 3
    state["handle"] = 111
    assert compat.current_stream(0)[0] is s1  # back to the first stream: the cached object
    assert compat.current_device() == 0
    state["dev"] = 3
    assert compat.current_device() == 3


def test_current_cuda_stream_disagreeing_binding_is_not_cached(monkeypatch):
    """Where the raw binding and torch.cuda.current_stream disagree, the public call's stream
    is returned and nothing is cached."""
    monkeypatch.setattr(compat, "_RAW_STREAM", lambda index: 5)
    monkeypatch.setattr(compat, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index: types.SimpleNamespace(cuda_stream=6))
    s, h = compat.current_stream(0)
    assert h == 6 and s.cuda_stream == 6 and not compat._STREAMS


def test_current_cuda_stream_without_bindings(monkeypatch):
    monkeypatch.setattr(compat, "_RAW_STREAM", None)
    monkeypatch.setattr(compat, "_GET_DEVICE", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: types.SimpleNamespace(cuda_stream=9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert compat.current_stream(0)[1] == 9
    assert compat.current_device() == 2
