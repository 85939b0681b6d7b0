"""NVIDIA GPUs: torch's "cuda" device type on CUDA builds of torch. The stream, event and future
handling here is torch.cuda's and serves AMD too (ROCm builds of torch expose HIP as torch.cuda):
rocm.py subclasses this module's seam and replaces only the vendor facts (runtime, native
library, memory type, vendor label). These two modules are the only ones that call torch.cuda.

Stream semantics of a collective on device tensors (what DDP and FSDP expect, as with NCCL):
  * launch() makes the engine's comm stream of the device wait for the caller's current stream
    (everything queued before the call), records the tensors on it for the caching allocator,
    and returns the comm stream (receives, reductions, native steps) and a side stream (sends):
    the engine enqueues its copies on them and the two copy directions overlap;
  * the Work's future is completed on the comm stream, so work.wait() makes the caller's stream
    wait and never blocks the host.
The engine's copies and flag operations go through the vendor runtime the process already
loaded (here the CUDA driver, libcuda), opened by the C++ core's CUDA module
(csrc/device/cuda_ops.cc).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist


def _loaded_library(stems: tuple[str, ...]) -> str | None:
    """Path of an already-loaded shared library whose file name starts with one of stems."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(name).startswith(stems):
                    return name
    except OSError:
        pass
    return None


class Launch:
    """One collective's streams: `comm` (current inside `with launch:`), `side`, and their raw
    handles for the engine."""

    __slots__ = ("comm", "side", "comm_handle", "side_handle", "index", "_prev", "_devices")

    def __init__(self, comm, side, index):
        self.comm, self.side, self.index = comm, side, index
        self._devices = [torch.device("cuda", index)]
        self.comm_handle = comm.cuda_stream
        self.side_handle = side.cuda_stream
        self._prev = None

    def __enter__(self):
        # torch.cuda.set_stream also makes the stream's device current; both are restored
        # on exit (cheaper than the device and stream context managers, per collective)
        self._prev = (torch.cuda.current_device(), torch.cuda.current_stream(self.index))
        torch.cuda.set_stream(self.comm)
        return self

    def __exit__(self, *exc):
        dev, stream = self._prev
        torch.cuda.set_stream(stream)
        if dev != self.index:
            torch.cuda.set_device(dev)
        return False

    def current_handle(self) -> int:
        """The caller's current stream on this device (what a Work's wait() orders)."""
        return torch.cuda.current_stream(self.index).cuda_stream

    def future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=self._devices)


def _native_library_path(stems: tuple[str, ...], torch_lib_names: tuple[str, ...]) -> str | None:
    """The native library's file: the copy already loaded, else one shipped beside torch."""
    path = _loaded_library(stems)
    if path:
        return path
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for n in torch_lib_names:
        p = os.path.join(lib_dir, n)
        if os.path.exists(p):
            return p
    return None


class CudaSeam:
    type = "cuda"
    build = "cuda"            # vendor.build_kind() of a process this seam serves
    vendor = "nvidia"         # its vendor label
    runtime_name = "cuda"     # the C++ runtime module (csrc/device/cuda_ops.cc)
    runtime_library = ("libcuda.so", "libcuda.so.1")  # (file-name stem when loaded, dlopen name)
    native_backend = "nccl"   # torch's backend name inside a vendor group
    native_library = ("libnccl.so", "libnccl.so.2")   # NCCL: (stem when loaded, soname)
    asynchronous = True
    device_code = 2           # argument-check header code of torch's "cuda" type (rocm.py: same)
    memory_type = "cuda"      # UCX's / the transports' name of this device memory
    # UCX transports that move or map this vendor's device memory between processes
    ucx_device_paths: tuple[str, ...] = ("cuda_ipc", "gdr_copy")
    staging_slot_bytes = 8 << 20  # default shared-memory slot (bridge.py) where devices stage
    # dtypes NCCL reduces (checked before any communication starts)
    reduce_dtypes = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                               torch.int8, torch.uint8, torch.int32, torch.int64})

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def build_matches() -> bool:
        """Whether this torch build is this vendor's (CUDA: no HIP version)."""
        return not getattr(torch.version, "hip", None)

    @staticmethod
    def is_device(t: torch.Tensor) -> bool:
        return t.is_cuda

    def native_library_path(self) -> str | None:
        """The native library's file (loaded, or shipped with torch); None if neither."""
        stem, soname = self.native_library
        return _native_library_path((stem,), (soname,))

    def new_native(self, store, rank: int, size: int, timeout, group_name: str = "",
                   global_ranks=None):
        """Options mirror what torch's own init_process_group("nccl") sets."""
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        if group_name and hasattr(opts, "group_name"):
            opts.group_name = group_name
        if global_ranks and hasattr(opts, "global_ranks_in_group"):
            opts.global_ranks_in_group = list(global_ranks)
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    @functools.lru_cache(maxsize=1)
    def runtime(self):
        """hetccl._C.DeviceOps over the vendor runtime torch loaded (the copy in this process)."""
        from .._core import _C

        torch.cuda.init()
        stem, default = self.runtime_library
        return _C.device_ops(self.runtime_name, _loaded_library((stem,)) or default)

    def launch(self, device: torch.device, tensors, cache: dict, join) -> Launch:
        """cache: the process group's own streams (per device): two groups never share a
        stream, or their collectives could wait on each other across ranks in different orders.
        join(index, waiter_handle, waitee_handle): orders waiter after waitee's queued work."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        launch = cache.get(idx)
        if launch is None:
            launch = cache[idx] = Launch(torch.cuda.Stream(device=idx),
                                         torch.cuda.Stream(device=idx), idx)
        join(idx, launch.comm_handle, torch.cuda.current_stream(idx).cuda_stream)
        for t in tensors:
            if t.is_cuda:  # torch.cuda's allocator (ROCm builds: HIP's, under the same name)
                t.record_stream(launch.comm)
        return launch

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- placement
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"  # honoured by CUDA and by ROCm's HIP runtime alike


def visible_gpus(env=None) -> list[str]:
    """The GPUs this process would see, as entries for VISIBLE_ENV, WITHOUT initialising the
    runtime (a process whose runtime is initialised can no longer be shown fewer GPUs):
    the entries of VISIBLE_ENV when it is set, else 0..n-1 counted through NVML (NVIDIA) or
    amdsmi (AMD). [] when there is no GPU or it cannot be counted. env: the process's
    environment (default os.environ)."""
    listed = (os.environ if env is None else env).get(VISIBLE_ENV)
    if listed is not None:
        return [e.strip() for e in listed.split(",") if e.strip()]
    n = -1
    if torch.version.hip is not None:
        counter = getattr(torch.cuda, "_device_count_amdsmi", None)
    else:
        counter = getattr(torch.cuda, "_device_count_nvml", None)
    if counter is not None:
        try:
            n = int(counter())
        except Exception:  # noqa: BLE001 - no management library: counted as none
            n = -1
    if n < 0 and torch.version.hip is None and os.path.isdir("/proc/driver/nvidia/gpus"):
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    return [str(i) for i in range(max(n, 0))]


def show_one_gpu(env, gpu: str) -> None:
    """Make `gpu` (an entry of visible_gpus()) the only GPU of a process started with env."""
    env[VISIBLE_ENV] = gpu
