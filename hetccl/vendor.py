"""Vendor detection and the one seam for vendor-specific device code.

Everything that differs between CUDA (NVIDIA), ROCm/HIP (AMD) and other accelerators lives
here; the rest of hetccl asks this module and never mentions a vendor API. On ROCm builds of
torch, HIP is exposed as ``torch.cuda`` (device type "cuda", native library RCCL under the
name "nccl"), so most of the data path is shared; the differences are the host-registration
call and the vendor label.
"""
from __future__ import annotations

import ctypes
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


def detect_vendor(rank: int | None = None) -> str:
    """This process's vendor label: HETCCL_VENDOR if set (any non-empty label; this is how
    several vendors are emulated on one kind of hardware), else HETCCL_VENDOR_SPLIT's label for
    this process, else derived from the torch build.

    HETCCL_VENDOR_SPLIT labels a process by its launch rank: RANK when a launcher sets it
    (torchrun, hetccl run; a Megatron layout may renumber ranks later, the label stays with the
    process), else `rank` (the backend passes the default-group rank it was created with: the
    mp.spawn / init_process_group(rank=...) case). Neither known: ValueError, as a silent
    guess would put every process in one vendor group."""
    label = config.get("HETCCL_VENDOR")
    if label:
        return label
    split = config.get("HETCCL_VENDOR_SPLIT")
    if split:
        from .launch import vendor_labels

        labels = vendor_labels(split)
        env_rank = os.environ.get("RANK")
        if env_rank is not None and env_rank != "":
            rank = int(env_rank)
        elif rank is None:
            raise ValueError(f"hetccl: HETCCL_VENDOR_SPLIT={split!r} labels processes by rank, "
                             f"but this process's rank is unknown (no RANK variable, and no "
                             f"process group yet); set RANK or HETCCL_VENDOR")
        if not 0 <= rank < len(labels):
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


class RawRuntime:
    """The vendor runtime's own asynchronous copy and event calls, through ctypes, for the
    zero-copy staging loop (staging.py): it issues a few calls per chunk, and torch's Python
    wrappers (stream context managers, Event objects, device-index lookups) cost tens of
    microseconds each, which at PCIe speed is a large part of a chunk's time. Same library that
    torch already loaded (libcudart for CUDA, libamdhip64 for ROCm/HIP), same device context.

    Contract: handles are plain ints (stream.cuda_stream, event pointers); every call raises
    RuntimeError naming the call and the runtime's error string on failure; events are created
    without timing (cheapest record/query) and reused by the caller."""

    D2H, H2D = 2, 1  # cudaMemcpyDeviceToHost / HostToDevice (same values in HIP)

    def __init__(self, lib: ctypes.CDLL, prefix: str):
        self.prefix = prefix
        f = lambda name: getattr(lib, prefix + name)  # noqa: E731
        self._memcpy = f("MemcpyAsync")
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_void_p]
        self._ev_create = f("EventCreateWithFlags")
        self._ev_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._ev_record = f("EventRecord")
        self._ev_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._ev_query = f("EventQuery")
        self._ev_query.argtypes = [ctypes.c_void_p]
        self._ev_destroy = f("EventDestroy")
        self._ev_destroy.argtypes = [ctypes.c_void_p]
        self._wait = f("StreamWaitEvent")
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._errstr = f("GetErrorString")
        self._errstr.restype = ctypes.c_char_p
        self._not_ready = 600  # cudaErrorNotReady (hipErrorNotReady is 600 too)

    def _check(self, what: str, err: int) -> None:
        if err:
            raise RuntimeError(f"hetccl: {self.prefix}{what} failed: error {err} "
                               f"({self._errstr(err).decode(errors='replace')})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check("MemcpyAsync", self._memcpy(dst, src, nbytes, kind, stream))

    def event(self) -> int:
        ev = ctypes.c_void_p()
        self._check("EventCreateWithFlags", self._ev_create(ctypes.byref(ev), 2))  # DisableTiming
        return ev.value

    def record(self, event: int, stream: int) -> None:
        self._check("EventRecord", self._ev_record(event, stream))

    def done(self, event: int) -> bool:
        err = self._ev_query(event)
        if err == self._not_ready:
            return False
        self._check("EventQuery", err)
        return True

    def stream_wait(self, stream: int, event: int) -> None:
        self._check("StreamWaitEvent", self._wait(stream, event, 0))

    def destroy(self, event: int) -> None:
        self._ev_destroy(event)


@functools.lru_cache(maxsize=None)
def raw_runtime() -> RawRuntime | None:
    """The runtime library torch already loaded into this process, or None (then the staging
    loop uses torch's calls). Found by name in /proc/self/maps, so it is the very copy torch uses."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    is_rocm = bool(getattr(torch.version, "hip", None))
    stem, prefix = ("libamdhip64.so", "hip") if is_rocm else ("libcudart.so", "cuda")
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(name).startswith(stem):
                    path = name
                    break
    except OSError:
        pass
    if path is None:  # statically linked runtime, or an unusual layout
        return None
    try:
        return RawRuntime(ctypes.CDLL(path), prefix)
    except (OSError, AttributeError):
        return None


def seam_for(device: torch.device) -> DeviceSeam | None:
    return DeviceSeam(device) if device.type == "cuda" else None
