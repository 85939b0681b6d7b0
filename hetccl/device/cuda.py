"""torch's "cuda" device type: NVIDIA GPUs (CUDA) and AMD GPUs (ROCm/HIP, which torch exposes
under the same name). The one module that calls torch.cuda.

Stream semantics of a collective on device tensors (what DDP and FSDP expect, as with NCCL):
  * launch() makes the engine's comm stream of the device wait for the caller's current stream
    (everything queued before the call), records the tensors on it for the caching allocator,
    and returns the comm stream (receives, reductions, native steps) and a side stream (sends):
    the engine enqueues its copies on them and the two copy directions overlap;
  * the Work's future is completed on the comm stream, so work.wait() makes the caller's stream
    wait and never blocks the host.
The engine's copies and flag operations go through the vendor runtime the process already
loaded (libcuda for CUDA, libamdhip64 for ROCm), opened by the C++ core (csrc/device_ops.cc).
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


class CudaSeam:
    type = "cuda"
    native_backend = "nccl"  # NCCL on CUDA builds, RCCL on ROCm builds
    asynchronous = True

    def __init__(self):
        self.is_rocm = bool(getattr(torch.version, "hip", None))

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

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
        """hetccl._C.DeviceOps over the vendor runtime torch loaded (CUDA driver / HIP)."""
        from .._core import _C

        torch.cuda.init()
        if self.is_rocm:
            lib = _loaded_library(("libamdhip64.so",)) or "libamdhip64.so"
            return _C.device_ops("hip", lib)
        lib = _loaded_library(("libcuda.so",)) or "libcuda.so.1"
        return _C.device_ops("cuda", lib)

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
            if t.is_cuda:
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
