"""AMD GPUs: torch's "cuda" device type on ROCm builds of torch, which expose HIP as torch.cuda
(streams, events, the caching allocator and the "nccl" backend name, RCCL underneath, all keep
CUDA's names). The stream semantics are therefore cuda.py's, inherited unchanged; this module
holds the AMD facts:

  * runtime: the HIP runtime (libamdhip64) through the C++ core's HIP module
    (csrc/device/hip_ops.cc: 64-bit stream waits on signal memory, docs/gpu.md);
  * native library: RCCL, torch's "nccl" backend on ROCm builds; its file librccl.so.1 (the same
    C API as NCCL; a later drop-in librccl.so.1 twin loads through native_library_path);
  * memory type "rocm" (UCX's rocm_copy / rocm_ipc / rocm_gdr), vendor label "amd".

Naming, used everywhere in hetccl: the vendor label is "amd"; the software stack, this module,
the build kind and the memory type are "rocm"; "hip" names only the HIP runtime API (the C++
runtime module and its declarations).

Never run on AMD hardware (there is none on our machines): what was verified, and how, is in
docs/gpu.md.
"""
from __future__ import annotations

import torch

from .cuda import CudaSeam


class RocmSeam(CudaSeam):
    build = "rocm"
    vendor = "amd"
    runtime_name = "hip"
    runtime_library = ("libamdhip64.so", "libamdhip64.so")
    native_backend = "nccl"   # torch's name of RCCL on ROCm builds
    native_library = ("librccl.so", "librccl.so.1")
    memory_type = "rocm"
    ucx_device_paths = ("rocm_ipc", "rocm_gdr")
    ucx_copy_paths = ("rocm_copy",)
    peer_memory_modules = ("amdp2p",)
    graph_name = "HIP graph"  # torch.cuda.graph on ROCm builds captures a HIP graph
    # dtypes RCCL reduces, as torch's ProcessGroupNCCL on ROCm offers them (NCCL's set)
    reduce_dtypes = CudaSeam.reduce_dtypes

    @staticmethod
    def build_matches() -> bool:
        return bool(getattr(torch.version, "hip", None))

    @classmethod
    def count_devices(cls) -> int:
        """AMD GPUs through amdsmi, without initialising HIP; -1 when they cannot be counted."""
        try:
            return int(torch.cuda._raw_device_count_amdsmi())
        except Exception:  # noqa: BLE001 - no management library: not counted
            return -1
