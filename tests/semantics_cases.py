"""Rank-side checks of the torch.distributed semantics of issue 15 across emulated vendors:
all_gather_coalesced's layout, bitwise reductions, sparse all-reduce (and DDP with a sparse
embedding), receive from any source, torch's timeout wording, monitored_barrier, the backend
name DDP logs, the vendor split when the rank is passed to init_process_group, and the start
line. Every result is compared with a reference computed locally from per-rank seeds.
run_all() returns {case: "ok" | what went wrong}."""
from __future__ import annotations

import functools
import logging
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
              torch.uint16, torch.uint32, torch.uint64]
BITWISE = {"BAND": (dist.ReduceOp.BAND, torch.bitwise_and),
           "BOR": (dist.ReduceOp.BOR, torch.bitwise_or),
           "BXOR": (dist.ReduceOp.BXOR, torch.bitwise_xor)}


def ints(rank: int, case: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * case + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)  # within int64
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def expect_error(fn, exc, *words) -> str:
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        return f"message lacks {missing}: {e}" if missing else "ok"
    except Exception as e:  # noqa: BLE001
        return f"wrong exception {type(e).__name__}: {e}"
    return "no error raised"


def times_out(work, seconds: float, returned: str) -> str | None:
    """None when work.wait(timeout=seconds) raises a timeout; else what went wrong (`returned`
    when it returned)."""
    try:
        work.wait(timeout=timedelta(seconds=seconds))
        return returned
    except Exception as e:  # noqa: BLE001
        return None if "imed out" in str(e) else f"not a timeout: {type(e).__name__}: {e}"


