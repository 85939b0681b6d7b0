"""The engine behind one multi-vendor process group.

It owns the group's topology, the native communicator of this rank's vendor group, the bridge
to the other vendor groups, and one worker thread that runs the group's collectives in the
order they were issued (every rank issues them in the same order, so sequence numbers, and
therefore bridge tags, agree without negotiation).

Contract with the torch face (backend.py):
  * submit(name, fn, outputs, tensors) returns a Work at once; fn(ctx) runs on the worker.
    Work.wait() raises the collective's error, if any. For device tensors the work runs on a
    comm stream that first waits on the caller's current stream; the future completes on
    that stream, so wait() only orders the caller's stream after it (no host block there).
  * Argument checking (HETCCL_CHECK_ARGS, default on): before moving data, every rank learns
    every rank's (collective, element count, dtype, op, root) through the bridge plus a tiny
    native all-gather, so all ranks reach the same verdict and raise the same clear error
    instead of hanging on mismatched sizes.
  * A communication failure (peer death, timeout, protocol error) makes the group unusable:
    later operations fail at once with an error naming the first failure, never a hang.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import config, vendor
from ._core import HOST_REDUCE_DTYPES, CommError, _C
from .bridge import Bridge, torch_dtype_name
from .native import NativeGroup
from .topology import Topology

log = logging.getLogger("hetccl")

COLL_CODES = {name: i + 1 for i, name in enumerate(
    ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
     "gather", "scatter", "barrier"])}
OP_CODES = {None: 0, "sum": 1, "prod": 2, "min": 3, "max": 4, "avg": 5,
            "band": 6, "bor": 7, "bxor": 8}  # bitwise: backend.py builds them from copy ops
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.int16, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
HEADER_LEN = 6
TAG_WINDOW = 1024
# Chunk of the host pair kernel: small enough that a reduced chunk is still in L1/L2 when its
# sum is written back into the slot, large enough to amortise the per-slot handshake (128 KiB
# measured best on the CPU machines against 64 KiB-1 MiB; docs/benchmarks.md).
PAIR_CHUNK_BYTES = 128 << 10


class HetcclWork(dist.Work):
    """Work backed by a torch Future that the engine completes (or fails)."""

    def __init__(self, fut: torch.futures.Future, outputs: Any = None):
        super().__init__()
        self.fut = fut
        self.outputs = outputs

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002 - group timeout applies
        self.fut.wait()
        return True

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        if not self.fut.done():
            return False
        try:
            self.fut.value()
            return True
        except Exception:  # noqa: BLE001
            return False

    def exception(self):
        try:
            self.fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def result(self):
        return self.outputs


class Engine:
    def __init__(self, store, rank: int, size: int, timeout: timedelta, topo: Topology,
                 name: str = ""):
        self.rank, self.size, self.timeout, self.topo, self.name = rank, size, timeout, topo, name
        self.local = None
        self.bridge = None
        self._seq = 0
        self._broken: BaseException | None = None
        self._closed = False
        # raw runtime events of the GPU staging loop, per device index (staging._RawOps)
        self.raw_events: dict[int, list] = {}
        self.chunk_bytes = int(config.get("HETCCL_CHUNK_BYTES"))
        self.check_args = bool(config.get("HETCCL_CHECK_ARGS"))
        # read once, as the bridge checked them across ranks at start (config.MUST_AGREE)
        self.host_kernel = bool(config.get("HETCCL_HOST_KERNEL"))
        self.zc_min_bytes = int(config.get("HETCCL_ZC_MIN_BYTES"))
        try:
            if topo.local_size > 1:
                self.local = NativeGroup(store, topo.labels[topo.my_group], topo.local_rank,
                                         topo.local_size, timeout)
            self.bridge = Bridge(store, topo, timeout)
        except BaseException:
            self.close()
            raise
        self._bounce: dict[tuple[int, str], torch.Tensor] = {}
        self._stage: dict[int, torch.Tensor] = {}
        self._streams: dict[Any, Any] = {}
        self._seam_of: dict[torch.device, Any] = {}
        # bytes sent by the zero-copy GPU path and by the staged path (tests and doctor read it)
        self.stats = {"zero_copy_bytes": 0, "staged_bytes": 0, "pair_kernel_bytes": 0}
        self._q: queue.Queue = queue.Queue()
        self._exec = threading.Lock()
        self._worker = threading.Thread(target=self._run, name=f"hetccl-{name or rank}",
                                        daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            with self._exec:
                self._execute(*item)

    def _execute(self, fn, fut, outputs, device, ready) -> None:
        try:
            if self._broken is not None:
                raise CommError(f"hetccl: process group {self.name!r} is unusable after an "
                                f"earlier failure: {self._broken}")
            if device is not None and device.type == "cuda":
                stream = self._comm_stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    if ready is not None:
                        stream.wait_event(ready)
                    fn()
                    fut.set_result(outputs)
            else:
                fn()
                fut.set_result(outputs)
        except (ValueError, TypeError, NotImplementedError) as e:
            # argument errors: every rank reached the same verdict, the group stays usable
            fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001
            if self._broken is None and not isinstance(e, _ArgMismatch):
                self._broken = e
                log.error("hetccl: rank %d: %s", self.rank, e)
            fut.set_exception(e)

    def copy_streams(self, device: torch.device):
        """(d2h, h2d, reduce) streams of the GPU data path, one set per device: the copy
        engines of both directions and the reductions of received chunks each get their own
        stream, so an H2D copy never queues behind a reduction kernel."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = ("copy", idx)
        trio = self._streams.get(key)
        if trio is None:
            trio = self._streams[key] = tuple(torch.cuda.Stream(device=idx) for _ in range(3))
        return trio

    def seam(self, device: torch.device):
        s = self._seam_of.get(device)
        if s is None:
            s = self._seam_of[device] = vendor.seam_for(device)
            self.bridge._seams.append(s)
        return s

    def _comm_stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def submit(self, fn: Callable[[], None], outputs: Any, tensors: list[torch.Tensor],
               async_op: bool = True) -> HetcclWork:
        """Queue fn for the worker, or, for a synchronous op while nothing is queued, run it
        right here: the caller waits anyway, and skipping the thread hand-off saves tens of
        microseconds per small collective. Order is kept: the worker and inline callers hold
        the same execution lock, and inline runs only when the queue is empty."""
        if self._closed:
            raise RuntimeError("hetccl: operation on a process group that was shut down")
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        ready = None
        if device is not None and device.type == "cuda":
            fut = torch.futures.Future(devices=[device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            stream = self._comm_stream(device)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)
        else:
            fut = torch.futures.Future()
        item = (fn, fut, outputs, device, ready)
        if not async_op and self._q.empty() and self._exec.acquire(blocking=False):
            try:
                if self._q.empty():
                    self._execute(*item)
                    return HetcclWork(fut, outputs)
            finally:
                self._exec.release()
        self._q.put(item)
        return HetcclWork(fut, outputs)

    def next_ctx(self, device: torch.device) -> "EngineCtx":
        """Called on the worker: a context with a fresh sequence number and deadline."""
        self._seq += 1
        return EngineCtx(self, self._seq, time.monotonic() + self.timeout.total_seconds(),
                         device)

    # ------------------------------------------------------------------ buffers
    def bounce(self, slot: int, dtype: torch.dtype, numel: int, pinned: bool) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        key = (slot, "pinned" if pinned else "host")
        buf = self._bounce.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.chunk_bytes), dtype=torch.uint8,
                              pin_memory=pinned)
            self._bounce[key] = buf
        return buf[:nbytes].view(dtype)

    def stage(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._stage.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.chunk_bytes), dtype=torch.uint8, pin_memory=True)
            self._stage[slot] = buf
        return buf[:nbytes]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_worker", None) is not None:
            self._q.put(None)
            self._worker.join(timeout=5)
        if self.bridge is not None:
            self.bridge.close()
        if self.local is not None:
            self.local.close()
        if self.raw_events:
            from . import vendor

            rt = vendor.raw_runtime()
            for events in self.raw_events.values():
                for ev in events:
                    rt.destroy(ev)
            self.raw_events = {}


