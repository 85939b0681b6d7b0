"""The torch face on the C API (``HETCCL_FACE_ROUTE=capi``, opt-in): the single-tensor
collectives of a cross-vendor group go straight to libhetccl's C API (csrc/hetccl.h, through
hetccl/capi.py's ctypes binding), the core the drop-in NCCL runs on, instead of the face's Python
schedule and engine (backend.py -> algorithms/ -> engine.py).

What it takes (CollRoute.take): all_reduce of one tensor, reduce, broadcast,
all_gather_into_tensor and reduce_scatter_tensor, dense, on CPU or CUDA, of the C API's ten
dtypes plus bool (on its bytes, SUM/PROD as MAX/MIN, as ProcessGroupNCCL) and complex (SUM and
AVG on the real view); ops SUM, PRODUCT, MIN, MAX, AVG. Everything else (coalesced lists,
bitwise ops, PREMUL_SUM, int16, sparse, overlapping outputs, uneven shapes) stays on the face's
own path, which refuses or runs it as before.

Contract:
 * CUDA tensors: the call is enqueued on the caller's current stream (stream-ordered, as
   ProcessGroupNCCL's work after wait()); the host does not wait. The returned work's wait()
   makes the then-current stream wait for an event recorded after the call. A call that takes
   the C API's device route (large ones) is only handed over (HETCCL_FACE_DEFER_JOIN, default
   on: hetcclCommDeferJoin): its work's wait() joins it (hetcclCommJoin: the then-current
   stream waits for the route's done word), as ProcessGroupNCCL's wait() orders the current
   stream after its own stream; the work keeps the call's tensors until it is joined (a work
   dropped unwaited joins on a side stream, so the allocator never hands them out early).
   is_completed() and get_future() join on that side stream. A failure after
   issue (a peer died, ranks' arguments differed) is the C API's asynchronous error: the
   communicator breaks, every stream is still released, and wait() and every later routed call
   raise it (NCCL's semantics; the face's own path checks CUDA calls inline instead).
 * CPU tensors: the C API's host call, blocking; the argument check runs inline, so a mismatch
   or a rank's refusal raises ValueError on every rank and the group stays usable. Blocking
   (host calls, and the marker below, which is a host call on CUDA groups too) means two
   groups whose async calls the ranks issue in different orders wait for each other until the
   timeout, where the face's own path (a worker per group) runs them.
 * Route decision: from the call alone (collective, dtype, op, layout). Every other collective
   call of the group (these five in forms the route does not take, and every other collective:
   gather, all_to_all, barrier, ...) first meets its peers on the C API's check with a marker
   (CollRoute.declined: an empty all_to_all, which no routed call is), so ranks that disagree
   on the route (one rank's call routed, another's not: already a bad call) fail on every rank
   instead of waiting until the timeout. Trade-off: one small exchange more per call the route
   does not take. Point-to-point calls are not marked (they are not collective).
 * Half-precision AVG is NCCL's: a PreMulSum by 1/n (so a sum near the top of float16's range
   does not overflow), as the face's own path.
 * Vendor groups: the C API runs flat rings over every rank (docs/capi.md); no native NCCL
   step inside a vendor group yet, so groups of more than one GPU per vendor are better served
   by the face's own path for now.

The communicator is made on the first routed call (every rank makes its first routed call at
the same point of the group's collective order): rank 0 makes the unique id and hands it over
the group's store.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from . import capi, config, device as devices
from ._core import ArgMismatch, CommError, PeerFailure

# torch dtype -> the C API's (NCCL's) datatype code
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
           torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
for _name, _code in (("uint32", 3), ("uint64", 5)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# torch's reduction (ReduceOp.op) -> the route's op name, for the ops the route takes
_RED = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MAX: "max",
        dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}
_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
_HALF = (torch.float16, torch.bfloat16)


def _raise(e: capi.HetcclError) -> None:
    """The C API's error as the face's own path raises it: arguments refused or differing across
    ranks -> ArgMismatch (a ValueError), a dead peer -> PeerFailure, else CommError."""
    if e.code in (capi.INVALID_ARGUMENT, capi.INVALID_USAGE):
        raise ArgMismatch(e.text) from None
    kind = PeerFailure if e.code == capi.REMOTE_ERROR else CommError
    raise kind(f"{e.text} [hetccl C API: {capi.RESULTS.get(e.code, e.code)}]") from None


def _as_c(t: torch.Tensor, op: str | None):
    """(tensor view the C API reduces, dtype code, op) or None when the route does not take it.
    bool: its bytes, SUM -> MAX and PROD -> MIN (ProcessGroupNCCL's mapping); complex: the real
    view for SUM and AVG (elementwise on the pairs)."""
    if t.dtype == torch.bool:
        if op == "avg":
            return None  # the face's own path raises ProcessGroupNCCL's TypeError
        return t.view(torch.uint8), 1, {"sum": "max", "prod": "min"}.get(op, op)
    if t.dtype in _COMPLEX:
        if op not in (None, "sum", "avg"):
            return None
        return torch.view_as_real(t), _DTYPES[_COMPLEX[t.dtype]], op
    code = _DTYPES.get(t.dtype)
    return None if code is None else (t, code, op)


class CapiWork(dist.Work):
    """A routed call's work. Host calls are done when made. Device calls carry an event
    recorded on the caller's stream after the call (`cs`: the seam's CallerStream): wait()
    makes the current stream wait on it and raises the communicator's asynchronous error, if
    any; is_completed() queries it. The torch Future (get_future) is made only when asked for
    (it costs more than the call)."""

    def __init__(self, route: "CollRoute", outputs, event=None, cs=None, ticket=0, tensors=None):
        super().__init__()
        self._route, self.outputs = route, outputs
        self._event, self._cs = event, cs
        self._fut = None
        # deferred join (the device route): the call's ticket and tensors, until joined
        self._ticket, self._tensors = ticket, tensors

    def _join_side(self) -> None:
        """Joins the call on the device's side stream (once), with an event after it."""
        if self._event is None:
            side, handle = self._cs.side()
            self._route.join(self._ticket, handle, self._cs)
            self._cs.keep_on(self._tensors, side)
            self._event = self._cs.record_on(side)
            self._tensors = None

    def wait(self, timeout=None) -> bool:
        if self._ticket:
            # the then-current stream waits for the route's done word (each wait: the stream
            # current then, as ProcessGroupNCCL's wait)
            cur, handle = self._cs.current_stream()
            self._route.join(self._ticket, handle, self._cs)
            if self._tensors is not None:  # once: the allocator waits for this stream's join
                self._cs.keep_on(self._tensors, cur)
                self._tensors = None
        elif self._event is not None:
            self._cs.wait(self._event, self._cs.index)
        self._route.raise_if_broken()
        return True

    def is_completed(self) -> bool:
        if self._ticket:
            self._join_side()
        return self._event is None or self._cs.query(self._event)

    def __del__(self):
        # dropped without a join: the tensors go back to the allocator only after the call
        if self._ticket and self._tensors is not None and self._event is None:
            try:
                self._join_side()
            except Exception:  # noqa: BLE001 - the group is gone: its end drained the route
                pass

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self):
        try:
            self._route.raise_if_broken()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            if self._ticket:
                self._join_side()
            if self._event is None:
                self._fut = torch.futures.Future()
                self._fut.set_result(self.outputs)
            else:
                self._fut = self._cs.future_after(self._event, self._cs.index, self.outputs)
        return self._fut

    def result(self):
        return self.outputs


