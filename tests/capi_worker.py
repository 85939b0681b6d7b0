"""One rank of a C API job (tests/test_capi.py, `hetccl bench scale`): no torch, no hetccl
package import -- hetccl/capi.py is loaded by path. argv: a JSON file of
{"uid": hex, "rank", "n", "mode": "cases" | "death" | "scale", "out": result path, ...};
writes {case: "ok" | what went wrong} (cases), or the mode's figures, as JSON to "out".

References: every rank regenerates every rank's input from (case, rank) seeds and computes the
expected result in float64 (floats) or in the dtype's own wrapping arithmetic (integers).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
import time
import traceback

import numpy as np


def load_capi():
    spec = importlib.util.find_spec("hetccl")  # a top-level find: hetccl/__init__ does not run
    # an editable install lists the build's directory beside the source's
    path = next(p for p in (os.path.join(d, "capi.py") for d in spec.submodule_search_locations)
                if os.path.exists(p))
    s = importlib.util.spec_from_file_location("hetccl_capi", path)
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    return m


capi = load_capi()

ARGS: dict = {}  # the job's configuration (main)
FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "uint32", "int64", "uint64"]
NP = {"int8": np.int8, "uint8": np.uint8, "int32": np.int32, "uint32": np.uint32,
      "int64": np.int64, "uint64": np.uint64, "float16": np.float16, "float32": np.float32,
      "float64": np.float64, "bfloat16": np.uint16}  # bf16 travels as its 16 bits


def to_bf16(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def as_f64(a: np.ndarray, dt: str) -> np.ndarray:
    return from_bf16(a).astype(np.float64) if dt == "bfloat16" else a.astype(np.float64)


def data(case: int, rank: int, count: int, dt: str, op: str) -> np.ndarray:
    g = np.random.default_rng(case * 1009 + rank)
    if dt in FLOATS:
        x = g.uniform(0.5, 1.5, count) if op == "prod" else g.uniform(-2, 2, count)
        return to_bf16(x) if dt == "bfloat16" else x.astype(NP[dt])
    if dt in ("uint32", "uint64"):  # the whole range: values above the signed maximum order as unsigned
        return g.integers(0, 2**32 if dt == "uint32" else 2**64, count, dtype=NP[dt], endpoint=False)
    lo = 0 if dt.startswith("u") else -100
    return g.integers(lo, 100, count).astype(NP[dt])


def reduce_ref(ins: list[np.ndarray], dt: str, op: str):
    """float64 reference (floats) or the exact wrapped result (integers)."""
    n = len(ins)
    if dt in FLOATS:
        xs = [as_f64(a, dt) for a in ins]
        f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
             "min": np.minimum}[op]
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = f(acc, x)
        return acc / n if op == "avg" else acc
    with np.errstate(over="ignore"):
        f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
             "min": np.minimum}[op]
        acc = ins[0].copy()
        for x in ins[1:]:
            acc = f(acc, x).astype(ins[0].dtype)
        if op == "avg":  # NCCL's: the wrapped sum divided, truncated toward zero, exactly
            acc = np.array([(abs(v) // n) * (1 if v >= 0 else -1) for v in acc.tolist()],
                           dtype=object).astype(ins[0].dtype)
        return acc


def close(got: np.ndarray, ref, dt: str, n: int) -> str | None:
    if got.size == 0 and np.size(ref) == 0:
        return None
    if dt in INTS:
        bad = np.flatnonzero(got != ref)
        return None if bad.size == 0 else f"{bad.size} wrong, first at {bad[0]}: {got[bad[0]]} != {ref[bad[0]]}"
    g = as_f64(got, dt)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}[dt] * max(2, n)
    err = np.abs(g - ref) / np.maximum(1.0, np.abs(ref))
    bad = np.flatnonzero(~(err <= tol))
    return None if bad.size == 0 else f"{bad.size} wrong, first at {bad[0]}: {g[bad[0]]} vs {ref[bad[0]]}"


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]


class StreamComm:
    """A communicator whose calls go on one stream and wait for it (except inside a group:
    group_end() then waits)."""

    def __init__(self, comm, stream):
        self.comm, self.stream = comm, stream

    def __getattr__(self, name):
        f = getattr(self.comm, name)
        if name not in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                        "all_to_all", "send", "recv"):
            return f

        def call(*a, **k):
            f(*a, stream=self.stream, **k)
            if not GROUP[0]:
                self.comm.stream_sync(self.stream)
        return call


class DeferredComm:
    """A communicator with deferred joins (hetcclCommDeferJoin, stream_path.h): every stream
    call that returns a new ticket is joined on its own stream only when that stream is next
    synchronized, so device-route calls stay unjoined while later calls (staged ones: joined
    implicitly by the C API; device ones; calls on other streams) are issued, and a stream
    synchronized without its join would expose the route's unfinished results."""

    def __init__(self, comm):
        self.comm = comm
        self.word = comm.defer_joins(True)
        self.last = 0
        self.pending: dict = {}
        self.deferred = 0

    def __getattr__(self, name):
        f = getattr(self.comm, name)
        if not callable(f) or name in ("stream_sync", "join"):
            return f

        def call(*a, **k):
            r = f(*a, **k)
            if k.get("stream") is None:  # host calls, abort, destroy, info: no ticket
                return r
            t = self.word.value
            if t and t != self.last:
                self.last = t
                self.deferred += 1
                self.pending[k.get("stream")] = t
            return r
        return call

    def stream_sync(self, stream):
        t = self.pending.pop(stream, 0)
        if t:
            self.comm.join(t, stream)
        self.comm.stream_sync(stream)


GROUP = [0]
_STREAMS: list = []


def group_start():
    GROUP[0] += 1
    capi.group_start()


def group_end():
    GROUP[0] -= 1
    capi.group_end()
    for c in _STREAMS:
        c.comm.stream_sync(c.stream)


