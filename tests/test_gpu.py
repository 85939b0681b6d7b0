"""GPU data path (runs on the GPU box; skipped with a reason on machines without 2 GPUs)."""
from __future__ import annotations

import pytest
import torch

from hetccl.launch import spawn

import gpu_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (run .ci/gpu-box.sh on the GPU box)"),
]


def test_cuda_tensors_across_emulated_vendors():
    res = spawn(gpu_cases.run, 2, vendors="1+1", timeout=600)
    for r, out in enumerate(res):
        assert out["is_hetccl_group"]
        assert not out["native_comm_across_groups"], "a native communicator spans both vendors"
        assert out["bridge_kinds"] == ["shm"]
        bad = [k for k, ok in out["correct"].items() if not ok]
        assert not bad, f"rank {r}: wrong results for {bad}"
        assert out["stream"]["value_ok"], out["stream"]
        # issuing did not wait for the 0.1 s kernel queued before it
        assert out["stream"]["issue_s"] < 0.05, out["stream"]
        # large transfers took the zero-copy path; small ones are staged (HETCCL_ZC_MIN_BYTES)
        assert out["zero_copy_bytes"] > 0, out
        # the staging loop drove copies and events through the vendor runtime (not the
        # slower torch-call fallback)
        assert out["raw_runtime"] is True, out
        assert out["device_mismatch"] == "ok", out["device_mismatch"]
