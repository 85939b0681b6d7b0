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
import time

import torch
import torch.distributed as dist

from .. import tuning


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

    def idle(self, timeout_s: float) -> bool:
        """Whether everything queued on the launch's streams so far has run, waiting at most
        timeout_s (a stream stuck on a wait that will never pass stays busy: False)."""
        evs = []
        for s in (self.comm, self.side):
            ev = torch.cuda.Event()
            ev.record(s)
            evs.append(ev)
        end = time.monotonic() + timeout_s
        while not all(ev.query() for ev in evs):
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    def current_handle(self) -> int:
        """The caller's current stream on this device (what a Work's wait() orders)."""
        return torch.cuda.current_stream(self.index).cuda_stream

    def future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=self._devices)

    # point-to-point works (work.StreamWork): one event per message, recorded right after it, so
    # a wait orders the caller after that message only, not after later ones on the stream
    def record(self):
        ev = torch.cuda.Event()
        ev.record(self.comm)
        return ev

    def wait_event(self, ev) -> None:
        torch.cuda.current_stream(self.index).wait_event(ev)

    @staticmethod
    def query(ev) -> bool:
        return ev.query()

    def complete_after(self, ev, fut, value) -> None:
        """Completes fut with value on a stream that waits for ev (the side stream, which
        point-to-point launches do not use otherwise)."""
        self.side.wait_event(ev)
        prev = torch.cuda.current_stream(self.index)
        torch.cuda.set_stream(self.side)
        try:
            fut.set_result(value)
        finally:
            torch.cuda.set_stream(prev)


# The caller's current stream on a device, as the C API route issues on it (CallerStream,
# once per call): torch.cuda.current_stream() builds a new Stream object each
# time (~3-5 us on the GPU box, tests/gpu_dropin_bench.py --profile-issue); the raw handle
# comes from torch's C binding in well under a microsecond, and one Stream object per (device,
# handle) is kept. A handle names one stream for as long as it lives (torch's pool streams
# never go; an external stream whose handle comes back names the same raw stream), so the
# cached object stays right. Where the private bindings are missing, the public calls.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def current_stream(index: int):
    """(torch.cuda.Stream, raw handle) of device `index`'s current stream."""
    if _RAW_STREAM is None:
        s = torch.cuda.current_stream(index)
        return s, s.cuda_stream
    h = _RAW_STREAM(index)
    s = _STREAMS.get((index, h))
    if s is None:
        s = torch.cuda.current_stream(index)
        if s.cuda_stream != h:  # not what the binding said: no caching
            return s, s.cuda_stream
        if len(_STREAMS) > 1024:  # bounded (external streams come and go)
            _STREAMS.clear()
        _STREAMS[(index, h)] = s
    return s, h


def current_device() -> int:
    """torch.cuda.current_device() without its per-call lazy-init check (CUDA is initialized
    once a CUDA tensor exists, which is when the route asks)."""
    return _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()