class Cases:
    def __init__(self, comm, rank: int, n: int, stream=None):
        """stream: every call goes on it (the stream path, emulated runtime) and is waited for
        before its result is read."""
        self.c, self.rank, self.n = (StreamComm(comm, stream) if stream else comm), rank, n
        self.stream = stream
        self.out: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.case = 0

    def run(self, name, fn, *a):
        self.case += 1
        try:
            r = fn(self.case, *a)
            self.out[name] = "ok" if r is None else r
        except Exception as e:  # noqa: BLE001
            self.out[name] = f"{type(e).__name__}: {e}"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, case, dt, op, count, inplace):
        ins = [data(case, r, count, dt, op) for r in range(self.n)]
        send = ins[self.rank].copy()
        recv = send if inplace else np.full(count, 7, dtype=NP[dt])
        self.c.all_reduce(send, recv, count, dt, op)
        if not inplace and not np.array_equal(send, ins[self.rank]):
            return "sendbuff was modified"
        self.digests[f"ar/{case}"] = digest(recv)
        return close(recv, reduce_ref(ins, dt, op), dt, self.n)

    def reduce_scatter(self, case, dt, op, count, inplace):
        n = self.n
        ins = [data(case, r, count * n, dt, op) for r in range(n)]
        send = ins[self.rank].copy()
        if inplace:
            recv = send[self.rank * count:(self.rank + 1) * count]
        else:
            recv = np.full(count, 7, dtype=NP[dt])
        self.c.reduce_scatter(send, recv, count, dt, op)
        if not inplace and not np.array_equal(send, ins[self.rank]):
            return "sendbuff was modified"
        ref = reduce_ref(ins, dt, op)[self.rank * count:(self.rank + 1) * count]
        return close(np.array(recv), ref, dt, n)

    def all_gather(self, case, dt, count, inplace):
        n = self.n
        ins = [data(case, r, count, dt, "sum") for r in range(n)]
        recv = np.full(count * n, 7, dtype=NP[dt])
        if inplace:
            recv[self.rank * count:(self.rank + 1) * count] = ins[self.rank]
            send = recv[self.rank * count:(self.rank + 1) * count]
        else:
            send = ins[self.rank].copy()
        self.c.all_gather(send, recv, count, dt)
        want = np.concatenate(ins) if count else recv
        return None if np.array_equal(recv, want) else "all_gather output differs from the inputs"

    def reduce(self, case, dt, op, count, root):
        ins = [data(case, r, count, dt, op) for r in range(self.n)]
        send = ins[self.rank].copy()
        recv = np.full(count, 7, dtype=NP[dt])
        self.c.reduce(send, recv, count, dt, op, root)
        if not np.array_equal(send, ins[self.rank]):
            return "sendbuff was modified"
        if self.rank != root:
            return None if np.all(recv == 7) else "reduce wrote recvbuff on a rank other than the root"
        return close(recv, reduce_ref(ins, dt, op), dt, self.n)

    def all_to_all(self, case, dt, count, inplace):
        n, r = self.n, self.rank
        ins = [data(case, p, count * n, dt, "sum") for p in range(n)]
        send = ins[r].copy()
        recv = send if inplace else np.full(count * n, 7, dtype=NP[dt])
        self.c.all_to_all(send, recv, count, dt)
        want = np.concatenate([ins[p][r * count:(r + 1) * count] for p in range(n)]) if count else recv
        if not inplace and not np.array_equal(send, ins[r]):
            return "sendbuff was modified"
        return None if np.array_equal(recv, want) else "all_to_all output differs from the inputs"

    def premul(self, case, dt, coll, device):
        """PreMulSum: sum over ranks of scalar_r * x_r; scalar per rank, host immediate or read
        at the call (device)."""
        n, r, count = self.n, self.rank, 257
        ins = [data(case, p, count * n, dt, "sum") for p in range(n)]
        sc = [np.array([p + 2], dtype=NP[dt]) if dt != "bfloat16" else to_bf16(np.array([p + 2.0]))
              for p in range(n)]
        mine = sc[r].copy()
        op = self.c.premul_sum(mine, dt, device=device)
        if device:
            mine[:] = sc[r]  # read when the call runs
        send = ins[r].copy()
        if coll == "all_reduce":
            recv = np.zeros(count * n, NP[dt])
            self.c.all_reduce(send, recv, count * n, dt, op)
            lo, hi = 0, count * n
        else:
            recv = np.zeros(count, NP[dt])
            self.c.reduce_scatter(send, recv, count, dt, op)
            lo, hi = r * count, (r + 1) * count
        self.c.op_destroy(op)
        if not np.array_equal(send, ins[r]):
            return "sendbuff was modified"
        if dt in FLOATS:
            ref = sum(as_f64(sc[p], dt)[0] * as_f64(ins[p], dt) for p in range(n))[lo:hi]
        else:
            with np.errstate(over="ignore"):
                ref = ins[0] * sc[0][0]
                for p in range(1, n):
                    ref = (ref + ins[p] * sc[p][0]).astype(NP[dt])
                ref = ref[lo:hi]
        return close(recv, ref, dt, n + 4)

    def split(self, case):
        """colors rank % 2 (rank 0: NOCOLOR when n > 2), keys descending: the new ranks are
        ordered by key; an all_reduce on each new communicator."""
        n, r = self.n, self.rank
        color = capi.SPLIT_NOCOLOR if (r == 0 and n > 2) else r % 2
        sub = self.c.split(color, -r)
        if color == capi.SPLIT_NOCOLOR:
            return None if sub is None else "NOCOLOR gave a communicator"
        members = [p for p in range(n) if (capi.SPLIT_NOCOLOR if (p == 0 and n > 2) else p % 2) == color]
        want_rank = sorted(members, key=lambda p: -p).index(r)
        if sub.size != len(members) or sub.rank != want_rank:
            return f"split: size {sub.size} rank {sub.rank}, expected {len(members)} / {want_rank}"
        x = np.full(10, float(r), np.float64)
        sub.all_reduce(x, x, 10, "float64", "sum")
        sub.destroy()
        return None if np.all(x == sum(members)) else f"split all_reduce: {x[0]} != {sum(members)}"

    def split_bad_color(self, case):
        """The last rank passes color -5: every rank is refused (invalid argument, naming that
        rank) at once, none waits in the split's gather, and the communicator stays usable."""
        n, r = self.n, self.rank
        t0 = time.time()
        try:
            self.c.split(-5 if r == n - 1 else 0, r)
            return "split with a bad color was not refused"
        except capi.HetcclError as e:
            if e.code != capi.INVALID_ARGUMENT or f"rank {n - 1}'s color -5" not in e.text:
                return f"{e.code}: {e.text}"
        if time.time() - t0 > 5:
            return f"the refusal took {time.time() - t0:.1f} s"
        x = np.full(4, 1.0, np.float64)
        self.c.all_reduce(x, x, 4, "float64", "sum")
        return None if np.all(x == n) else f"communicator unusable after the refusal: {x[0]}"

    def broadcast(self, case, dt, count, root, inplace):
        x = data(case, root, count, dt, "sum")
        recv = x.copy() if (inplace and self.rank == root) else np.full(count, 7, dtype=NP[dt])
        send = recv if inplace else (x.copy() if self.rank == root else None)
        self.c.broadcast(send, recv, count, dt, root)
        return None if np.array_equal(recv, x) else f"broadcast from {root}: output differs"

    # ------------------------------------------------------------------ point to point
    def p2p_ring(self, case, count):
        n, r = self.n, self.rank
        if n == 1:
            return None
        mine = data(case, r, count, "float32", "sum")
        got = np.zeros(count, np.float32)
        group_start()
        self.c.send(mine, count, "float32", (r + 1) % n)
        self.c.recv(got, count, "float32", (r - 1) % n)
        group_end()
        want = data(case, (r - 1) % n, count, "float32", "sum")
        return None if np.array_equal(got, want) else "ring exchange: wrong data"

    def p2p_batch_with_self(self, case):
        """A group of sends and receives with every rank, this one included (torch's
        batch_isend_irecv with self, as an all-to-all written with p2p does): per peer, in
        order, a float32 pair with self only, then an int64 send and receive; then an
        all_reduce, which must not meet anything the group left behind."""
        n, r = self.n, self.rank
        got = {p: np.zeros(17, np.int64) for p in range(n)}
        col = np.zeros(17, np.float32)
        sends = []
        group_start()
        for p in range(n):
            if p == r:
                self.c.recv(col, 17, "float32", p)
                sends.append(data(case, r * 100 + p, 17, "float32", "sum"))
                self.c.send(sends[-1], 17, "float32", p)
            sends.append(data(case + 1, r * 100 + p, 17, "int64", "sum"))
            self.c.send(sends[-1], 17, "int64", p)
            self.c.recv(got[p], 17, "int64", p)
        group_end()
        x = data(case + 2, r, 64, "float32", "sum")
        y = x.copy()
        self.c.all_reduce(y, y, 64, "float32", "sum")
        for p in range(n):
            if not np.array_equal(got[p], data(case + 1, p * 100 + r, 17, "int64", "sum")):
                return f"int64 message from {p} wrong"
        if not np.array_equal(col, data(case, r * 100 + r, 17, "float32", "sum")):
            return "float32 message to self wrong"
        want = sum(data(case + 2, q, 64, "float32", "sum").astype(np.float64) for q in range(n))
        err = float(np.abs(y - want).max())
        return None if err < 1e-5 * n else f"the all_reduce after the group: max error {err:.3g}"

    def p2p_far(self, case, count):
        """rank 0 and rank n//2 (not ring neighbours for n >= 4: over tcp, dialled on first
        use), several messages in order."""
        n, r = self.n, self.rank
        far = n // 2
        if n < 2 or r not in (0, far):
            return None
        peer = far if r == 0 else 0
        for k in range(3):
            x = data(case * 10 + k, 0, count, "int32", "sum")
            if r == 0:
                self.c.send(x, count, "int32", peer)
            else:
                got = np.zeros(count, np.int32)
                self.c.recv(got, count, "int32", peer)
                if not np.array_equal(got, x):
                    return f"message {k} differs (order or data)"
        return None

    def p2p_size_mismatch(self, case):
        n, r = self.n, self.rank
        if n == 1 or r > 1:
            return None
        if r == 0:
            self.c.send(np.ones(4, np.float32), 4, "float32", 1)
            return None
        try:
            self.c.recv(np.zeros(8, np.float32), 8, "float32", 0)
        except capi.HetcclError as e:
            if e.code == capi.INVALID_ARGUMENT and "16 bytes" in e.text:
                return None
            return f"wrong error: {e}"
        return "no error for a receive larger than the message"

    def p2p_group_failed_leaves_nothing(self, case):
        """Rank 0 receives from ranks 1 and 2 in one group; rank 1's message is too short, so
        the group fails while the receive from rank 2 is still posted. That receive must be
        withdrawn (its buffer is never written once the call returned), and rank 2's message,
        sent later, goes to rank 0's next receive from it."""
        n, r = self.n, self.rank
        if n < 3 or r > 2:
            return None
        if r == 1:
            self.c.send(np.ones(2, np.float32), 2, "float32", 0)
            return None
        if r == 2:
            time.sleep(0.5)
            self.c.send(np.full(4, 5.0, np.float32), 4, "float32", 0)
            return None
        a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
        try:
            group_start()
            self.c.recv(a, 4, "float32", 1)
            self.c.recv(b, 4, "float32", 2)
            group_end()
            return "a group with a short message did not fail"
        except capi.HetcclError as e:
            if e.code != capi.INVALID_ARGUMENT:
                return f"wrong error: {e}"
        time.sleep(1.0)  # rank 2's message arrives meanwhile
        if b.any():
            return f"the withdrawn receive's buffer was written: {b.tolist()}"
        c = np.zeros(4, np.float32)
        self.c.recv(c, 4, "float32", 2)
        return None if np.all(c == 5.0) else f"the next receive from rank 2 got {c.tolist()}"

    # ------------------------------------------------------------------ bad input
    def expect_all(self, case, fn, code, *words):
        try:
            fn()
        except capi.HetcclError as e:
            missing = [w for w in words if w not in e.text]
            if e.code != code or missing:
                return f"code {e.code} (expected {code}), text lacks {missing}: {e.text}"
            self.digests[f"err/{case}"] = hashlib.sha256(e.text.encode()).hexdigest()[:16]
            return None
        return "no error raised"

    def usable_after(self, case):
        x = np.full(5, float(self.rank + 1), np.float32)
        self.c.all_reduce(x, x, 5, "float32", "sum")
        want = self.n * (self.n + 1) / 2
        return None if np.all(x == want) else f"after errors: {x.tolist()} != {want}"


