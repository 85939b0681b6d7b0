"""The device seam: everything that differs between device types and vendors lives in one module
each, and nothing else in hetccl names a vendor or calls a device API (tests/test_vendor_seam.py
greps the library for it).

    host.py  host tensors (torch "cpu"): no streams; native library gloo; vendor label "host"
    cuda.py  NVIDIA: torch "cuda" on CUDA builds; streams, events, futures on streams, the CUDA
             runtime module of the C++ core (csrc/device/cuda_ops.cc), native library NCCL
    rocm.py  AMD: torch "cuda" on ROCm builds (torch exposes HIP as torch.cuda, so the stream
             handling is cuda.py's, inherited); the HIP runtime module (csrc/device/hip_ops.cc),
             native library RCCL; vendor label "amd"

Each module defines one Seam class with the interface below. SEAMS maps a torch device type to
the seam this torch build serves it with ("cuda" -> RocmSeam on ROCm builds, else CudaSeam).
Supporting another device type (e.g. Intel XPU with xccl) means one module here and one entry
in _CANDIDATES; nothing else in hetccl changes.

Seam interface:
    type: str               torch device type served
    build: str              what vendor.build_kind() reports where this seam drives the device
    vendor: str             the vendor label of such a process ("nvidia", "amd", "host")
    native_backend: str     torch backend name used inside a vendor group
    native_library          (file-name stem, soname) of the native library, None for gloo
    asynchronous: bool      collectives are stream-ordered (issue returns before data moves)
    device_code: int        the device type's code in argument-check headers (checks.py)
    memory_type: str        the transports' / UCX's name of this memory ("host", "cuda", "rocm")
    ucx_device_paths        UCX transports that move or map this memory between processes
    ucx_copy_paths          UCX's copy transport between this memory and the host
    peer_memory_modules     kernel modules through which an RDMA NIC registers this memory
                            (peer-memory clients; dma-buf aside)
    staging_slot_bytes      default shared-memory slot size where this device stages data
    shm_budget_bytes        default bound on the shared memory one rank creates (all its peers)
    reduce_dtypes           dtypes the native library reduces
    available() / build_matches()   usable here / this torch build is this seam's
    is_device(t)            whether t lives in this seam's device memory
    new_native(store, rank, size, timeout, group_name="", global_ranks=None) -> c10d Backend
    runtime() -> hetccl._C.DeviceOps | None           (asynchronous seams)
    launch(device, tensors, cache, join) -> Launch    (asynchronous seams: see cuda.py)
    caller_stream(device) -> CallerStream             (asynchronous seams: work enqueued on the
                            caller's own stream, the C API route's; see cuda.py)
"""
from __future__ import annotations

import functools

import torch

from .cuda import CudaSeam
from .host import HostSeam
from .rocm import RocmSeam

# per torch device type, the seams that may serve it, the first whose build matches wins
_CANDIDATES = {"cpu": (HostSeam,), "cuda": (RocmSeam, CudaSeam)}
SEAMS = {t: next(c for c in cs if c.build_matches()) for t, cs in _CANDIDATES.items()}


@functools.lru_cache(maxsize=None)
def seam(device_type: str):
    """The seam of a torch device type (one instance per process)."""
    cls = SEAMS.get(device_type)
    if cls is None:
        raise ValueError(f"hetccl: device type {device_type!r} is not supported across vendors "
                         f"(supported: {', '.join(sorted(SEAMS))})")
    return cls()


def device_types() -> list[str]:
    """torch device types hetccl serves (what the backend registers for)."""
    return list(SEAMS)


def device_codes() -> dict[str, int]:
    """Argument-check header code of each device type (checks.py)."""
    return {t: cls.device_code for t, cls in SEAMS.items()}


def is_host(t: torch.Tensor) -> bool:
    """Whether t is in host memory (device tensors are staged through the host where needed)."""
    return not SEAMS.get(t.device.type, HostSeam).asynchronous


def reduce_dtypes(device_type: str) -> frozenset:
    """dtypes the native library of a device type reduces (empty for an unsupported type)."""
    cls = SEAMS.get(device_type)
    return cls.reduce_dtypes if cls is not None else frozenset()


def accelerator_types() -> list[str]:
    """Device types with a usable accelerator in this process (for single-vendor groups)."""
    return [k for k, cls in SEAMS.items() if cls.asynchronous and cls.available()]


def build_seam():
    """The seam describing this process: its accelerator's where one is usable, else the host's."""
    for k in accelerator_types():
        return seam(k)
    return seam("cpu")


def visible_accelerators(env) -> tuple[object, list[str]]:
    """(the seam class of this build's accelerator, the devices a process started with env
    would see, counted without initialising any runtime), or (None, []) without one."""
    for cls in SEAMS.values():
        if cls.asynchronous and hasattr(cls, "visible_devices"):
            return cls, cls.visible_devices(env)
    return None, []


def has_accelerator() -> bool:
    return build_seam().asynchronous


def _every_seams(field: str) -> tuple[str, ...]:
    paths: list[str] = []
    for cs in _CANDIDATES.values():
        for c in cs:
            paths += [p for p in getattr(c, field, ()) if p not in paths]
    return tuple(paths)


def ucx_device_paths() -> tuple[str, ...]:
    """Every seam's UCX device transports (all vendors': a peer may be of another vendor)."""
    return _every_seams("ucx_device_paths")


def ucx_copy_paths() -> tuple[str, ...]:
    """Every seam's UCX copy transport between its device memory and the host (cuda_copy,
    rocm_copy)."""
    return _every_seams("ucx_copy_paths")


def peer_memory_kinds(modules) -> set[str]:
    """Memory types (every seam's) whose memory an RDMA NIC registers through one of the loaded
    kernel ``modules`` (a peer-memory client)."""
    return {c.memory_type for cs in _CANDIDATES.values() for c in cs
            if any(m in modules for m in getattr(c, "peer_memory_modules", ()))}


def native_names() -> tuple[str, ...]:
    """Lower-case names under which the native libraries of every seam show up in their error
    texts: torch backend names (gloo, nccl) and library stems (nccl, rccl)."""
    names = set()
    for classes in _CANDIDATES.values():
        for cls in classes:
            names.add(cls.native_backend.lower())
            lib = getattr(cls, "native_library", None)
            if lib:
                stem = lib[0].rsplit("/", 1)[-1].split(".so")[0]
                names.add(stem[3:] if stem.startswith("lib") else stem)
    return tuple(sorted(names))


def native_backend(device_type: str) -> str:
    return seam(device_type).native_backend