class CallerStream:
    """The caller's current stream on one device, for work enqueued on it directly (the C API
    route, hetccl/face_capi.py: no stream of hetccl's own, ordered as the caller's own
    kernels). `handle` is the raw stream (0: the legacy default stream)."""

    __slots__ = ("stream", "index", "handle")

    def __init__(self, index: int):
        self.index = index
        self.stream, self.handle = current_stream(index)

    def current(self) -> bool:
        """Whether the stream's device is the current device (the runtime's calls need it)."""
        return current_device() == self.index

    def device_guard(self):
        return torch.cuda.device(self.index)

    def keep(self, tensors) -> None:
        """The allocator must not hand the tensors out before the stream ran past here."""
        for t in tensors:
            t.record_stream(self.stream)

    def record(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    # Deferred joins (hetccl/face_capi.py CapiWork): the then-current stream, one side stream
    # per device (is_completed, get_future, a work dropped unwaited), and tensors and events on
    # a given stream.
    _SIDE: dict[int, "torch.cuda.Stream"] = {}

    def current_stream(self):
        """(stream, raw handle) of the device's then-current stream."""
        return current_stream(self.index)

    def side(self):
        """(stream, raw handle) of the device's side stream."""
        s = CallerStream._SIDE.get(self.index)
        if s is None:
            s = CallerStream._SIDE[self.index] = torch.cuda.Stream(self.index)
        return s, s.cuda_stream

    @staticmethod
    def keep_on(tensors, stream) -> None:
        for t in tensors or ():
            t.record_stream(stream)

    @staticmethod
    def record_on(stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    @staticmethod
    def wait(ev, index: int) -> None:
        """Orders the then-current stream of device `index` after ev."""
        torch.cuda.current_stream(index).wait_event(ev)

    @staticmethod
    def query(ev) -> bool:
        return ev.query()

    @staticmethod
    def future_after(ev, index: int, value) -> torch.futures.Future:
        """A device future holding value, completed on a side stream that waits for ev."""
        fut = torch.futures.Future(devices=[torch.device("cuda", index)])
        side = torch.cuda.Stream(index)
        side.wait_event(ev)
        with torch.cuda.stream(side):
            fut.set_result(value)
        return fut


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
    ucx_copy_paths: tuple[str, ...] = ("cuda_copy",)
    # kernel modules through which an RDMA NIC registers this memory as a peer-memory client
    peer_memory_modules: tuple[str, ...] = ("nvidia_peermem", "nv_peer_mem")
    # default shared-memory and staging slot (bridge.py) where devices stage: the device
    # table's largest chunk (a larger slot would never be filled)
    staging_slot_bytes = tuning.max_chunk(tuning.DEVICE)
    # default shared memory one rank creates (HETCCL_SHM_BUDGET_BYTES); pinned on GPU hosts
    shm_budget_bytes = 64 << 20
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

    graph_name = "CUDA graph"  # what the vendor calls a captured stream's graph (messages)

    @staticmethod
    def capturing() -> bool:
        """Whether the current stream is capturing a CUDA graph (HIP graphs on ROCm builds)."""
        return torch.cuda.is_current_stream_capturing()

    def caller_stream(self, device: torch.device) -> CallerStream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return CallerStream(idx)

    def launch(self, device: torch.device, tensors, cache: dict, join, kind=None) -> Launch:
        """cache: the process group's own streams (per device): two groups never share a
        stream, or their collectives could wait on each other across ranks in different orders.
        join(index, waiter_handle, waitee_handle): orders waiter after waitee's queued work.
        kind: None for collectives; "send" / "recv" for point-to-point messages
        (engine_messages.cc), which get streams of their own, apart from the collectives', so
        that a send never waits behind a receive (isend and irecv with one peer, posted alike on
        both ranks) and no message waits behind a collective. The launch's stream first waits
        for the caller's current stream; the tensors are recorded on it for the allocator."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = idx if kind is None else (idx, kind)
        launch = cache.get(key)
        if launch is None:
            launch = cache[key] = Launch(torch.cuda.Stream(device=idx),
                                         torch.cuda.Stream(device=idx), idx)
        join(idx, launch.comm_handle, torch.cuda.current_stream(idx).cuda_stream)
        for t in tensors:
            if t.is_cuda:  # torch.cuda's allocator (ROCm builds: HIP's, under the same name)
                t.record_stream(launch.comm)
        return launch

    # ------------------------------------------------------------------------- placement
    # CUDA_VISIBLE_DEVICES is honoured by CUDA and by ROCm's HIP runtime alike.
    visible_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def count_devices(cls) -> int:
        """GPUs of this host, whatever visible_env says, through the management library
        (NVML), without initialising the runtime; -1 when they cannot be counted."""
        try:
            n = int(torch.cuda._raw_device_count_nvml())
        except Exception:  # noqa: BLE001 - no management library: not counted
            n = -1
        if n < 0 and os.path.isdir("/proc/driver/nvidia/gpus"):
            n = len(os.listdir("/proc/driver/nvidia/gpus"))
        return n

    @classmethod
    def visible_devices(cls, env) -> list[str]:
        """The GPUs a process started with env would see, as entries for visible_env, WITHOUT
        initialising the runtime (a process whose runtime is initialised can no longer be
        shown fewer GPUs): visible_env's entries when it is set, else 0..n-1. [] when there is
        no GPU or it cannot be counted."""
        listed = env.get(cls.visible_env)
        n = cls.count_devices()
        if listed is None:
            return [str(i) for i in range(max(n, 0))]
        items = [e.strip() for e in listed.split(",") if e.strip()]
        # Launchers list GPUs that do not exist (the deepspeed launcher writes 0,1 for
        # --num_gpus 2 on a one-GPU host): ordinals past the host's count are dropped, as the
        # runtime would. UUIDs and MIG names are kept as they are.
        if n >= 0:
            items = [e for e in items if not e.isdigit() or int(e) < n]
        return items

    @classmethod
    def show_only(cls, env, device: str) -> None:
        """Make `device` (an entry of visible_devices()) the only GPU of a process started
        with env."""
        env[cls.visible_env] = device
