"""GPU data path (runs on the GPU box; skipped with a reason on machines without a GPU).

Ranks use GPU rank % device_count: on a one-GPU box both emulated vendors' processes share the
GPU (two CUDA contexts, nothing shared between them but the device): a correctness run, not a
placement whose speed means anything."""
from __future__ import annotations

import pytest
import torch

from hetccl.launch import spawn

import gpu_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1,
                       reason="needs a CUDA GPU (run .ci/gpu-box.sh on the GPU box)"),
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
        # nor for 0.2 s of GPU work before eight 8 MiB all-reduces (stream memory operations)
        assert out["async_issue_s"] < 0.05, out["async_issue_s"]
        assert out["async_values_ok"], out
        assert out["concurrent_groups_ok"], out
        assert out["ddp_grad_err"] < 1e-5, out["ddp_grad_err"]
        # device data went through the zero-copy rings, enqueued on the streams
        assert out["stats"]["zc_device_bytes"] > 0 and out["stats"]["device_enqueues"] > 0, out
        # every device call is checked before data moves (hetccl/checks.py), none asynchronously
        assert out["stats"].get("checks_blocking", 0) > 0, out["stats"]
        assert out["stats"].get("checks_async", 0) == 0, out["stats"]
        assert out["device_mismatch"] == "ok", out["device_mismatch"]
        assert out["size_mismatch"] == "ok", out["size_mismatch"]
        assert out["usable_after_errors"], out
