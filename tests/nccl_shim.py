"""The drop-in NCCL (hetccl/dropin/libnccl.so.2) through ctypes, with the interface of
hetccl/capi.py, so that tests/capi_worker.py runs its cases through NCCL's ABI (job key
"api": "nccl"). The drop-in also exports hetccl's C API; capi.py is pointed at it
(HETCCL_CAPI_LIB) for what NCCL has no call for: the emulated runtime's streams
(hetcclTestStream*, through hetcclDropinComm) and hetcclCommInfo.

A call with stream=None passes NCCL's NULL stream (the device's default stream) and then waits
for that stream, except inside a group (group_end waits), so results can be read at once as
with capi.Comm.
"""
from __future__ import annotations

import ctypes


class NcclApi:
    def __init__(self, capi, path: str):
        self.capi = capi
        self.L = L = ctypes.CDLL(path)
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sig = {
            "ncclGetUniqueId": [vp], "ncclCommInitRank": [ctypes.POINTER(vp), i, capi._UniqueId, i],
            "ncclCommDestroy": [vp], "ncclCommAbort": [vp], "ncclCommGetAsyncError": [vp, ctypes.POINTER(i)],
            "ncclCommCount": [vp, ctypes.POINTER(i)], "ncclCommUserRank": [vp, ctypes.POINTER(i)],
            "ncclCommCuDevice": [vp, ctypes.POINTER(i)],
            "ncclAllReduce": [vp, vp, sz, i, i, vp, vp], "ncclReduce": [vp, vp, sz, i, i, i, vp, vp],
            "ncclBroadcast": [vp, vp, sz, i, i, vp, vp], "ncclBcast": [vp, sz, i, i, vp, vp],
            "ncclAllGather": [vp, vp, sz, i, vp, vp], "ncclReduceScatter": [vp, vp, sz, i, i, vp, vp],
            "ncclAlltoAll": [vp, vp, sz, i, vp, vp], "ncclGather": [vp, vp, sz, i, i, vp, vp],
            "ncclScatter": [vp, vp, sz, i, i, vp, vp],
            "ncclSend": [vp, sz, i, i, vp, vp], "ncclRecv": [vp, sz, i, i, vp, vp],
            "ncclGroupStart": [], "ncclGroupEnd": [],
            "ncclCommSplit": [vp, i, i, ctypes.POINTER(vp), vp],
            "ncclCommShrink": [vp, ctypes.POINTER(i), i, ctypes.POINTER(vp), vp, i],
            "ncclRedOpCreatePreMulSum": [ctypes.POINTER(i), vp, i, i, vp], "ncclRedOpDestroy": [i, vp],
            "ncclCommRegister": [vp, vp, sz, ctypes.POINTER(vp)], "ncclCommDeregister": [vp, vp],
            "ncclCommWindowRegister": [vp, vp, sz, ctypes.POINTER(vp), i],
            "ncclGetVersion": [ctypes.POINTER(i)],
        }
        for name, args in sig.items():
            f = getattr(L, name)
            f.argtypes, f.restype = args, ctypes.c_int
        L.ncclGetLastError.argtypes, L.ncclGetLastError.restype = [vp], ctypes.c_char_p
        L.hetcclDropinComm.argtypes, L.hetcclDropinComm.restype = [vp], vp
        L.hetcclDropinInfo.argtypes, L.hetcclDropinInfo.restype = [], ctypes.c_char_p
        self.depth = 0
        self.comms: list = []
        for k in ("SUCCESS", "INVALID_ARGUMENT", "INVALID_USAGE", "REMOTE_ERROR", "SYSTEM_ERROR",
                  "HetcclError", "STREAM_DEFAULT", "SPLIT_NOCOLOR", "SHRINK_DEFAULT", "SHRINK_ABORT", "DTYPES", "OPS"):
            setattr(self, k, getattr(capi, k))

    def check(self, code, comm=None):
        if code != 0:
            text = (self.L.ncclGetLastError(comm) or b"").decode(errors="replace")
            raise self.capi.HetcclError(code, text)

    def unique_id(self) -> bytes:
        u = self.capi._UniqueId()
        self.check(self.L.ncclGetUniqueId(ctypes.byref(u)))
        return ctypes.string_at(ctypes.addressof(u), self.capi.UNIQUE_ID_BYTES)

    def Comm(self, n, uid, rank):  # noqa: N802 (the capi.Comm constructor's name)
        u = self.capi._UniqueId()
        ctypes.memmove(ctypes.byref(u), uid, self.capi.UNIQUE_ID_BYTES)
        h = ctypes.c_void_p()
        self.check(self.L.ncclCommInitRank(ctypes.byref(h), n, u, rank))
        return NcclComm(self, h, rank, n)

    def group_start(self):
        self.depth += 1
        self.check(self.L.ncclGroupStart())

    def group_end(self):
        self.depth -= 1
        self.check(self.L.ncclGroupEnd())
        if self.depth == 0:
            for c in self.comms:
                c.sync_default()