LABELS: list = []  # every rank's vendor label (from the job file)


def run_cases(comm, rank, n, stream=None):
    c = Cases(comm, rank, n, stream)
    if stream:
        _STREAMS.append(c.c)
    for dt in FLOATS + INTS:
        for op in ["sum", "prod", "max", "min", "avg"]:  # every type with every op, as NCCL
            for count in (0, 1, 1031):
                c.run(f"all_reduce/{dt}/{op}/{count}", c.all_reduce, dt, op, count, False)
        c.run(f"all_reduce/{dt}/sum/inplace", c.all_reduce, dt, "sum", 333, True)
        for op in ("sum", "max", "avg"):
            for count in (0, 3, 517):
                c.run(f"reduce_scatter/{dt}/{op}/{count}", c.reduce_scatter, dt, op, count, False)
        c.run(f"reduce_scatter/{dt}/sum/inplace", c.reduce_scatter, dt, "sum", 129, True)
        for count in (0, 1, 1031):
            c.run(f"all_gather/{dt}/{count}", c.all_gather, dt, count, False)
        c.run(f"all_gather/{dt}/inplace", c.all_gather, dt, 77, True)
        for root in range(n):
            c.run(f"broadcast/{dt}/root{root}", c.broadcast, dt, 1031, root, False)
        for op in ("sum", "max", "min"):
            c.run(f"reduce/{dt}/{op}/root{n - 1}", c.reduce, dt, op, 1031, n - 1)
        for count in (0, 5):
            c.run(f"all_to_all/{dt}/{count}", c.all_to_all, dt, count, False)
        c.run(f"all_to_all/{dt}/inplace", c.all_to_all, dt, 33, True)
    # large: several engine chunks per step and several broadcast segments
    for dt in ("float32", "bfloat16"):
        c.run(f"all_reduce/{dt}/sum/large", c.all_reduce, dt, "sum", 300_000, False)
    c.run("reduce_scatter/float32/sum/large", c.reduce_scatter, "float32", "sum", 150_000, False)
    c.run("all_gather/float32/large", c.all_gather, "float32", 150_000, False)
    c.run("broadcast/float32/large", c.broadcast, "float32", 400_000, n - 1, True)
    c.run("reduce/float32/sum/large", c.reduce, "float32", "sum", 300_000, 0)
    for dt in ("float32", "bfloat16", "float64", "int32"):
        for coll in ("all_reduce", "reduce_scatter"):
            for device in (False, True):
                c.run(f"premul/{dt}/{coll}/{'device' if device else 'host'}", c.premul, dt, coll, device)
    if not stream:
        c.run("split", c.split)
        c.run("split/bad_color", c.split_bad_color)
        groups, mine = comm.vendor_groups()
        if LABELS and (groups, mine) != (len(set(LABELS)), LABELS.count(os.environ.get("HETCCL_VENDOR", ""))):
            c.out["vendor_groups"] = f"{groups}, {mine} for labels {LABELS}"
    c.run("all_to_all/float32/large", c.all_to_all, "float32", 100_000, False)
    c.run("p2p/ring", c.p2p_ring, 1000)
    c.run("p2p/ring_large", c.p2p_ring, 300_000)
    c.run("p2p/far", c.p2p_far, 2000)
    c.run("p2p/batch_with_self", c.p2p_batch_with_self)
    if not stream:  # on a stream, a size mismatch breaks the communicator (an async error)
        c.run("p2p/size_mismatch", c.p2p_size_mismatch)
        c.run("p2p/group_failed_leaves_nothing", c.p2p_group_failed_leaves_nothing)
    if stream:
        return {"cases": c.out, "digests": c.digests, "info": comm.info()}
    # bad input: every rank returns the error, the communicator stays usable
    x = np.ones(16, np.float32)
    if n > 1:
        c.run("error/count", c.expect_all,
              lambda: comm.all_reduce(x, x, 11 if rank == 0 else 10, "float32", "sum"),
              capi.INVALID_ARGUMENT, "number of elements differs across ranks", "ranks [0]: 11")
        c.run("error/dtype", c.expect_all,
              lambda: comm.all_reduce(x, x, 4, "float32" if rank else "int32", "sum"),
              capi.INVALID_ARGUMENT, "dtype")
        c.run("error/op", c.expect_all,
              lambda: comm.all_reduce(x, x, 4, "float32", "max" if rank else "sum"),
              capi.INVALID_ARGUMENT, "op")
        c.run("error/root_one_rank", c.expect_all,
              lambda: comm.broadcast(x, x, 4, "float32", n + 3 if rank == n - 1 else 0),
              capi.INVALID_ARGUMENT, "root", str(n + 3))
        c.run("error/stream_one_rank", c.expect_all,
              lambda: comm.all_gather(x, np.zeros(16 * n, np.float32), 4, "float32",
                                      stream=1 if rank == 1 else None),
              capi.INVALID_USAGE, "stream", "cannot open")
    # a count that is a negative int cast to size_t, or whose bytes overflow: refused, not wrapped
    c.run("error/count_overflows", c.expect_all,
          lambda: comm.all_reduce(x, x, 2**64 - 1, "float32", "sum"), capi.INVALID_ARGUMENT, "address space")
    if n > 1:
        c.run("error/count_overflows_one_rank", c.expect_all,
              lambda: comm.all_gather(x, np.zeros(16 * n, np.float32), 2**62 if rank == n - 1 else 4, "float32"),
              capi.INVALID_ARGUMENT, f"rank {n - 1}")
        c.run("error/send_count_overflows", c.expect_all,
              lambda: comm.send(x, 2**63, "float64", (rank + 1) % n), capi.INVALID_ARGUMENT, "address space")
    c.run("error/unknown_dtype", c.expect_all,
          lambda: comm.all_reduce(x, x, 2, 42, "sum"), capi.INVALID_ARGUMENT, "datatype 42")
    c.run("error/usable_after", c.usable_after)
    if comm.async_error() != 0:
        c.out["async_error"] = f"async error {comm.async_error()} after argument errors"
    return {"cases": c.out, "digests": c.digests, "info": comm.info()}


