"""ctypes binding of hetccl's C API (csrc/hetccl.h, libhetccl.so), for harnesses that run
without torch (tests/capi_worker.py, `hetccl bench scale`).

This module imports nothing of hetccl and no torch: load it by path (``load_module()`` below
does that for callers that have hetccl importable; a worker process can use
``importlib.util.spec_from_file_location``) so that ``hetccl/__init__.py``, which registers the
torch backend, never runs. Buffers are anything with a writable buffer interface or a NumPy
array; counts are in elements of the given dtype.
"""
from __future__ import annotations

import ctypes
import os
import sys

# NCCL's values (csrc/hetccl.h)
RESULTS = {0: "success", 1: "unhandled device error", 2: "system error", 3: "internal error",
           4: "invalid argument", 5: "invalid usage", 6: "remote error", 7: "in progress"}
SUCCESS, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 0, 2, 3, 4, 5, 6
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
          "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
UNIQUE_ID_BYTES = 128


class HetcclError(RuntimeError):
    """A C API call returned an error: .code (hetcclResult_t) and the library's text."""

    def __init__(self, code: int, text: str):
        super().__init__(f"{text} [{RESULTS.get(code, code)}]")
        self.code = code
        self.text = text


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def library_path() -> str:
    """HETCCL_CAPI_LIB, else libhetccl.so beside this file (a wheel install), else in a
    hetccl/ directory on sys.path (an editable install keeps the built files in site-packages)."""
    p = os.environ.get("HETCCL_CAPI_LIB")
    if p:
        return p
    cands = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "libhetccl.so")]
    cands += [os.path.join(d, "hetccl", "libhetccl.so") for d in sys.path if d]
    for c in cands:
        if os.path.exists(c):
            return c
    raise FileNotFoundError("libhetccl.so not found (build hetccl, or set HETCCL_CAPI_LIB); looked in "
                            + ", ".join(cands[:4]) + ", ...")


_LIB = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        L = ctypes.CDLL(library_path())
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        sig = {
            "hetcclGetVersion": [ctypes.POINTER(i)],
            "hetcclGetUniqueId": [ctypes.POINTER(_UniqueId)],
            "hetcclCommInitRank": [ctypes.POINTER(vp), i, _UniqueId, i],
            "hetcclCommDestroy": [vp], "hetcclCommAbort": [vp],
            "hetcclCommCount": [vp, ctypes.POINTER(i)], "hetcclCommUserRank": [vp, ctypes.POINTER(i)],
            "hetcclCommGetAsyncError": [vp, ctypes.POINTER(i)],
            "hetcclCommInfo": [vp, ctypes.c_char_p, sz],
            "hetcclAllReduce": [vp, vp, sz, i, i, vp, vp],
            "hetcclReduce": [vp, vp, sz, i, i, i, vp, vp],
            "hetcclAllToAll": [vp, vp, sz, i, vp, vp],
            "hetcclCommSplit": [vp, i, i, ctypes.POINTER(vp)],
            "hetcclCommShrink": [vp, ctypes.POINTER(i), i, ctypes.POINTER(vp), i],
            "hetcclCommVendorGroups": [vp, ctypes.POINTER(i), ctypes.POINTER(i)],
            "hetcclRedOpCreatePreMulSum": [ctypes.POINTER(i), vp, i, i, vp],
            "hetcclRedOpDestroy": [i, vp],
            "hetcclTestStreamCreate": [vp, ctypes.POINTER(vp)], "hetcclTestStreamSynchronize": [vp, vp],
            "hetcclBroadcast": [vp, vp, sz, i, i, vp, vp],
            "hetcclAllGather": [vp, vp, sz, i, vp, vp],
            "hetcclReduceScatter": [vp, vp, sz, i, i, vp, vp],
            "hetcclSend": [vp, sz, i, i, vp, vp], "hetcclRecv": [vp, sz, i, i, vp, vp],
            "hetcclGroupStart": [], "hetcclGroupEnd": [],
            "hetcclCommDeferJoin": [vp, i, ctypes.POINTER(ctypes.POINTER(ctypes.c_ulonglong))],
            "hetcclCommJoin": [vp, ctypes.c_ulonglong, vp],
        }
        for name, args in sig.items():
            f = getattr(L, name)
            f.argtypes = args
            f.restype = ctypes.c_int
        L.hetcclGetLastError.argtypes = [vp]
        L.hetcclGetLastError.restype = ctypes.c_char_p
        L.hetcclGetErrorString.argtypes = [i]
        L.hetcclGetErrorString.restype = ctypes.c_char_p
        _LIB = L
    return _LIB


