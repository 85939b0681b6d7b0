"""The C API on CUDA memory (GPU box): every collective case of tests/capi_worker.py -- every
dtype and op, zero-size, in place, PreMulSum with host and device scalars, point to point --
against float64 / exact references with the same bits on every rank, through the CUDA runtime
module, hetccl's device kernels and the device route's engine plans (HETCCL_STREAM_DEVICE_BYTES=1:
every call with data) or the default switch point (staged below it, device above), for 1+1 and
1+1+1 emulated vendors whose processes share the one GPU (tests/capi_cuda.py)."""
from __future__ import annotations

import os

import pytest

from test_capi import launch

torch = pytest.importorskip("torch")

# HETCCL_GPU_SUITE_DEVICE=cpu runs the same harness on the CPU machine (CPU tensors, the
# emulated runtime), as tests/test_gpu_suite.py does: a check of the harness, not of CUDA.
DEVICE = os.environ.get("HETCCL_GPU_SUITE_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA (the GPU box)"),
]


@pytest.mark.parametrize("route", ["device", "auto", "kernel"])
@pytest.mark.parametrize("split", ["1+1", "1+1+1"])
def test_capi_cases_on_cuda(tmp_path, split, route):
    # kernel: every device-route call one program kernel on the caller's stream
    # (HETCCL_CAPI_ROUTE_LAUNCH=kernel, csrc/api/device_program.h; reduce_kernels.cu's
    # hetccl_program on the GPU)
    env = {"HETCCL_TIMEOUT_S": "60"}
    if route in ("device", "kernel"):
        env["HETCCL_STREAM_DEVICE_BYTES"] = "1"
    if route == "kernel":
        env["HETCCL_CAPI_ROUTE_LAUNCH"] = "kernel"
    if DEVICE == "cpu":
        env["HETCCL_CAPI_DEVICE"] = "emulated"
    res, procs, logs = launch(tmp_path, split, "cuda", env=env, timeout=300, worker="capi_cuda.py",
                              device=DEVICE)
    assert sorted(res) == list(range(len(split.split("+")))), "\n".join(logs)[-4000:]
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    assert len(res[0]["cases"]) > 200 and "cuda/burst40" in res[0]["cases"]
    for r in res:
        assert res[r]["digests"] == res[0]["digests"], f"rank {r} has other bits"
        info = res[r]["info"]
        assert info["stream_device_route"] == "1", info  # the kernels loaded, the route exists
        dev = int(info["stream_device_jobs"])
        assert dev > (40 if route == "auto" else 200), info
        assert (int(info["stream_program_jobs"]) == dev) == (route == "kernel"), info
        if route == "kernel":  # scratch of ended programs is reused (device_program.h's cache)
            assert 0 < int(info["stream_program_scratch_reuses"]), info
            assert int(info["stream_program_scratch_allocs"]) < int(info["stream_program_jobs"]) // 2, info
        if route != "auto":
            for coll in ("all_reduce_ring", "reduce_scatter_ring", "all_gather_ring", "broadcast_chain"):
                assert int(info.get(f"algo_{coll}_device", 0)) > 0, (coll, info)