def record_case(out: dict, name: str, fn) -> None:
    """out[name] = "ok" when fn() returns None, else what it returned or raised."""
    try:
        r = fn()
        out[name] = "ok" if r is None else r
    except Exception as e:  # noqa: BLE001
        out[name] = f"{type(e).__name__}: {e}"


def run_stream(comm, rank, n):
    """The stream path (HETCCL_CAPI_DEVICE=emulated): every case of run_cases on a stream, then
    what only streams have: many calls in flight before one wait, the default stream, ranks that
    mix host and stream calls, a group over two streams, and a refusal (last: it breaks the
    communicator on every rank)."""
    s = comm.stream_create()
    res = run_cases(comm, rank, n, stream=s)
    out = res["cases"]

    def case(name, fn):
        record_case(out, name, fn)

    def burst():
        xs = [np.full(4099, float(rank + k), np.float32) for k in range(40)]
        for x in xs:
            comm.all_reduce(x, x, x.size, "float32", "sum", stream=s)
        comm.stream_sync(s)
        for k, x in enumerate(xs):
            want = sum(r + k for r in range(n))
            if not np.all(x == want):
                return f"call {k} of 40 in flight: {x[:3].tolist()} != {want}"
        return None

    def default_stream():
        x = np.full(100, float(rank + 1), np.float64)
        comm.all_reduce(x, x, 100, "float64", "sum", stream=capi.STREAM_DEFAULT)
        comm.stream_sync(capi.STREAM_DEFAULT)
        return None if np.all(x == n * (n + 1) / 2) else f"default stream: {x[:3].tolist()}"

    def mixed():
        x = np.full(1000, float(rank + 1), np.float32)
        y = np.zeros(1000 * n, np.float32)
        if rank % 2:
            comm.all_reduce(x, x, 1000, "float32", "sum", stream=s)
            comm.all_gather(x, y, 1000, "float32", stream=s)
            comm.stream_sync(s)
        else:
            comm.all_reduce(x, x, 1000, "float32", "sum")
            comm.all_gather(x, y, 1000, "float32")
        want = n * (n + 1) / 2
        return None if np.all(x == want) and np.all(y == want) else "host and stream ranks disagree"

    def two_streams():
        if n == 1:
            return None
        s2 = comm.stream_create()
        mine = np.arange(5000, dtype=np.float32) + rank
        got = np.zeros(5000, np.float32)
        capi.group_start()
        comm.send(mine, 5000, "float32", (rank + 1) % n, stream=s)
        comm.recv(got, 5000, "float32", (rank - 1) % n, stream=s2)
        capi.group_end()
        comm.stream_sync(s2)
        comm.stream_sync(s)
        want = np.arange(5000, dtype=np.float32) + (rank - 1) % n
        return None if np.array_equal(got, want) else "group over two streams: wrong data"

    def gather_scatter():
        """ncclGather / ncclScatter (the drop-in builds them from a group of sends and
        receives, the root's own block included)."""
        root = n - 1
        mine = np.arange(300, dtype=np.float32) + 1000 * rank
        got = np.zeros(300 * n, np.float32)
        comm.gather(mine, got, 300, "float32", root, stream=s)
        blocks = np.arange(300 * n, dtype=np.float32) * 3
        back = np.zeros(300, np.float32)
        comm.scatter(blocks, back, 300, "float32", root, stream=s)
        comm.stream_sync(s)
        if rank == root and not np.array_equal(got, np.concatenate(
                [np.arange(300, dtype=np.float32) + 1000 * p for p in range(n)])):
            return "gather: wrong blocks at the root"
        want = np.arange(300 * n, dtype=np.float32)[rank * 300:(rank + 1) * 300] * 3
        return None if np.array_equal(back, want) else "scatter: wrong block"

    if hasattr(comm, "gather"):  # NCCL's names only (tests/nccl_shim.py)
        case("nccl/gather_scatter", gather_scatter)
    case("stream/burst40", burst)

    def route_then_staged():
        """A large call (device route where it is on) and, behind it on the same stream with
        no wait between, a small one reading the large one's result: calls on one communicator
        see each other's results in issue order (NCCL's semantics; with deferred joins the C
        API joins the small call's stream after the large one first)."""
        big = np.full(1 << 22, float(rank + 1), np.float32)
        small = np.zeros(8, np.float32)
        comm.all_reduce(big, big, big.size, "float32", "sum", stream=s)
        comm.all_reduce(big, small, 8, "float32", "sum", stream=s)
        comm.stream_sync(s)
        want = n * n * (n + 1) / 2
        return None if np.all(small == want) else f"the second call read {small[:3].tolist()}, want {want}"
    case("stream/route_then_staged_reads_its_result", route_then_staged)
    case("stream/default_stream", default_stream)
    case("stream/mixed_host_and_stream", mixed)
    case("stream/group_two_streams", two_streams)

    def refused_everywhere():
        """Every rank refuses the call itself (a root out of range on every rank): each returns
        the refusal at once, and the communicator stays usable -- no async error, the next
        stream call works (NCCL's blocking communicators stay usable after an argument error)."""
        x = np.ones(8, np.float32)
        try:
            comm.broadcast(x, x, 8, "float32", n + 3, stream=s)
            return "no immediate error"
        except capi.HetcclError as e:
            if e.code != capi.INVALID_ARGUMENT:
                return f"unexpected {e}"
        y = np.full(8, float(rank + 1), np.float32)
        comm.all_reduce(y, y, 8, "float32", "sum", stream=s)
        comm.stream_sync(s)
        if comm.async_error() != 0:
            return f"async error {comm.async_error()} after a refusal every rank made"
        want = n * (n + 1) / 2
        return None if np.all(y == want) else f"next call: {y.tolist()} != {want}"

    if n > 1:
        case("stream/refused_everywhere_keeps_the_comm", refused_everywhere)

    def refusal():
        """rank n-1 names a root out of range: it returns the refusal at once; every rank's
        communicator then reports hetcclInvalidArgument as its async error, with the text."""
        x = np.ones(8, np.float32)
        root = n + 3 if rank == n - 1 else 0
        try:
            comm.broadcast(x, x, 8, "float32", root, stream=s)
            if rank == n - 1:
                return "no immediate error on the refusing rank"
        except capi.HetcclError as e:
            if rank != n - 1 or e.code != capi.INVALID_ARGUMENT:
                return f"unexpected {e}"
        err = _async_error_after(s)
        if err:
            return err
        try:
            comm.all_reduce(x, x, 8, "float32", "sum", stream=s)
        except capi.HetcclError as e:
            return None if "root" in e.text and str(n + 3) in e.text else f"text: {e.text}"
        return "a later call succeeded"

    def _async_error_after(stream):
        """Waits for the stream, then up to 30 s for the communicator's async error: None if it
        is hetcclInvalidArgument, else what it is."""
        comm.stream_sync(stream)
        end = time.time() + 30
        while comm.async_error() == 0 and time.time() < end:
            time.sleep(0.01)
        return None if comm.async_error() == capi.INVALID_ARGUMENT else f"async error {comm.async_error()}"

    def chunked_mismatch():
        """HETCCL_STREAM_CHUNK_BYTES: counts that differ (rank 0's spans more chunks) are
        refused by the first chunk's check of the whole call: every rank's communicator reports
        it as its async error, and no chunk of any rank's buffer was reduced."""
        count = 30_000 if rank == 0 else 20_000
        x = np.arange(count, dtype=np.float32) + rank
        keep = x.copy()
        comm.all_reduce(x, x, count, "float32", "sum", stream=s)
        err = _async_error_after(s)
        if err:
            return err
        if not np.array_equal(x, keep):
            return f"a chunk was reduced: {int((x != keep).sum())} elements changed"
        try:
            comm.all_reduce(x, x, 8, "float32", "sum", stream=s)
        except capi.HetcclError as e:
            return None if "30000" in e.text and "20000" in e.text else f"text: {e.text}"
        return "a later call succeeded"

    if n > 1 and int(os.environ.get("HETCCL_STREAM_CHUNK_BYTES") or 0):
        case("stream/chunked_mismatch_breaks_every_rank", chunked_mismatch)
    elif n > 1 and os.environ.get("HETCCL_STREAM_DEVICE_BYTES", "").isdigit() and \
            int(os.environ["HETCCL_STREAM_DEVICE_BYTES"]) <= 80_000:
        # the device route (csrc/api/device_route.h): the check before any plan is posted
        case("stream/device_mismatch_breaks_every_rank", chunked_mismatch)
    elif n > 1:
        case("stream/refusal_breaks_every_rank", refusal)
    res["info"] = comm.info()
    return res


