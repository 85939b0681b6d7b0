"""The drop-in NCCL on CUDA tensors (GPU box): unchanged torch code that calls
init_process_group("nccl"), with hetccl/dropin/libnccl.so.2 preloaded in front of torch and the
real NCCL (the nvidia-nccl wheel) behind it.

  * every c10d family of tests/collective_cases.py for 1+1 and 1+1+1 emulated vendors on the
    one GPU (hetccl's stream path serves the calls: csrc/api/stream_path.h) and for one vendor
    (world size 1: the real NCCL serves them), with get_backend() == "nccl";
  * DDP and FSDP2 against the float64 single-process reference, 1+1;
  * the drop-in's start-up line, and which library served each communicator.
Rank r uses GPU r % device_count (all vendors share the one GPU)."""
from __future__ import annotations

import os

import pytest
import torch

from hetccl import nccl_dropin
from hetccl.launch import spawn

import collective_cases
import gpu_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU box)"),
]


@pytest.fixture
def dropin_env(monkeypatch):
    """LD_PRELOAD and the real library for the ranks (spawned processes inherit os.environ)."""
    real = nccl_dropin.real_library("nccl")
    if not real:
        pytest.fail("no real libnccl.so.2 found (torch's nvidia-nccl wheel): the drop-in has nothing to forward to")
    for k, v in nccl_dropin.launch_env("nccl", {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HETCCL_NCCL_LIBRARY", real)
    monkeypatch.setenv("HETCCL_LOG_LEVEL", "INFO")
    return real


def _families(ctx):
    return collective_cases.run_all(ctx, device="cuda", backend="nccl", timeout_s=120)


@pytest.mark.parametrize("split", ["1", "1+1", "1+1+1"])
def test_every_family_under_the_dropin(split, dropin_env, capfd):
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(_families, world, vendors=split if world > 1 else None, timeout=400)
    bad = {f"rank {r} {k}": v for r, res in enumerate(per_rank) for k, v in res.items()
           if v != "ok" and not v.startswith("skip")}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    assert len(per_rank[0]) > 50, sorted(per_rank[0])
    assert all(res["backend/get_backend"] == "ok" for res in per_rank)
    err = capfd.readouterr().err
    assert "hetccl: serving NCCL calls (drop-in libnccl.so.2)" in err, err[-3000:]
    want = "one vendor: the real NCCL serves" if world == 1 else "vendor group(s): hetccl serves"
    assert want in err, err[-3000:]


def test_training_under_the_dropin(dropin_env):
    import training_cases as tc

    per_rank = spawn(gpu_cases.run_training, 2, args=("cuda", ["ddp", "fsdp2"], "nccl"), vendors="1+1",
                     timeout=300)
    ref = tc.reference_params()
    for which in ("ddp", "fsdp2"):
        for r, out in enumerate(per_rank):
            for p, want in zip(out[which]["params"], ref):
                torch.testing.assert_close(p, want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, r=r, w=which: f"rank {r} {w}: {m}")