class NcclComm:
    def __init__(self, api: NcclApi, h, rank, n):
        self.api, self.h, self.rank, self.size = api, h, rank, n
        api.comms.append(self)

    @property
    def het(self):
        return self.api.L.hetcclDropinComm(self.h)

    def _call(self, name, *args, stream="none"):
        L, capi = self.api.L, self.api.capi
        self.api.check(getattr(L, name)(*args), self.h)
        if stream is None and self.api.depth == 0:
            self.sync_default()

    def sync_default(self):
        if self.h and self.het:
            self.api.capi._check(self.api.capi.lib().hetcclTestStreamSynchronize(self.het, 1), self.het)

    def all_reduce(self, send, recv, count, dtype="float32", op="sum", stream=None):
        self._call("ncclAllReduce", _p(send), _p(recv), count, _dt(dtype), _op(op), self.h, stream, stream=stream)

    def reduce(self, send, recv, count, dtype="float32", op="sum", root=0, stream=None):
        self._call("ncclReduce", _p(send), _p(recv), count, _dt(dtype), _op(op), root, self.h, stream, stream=stream)

    def broadcast(self, send, recv, count, dtype="float32", root=0, stream=None):
        self._call("ncclBroadcast", _p(send), _p(recv), count, _dt(dtype), root, self.h, stream, stream=stream)

    def all_gather(self, send, recv, sendcount, dtype="float32", stream=None):
        self._call("ncclAllGather", _p(send), _p(recv), sendcount, _dt(dtype), self.h, stream, stream=stream)

    def reduce_scatter(self, send, recv, recvcount, dtype="float32", op="sum", stream=None):
        self._call("ncclReduceScatter", _p(send), _p(recv), recvcount, _dt(dtype), _op(op), self.h, stream,
                   stream=stream)

    def all_to_all(self, send, recv, count, dtype="float32", stream=None):
        self._call("ncclAlltoAll", _p(send), _p(recv), count, _dt(dtype), self.h, stream, stream=stream)

    def gather(self, send, recv, count, dtype="float32", root=0, stream=None):
        self._call("ncclGather", _p(send), _p(recv), count, _dt(dtype), root, self.h, stream, stream=stream)

    def scatter(self, send, recv, count, dtype="float32", root=0, stream=None):
        self._call("ncclScatter", _p(send), _p(recv), count, _dt(dtype), root, self.h, stream, stream=stream)

    def send(self, buf, count, dtype, peer, stream=None):
        self._call("ncclSend", _p(buf), count, _dt(dtype), peer, self.h, stream, stream=stream)

    def recv(self, buf, count, dtype, peer, stream=None):
        self._call("ncclRecv", _p(buf), count, _dt(dtype), peer, self.h, stream, stream=stream)

    def premul_sum(self, scalar, dtype, device=False):
        op = ctypes.c_int()
        self._call("ncclRedOpCreatePreMulSum", ctypes.byref(op), _p(scalar), _dt(dtype), 0 if device else 1, self.h)
        return op.value

    def op_destroy(self, op):
        self._call("ncclRedOpDestroy", op, self.h)

    def split(self, color, key):
        h = ctypes.c_void_p()
        self._call("ncclCommSplit", self.h, color, key, ctypes.byref(h), None)
        if not h.value:
            return None
        n, r = ctypes.c_int(), ctypes.c_int()
        self.api.check(self.api.L.ncclCommCount(h, ctypes.byref(n)), h)
        self.api.check(self.api.L.ncclCommUserRank(h, ctypes.byref(r)), h)
        return NcclComm(self.api, h, r.value, n.value)

    def shrink(self, exclude, flags=0):
        h = ctypes.c_void_p()
        arr = (ctypes.c_int * max(1, len(exclude)))(*exclude)
        self._call("ncclCommShrink", self.h, arr, len(exclude), ctypes.byref(h), None, flags)
        n, r = ctypes.c_int(), ctypes.c_int()
        self.api.check(self.api.L.ncclCommCount(h, ctypes.byref(n)), h)
        self.api.check(self.api.L.ncclCommUserRank(h, ctypes.byref(r)), h)
        return NcclComm(self.api, h, r.value, n.value)

    def vendor_groups(self):
        g, m = ctypes.c_int(), ctypes.c_int()
        self.api.capi._check(self.api.capi.lib().hetcclCommVendorGroups(self.het, ctypes.byref(g), ctypes.byref(m)))
        return g.value, m.value

    def async_error(self) -> int:
        e = ctypes.c_int()
        self._call("ncclCommGetAsyncError", self.h, ctypes.byref(e))
        return e.value

    def info(self) -> dict:
        if not self.het:
            return {"real": "1"}
        buf = ctypes.create_string_buffer(8192)
        self.api.capi._check(self.api.capi.lib().hetcclCommInfo(self.het, buf, len(buf)))
        return dict(kv.split("=", 1) for kv in buf.value.decode().split() if "=" in kv)

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self.api.capi._check(self.api.capi.lib().hetcclTestStreamCreate(self.het, ctypes.byref(s)), self.het)
        return s.value

    def stream_sync(self, stream) -> None:
        self.api.capi._check(self.api.capi.lib().hetcclTestStreamSynchronize(self.het, stream), self.het)

    def destroy(self):
        if self.h:
            h, self.h = self.h, None
            self.api.comms.remove(self)
            self.api.check(self.api.L.ncclCommDestroy(h))

    def abort(self):
        if self.h:
            h, self.h = self.h, None
            self.api.comms.remove(self)
            self.api.check(self.api.L.ncclCommAbort(h))


def _p(buf):
    if buf is None:
        return None
    if isinstance(buf, int):
        return buf
    return buf.__array_interface__["data"][0]


def _dt(d, table=None):
    from_names = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                  "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
    return d if isinstance(d, int) else from_names[d]


def _op(o):
    return o if isinstance(o, int) else {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}[o]