def run_forward(comm, rank, n):
    """The drop-in over a stand-in real NCCL (tests/cpp/fake_nccl.cc): whether this
    communicator is the real library's, what an all_reduce on it wrote (the stand-in's mark:
    send + 1000 + rank), and a split by vendor label whose children are one vendor each."""
    x = np.full(8, 1.0, np.float32)
    y = np.zeros(8, np.float32)
    comm.all_reduce(x, y, 8, "float32", "sum")
    out = {"real": comm.het is None or not comm.het, "y": y.tolist(), "cases": {}}
    if comm.het:  # across vendors: split into one-vendor children
        label = os.environ.get("HETCCL_VENDOR", "")
        color = sorted(set(LABELS)).index(label)
        sub = comm.split(color, rank)
        z = np.zeros(8, np.float32)
        sub.all_reduce(x, z, 8, "float32", "sum")
        out["child_real"] = not sub.het
        out["child_y"] = z.tolist()
        out["child_size"] = sub.size
        sub.destroy()
    if ARGS.get("singletons"):
        # as torch's new_group([r]) on every rank of a cross-vendor world: a stream all_reduce
        # of the world still in flight, then each rank's own one-rank communicator (its own
        # unique id; the real library serves it), then the world again
        s = comm.stream_create()
        w = np.full(1 << 16, 1.0 + rank, np.float32)
        comm.all_reduce(w, w, w.size, "float32", "sum", stream=s)
        one = capi.Comm(1, capi.unique_id(), 0)
        o = np.zeros(8, np.float32)
        one.all_reduce(x, o, 8, "float32", "sum")
        out["single_real"] = not one.het
        out["single_y"] = o.tolist()
        one.destroy()
        comm.stream_sync(s)
        out["world_after"] = bool(np.all(w == n * (n + 1) / 2))
    return out


