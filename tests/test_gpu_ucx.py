"""UCX bridge with CUDA tensors (runs on the GPU box: `.ci/gpu-box.sh ucx`; skipped with a reason
elsewhere). Emulated vendors on emulated hosts (HETCCL_EMULATE_HOSTS=1, HETCCL_TRANSPORT=ucx):
all collectives, 1+1 and 2+1, under HETCCL_UCX_DEVICE=auto (the default) and off: both stage
device memory through host memory (no UCX of this build has a runtime-free device path); the
UCX context never has cuda_ipc, cuda_copy (or any device path) or shared memory
between the groups."""
from __future__ import annotations

import pytest
import torch

from hetccl import transports
from hetccl._core import _C
from hetccl.launch import spawn

import gpu_ucx_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1,
                       reason="needs a CUDA GPU (run .ci/gpu-box.sh ucx on the GPU box)"),
    pytest.mark.skipif("ucx" not in _C.transport_names(),
                       reason="hetccl._C built without UCX (carry the libucx wheel: .ci/gpu-box.sh ucx)"),
]


def _ucx_memory():
    return next(t["memory"] for t in transports.local_table() if t["name"] == "ucx")


@pytest.mark.parametrize("vendors", ["1+1", "2+1"])
@pytest.mark.parametrize("device", [
    # the default: direct only where the device path makes no runtime call off the issuing
    # thread (runtime_free + peer memory, ranks on different real hosts); no UCX of this build
    # qualifies (here: one box, tcp and cuda_copy only), so auto must stage, with cuda_copy out
    # of the context. HETCCL_UCX_DEVICE=force (cuda_copy on UCX's thread) deadlocks against the
    # copy-out pattern these cases use: tests/gpu_ucx_probe.py shows it, docs/transports.md.
    "auto",
    "off"])
def test_cuda_over_ucx_hosts_emulated(vendors, device):
    if device == "auto" and "cuda" not in _ucx_memory():
        pytest.fail(f"UCX on this box does not handle CUDA memory (memory {_ucx_memory()}): "
                    "auto's choice cannot be tested; check the libucx wheel's cuda_copy")
    world = sum(int(x) for x in vendors.split("+"))
    if vendors == "2+1" and torch.cuda.device_count() < 2:
        pytest.skip("2+1 needs 2 GPUs: the two ranks of vendor v0 would share one GPU, which NCCL "
                    "refuses inside that vendor's group")
    env = {"HETCCL_EMULATE_HOSTS": "1", "HETCCL_TRANSPORT": "ucx", "HETCCL_UCX_DEVICE": device,
           "CUDA_MODULE_LOADING": "EAGER"}
    res = spawn(gpu_ucx_cases.run, world, vendors=vendors, env=env, timeout=600)
    for r, out in enumerate(res):
        assert out["is_hetccl_group"]
        bad = [k for k, ok in out["correct"].items() if not ok]
        assert not bad, f"rank {r}: wrong results for {bad}"
        assert set(out["choices"].values()) == {"ucx"}, out["choices"]
        # ranks on one real host: no runtime-free device path, so never direct (not even auto)
        assert not any(out["device_direct"].values()), out["device_direct"]
        resources = set(out["ucx"]["resources"].split(","))
        forbidden = set(transports.UCX_DEVICE_PATHS + transports.UCX_SHM_PATHS
                        + transports.UCX_COPY_PATHS)
        assert not resources & forbidden, f"UCX context has {resources & forbidden} between vendors"
        st = out["stats"]  # every device byte staged by the engine, none handed to UCX
        assert st.get("msg_device_bytes", 0) > 0 and st.get("msg_device_direct_bytes", 0) == 0, st