class CollRoute:
    """One group's C API communicator and the routed calls on it."""

    def __init__(self, store, rank: int, size: int):
        self._store = dist.PrefixStore("hetccl/capi_route/", store)
        self._rank, self._size = rank, size
        self._comm: capi.Comm | None = None
        self._avg_ops: dict[int, int] = {}  # dtype code -> PreMulSum(1/n) operator
        self._lock = threading.Lock()
        self._closed = False
        # deferred joins (HETCCL_FACE_DEFER_JOIN): the C API's ticket word and the last value
        # read from it (a new value: the call just made was deferred)
        self._ticket = None
        self._last_ticket = 0
        self._unjoined = None  # (ticket, CallerStream) of the last deferred call: declined() joins it

    # ------------------------------------------------------------------ communicator
    def comm(self) -> capi.Comm:
        if self._comm is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("hetccl: the group was shut down")
                if self._comm is None:
                    # the C API's device runtime: this torch build's (cuda, or hip on ROCm)
                    acc = [devices.seam(t) for t in devices.SEAMS if devices.seam(t).asynchronous]
                    if acc:
                        config.set_for_this_process("HETCCL_CAPI_DEVICE", acc[0].runtime_name)
                    if self._rank == 0:
                        uid = capi.unique_id()
                        self._store.set("uid", uid)
                    else:
                        uid = self._store.get("uid")
                    try:
                        comm = capi.Comm(self._size, bytes(uid), self._rank)
                    except capi.HetcclError as e:
                        _raise(e)
                    if acc and config.get("HETCCL_FACE_DEFER_JOIN"):
                        try:
                            self._ticket = comm.defer_joins(True)
                        except capi.HetcclError:  # no stream path here: calls join at issue
                            self._ticket = None
                    self._comm = comm
        return self._comm

    def close(self, abort: bool = False) -> None:
        with self._lock:
            self._closed = True
            c, self._comm = self._comm, None
        if c is not None:
            try:
                c.abort() if abort else c.destroy()
            except capi.HetcclError:
                pass

    def raise_if_broken(self) -> None:
        c = self._comm
        if c is None:
            return
        try:
            code = c.async_error()
        except capi.HetcclError as e:
            _raise(e)
        if code not in (capi.SUCCESS, 7):  # 7: in progress (a nonblocking init)
            try:
                capi._check(code, c._c)  # the communicator's last error text
            except capi.HetcclError as e:
                _raise(e if e.text else capi.HetcclError(code, "the communicator is broken"))

    # ------------------------------------------------------------------ calls
    def _op_code(self, c: capi.Comm, op: str, code: int, dtype: torch.dtype) -> int:
        """The C API's op for a reduction: half-precision AVG is a PreMulSum by 1/n (one
        operator per dtype, made on first use), every other op its code."""
        if op != "avg" or dtype not in _HALF:
            return _OPS[op]
        red = self._avg_ops.get(code)
        if red is None:
            scalar = torch.tensor([1.0 / self._size], dtype=dtype, device="cpu").view(torch.uint8).numpy()
            try:
                red = self._avg_ops[code] = c.premul_sum(scalar, code)
            except capi.HetcclError as e:
                _raise(e)
        return red

    def _issue(self, c: capi.Comm, name: str, args: tuple, tensors, outputs, device: torch.device):
        """The C API's `name`(*args, comm, stream): on the caller's current stream for device
        tensors (stream-ordered, the host does not wait), a blocking host call for CPU ones;
        returns the work. The route's hot path (issue cost, docs/capi.md): the C function is
        called directly (capi.Comm.fn), no closure, no per-call conversion."""
        f = c.fn(name)
        seam = devices.seam(device.type)
        try:
            if not seam.asynchronous:
                c.check(f(*args, c._c, None))
                return CapiWork(self, outputs)
            cs = seam.caller_stream(device)
            handle = cs.handle or capi.STREAM_DEFAULT
            if cs.current():
                rc = f(*args, c._c, handle)
            else:
                with cs.device_guard():  # the C API works on the current device
                    rc = f(*args, c._c, handle)
            c.check(rc)
        except capi.HetcclError as e:
            _raise(e)
        if self._ticket is not None:
            t = self._ticket.value
            if t and t != self._last_ticket:  # deferred: joined by the work
                self._last_ticket = t
                self._unjoined = (t, cs)
                return CapiWork(self, outputs, None, cs, t, tensors)
        cs.keep(tensors)
        return CapiWork(self, outputs, cs.record(), cs)

    def join(self, ticket: int, stream_handle, cs) -> None:
        """The call of `ticket` joined on a stream (hetcclCommJoin), on the stream's device."""
        c = self._comm
        if c is None or self._closed:
            return  # closed: the route was drained when the communicator ended
        try:
            if cs.current():
                c.join(ticket, stream_handle or capi.STREAM_DEFAULT)
            else:
                with cs.device_guard():
                    c.join(ticket, stream_handle or capi.STREAM_DEFAULT)
        except capi.HetcclError as e:
            _raise(e)

    def all_reduce(self, t: torch.Tensor, op: str):
        v, code, op = _as_c(t, op)
        c = self.comm()
        p = v.data_ptr()
        return self._issue(c, "hetcclAllReduce", (p, p, v.numel(), code, self._op_code(c, op, code, v.dtype)),
                           [t], [t], t.device)

    def all_reduce_if_taken(self, t: torch.Tensor, opts):
        """all_reduce of one tensor through the route, or None where the route does not take
        it (the caller then declines it: declined()). What backend.allreduce calls first; the
        same decision as takes(), made without its general checks for the common case (a
        dense tensor of one of the C API's dtypes)."""
        red = opts.reduceOp if opts is not None else None
        op = "sum" if red is None else _RED.get(getattr(red, "op", red))
        if op is None:
            return None  # bitwise, PREMUL_SUM: the face's own path
        if t.dtype in _DTYPES and t.layout == torch.strided:  # the common case, decided here
            taken = t.is_contiguous() and t.device.type in devices.SEAMS
        else:  # bool, complex, sparse, ...: the general test
            taken = self.takes(op, t)
        return self.all_reduce(t, op) if taken else None

    def reduce(self, t: torch.Tensor, op: str, root: int):
        v, code, op = _as_c(t, op)
        c = self.comm()
        p = v.data_ptr()
        return self._issue(c, "hetcclReduce",
                           (p, p, v.numel(), code, self._op_code(c, op, code, v.dtype), root), [t], [t], t.device)

    def broadcast(self, t: torch.Tensor, root: int):
        v, code, _ = _as_c(t, None)
        c = self.comm()
        p = v.data_ptr()
        return self._issue(c, "hetcclBroadcast", (p, p, v.numel(), code, root), [t], [t], t.device)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        vo, code, _ = _as_c(out, None)
        vi, _, _ = _as_c(inp, None)
        c = self.comm()
        return self._issue(c, "hetcclAllGather", (vi.data_ptr(), vo.data_ptr(), vi.numel(), code),
                           [out, inp], [out], out.device)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str):
        vo, code, op = _as_c(out, op)
        vi, _, _ = _as_c(inp, op)
        c = self.comm()
        return self._issue(c, "hetcclReduceScatter",
                           (vi.data_ptr(), vo.data_ptr(), vo.numel(), code, self._op_code(c, op, code, vo.dtype)),
                           [out, inp], [out], out.device)

    def declined(self, coll: str) -> None:
        """A collective call this route does not take on this rank (a list of tensors, a
        bitwise op, an uneven shape, a collective it never takes): before the face's own path
        runs it, the ranks meet on the C API's check with a marker no routed call makes (an
        empty all_to_all). Where every rank declined, the marker passes (one small exchange) and the
        face's path follows; where a peer's call was routed, both checks see different
        collectives and every rank fails (this one here with ArgMismatch; a peer's CUDA call
        with the communicator's asynchronous error) instead of waiting until the timeout."""
        c = self.comm()
        # the face's own path reads and writes on the current stream: ordered after the route's
        # deferred calls first, as calls of one group see each other's results in issue order
        # (the C API does the same for its own calls: stream_path.h)
        u, self._unjoined = self._unjoined, None
        if u is not None:
            self.join(u[0], u[1].current_stream()[1], u[1])
        try:
            c.all_to_all(None, None, 0, 1, None)
        except capi.HetcclError as e:
            if e.code in (capi.INVALID_ARGUMENT, capi.INVALID_USAGE):
                raise ArgMismatch(
                    f"hetccl: {coll}: the ranks' calls differ in whether the C API route "
                    f"(HETCCL_FACE_ROUTE=capi) takes them (the marker all_to_all is this "
                    f"rank's: its call was not routed): {e.text}") from None
            _raise(e)

    # ------------------------------------------------------------------ what it takes
    @staticmethod
    def takes(op: str | None, *tensors: torch.Tensor) -> bool:
        """Whether the route runs this call: dense contiguous tensors of one dtype and device
        the C API reduces (see _as_c), on CPU or CUDA."""
        if not tensors:
            return False
        t0 = tensors[0]
        for t in tensors:
            if (t.layout != torch.strided or not t.is_contiguous() or t.dtype != t0.dtype
                    or t.device != t0.device or t.device.type not in devices.SEAMS):
                return False
        if op is not None and op not in _OPS:
            return False
        return _as_c(t0, op) is not None