def _sum_check(c, ranks, what):
    """An all_reduce on c where each member contributes its old rank + 1 (ranks: old ranks)."""
    x = np.full(1000, float(ranks[c.rank] + 1), np.float32)
    c.all_reduce(x, x, x.size, "float32", "sum")
    want = float(sum(r + 1 for r in ranks))
    return None if np.all(x == want) else f"{what}: {x[:3].tolist()} != {want}"


def run_shrink(comm, rank, n):
    """hetcclCommShrink / ncclCommShrink (healthy parent, HETCCL_SHRINK_DEFAULT): the last rank
    left out, then the first; every survivor's new rank and size, an all_reduce on each child,
    the parent still usable (every rank, the excluded too), and bad lists refused locally."""
    out = {"cases": {}}

    def case(name, fn):
        try:
            out["cases"][name] = fn() or "ok"
        except Exception:  # noqa: BLE001
            out["cases"][name] = traceback.format_exc(limit=4)

    for name, excl in (("last", [n - 1]), ("first", [0])):
        keep = [r for r in range(n) if r not in excl]
        if rank in keep:
            def one(excl=excl, keep=keep, name=name):
                sub = comm.shrink(excl)
                if (sub.rank, sub.size) != (keep.index(rank), len(keep)):
                    return f"rank {sub.rank} of {sub.size}, expected {keep.index(rank)} of {len(keep)}"
                e = _sum_check(sub, keep, name)
                out.setdefault("child_real", {})[name] = not getattr(sub, "het", True)
                sub.destroy()
                return e
            case(f"shrink/{name}", one)
        case(f"parent_after/{name}", lambda: _sum_check(comm, list(range(n)), "parent"))

    def refused(excl, code, word):
        try:
            comm.shrink(excl)
        except capi.HetcclError as e:
            return None if e.code == code and word in e.text else f"{e.code}: {e.text}"
        return f"shrink({excl}) was not refused"
    case("bad/out_of_range", lambda: refused([n + 5], capi.INVALID_ARGUMENT, "out of range"))
    case("bad/self", lambda: refused([rank], capi.INVALID_USAGE, "excluded"))
    case("bad/twice", lambda: refused([(rank + 1) % n] * 2, capi.INVALID_ARGUMENT, "twice"))
    case("parent_after/bad", lambda: _sum_check(comm, list(range(n)), "parent after refusals"))
    return out


