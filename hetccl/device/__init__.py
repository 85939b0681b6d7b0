"""The device seam: everything that differs between device types lives in one module each.

    cpu.py   host tensors: no streams; native library gloo
    cuda.py  torch's "cuda" device type: NVIDIA (CUDA) and AMD (ROCm/HIP: torch exposes HIP as
             "cuda"); streams, events, futures on streams, the vendor runtime the C++ engine
             drives (stream memory operations, copies, host registration: csrc/device_ops.h),
             native library nccl (NCCL, or RCCL on ROCm builds)

Each module defines one Seam class with the interface below and registers it in SEAMS by torch
device type. Supporting another device type (e.g. Intel XPU with xccl) means one module here
and one line in SEAMS; nothing else in hetccl calls a device API.

Seam interface:
    type: str               torch device type served
    native_backend: str     torch backend name used inside a vendor group
    asynchronous: bool      collectives are stream-ordered (issue returns before data moves)
    new_native(store, rank, size, timeout, group_name="", global_ranks=None) -> c10d Backend
    runtime() -> hetccl._C.DeviceOps | None           (asynchronous seams)
    launch(device, tensors) -> Launch                 (asynchronous seams: see cuda.py)
"""
from __future__ import annotations

import functools

import torch

from .cpu import CpuSeam
from .cuda import CudaSeam

SEAMS = {"cpu": CpuSeam, "cuda": CudaSeam}


@functools.lru_cache(maxsize=None)
def seam(device_type: str):
    """The seam of a torch device type (one instance per process)."""
    cls = SEAMS.get(device_type)
    if cls is None:
        raise ValueError(f"hetccl: device type {device_type!r} is not supported across vendors "
                         f"(supported: {', '.join(sorted(SEAMS))})")
    return cls()


def of(t: torch.Tensor):
    return seam(t.device.type)


def accelerator_types() -> list[str]:
    """Device types with a usable accelerator in this process (for single-vendor groups)."""
    return [k for k, cls in SEAMS.items() if cls.asynchronous and cls.available()]


def native_backend(device_type: str) -> str:
    return seam(device_type).native_backend
