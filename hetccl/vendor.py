"""Vendor detection and the one seam for vendor-specific device code.

Everything that differs between CUDA (NVIDIA), ROCm/HIP (AMD) and other accelerators lives
here; the rest of hetccl asks this module and never mentions a vendor API. On ROCm builds of
torch, HIP is exposed as ``torch.cuda`` (device type "cuda", native library RCCL under the
name "nccl"), so most of the data path is shared; the differences are the host-registration
call and the vendor label.
"""
from __future__ import annotations

import functools
import os
import socket

import torch

from . import config

VENDOR_OF_BUILD = {"cuda": "nvidia", "rocm": "amd", "xpu": "intel", "cpu": "host"}


def build_kind() -> str:
    """What this torch build drives: 'rocm', 'cuda', 'xpu' or 'cpu' (no usable accelerator)."""
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "rocm"
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def detect_vendor() -> str:
    """This process's vendor label: HETCCL_VENDOR if set (any non-empty label; this is how
    several vendors are emulated on one kind of hardware), else derived from the torch build."""
    label = config.get("HETCCL_VENDOR")
    if label:
        return label
    split = config.get("HETCCL_VENDOR_SPLIT")
    if split:
        from .launch import vendor_labels

        labels = vendor_labels(split)
        rank = int(os.environ.get("RANK", "0"))
        if rank >= len(labels):
            raise ValueError(f"hetccl: HETCCL_VENDOR_SPLIT={split!r} covers {len(labels)} ranks,"
                             f" but this is rank {rank}")
        return labels[rank]
    return VENDOR_OF_BUILD[build_kind()]


def native_backend(device_type: str) -> str:
    """torch backend that runs collectives inside one vendor group for this device type."""
    return {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """Identifies this host's shared-memory domain: processes with equal identities can use the
    shm transport (same kernel boot, same /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        shm = os.stat("/dev/shm").st_ino
    except OSError:
        shm = 0
    return f"{socket.gethostname()}/{boot}/{shm}"


# ---------------------------------------------------------------------------------------------
# Device staging seam (GPU data path). Device tensors cross vendors through pinned host memory.
# ---------------------------------------------------------------------------------------------

class DeviceSeam:
    """Stream/event/pinned-memory operations for 'cuda'-type devices (CUDA and ROCm/HIP)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_rocm = bool(getattr(torch.version, "hip", None))

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def event(self):
        return torch.cuda.Event()

    def stream_ctx(self, stream):
        return torch.cuda.stream(stream)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """Page-lock existing host memory (our shared-memory slots) so copies from/to it run at
        full PCIe speed. cudaHostRegister on CUDA; on ROCm torch's cudart shim maps to HIP."""
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(ptr, nbytes, 0)
        return int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0

    def host_unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def seam_for(device: torch.device) -> DeviceSeam | None:
    return DeviceSeam(device) if device.type == "cuda" else None