def run_shrink_death(comm, rank, n, args):
    """The last rank dies; each survivor sees the parent fail, then shrinks it with
    HETCCL_SHRINK_ABORT (the parent is broken: no collective over it is possible) and carries
    on in the child: an all_reduce with the right sum, the vendor groups of the survivors."""
    victim = n - 1
    x = np.ones(1 << 16, np.float32)
    if rank == victim:
        comm.all_reduce(x, x, x.size, "float32", "sum")
        os._exit(17)
    err = None
    for _ in range(1000):
        try:
            comm.all_reduce(x, x, x.size, "float32", "sum")
        except capi.HetcclError as e:
            err = e
            break
    out = {"parent_error": err.code if err else None}
    t0 = time.time()
    sub = comm.shrink([victim], capi.SHRINK_ABORT)
    out["shrink_s"] = time.time() - t0
    keep = list(range(n - 1))
    out["child"] = [sub.rank, sub.size]
    out["child_sum"] = _sum_check(sub, keep, "child") or "ok"
    out["child_groups"] = list(sub.vendor_groups()) if hasattr(sub, "vendor_groups") else None
    try:
        comm.all_reduce(x, x, 4, "float32", "sum")
        out["parent_after"] = "a call on the aborted parent succeeded"
    except capi.HetcclError as e:
        out["parent_after"] = e.code
    sub.destroy()
    comm.abort()
    return out


def run_death(comm, rank, n, args):
    """all_reduces until the victim (the last rank) exits mid-way; survivors report the error."""
    victim = n - 1
    x = np.ones(1 << 20, np.float32)
    t0 = time.time()
    err = None
    i = 0
    while time.time() - t0 < 60:
        if rank == victim and i == args.get("kill_at", 3):
            os._exit(17)
        try:
            comm.all_reduce(x, x, x.size, "float32", "max")
        except capi.HetcclError as e:
            err = e
            break
        i += 1
    t_err = time.time()
    out = {"ops": i, "code": err.code if err else None, "text": err.text if err else None,
           "async": comm.async_error(), "t_err": t_err}
    # as torch's watchdog does: another thread polls the async error, then reads the last
    # error with no communicator (NCCL's ncclGetLastError(NULL)); it must name the failure
    seen = {}

    def watchdog():
        seen["async"] = comm.async_error()
        if hasattr(comm, "api"):  # the drop-in's ABI
            text = comm.api.L.ncclGetLastError(None)
        else:
            text = capi.lib().hetcclGetLastError(None)
        seen["text"] = (text or b"").decode(errors="replace")
    th = threading.Thread(target=watchdog)
    th.start()
    th.join()
    out["watchdog_async"], out["watchdog_text"] = seen.get("async"), seen.get("text")
    try:
        t1 = time.time()
        comm.all_reduce(x, x, 4, "float32", "sum")
        out["again"] = "second op succeeded"
    except capi.HetcclError as e:
        out["again"] = e.text
        out["again_code"] = e.code
        out["again_s"] = time.time() - t1
    comm.abort()
    return out


def run_death_stream(comm, rank, n, args):
    """Stream calls (the device route when HETCCL_STREAM_DEVICE_BYTES allows: plans in flight
    on the route's streams) until the victim (the last rank) exits mid-way: the survivors'
    streams must not stay blocked, the communicator reports the failure as its async error, and
    a later call fails at once naming it."""
    victim = n - 1
    s = comm.stream_create()
    x = np.ones(1 << 18, np.float32)  # 1 MiB
    t0 = time.time()
    i = 0
    out = {}
    while time.time() - t0 < 60:
        if rank == victim and i == args.get("kill_at", 3):
            os._exit(17)
        try:
            for _ in range(4):  # several calls in flight before one wait
                comm.all_reduce(x, x, x.size, "float32", "sum", stream=s)
        except capi.HetcclError as e:
            out["issue_error"] = e.code
            break
        comm.stream_sync(s)  # returns even once the peer is gone: the engine releases the words
        if comm.async_error() != 0:
            break
        i += 1
    end = time.time() + 60
    while comm.async_error() == 0 and time.time() < end:
        time.sleep(0.01)
    out.update({"ops": i, "async": comm.async_error(), "t_err": time.time() - t0})
    try:
        t1 = time.time()
        comm.all_reduce(x, x, 4, "float32", "sum", stream=s)
        out["again"] = "a later call succeeded"
    except capi.HetcclError as e:
        out["again"], out["again_code"], out["again_s"] = e.text, e.code, time.time() - t1
    out["info"] = comm.info()
    comm.abort()
    return out