class Cases:
    def __init__(self, rank: int, world: int, labels: list[str]):
        self.rank, self.world, self.labels = rank, world, labels
        self.out: dict[str, str] = {}

    def run(self, name, fn, *args):
        try:
            r = fn(*args)
            self.out[name] = "ok" if r in (None, True, "ok") else str(r)
        except Exception:  # noqa: BLE001
            self.out[name] = traceback.format_exc(limit=6)

    # ---------------------------------------------------------------- lifetimes
    def released_after_wait(self, async_op: bool):
        """Once wait() returned and the caller dropped its tensor and Work, nothing of hetccl
        keeps the tensor (the engine's worker thread let go of the queued item), also while
        no later operation is issued. Bounded wait: the worker lets go right after it
        completed the future."""
        import gc
        import weakref

        x = torch.full((1 << 16,), float(self.rank + 1))
        work = dist.all_reduce(x, async_op=async_op)
        if work is not None:
            work.wait()
        want = float(sum(range(1, self.world + 1)))
        if not torch.all(x == want):
            return f"all_reduce gave {x[:4].tolist()}, expected {want}"
        ref = weakref.ref(x)
        del x, work
        end = time.monotonic() + 2
        gc.collect()
        while ref() is not None and time.monotonic() < end:
            time.sleep(0.02)
            gc.collect()
        held = ref() is not None
        dist.barrier()  # the next operation: only after the check
        if held:
            return "the all_reduce's tensor is still referenced 2 s after wait() returned"

    # ---------------------------------------------------------------- all_gather_coalesced
    def all_gather_coalesced(self, k: int, case: int):
        """k tensors of different shapes per rank; output_lists[rank][i] must be rank's i-th."""
        shapes = [(i + 1, 2) if i % 2 else (3 * i + 1,) for i in range(k)]

        def tensor(rank, i):
            g = torch.Generator().manual_seed(1000 * case + 10 * rank + i)
            return torch.randn(shapes[i], generator=g)

        ins = [tensor(self.rank, i) for i in range(k)]
        outs = [[torch.full(s, -1.0) for s in shapes] for _ in range(self.world)]
        dist.all_gather_coalesced(outs, ins)
        for r in range(self.world):
            for i in range(k):
                if not torch.equal(outs[r][i], tensor(r, i)):
                    return f"output [{r}][{i}] is not rank {r}'s input {i}"

    def all_gather_coalesced_bad_layout(self):
        # [tensor][rank] instead of [rank][tensor], with a tensor count != world size
        ins = [torch.ones(2)] * (self.world + 1)
        outs = [[torch.empty(2) for _ in range(self.world)] for _ in ins]
        return expect_error(lambda: dist.all_gather_coalesced(outs, ins), (ValueError, RuntimeError),
                            "output list", "per rank")

    # ---------------------------------------------------------------- bitwise
    def bitwise(self, case: int):
        bad = []
        for dtype in INT_DTYPES:
            for n in (0, 1, 7, 1000, 70001):
                for name, (op, fn) in BITWISE.items():
                    case += 1
                    everyone = [ints(r, case, n, dtype) for r in range(self.world)]
                    ref = functools.reduce(fn, everyone) if n else everyone[0]
                    x = everyone[self.rank].clone()
                    dist.all_reduce(x, op)
                    if not torch.equal(x, ref):
                        bad.append(f"all_reduce {name} {dtype} n={n}")
                    root = self.world - 1
                    y = everyone[self.rank].clone()
                    dist.reduce(y, root, op)
                    if self.rank == root and not torch.equal(y, ref):
                        bad.append(f"reduce {name} {dtype} n={n}")
                    if self.rank != root and not torch.equal(y, everyone[self.rank]):
                        bad.append(f"reduce {name} {dtype} n={n}: non-root input changed")
                    m = n // self.world
                    if m:
                        full = [ints(r, case + 10 ** 6, m * self.world, dtype)
                                for r in range(self.world)]
                        o = torch.empty(m, dtype=dtype)
                        dist.reduce_scatter_tensor(o, full[self.rank], op)
                        rs_ref = functools.reduce(fn, full)[self.rank * m:(self.rank + 1) * m]
                        if not torch.equal(o, rs_ref):
                            bad.append(f"reduce_scatter {name} {dtype} m={m}")
        # non-contiguous input
        base = ints(self.rank, 99, 400, torch.int32).view(20, 20)
        x = base.t()
        dist.all_reduce(x, dist.ReduceOp.BXOR)
        ref = functools.reduce(torch.bitwise_xor,
                               [ints(r, 99, 400, torch.int32).view(20, 20).t()
                                for r in range(self.world)])
        if not torch.equal(x, ref):
            bad.append("all_reduce BXOR non-contiguous")
        return "; ".join(bad[:10]) or None

    def bitwise_float_error(self):
        return expect_error(lambda: dist.all_reduce(torch.ones(3), dist.ReduceOp.BOR),
                            ValueError, "BOR", "integer")

    # ---------------------------------------------------------------- sparse
    def sparse(self, case: int):
        size = (50, 3)

        def local(rank):
            g = torch.Generator().manual_seed(case * 31 + rank)
            nnz = 0 if rank == 1 else int(torch.randint(1, 40, (1,), generator=g))
            idx = torch.randint(0, size[0], (1, nnz), generator=g)  # duplicates on purpose
            vals = torch.randn(nnz, size[1], generator=g, dtype=torch.float64)
            return torch.sparse_coo_tensor(idx, vals, size)

        t = local(self.rank)
        dist.all_reduce(t)
        ref = sum(local(r).to_dense() for r in range(self.world))
        if not t.is_sparse:
            return "result is not sparse"
        err = (t.to_dense() - ref).abs().max().item()
        return None if err < 1e-12 else f"max error {err}"

    def sparse_shape_mismatch(self):
        # same number of elements (the generic header check passes), different shapes
        t = torch.ones(6) if self.rank == 0 else torch.ones(2, 3)
        msg = expect_error(lambda: dist.all_reduce(t.to_sparse()), ValueError,
                           "sparse", "differ", "size [6]", "size [2, 3]")
        x = torch.ones(3)
        dist.all_reduce(x)  # the group stays usable
        return msg if msg != "ok" or torch.equal(x, torch.full((3,), float(self.world))) \
            else "group unusable after the error"

    def ddp_sparse_embedding(self):
        """DDP with nn.Embedding(sparse=True): one SGD step equals the single-process step on
        the union of the ranks' batches (mean loss over ranks)."""
        torch.manual_seed(0)
        emb = torch.nn.Embedding(40, 4, sparse=True)
        ref = torch.nn.Embedding(40, 4, sparse=True)
        ref.load_state_dict(emb.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(emb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)

        def batch(r):
            g = torch.Generator().manual_seed(500 + r)
            return torch.randint(0, 40, (6,), generator=g)

        ddp(batch(self.rank)).pow(2).sum().backward()
        opt.step()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
        (sum(ref(batch(r)).pow(2).sum() for r in range(self.world)) / self.world).backward()
        ropt.step()
        if ddp._get_ddp_logging_data().get("backend_name") != "hetccl":
            return f"DDP logs backend {ddp._get_ddp_logging_data().get('backend_name')!r}"
        err = (emb.weight - ref.weight).abs().max().item()
        return None if err < 1e-6 else f"weights differ from the reference by {err}"

    # ---------------------------------------------------------------- any source
    def any_source(self, tag: int):
        """Every rank sends one tensor to every other rank; each receives them with src=None."""
        w, me = self.world, self.rank

        def payload(src, dst):
            g = torch.Generator().manual_seed(tag * 100 + src * 10 + dst)
            return torch.randn(5, generator=g)

        works = [dist.isend(payload(me, d), d, tag=tag) for d in range(w) if d != me]
        seen = []
        for _ in range(w - 1):
            t = torch.empty(5)
            src = dist.recv(t, src=None, tag=tag)
            if not torch.equal(t, payload(src, me)):
                return f"data from rank {src} wrong"
            seen.append(src)
        for wk in works:
            wk.wait()
        return None if sorted(seen) == [r for r in range(w) if r != me] else f"sources {seen}"

    def any_source_then_named(self, tag: int):
        """Rank 0 receives from any source first, then names the sources: the receive that
        any-source posted to the losing rank must hand over that rank's message in order."""
        w, me = self.world, self.rank
        if me == 0:
            got = {}
            work = dist.irecv(torch.empty(3), src=None, tag=tag)
            work.wait()
            first = work._source_rank()
            t = torch.empty(3)
            for src in range(1, w):
                for k in range(2):
                    if src == first and k == 0:
                        continue
                    dist.recv(t, src=src, tag=tag)
                    got[(src, k)] = t.clone()
            bad = [(s, k) for (s, k), v in got.items() if not torch.equal(v, torch.full((3,), 10.0 * s + k))]
            return f"wrong messages {bad}" if bad else None
        for k in range(2):
            dist.send(torch.full((3,), 10.0 * me + k), 0, tag=tag)

    def any_source_size_error(self, tag: int):
        """A cross-vendor message smaller than the receiving tensor: a clear error."""
        w, me = self.world, self.rank
        other = w - 1  # in every split the last rank is of a different vendor than rank 0
        if me == other:
            dist.send(torch.ones(2), 0, tag=tag)
        elif me == 0:
            t = torch.empty(4)
            res = expect_error(lambda: dist.recv(t, src=other, tag=tag), ValueError, "bytes")
            return res

    def usable_after(self, bad: list) -> str | None:
        """The verdict of a refusal case: what went wrong, or None once an all_reduce shows the
        group still usable after the refusals."""
        y = torch.full((5,), 1.0)
        dist.all_reduce(y)
        if not torch.equal(y, torch.full((5,), float(self.world))):
            bad.append(f"group unusable after: {y.tolist()}")
        return "; ".join(bad) or None

    # ---------------------------------------------------------------- one rank's bad output
    def refused_on_one_rank(self):
        """One rank passes an all_gather output (then a reduce_scatter input) of the wrong size,
        which only it can see: it raises naming its sizes, every other rank raises naming that
        rank (no rank waits for data that never comes), and the group stays usable."""
        w, me = self.world, self.rank
        bad = []
        x = torch.full((4,), float(me))
        out = torch.empty(4 * w - (1 if me == 0 else 0))
        want = ("all_gather output has",) if me == 0 else ("refused on that rank", "[0]")
        v = expect_error(lambda: dist.all_gather_into_tensor(out, x), ValueError, *want)
        if v != "ok":
            bad.append(f"all_gather: {v}")
        last = w - 1
        inp = torch.ones(3 * w + (2 if me == last else 0))
        o = torch.empty(3)
        want = ("reduce_scatter input has",) if me == last else ("refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.reduce_scatter_tensor(o, inp), ValueError, *want)
        if v != "ok":
            bad.append(f"reduce_scatter: {v}")
        # all_to_all_single whose input split sizes do not add up, on rank 0 only (counts
        # differ by design here: the refusal travels in the dtype field)
        a_in = torch.ones(2 * w)
        splits = [2] * w
        if me == 0:
            splits[0] = 3
        want = ("split sizes",) if me == 0 else ("refused on that rank", "[0]")
        v = expect_error(lambda: dist.all_to_all_single(torch.empty(2 * w), a_in, None, splits),
                         ValueError, *want)
        if v != "ok":
            bad.append(f"all_to_all: {v}")
        # the list form of all_gather with one output too few, on the last rank only
        outs = [torch.empty(4) for _ in range(w - (1 if me == last else 0))]
        want = ("output tensors",) if me == last else ("refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.all_gather(outs, torch.ones(4)), ValueError, *want)
        if v != "ok":
            bad.append(f"all_gather list: {v}")
        # the root's gather list / scatter list with an entry of the wrong size
        gl = [torch.empty(4) for _ in range(w)]
        gl[w - 1] = torch.empty(5)
        want = ("gather root's output tensor",) if me == 0 else ("refused on that rank", "[0]")
        v = expect_error(lambda: dist.gather(torch.ones(4), gl if me == 0 else None, dst=0),
                         ValueError, *want)
        if v != "ok":
            bad.append(f"gather: {v}")
        sl = [torch.ones(3) for _ in range(w)]
        sl[0] = torch.ones(2)
        want = ("scatter root's input tensor",) if me == last else ("refused on that rank",
                                                                    f"[{last}]")
        v = expect_error(lambda: dist.scatter(torch.empty(3), sl if me == last else None,
                                              src=last), ValueError, *want)
        if v != "ok":
            bad.append(f"scatter: {v}")
        # every rank: reduce_scatter with the input's dtype differing from the output's (torch
        # does not check it; reduced as they were, float bits landed in the int32 output), and
        # a complex PRODUCT reduce (it worked or failed depending on the topology)
        v = expect_error(lambda: dist.reduce_scatter_tensor(torch.zeros(4, dtype=torch.int32),
                                                            torch.ones(4 * w)),
                         TypeError, "dtype", "int32")
        if v != "ok":
            bad.append(f"reduce_scatter dtypes: {v}")
        v = expect_error(lambda: dist.reduce(torch.full((4,), 1 + 1j, dtype=torch.complex64), 0,
                                             op=dist.ReduceOp.PRODUCT),
                         NotImplementedError, "PROD", "complex")
        if v != "ok":
            bad.append(f"complex product: {v}")
        return self.usable_after(bad)

    def refused_at_the_call_on_one_rank(self):
        """What one rank refuses at the call (a dtype or op it cannot reduce, a root out of
        range) raises there at once, as torch's groups do, and also reaches the peers' check:
        they raise naming that rank instead of waiting for its data; the group stays usable."""
        w, me = self.world, self.rank
        last = w - 1
        bad = []
        # rank 0: int16, which it cannot reduce (torch passes it on), the others int32
        x = torch.ones(4, dtype=torch.int16 if me == 0 else torch.int32)
        want = (NotImplementedError, "int16") if me == 0 else (ValueError, "refused on that rank", "[0]")
        v = expect_error(lambda: dist.all_reduce(x), *want)
        if v != "ok":
            bad.append(f"all_reduce int16: {v}")
        # the last rank: a broadcast root out of range
        y = torch.ones(3)
        want = (ValueError, "rank", str(w + 5)) if me == last else (ValueError, "refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.broadcast(y, src=w + 5 if me == last else 0), *want)
        if v != "ok":
            bad.append(f"broadcast root: {v}")
        # the last rank: a broadcast into an expanded view (overlapping memory), refused at
        # the call before anything moves (before: the copy back failed on that rank alone
        # after the data had moved, and the group broke there)
        e = torch.zeros(1).expand(4) if me == last else torch.zeros(4)
        want = (ValueError, "overlapping") if me == last else (ValueError, "refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.broadcast(e, src=0), *want)
        if v != "ok":
            bad.append(f"broadcast into an expanded view: {v}")
        # rank 0: BAND on a float output (refused), the others on int32
        dt = torch.float32 if me == 0 else torch.int32
        want = (ValueError, "BAND") if me == 0 else (ValueError, "refused on that rank", "[0]")
        v = expect_error(lambda: dist.reduce_scatter_tensor(torch.zeros(2, dtype=dt), torch.ones(2 * w, dtype=dt),
                                                            op=dist.ReduceOp.BAND), *want)
        if v != "ok":
            bad.append(f"reduce_scatter band: {v}")
        # the last rank: AVG on bool (refused), the others float32, into a reduce to rank 0
        z = torch.ones(4, dtype=torch.bool) if me == last else torch.ones(4)
        want = (TypeError, "boolean") if me == last else (ValueError, "refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.reduce(z, 0, op=dist.ReduceOp.AVG), *want)
        if v != "ok":
            bad.append(f"reduce avg bool: {v}")
        # rank 0: the second of three coalesced reduce_scatters in int16 (refused); every
        # rank's three collectives pair up, so the next calls still meet their peers' own
        outs = [torch.zeros(2, dtype=torch.int16 if (me == 0 and k == 1) else torch.int32) for k in range(3)]
        ins = [torch.ones(2 * w, dtype=o.dtype) for o in outs]

        def coalesced():
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, i)
            cm.wait()
        want = (NotImplementedError, "int16") if me == 0 else ((ValueError, RuntimeError), "refused on that rank")
        v = expect_error(coalesced, *want)
        if v != "ok":
            bad.append(f"coalesced reduce_scatter: {v}")
        # the last rank: a gather root out of range
        want = (ValueError, "rank") if me == last else (ValueError, "refused on that rank", f"[{last}]")
        v = expect_error(lambda: dist.gather(torch.ones(2), [torch.empty(2) for _ in range(w)] if me == 0 else None,
                                             dst=w + 3 if me == last else 0), *want)
        if v != "ok":
            bad.append(f"gather root: {v}")
        return self.usable_after(bad)

    def avg_near_float16_max(self):
        """AVG of float16 values near the top of its range: NCCL multiplies by 1/n before the
        sum (ncclDevPreMulSum), so the mean stays finite; a sum first overflows to inf."""
        w, me = self.world, self.rank
        bad = []
        for dt in (torch.float16, torch.bfloat16):
            top = 30000.0 if dt == torch.float16 else 3.0e38
            x = torch.full((6,), top, dtype=dt)
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            if not torch.allclose(x.double(), torch.full((6,), top, dtype=torch.float64), rtol=1e-2):
                bad.append(f"all_reduce {dt}: {x.tolist()[:2]}")
            y = torch.full((6,), top, dtype=dt)
            keep = y.clone()
            dist.reduce(y, 0, op=dist.ReduceOp.AVG)
            if me == 0 and not torch.allclose(y.double(), torch.full((6,), top, dtype=torch.float64), rtol=1e-2):
                bad.append(f"reduce {dt}: {y.tolist()[:2]}")
            if me != 0 and not torch.equal(y, keep):
                bad.append(f"reduce {dt}: a non-root's tensor changed")
            inp = torch.full((2 * w,), top, dtype=dt)
            keep = inp.clone()
            o = torch.empty(2, dtype=dt)
            dist.reduce_scatter_tensor(o, inp, op=dist.ReduceOp.AVG)
            if not torch.allclose(o.double(), torch.full((2,), top, dtype=torch.float64), rtol=1e-2):
                bad.append(f"reduce_scatter {dt}: {o.tolist()}")
            if not torch.equal(inp, keep):
                bad.append(f"reduce_scatter {dt}: the input changed")
        return "; ".join(bad) or None

    def premul_sum(self):
        """ReduceOp.PREMUL_SUM (dist._make_nccl_premul_sum), as ProcessGroupNCCL: each rank's
        values times its own factor (a number or a one-element tensor), then summed, for
        all_reduce, reduce (a non-root's tensor unchanged) and reduce_scatter (list, tensor and
        coalesced; the input unchanged), against a float64 reference; an integer tensor is
        refused with TypeError on every rank, and the group stays usable."""
        w, me = self.world, self.rank
        bad = []
        fac = [0.25 * (r + 1) for r in range(w)]  # rank r's factor (exact in every dtype)

        def x_of(r, n, dt, seed):
            g = torch.Generator().manual_seed(9000 + 31 * seed + r)
            return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dt)

        def ref(n, dt, seed):
            return sum(x_of(r, n, dt, seed).double() * fac[r] for r in range(w))

        def close(got, want, dt):
            tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(dt, 1e-6) * w
            return got.numel() == want.numel() and bool(
                ((got.double() - want).abs() <= tol).all())

        for k, dt in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16)):
            for as_tensor in (False, True):
                seed = 2 * k + as_tensor
                f = torch.tensor([fac[me]]) if as_tensor else fac[me]
                op = dist._make_nccl_premul_sum(f)
                x = x_of(me, 1001, dt, seed)
                dist.all_reduce(x, op=op)
                if not close(x, ref(1001, dt, seed), dt):
                    bad.append(f"all_reduce {dt} tensor={as_tensor}")
                y = x_of(me, 301, dt, seed)
                keep = y.clone()
                dist.reduce(y, w - 1, op=op)
                if me == w - 1 and not close(y, ref(301, dt, seed), dt):
                    bad.append(f"reduce {dt} tensor={as_tensor}")
                if me != w - 1 and not torch.equal(y, keep):
                    bad.append(f"reduce {dt}: a non-root's tensor changed")
                inp = x_of(me, 5 * w, dt, seed)
                keep = inp.clone()
                o = torch.empty(5, dtype=dt)
                dist.reduce_scatter_tensor(o, inp, op=op)
                if not close(o, ref(5 * w, dt, seed)[5 * me:5 * me + 5], dt) or \
                        not torch.equal(inp, keep):
                    bad.append(f"reduce_scatter_tensor {dt} tensor={as_tensor}")
                o2 = torch.empty(5, dtype=dt)
                dist.reduce_scatter(o2, list(inp.chunk(w)), op=op)
                if not close(o2, ref(5 * w, dt, seed)[5 * me:5 * me + 5], dt):
                    bad.append(f"reduce_scatter (list) {dt} tensor={as_tensor}")
        # complex, as ProcessGroupNCCL (a real view): each part scaled by the real factor
        zc = torch.complex(x_of(me, 64, torch.float32, 50), x_of(me, 64, torch.float32, 51))
        dist.all_reduce(zc, op=dist._make_nccl_premul_sum(fac[me]))
        want = torch.complex(ref(64, torch.float32, 50), ref(64, torch.float32, 51))
        if not bool(((zc.to(torch.complex128) - want).abs() <= 1e-5 * w).all()):
            bad.append("complex64")
        # a call every rank refuses (rank 0's count differs) leaves each rank's tensor as it was
        u = x_of(me, 10 if me == 0 else 12, torch.float32, 60)
        keep = u.clone()
        res = expect_error(lambda: dist.all_reduce(u, op=dist._make_nccl_premul_sum(3.0)),
                           ValueError, "number of elements")
        if res != "ok" or not torch.equal(u, keep):
            bad.append(f"refused premul all_reduce: {res}; tensor kept: {torch.equal(u, keep)}")
        op = dist._make_nccl_premul_sum(0.5)
        res = expect_error(lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=op),
                           TypeError, "PreMulSum", "int32")
        if res != "ok":
            bad.append(f"int32: {res}")
        z = torch.ones(3)
        dist.all_reduce(z)
        if not torch.equal(z, torch.full((3,), float(w))):
            bad.append(f"unusable after the refusal: {z.tolist()}")
        return "; ".join(bad) or None

    def exception_while_running(self):
        """c10d's Work.exception() is None while the work runs (and is_success() True); the
        last rank joins the all_reduce a second late, so rank 0's work is still running."""
        w, me = self.world, self.rank
        if me == w - 1:
            time.sleep(1.0)
        x = torch.ones(8)
        work = dist.all_reduce(x, async_op=True)
        res = None
        if me == 0:
            if work.is_completed():
                res = "the work completed before its last rank joined"
            elif work.exception() is not None:
                res = f"exception() of a running work: {work.exception()!r}"
            elif not work.is_success():
                res = "is_success() is False for a running work"
        work.wait()
        if work.exception() is not None or not torch.equal(x, torch.full((8,), float(w))):
            res = res or f"after wait: {work.exception()!r}, {x.tolist()}"
        return res

    # ---------------------------------------------------------------- p2p works
    def any_source_open_then_named(self, tag: int):
        """Rank 0 posts an any-source receive, then a named receive from the last rank (of
        another vendor) into a non-contiguous tensor, and waits them in the opposite order:
        posting order decides (the any-source one gets the first message, the named one the
        second), whichever is waited first (gloo and MPI match in posting order)."""
        me, last = self.rank, self.world - 1
        if me == 0:
            a = torch.empty(3)
            r = torch.empty(6)[::2]
            wa = dist.irecv(a, src=None, tag=tag)
            wr = dist.irecv(r, src=last, tag=tag)
            wr.wait()
            wa.wait()
            bad = []
            if not torch.equal(a, torch.full((3,), 1.0)):
                bad.append(f"the any-source receive got {a.tolist()}")
            if not torch.equal(r, torch.full((3,), 2.0)):
                bad.append(f"the named receive got {r.tolist()}")
            if wa._source_rank() != last:
                bad.append(f"source {wa._source_rank()}")
            return "; ".join(bad) or None
        if me == last:
            dist.send(torch.full((3,), 1.0), 0, tag=tag)
            dist.send(torch.full((3,), 2.0), 0, tag=tag)

    def p2p_future_and_is_completed(self, tag: int):
        """A point-to-point work's future completes without wait() (isend and irecv), and
        is_completed() turns True only with the data in the caller's (non-contiguous) tensor."""
        me, last = self.rank, self.world - 1

        def poll(cond, what):
            end = time.monotonic() + 20
            while not cond():
                if time.monotonic() > end:
                    raise AssertionError(f"{what} not done after 20 s")
                time.sleep(0.01)

        if me == 0:
            t = torch.empty(5)
            fut = dist.irecv(t, src=last, tag=tag).get_future()
            poll(fut.done, "the irecv's future")
            u = torch.empty(10)[::2]
            w = dist.irecv(u, src=last, tag=tag + 1)
            poll(w.is_completed, "the irecv's is_completed")
            bad = []
            if not torch.equal(t, torch.arange(5.0)):
                bad.append(f"future: {t.tolist()}")
            if not torch.equal(u, torch.arange(5.0) + 10):
                bad.append(f"is_completed: {u.tolist()}")
            # result() is the caller's tensor, as c10d's (not a contiguous stand-in)
            if len(w.result()) != 1 or w.result()[0] is not u:
                bad.append(f"irecv result() is not the non-contiguous tensor received into: "
                           f"{[tuple(x.shape) for x in w.result()]}")
            v = torch.empty(6)[::2]
            s = dist.isend(v.fill_(7.0), last, tag=tag + 2)
            s.wait()
            if len(s.result()) != 1 or s.result()[0] is not v:
                bad.append("isend result() is not the non-contiguous tensor sent")
            return "; ".join(bad) or None
        if me == last:
            fut = dist.isend(torch.arange(5.0), 0, tag=tag).get_future()
            poll(fut.done, "the isend's future")
            dist.send(torch.arange(5.0) + 10, 0, tag=tag + 1)
            got = torch.empty(3)
            dist.recv(got, 0, tag=tag + 2)
            if not torch.equal(got, torch.full((3,), 7.0)):
                return f"the non-contiguous isend carried {got.tolist()}"


    def wait_with_timeout(self):
        """Work.wait(timeout) as c10d's: a collective whose peer is late raises "timed out"
        once the timeout passes; the collective goes on, and a later wait() returns with the
        right result."""
        import time as _time

        x = torch.full((1000,), float(self.rank + 1))
        if self.rank == self.world - 1:
            _time.sleep(2.0)
        w = dist.all_reduce(x, async_op=True)
        verdict = None
        if self.rank == 0:
            verdict = times_out(w, 0.3, "wait(timeout=0.3 s) returned although a peer came 2 s late")
        w.wait()
        want = float(sum(range(1, self.world + 1)))
        if not torch.equal(x, torch.full((1000,), want)):
            verdict = (verdict + "; " if verdict else "") + f"result {x[:3].tolist()}"
        return verdict

    def p2p_timeout_then_recv(self, tag: int):
        """A receive whose wait times out is withdrawn as if never posted: the message its peer
        sends afterwards goes to the next receive from that peer with that tag."""
        me, last = self.rank, self.world - 1
        verdict = None
        if me == 0:
            t = torch.zeros(4)
            w = dist.irecv(t, src=last, tag=tag)
            verdict = times_out(w, 1, "the wait did not time out")
        dist.barrier()  # the peer sends only now
        if me == last:
            dist.send(torch.full((4,), 3.0), 0, tag=tag)
        if me == 0:
            t2 = torch.zeros(4)
            dist.recv(t2, src=last, tag=tag)
            if not torch.equal(t2, torch.full((4,), 3.0)):
                verdict = (verdict + "; " if verdict else "") + f"the next recv got {t2.tolist()}"
        return verdict

    # ---------------------------------------------------------------- timeouts
    def timeout_wording(self):
        """A collective only rank 0 joins times out with torch's wording (' Timed out ')."""
        sub = dist.new_group(timeout=timedelta(seconds=1))
        if self.rank == 0:
            t0 = time.monotonic()
            res = expect_error(lambda: dist.barrier(sub), RuntimeError, " Timed out ")
            took = time.monotonic() - t0
            if res == "ok" and not 0.9 <= took < 6:
                res = f"timed out after {took:.1f} s, expected ~1 s"
        else:
            res = None
        dist.barrier()  # default group: still usable
        dist.destroy_process_group(sub)
        return res

    # ---------------------------------------------------------------- monitored barrier
    def monitored_barrier(self):
        import hetccl

        w, me = self.world, self.rank
        res = []
        hetccl.monitored_barrier(timeout=timedelta(seconds=5))
        hetccl.monitored_barrier(timeout=5, wait_all_ranks=True)
        # rank 1 stays away: rank 0 names it, the others learn that rank 0 failed
        if me == 0:
            res.append(expect_error(lambda: hetccl.monitored_barrier(timeout=1), RuntimeError,
                                    "Rank 1 failed to pass monitoredBarrier"))
        elif me != 1:
            res.append(expect_error(lambda: hetccl.monitored_barrier(timeout=1), RuntimeError,
                                    f"Rank {me} successfully reached monitoredBarrier"))
        dist.barrier()
        if w >= 3:
            # ranks 1..w-1 stay away: all are named
            if me == 0:
                names = ", ".join(str(r) for r in range(1, w))
                res.append(expect_error(
                    lambda: hetccl.monitored_barrier(timeout=0.5, wait_all_ranks=True),
                    RuntimeError, f"Ranks {names} failed to pass monitoredBarrier"))
            dist.barrier()
        # torch's own refuses the backend; ours is the documented equivalent
        res.append(expect_error(lambda: dist.monitored_barrier(), ValueError, "GLOO"))
        return "; ".join(r for r in res if r != "ok") or None

    # ---------------------------------------------------------------- pass-through identity
    def passthrough_identity(self):
        """A single-vendor subgroup is a plain c10d ProcessGroup: native speed, and no pybind
        trampoline, which would hold the GIL inside gloo's queue and deadlock (reproduced by
        Megatron's async tensor-parallel all-reduce in backward, tests/test_megatron.py
        test_2p2_*; see compat.passthrough_group). DDP on it (several gradient buckets) keeps
        the replicas equal and reports backend hetccl, like dist.get_backend."""
        v0 = [r for r, lab in enumerate(self.labels) if lab == self.labels[0]]
        sub = dist.new_group(v0)
        res = None
        if self.rank in v0:
            if type(sub) is not dist.ProcessGroup:
                res = f"single-vendor group is {type(sub).__name__}, not a plain ProcessGroup"
            elif len(v0) > 1:
                torch.manual_seed(0)
                net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
                model = torch.nn.parallel.DistributedDataParallel(
                    net, process_group=sub, bucket_cap_mb=0.02)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                for step in range(4):
                    g = torch.Generator().manual_seed(step * 10 + self.rank)
                    model(torch.randn(8, 64, generator=g)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                data = model._get_ddp_logging_data()
                if data.get("backend_name") != "hetccl" or dist.get_backend(sub) != "hetccl" \
                        or data.get("hetccl_native_backend") != "gloo":
                    res = (f"DDP logs {data.get('backend_name')!r} (native "
                           f"{data.get('hetccl_native_backend')!r}), dist.get_backend says "
                           f"{dist.get_backend(sub)!r}")
                w = torch.cat([p.detach().view(-1) for p in net.parameters()])
                ws = [torch.empty_like(w) for _ in v0]
                dist.all_gather(ws, w, group=sub)
                if not all(torch.equal(x, w) for x in ws):
                    res = "DDP replicas diverged on the pass-through group"
                import hetccl
                hetccl.monitored_barrier(sub, timeout=5)  # the native gloo backend's
        dist.barrier()
        return res


def run_p2p(ctx) -> dict[str, str]:
    """The point-to-point cases and Work.wait's timeout (test_semantics runs them over shm and
    over tcp)."""
    os.environ.pop("RANK", None)
    dist.init_process_group("hetccl", store=ctx.store(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=30))
    import hetccl

    c = Cases(ctx.rank, ctx.world_size, hetccl.vendor_of_ranks())
    c.run("p2p/any_source_open_then_named", c.any_source_open_then_named, 21)
    c.run("p2p/future_and_is_completed", c.p2p_future_and_is_completed, 22)
    c.run("p2p/timeout_then_recv", c.p2p_timeout_then_recv, 24)
    c.run("work/wait_with_timeout", c.wait_with_timeout)
    dist.destroy_process_group()
    return c.out


def run_all(ctx, start_lines: list | None = None) -> dict[str, str]:
    import hetccl

    # The rank comes from init_process_group, not from RANK (mp.spawn style): HETCCL_VENDOR_SPLIT
    # must still label this process by its rank.
    os.environ.pop("RANK", None)
    captured: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            captured.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger("hetccl").addHandler(Grab())
    dist.init_process_group("hetccl", store=ctx.store(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=30))
    labels = hetccl.vendor_of_ranks()
    c = Cases(ctx.rank, ctx.world_size, labels)
    split = os.environ.get("HETCCL_VENDOR_SPLIT", "")
    from hetccl.launch import vendor_labels
    c.out["vendor_split_without_RANK"] = "ok" if labels == vendor_labels(split) else \
        f"labels {labels}, expected {vendor_labels(split)}"
    starts = [line for line in captured if "started" in line]
    if ctx.rank == 0:
        want = (f"NOTICE hetccl: started, {ctx.world_size} ranks, "
                f"{len(set(labels))} vendor groups")
        c.out["start_line"] = "ok" if len(starts) == 1 and starts[0].startswith(want) and \
            "bridge transport shm" in starts[0] else f"start lines {starts}"
    else:
        c.out["start_line"] = "ok" if not starts else f"rank {ctx.rank} logged {starts}"
    for k in (1, ctx.world_size, ctx.world_size + 2):
        c.run(f"all_gather_coalesced/k={k}", c.all_gather_coalesced, k, k)
    c.run("all_gather_coalesced/bad_layout", c.all_gather_coalesced_bad_layout)
    c.run("bitwise/all", c.bitwise, 1)
    c.run("bitwise/float_error", c.bitwise_float_error)
    c.run("sparse/all_reduce", c.sparse, 3)
    c.run("sparse/shape_mismatch", c.sparse_shape_mismatch)
    c.run("sparse/ddp_embedding", c.ddp_sparse_embedding)
    c.run("any_source/all_to_all", c.any_source, 11)
    c.run("any_source/then_named", c.any_source_then_named, 12)
    c.run("any_source/size_error", c.any_source_size_error, 13)
    c.run("refusal/one_rank", c.refused_on_one_rank)
    c.run("refusal/at_the_call_on_one_rank", c.refused_at_the_call_on_one_rank)
    c.run("work/exception_while_running", c.exception_while_running)
    c.run("avg/near_the_top_of_half_ranges", c.avg_near_float16_max)
    c.run("premul_sum/all", c.premul_sum)
    c.run("timeout/wording", c.timeout_wording)
    c.run("monitored_barrier", c.monitored_barrier)
    c.run("passthrough/identity", c.passthrough_identity)
    c.run("lifetime/async_released", c.released_after_wait, True)
    c.run("lifetime/sync_released", c.released_after_wait, False)
    dist.destroy_process_group()
    return c.out


def run_bitwise_agreement(ctx) -> dict:
    """Three vendor groups off the all-linked path: an all_reduce whose float sums depend on
    the order of additions gives every rank the same bits (small: flat, large: hier)."""
    os.environ.pop("RANK", None)
    dist.init_process_group("hetccl", store=ctx.store(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    out = {}
    for n in (4, 1 << 18):
        vals = [1e8, 1.0, -1e8, 3.0]
        x = torch.full((n,), vals[ctx.rank % len(vals)], dtype=torch.float32)
        g = torch.Generator().manual_seed(ctx.rank)
        x += torch.randn(n, generator=g) * 1e3
        dist.all_reduce(x)
        everyone = [torch.empty_like(x) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, x)
        out[str(n)] = "ok" if all(torch.equal(e, everyone[0]) for e in everyone) else \
            f"ranks differ: {[e[:2].tolist() for e in everyone]}"
    dist.destroy_process_group()
    return out