class _ArgMismatch(ValueError):
    pass


class _HostReq:
    """Adapts a bridge request to the algorithms' Req protocol."""

    __slots__ = ("req",)

    def __init__(self, req):
        self.req = req

    def wait(self, deadline: float) -> int:
        return self.req.wait(deadline)


class EngineCtx:
    """CollCtx implementation (see algorithms/common.py) for host and device tensors."""

    def __init__(self, engine: Engine, seq: int, deadline: float, device: torch.device):
        self.engine = engine
        self.topo = engine.topo
        self.local = engine.local
        self.seq = seq
        self.deadline = deadline
        self.device = device
        self.chunk_bytes = engine.chunk_bytes
        self._dev = device.type == "cuda"
        self._pending_h2d: dict[int, tuple] = {}

    def tag(self, phase: int, index: int) -> int:
        # Sequence numbers wrap at TAG_WINDOW: a group runs one collective at a time, so
        # reusing a tag 1024 collectives later cannot match a stale message (matching is FIFO
        # per (peer, tag)), and transports that keep per-tag state (tcp) stay bounded.
        return ((self.seq % TAG_WINDOW) << 16) | (phase << 13) | index

    def isend(self, peer: int, t: torch.Tensor, tag: int, slot=None):
        if t.is_cuda:
            raw = _bytes_view(t)
            st = self.engine.stage(1000 + slot, raw.numel())
            self.engine.stats["staged_bytes"] += raw.numel()
            st.copy_(raw)  # D2H on the comm stream; synchronous with respect to the host
            return self.engine.bridge.isend(peer, st, tag)
        return self.engine.bridge.isend(peer, t, tag)

    def irecv(self, peer: int, t: torch.Tensor, tag: int, slot=None):
        if t.is_cuda:
            raw = _bytes_view(t)
            st = self.engine.stage(2000 + slot, raw.numel())
            self._pending_h2d[slot] = (raw, st)
            return self.engine.bridge.irecv(peer, st, tag)
        return self.engine.bridge.irecv(peer, t, tag)

    def irecv_reduce(self, peer: int, t: torch.Tensor, tag: int, op: str):
        return self.engine.bridge.irecv_reduce(peer, t, tag, op)

    def pair_allreduce(self, peer: int, give: torch.Tensor, keep: torch.Tensor, op: str,
                       tag: int) -> bool:
        """Two-rank ring all-reduce of give|keep with `peer` as one C++ loop on this thread
        (csrc/exchange.h); False when it does not apply (device tensors, a transport without a
        zero-copy ring, HETCCL_HOST_KERNEL=0) and the caller takes the generic path."""
        if self._dev or not self.engine.host_kernel:
            return False
        bridge = self.engine.bridge
        if not bridge.zero_copy([peer]):
            return False
        bridge.pair_allreduce(peer, give, keep, op, tag, PAIR_CHUNK_BYTES, self.deadline)
        self.engine.stats["pair_kernel_bytes"] += (give.numel() + keep.numel()) * keep.element_size()
        return True

    def finish_recv(self, t: torch.Tensor, slot) -> None:
        if t.is_cuda:
            raw, st = self._pending_h2d.pop(slot)
            raw.copy_(st)

    def bounce(self, slot: int, like: torch.Tensor, numel: int) -> torch.Tensor:
        return self.engine.bounce(slot, like.dtype, numel, pinned=like.is_cuda)

    def reduce_into(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
        reduce_into(dst, src, op)

    def wait_native(self, work) -> None:
        work.wait()

    def device_transfer(self, phase: int, sends, recvs, op) -> bool:
        """Zero-copy GPU path (staging.py) when the data is on a device and every peer shares
        this host's memory; False lets transfer() take the generic path."""
        if not self._dev:
            return False
        peers = {s[0] for s in sends} | {r[0] for r in recvs}
        nbytes = sum(v.numel() * v.element_size() for *_, v in list(sends) + list(recvs))
        if nbytes < self.engine.zc_min_bytes:
            return False
        bridge = self.engine.bridge
        if not peers or not bridge.zero_copy(peers):
            return False
        from . import staging

        staging.device_transfer(self, phase, sends, recvs, op, self.engine.seam(self.device),
                                bridge.slot_bytes)
        return True


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_TORCH_OPS = {
    "sum": lambda d, s: d.add_(s),
    "prod": lambda d, s: d.mul_(s),
    "min": lambda d, s: torch.minimum(d, s, out=d),
    "max": lambda d, s: torch.maximum(d, s, out=d),
}


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = op(dst, src), elementwise. Host tensors of the core's dtypes use the C++ kernels;
    device tensors and other dtypes use torch's own kernels (on the current stream)."""
    if dst.numel() == 0:
        return
    if dst.is_cuda:
        if not src.is_cuda:
            src = src.to(dst.device, non_blocking=False)
        _TORCH_OPS[op](dst, src)
        return
    name = torch_dtype_name(dst.dtype)
    if name in HOST_REDUCE_DTYPES:
        _C.reduce_into(op, name, dst.data_ptr(), src.data_ptr(), dst.numel(),
                       int(config.get("HETCCL_REDUCE_THREADS")))
    else:
        if dst.dtype == torch.bool:
            r = {"sum": torch.logical_or, "max": torch.logical_or, "prod": torch.logical_and,
                 "min": torch.logical_and}[op]
            r(dst, src, out=dst)
        else:
            _TORCH_OPS[op](dst, src)


def check_headers(ctx: EngineCtx, coll: str, numel: int, dtype: torch.dtype, op: str | None,
                  root: int = -1, same_numel: bool = True) -> None:
    """Exchange (collective, numel, dtype, op, root) among all ranks and raise the same clear
    error on every rank if they disagree."""
    topo = ctx.topo
    device_code = {"cpu": 1, "cuda": 2}.get(ctx.device.type, 3)
    mine = torch.tensor([COLL_CODES[coll], numel, DTYPE_CODES.get(dtype, 0), OP_CODES[op], root,
                         device_code], dtype=torch.int64)
    table = torch.zeros(topo.size, HEADER_LEN, dtype=torch.int64)
    table[topo.rank] = mine
    bridge = ctx.engine.bridge
    tag = ctx.tag(7, 8191)
    reqs = []
    peers = bridge.peers
    for p in peers:
        reqs.append(bridge.irecv(p, table[p], tag))
    for p in peers:
        reqs.append(bridge.isend(p, mine, tag))
    for r in reqs:
        r.wait(ctx.deadline)
    if topo.local_size > 1:
        got = torch.empty(topo.local_size * HEADER_LEN, dtype=torch.int64)
        ctx.local.all_gather(got, mine).wait()
        for i, r in enumerate(topo.local_ranks):
            table[r] = got[i * HEADER_LEN:(i + 1) * HEADER_LEN]
    fields = [(0, "collective"), (2, "dtype"), (3, "reduction op"), (4, "root"),
              (5, "device type")]
    if same_numel:
        fields.insert(1, (1, "number of elements"))
    names = {"collective": {v: k for k, v in COLL_CODES.items()},
             "dtype": {v: str(k) for k, v in DTYPE_CODES.items()},
             "reduction op": {v: k for k, v in OP_CODES.items()},
             "device type": {1: "cpu", 2: "cuda", 3: "other"}}
    for col, what in fields:
        vals = table[:, col].tolist()
        if len(set(vals)) > 1:
            by: dict[Any, list[int]] = {}
            for r, v in enumerate(vals):
                by.setdefault(names.get(what, {}).get(v, v), []).append(r)
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
            raise _ArgMismatch(f"hetccl: {coll}: {what} differs across ranks ({detail}). "
                               f"Every rank must call the same collective with matching "
                               f"tensors.")