def run_abort_hung(comm, rank, n, args):
    """Rank 0 calls a collective that rank 1 never joins (rank 1 sleeps, alive), and another
    thread of rank 0 aborts the communicator after 1 s, as torch's watchdog calls ncclCommAbort
    while the main thread waits in NCCL: the call returns an error and the abort returns, both at
    once, and nothing is touched after it was freed (the process exits cleanly)."""
    if rank != 0:
        time.sleep(args.get("sleep_s", 20))
        os._exit(0)
    out = {}

    def aborter():
        time.sleep(1.0)
        t0 = time.time()
        comm.abort()
        out["abort_s"] = time.time() - t0
    th = threading.Thread(target=aborter)
    th.start()
    x = np.ones(1 << 16, np.float32)
    t0 = time.time()
    try:
        if args.get("stream"):
            s = comm.stream_create()
            comm.all_reduce(x, x, x.size, "float32", "sum", stream=s)
        else:
            comm.all_reduce(x, x, x.size, "float32", "sum")
        out["call"] = "returned without an error"
    except capi.HetcclError as e:
        out["call"], out["code"] = e.text, e.code
    out["call_s"] = time.time() - t0
    th.join()
    return out


def run_abort_queued(comm, rank, n, args):
    """Rank 0 queues many stream calls on one stream while rank 1 stays silent (the first call's
    host collective hangs, the rest wait behind it on the stream), then aborts. The abort
    releases the stream, which then runs every queued call's copies out of staging and its
    flag writes: the staging buffers and flag pages must outlive them (under
    HETCCL_EMULATED_STRICT=1 the emulated device aborts the process on a stream operation that
    touches host memory after it was unregistered)."""
    if rank != 0:
        time.sleep(args.get("sleep_s", 8))
        os._exit(0)
    s = comm.stream_create()
    bufs = [np.full(1 << 16, float(i), np.float32) for i in range(args.get("calls", 24))]
    for x in bufs:
        comm.all_reduce(x, x, x.size, "float32", "sum", stream=s)
    time.sleep(0.5)
    t0 = time.time()
    comm.abort()
    return {"abort_s": time.time() - t0, "calls": len(bufs)}


def run_late_send(comm, rank, n, args):
    """Rank 1's receive from rank 0 gives up (HETCCL_TIMEOUT_S=1); rank 0 sends 2.5 s later.
    The message must not land in the buffer rank 1 gave the call that gave up: the receive is
    withdrawn when its wait gives up (Comm::wait_request), as the caller may free that buffer
    once the call returned."""
    nbytes = 1 << 16
    out = {}
    if rank == 0:
        time.sleep(2.5)
        x = np.full(nbytes, 7, np.uint8)
        try:
            comm.send(x, nbytes, "uint8", 1)
            out["send"] = "ok"
        except capi.HetcclError as e:
            out["send"] = e.text
        time.sleep(3)
        return out
    buf = np.zeros(nbytes, np.uint8)
    try:
        comm.recv(buf, nbytes, "uint8", 0)
        out["recv"] = "returned without an error"
    except capi.HetcclError as e:
        out["recv"], out["code"] = e.text, e.code
    time.sleep(4)  # the late message arrives meanwhile
    out["landed"] = int(np.count_nonzero(buf))
    return out


def main():
    global capi
    args = json.load(open(sys.argv[1]))
    if args.get("api") == "nccl":  # the same cases through the drop-in NCCL's ABI
        import nccl_shim

        if os.environ.get("FAKE_NCCL_GLOBAL"):  # as torch does: the real NCCL loaded globally first
            import ctypes
            ctypes.CDLL(os.environ["FAKE_NCCL_GLOBAL"], mode=ctypes.RTLD_GLOBAL)
        capi = nccl_shim.NcclApi(capi, os.environ["HETCCL_CAPI_LIB"])
    rank, n = args["rank"], args["n"]
    uid = args["uid"]
    if uid.startswith("file:"):  # rank 0 makes the id (its root runs here), the others read it
        path = uid[5:]
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                f.write(capi.unique_id().hex())
            os.replace(path + ".tmp", path)
        end = time.time() + 60
        while not os.path.exists(path):
            if time.time() > end:
                raise SystemExit(f"rank {rank}: no unique id in {path} after 60 s")
            time.sleep(0.05)
        uid = open(path).read()
    LABELS[:] = args.get("labels", [])
    ARGS.update(args)
    t0 = time.time()
    comm = capi.Comm(n, bytes.fromhex(uid), rank)
    init_s = time.time() - t0
    if args["mode"] == "cases":
        res = run_cases(comm, rank, n)
        comm.destroy()
    elif args["mode"] == "stream":
        if args.get("defer"):  # deferred joins, joined at each stream's synchronization
            dc = DeferredComm(comm)
            res = run_stream(dc, rank, n)
            res["deferred_calls"] = dc.deferred
            res["info_end"] = comm.info()
        else:
            res = run_stream(comm, rank, n)
        comm.destroy()
    elif args["mode"] == "forward":
        res = run_forward(comm, rank, n)
        comm.destroy()
    elif args["mode"] == "death":
        res = run_death(comm, rank, n, args)
    elif args["mode"] == "death_stream":
        res = run_death_stream(DeferredComm(comm) if args.get("defer") else comm, rank, n, args)
    elif args["mode"] == "abort_hung":
        res = run_abort_hung(comm, rank, n, args)
    elif args["mode"] == "abort_queued":
        res = run_abort_queued(DeferredComm(comm) if args.get("defer") else comm, rank, n, args)
    elif args["mode"] == "late_send":
        res = run_late_send(comm, rank, n, args)
        comm.destroy()
    elif args["mode"] == "shrink":
        res = run_shrink(comm, rank, n)
        comm.destroy()
    elif args["mode"] == "shrink_vendor":  # 2+2: vendor "a" (ranks 0, 1) shrinks "b" away
        res = {}
        if rank < 2:
            sub = comm.shrink([2, 3])
            x, y = np.full(8, 1.0, np.float32), np.zeros(8, np.float32)
            sub.all_reduce(x, y, 8, "float32", "sum")
            res = {"child_real": not sub.het, "child_y": y.tolist()}
            sub.destroy()
        comm.destroy()
    elif args["mode"] == "shrink_death":
        res = run_shrink_death(comm, rank, n, args)
    else:
        raise SystemExit(f"unknown mode {args['mode']}")
    res["init_s"] = init_s
    with open(args["out"] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(args["out"] + ".tmp", args["out"])


if __name__ == "__main__":
    main()