STREAM_DEFAULT = 1  # HETCCL_STREAM_DEFAULT: the device's default stream
SPLIT_NOCOLOR = -1  # HETCCL_SPLIT_NOCOLOR
SHRINK_DEFAULT, SHRINK_ABORT = 0, 1  # HETCCL_SHRINK_*


def _check(code: int, comm=None) -> None:
    if code != SUCCESS:
        text = (lib().hetcclGetLastError(comm) or b"").decode(errors="replace")
        raise HetcclError(code, text)


def version() -> int:
    v = ctypes.c_int()
    _check(lib().hetcclGetVersion(ctypes.byref(v)))
    return v.value


def unique_id() -> bytes:
    """A new id; this process runs its bootstrap root until every rank has joined."""
    u = _UniqueId()
    _check(lib().hetcclGetUniqueId(ctypes.byref(u)))
    return ctypes.string_at(ctypes.addressof(u), UNIQUE_ID_BYTES)  # c_char arrays stop at a NUL


def _ptr(buf):
    if buf is None:
        return None
    if isinstance(buf, int):
        return buf
    ai = getattr(buf, "__array_interface__", None)
    if ai is not None:
        return ai["data"][0]
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Comm:
    """One communicator (hetcclCommInitRank). Methods raise HetcclError."""

    def __init__(self, nranks: int, uid: bytes, rank: int):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique id of {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
        u = _UniqueId()
        ctypes.memmove(ctypes.byref(u), uid, UNIQUE_ID_BYTES)
        self._c = ctypes.c_void_p()
        _check(lib().hetcclCommInitRank(ctypes.byref(self._c), nranks, u, rank))
        self.rank, self.size = rank, nranks

    def _call(self, name, *args):
        _check(getattr(lib(), name)(*args), self._c)

    # The hot path of a face (hetccl/face_capi.py): the C function called directly with this
    # communicator's handle, its result checked only when it is not SUCCESS (what _call does,
    # without the per-call lookups and argument conversions).
    @staticmethod
    def fn(name: str):
        return getattr(lib(), name)

    def check(self, code: int) -> None:
        if code != SUCCESS:
            _check(code, self._c)

    def all_reduce(self, send, recv, count, dtype="float32", op="sum", stream=None):
        self._call("hetcclAllReduce", _ptr(send), _ptr(recv), count, _dt(dtype), _op(op), self._c, stream)

    def reduce(self, send, recv, count, dtype="float32", op="sum", root=0, stream=None):
        self._call("hetcclReduce", _ptr(send), _ptr(recv), count, _dt(dtype), _op(op), root, self._c, stream)

    def all_to_all(self, send, recv, count, dtype="float32", stream=None):
        self._call("hetcclAllToAll", _ptr(send), _ptr(recv), count, _dt(dtype), self._c, stream)

    def broadcast(self, send, recv, count, dtype="float32", root=0, stream=None):
        self._call("hetcclBroadcast", _ptr(send), _ptr(recv), count, _dt(dtype), root, self._c, stream)

    def all_gather(self, send, recv, sendcount, dtype="float32", stream=None):
        self._call("hetcclAllGather", _ptr(send), _ptr(recv), sendcount, _dt(dtype), self._c, stream)

    def reduce_scatter(self, send, recv, recvcount, dtype="float32", op="sum", stream=None):
        self._call("hetcclReduceScatter", _ptr(send), _ptr(recv), recvcount, _dt(dtype), _op(op),
                   self._c, stream)

    def send(self, buf, count, dtype, peer, stream=None):
        self._call("hetcclSend", _ptr(buf), count, _dt(dtype), peer, self._c, stream)

    def recv(self, buf, count, dtype, peer, stream=None):
        self._call("hetcclRecv", _ptr(buf), count, _dt(dtype), peer, self._c, stream)

    def defer_joins(self, enable: bool = True):
        """hetcclCommDeferJoin: device-route stream calls return before their stream is ordered
        after them; returns the ticket word (a ctypes c_ulonglong: .value after each call is
        that call's ticket, 0 where it needs no join)."""
        w = ctypes.POINTER(ctypes.c_ulonglong)()
        self._call("hetcclCommDeferJoin", self._c, 1 if enable else 0, ctypes.byref(w))
        return w.contents

    def join(self, ticket: int, stream) -> None:
        """hetcclCommJoin: `stream` ordered after the call of `ticket` and every earlier one."""
        self._call("hetcclCommJoin", self._c, ticket, stream)

    def split(self, color: int, key: int):
        """A new Comm of the ranks with this color (None for SPLIT_NOCOLOR)."""
        h = ctypes.c_void_p()
        self._call("hetcclCommSplit", self._c, color, key, ctypes.byref(h))
        return self._child(h)

    def shrink(self, exclude, flags: int = SHRINK_DEFAULT):
        """A new Comm of the ranks not in exclude (hetcclCommShrink; the excluded do not call)."""
        h = ctypes.c_void_p()
        arr = (ctypes.c_int * max(1, len(exclude)))(*exclude)
        self._call("hetcclCommShrink", self._c, arr, len(exclude), ctypes.byref(h), flags)
        return self._child(h)

    def _child(self, h):
        if not h.value:
            return None
        c = Comm.__new__(Comm)
        c._c = h
        n, r = ctypes.c_int(), ctypes.c_int()
        _check(lib().hetcclCommCount(h, ctypes.byref(n)), h)
        _check(lib().hetcclCommUserRank(h, ctypes.byref(r)), h)
        c.rank, c.size = r.value, n.value
        return c

    def vendor_groups(self) -> tuple[int, int]:
        g, m = ctypes.c_int(), ctypes.c_int()
        self._call("hetcclCommVendorGroups", self._c, ctypes.byref(g), ctypes.byref(m))
        return g.value, m.value

    def premul_sum(self, scalar, dtype, device: bool = False) -> int:
        """A PreMulSum operator; scalar: a one-element array (device: read at each call)."""
        op = ctypes.c_int()
        self._call("hetcclRedOpCreatePreMulSum", ctypes.byref(op), _ptr(scalar), _dt(dtype),
                   0 if device else 1, self._c)
        return op.value

    def op_destroy(self, op: int) -> None:
        self._call("hetcclRedOpDestroy", op, self._c)

    def stream_create(self) -> int:
        """A stream of the emulated device runtime (HETCCL_CAPI_DEVICE=emulated; tests)."""
        s = ctypes.c_void_p()
        self._call("hetcclTestStreamCreate", self._c, ctypes.byref(s))
        return s.value

    def stream_sync(self, stream) -> None:
        self._call("hetcclTestStreamSynchronize", self._c, stream)

    def async_error(self) -> int:
        e = ctypes.c_int()
        self._call("hetcclCommGetAsyncError", self._c, ctypes.byref(e))
        return e.value

    def info(self) -> dict[str, str]:
        buf = ctypes.create_string_buffer(8192)
        self._call("hetcclCommInfo", self._c, buf, len(buf))
        return dict(kv.split("=", 1) for kv in buf.value.decode().split() if "=" in kv)

    def destroy(self) -> None:
        if self._c:
            c, self._c = self._c, ctypes.c_void_p()
            _check(lib().hetcclCommDestroy(c))

    def abort(self) -> None:
        if self._c:
            c, self._c = self._c, ctypes.c_void_p()
            _check(lib().hetcclCommAbort(c))


def group_start() -> None:
    _check(lib().hetcclGroupStart())


def group_end() -> None:
    _check(lib().hetcclGroupEnd())


def _dt(d) -> int:
    return d if isinstance(d, int) else DTYPES[d]


def _op(o) -> int:
    return o if isinstance(o, int) else OPS[o]
