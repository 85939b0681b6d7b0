"""Rank-side checks of every collective against float64 / exact references.

Each rank generates every rank's input from a seed (rank, case), so it can compute the
reference for the whole group locally; results are compared with tolerances derived from the
dtype (see TOL). run_all() returns {case: "ok" | error text} so one spawn per vendor split
covers everything and pytest reports each case separately.
"""
from __future__ import annotations

import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

REDUCE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                 torch.uint8, torch.int32, torch.int64]
COPY_DTYPES = REDUCE_DTYPES + [torch.bool, torch.int16, torch.complex64]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
SIZES = [0, 1, 7, 1000, 70001]
# absolute tolerance per element and contributing rank, for data in [-1, 1]
TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def data(rank: int, case: int, n: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000003 * case + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        x = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
        if op == "prod":
            x = x.sign() * (0.5 + x.abs() / 2)
        return x.to(dtype)
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    if op == "prod":
        lo, hi = (1, 3) if dtype == torch.uint8 else (-2, 3)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        xs = torch.stack([x.to(torch.float64) for x in inputs])
    else:
        xs = torch.stack([x.to(torch.int64) for x in inputs])
    if op in ("sum", "avg"):
        r = xs.sum(0)
        if op == "avg":
            r = r / len(inputs)
    elif op == "prod":
        r = xs.prod(0)
    elif op == "min":
        r = xs.min(0).values if xs.numel() else xs.sum(0)
    else:
        r = xs.max(0).values if xs.numel() else xs.sum(0)
    if not dtype.is_floating_point and dtype != torch.int64:
        info = torch.iinfo(dtype)
        # integer results wrap around like the dtype does
        r = ((r - info.min) % (info.max - info.min + 1)) + info.min
    return r


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, world: int) -> str | None:
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.numel() == 0:
        return None
    if dtype.is_floating_point:
        err = (got.to(torch.float64) - ref).abs().max().item()
        tol = TOL[dtype] * world * max(1.0, ref.abs().max().item())
        return None if err <= tol else f"max error {err:.3g} > tol {tol:.3g}"
    bad = (got.to(torch.int64) != ref.to(torch.int64)).sum().item()
    return None if bad == 0 else f"{bad} wrong elements"


class Cases:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.results: dict[str, str] = {}
        self.case = 0

    def run(self, name, fn):
        self.case += 1
        try:
            err = fn(self.case)
            self.results[name] = "ok" if err is None else err
        except Exception:  # noqa: BLE001
            self.results[name] = traceback.format_exc(limit=6)


def _all_reduce_matrix(c: Cases, rank: int, W: int) -> None:
    """all_reduce: every op x dtype, several sizes."""
    for dtype in REDUCE_DTYPES:
        for opn, op in OPS.items():
            if opn == "avg" and not dtype.is_floating_point:
                continue
            for n in (SIZES if dtype == torch.float32 and opn == "sum" else [0, 7, 70001]):
                def f(case, dtype=dtype, opn=opn, op=op, n=n):
                    x = data(rank, case, n, dtype, opn)
                    dist.all_reduce(x, op=op)
                    ref = reference([data(r, case, n, dtype, opn) for r in range(W)], opn, dtype)
                    return close(x, ref, dtype, W)
                c.run(f"all_reduce/{opn}/{str(dtype)[6:]}/n{n}", f)


def run_all_reduce(ctx) -> dict:
    """Only the all_reduce matrix, plus which host path carried it (engine stats)."""
    import hetccl  # noqa: F401 - registers the backend

    rank, world = ctx.rank, ctx.world_size
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    c = Cases(rank, world)
    _all_reduce_matrix(c, rank, world)
    stats = dict(dist.group.WORLD.engine.stats)
    dist.destroy_process_group()
    return {"results": c.results, "stats": stats}


def run_all(ctx, extra_env_case: str = "") -> dict[str, str]:
    import hetccl  # noqa: F401 - registers the backend

    rank, world = ctx.rank, ctx.world_size
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    c = Cases(rank, world)
    W = world
    _all_reduce_matrix(c, rank, W)

    # async all_reduce with futures, non-contiguous input, 2-D tensor
    def f(case):
        xs = [data(rank, case + k, 5000, torch.float32) for k in range(3)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        fut_vals = [w.get_future().wait()[0] for w in works]
        for k, x in enumerate(xs):
            ref = reference([data(r, case + k, 5000, torch.float32) for r in range(W)], "sum",
                            torch.float32)
            e = close(x, ref, torch.float32, W) or close(fut_vals[k], ref, torch.float32, W)
            if e:
                return e
    c.run("all_reduce/async_futures", f)
    c.case += 3

    def f(case):
        base = data(rank, case, 600, torch.float32).view(20, 30)
        x = base.t()  # non-contiguous
        dist.all_reduce(x)
        ref = reference([data(r, case, 600, torch.float32).view(20, 30).t() for r in range(W)],
                        "sum", torch.float32)
        return close(x, ref, torch.float32, W)
    c.run("all_reduce/non_contiguous", f)

    # broadcast from every root, several dtypes
    for root in range(W):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            for n in (0, 13, 70001):
                def f(case, root=root, dtype=dtype, n=n):
                    x = data(rank, case, n, dtype) if rank == root else torch.zeros(n, dtype=dtype)
                    dist.broadcast(x, src=root)
                    ref = data(root, case, n, dtype)
                    return None if torch.equal(x, ref) else "mismatch"
                c.run(f"broadcast/root{root}/{str(dtype)[6:]}/n{n}", f)

    # reduce to every root
    for root in range(W):
        for opn in ("sum", "max", "avg"):
            def f(case, root=root, opn=opn):
                x = data(rank, case, 3001, torch.float32, opn)
                dist.reduce(x, dst=root, op=OPS[opn])
                if rank != root:
                    return None
                ref = reference([data(r, case, 3001, torch.float32, opn) for r in range(W)], opn,
                                torch.float32)
                return close(x, ref, torch.float32, W)
            c.run(f"reduce/root{root}/{opn}", f)

    # all_gather (list and into tensor)
    for dtype in COPY_DTYPES:
        for n in (0, 1, 999, 70001):
            def f(case, dtype=dtype, n=n):
                x = data(rank, case, n, dtype)
                outs = [torch.empty(n, dtype=dtype) for _ in range(W)]
                dist.all_gather(outs, x)
                for r in range(W):
                    if not torch.equal(outs[r], data(r, case, n, dtype)):
                        return f"block of rank {r} wrong"
                big = torch.empty(W * n, dtype=dtype)
                dist.all_gather_into_tensor(big, x)
                ref = torch.cat([data(r, case, n, dtype) for r in range(W)])
                return None if torch.equal(big, ref) else "into_tensor mismatch"
            c.run(f"all_gather/{str(dtype)[6:]}/n{n}", f)

    # reduce_scatter (list and tensor)
    for dtype in REDUCE_DTYPES:
        for opn in ("sum", "max", "min", "prod") + (("avg",) if dtype.is_floating_point else ()):
            for n in (0, 5, 20001):
                def f(case, dtype=dtype, opn=opn, n=n):
                    full = [data(rank, case, W * n, dtype, opn)]
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full[0].clone(), op=OPS[opn])
                    ref_full = reference([data(r, case, W * n, dtype, opn) for r in range(W)],
                                         opn, dtype)
                    ref = ref_full[rank * n:(rank + 1) * n]
                    e = close(out, ref, dtype, W)
                    if e:
                        return "tensor: " + e
                    out2 = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(out2, list(full[0].clone().chunk(W)) if n else
                                        [torch.empty(0, dtype=dtype) for _ in range(W)],
                                        op=OPS[opn])
                    e = close(out2, ref, dtype, W)
                    return "list: " + e if e else None
                c.run(f"reduce_scatter/{opn}/{str(dtype)[6:]}/n{n}", f)

    # all_to_all_single: even and uneven splits, 2-D rows
    def split_of(src, dst, case):
        return (src * 7 + dst * 3 + case) % 4  # rows src sends to dst (some zero)

    for uneven in (False, True):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            def f(case, uneven=uneven, dtype=dtype):
                cols = 3
                if uneven:
                    ins = [split_of(rank, d, case) for d in range(W)]
                    outs = [split_of(s, rank, case) for s in range(W)]
                else:
                    ins = outs = [2] * W
                x = data(rank, case, sum(ins) * cols, dtype).view(-1, cols)
                y = torch.empty(sum(outs), cols, dtype=dtype)
                dist.all_to_all_single(y, x, outs if uneven else None, ins if uneven else None)
                # reference: the piece rank s sends to me
                pos = 0
                for s in range(W):
                    s_ins = [split_of(s, d, case) for d in range(W)] if uneven else [2] * W
                    xs = data(s, case, sum(s_ins) * cols, dtype).view(-1, cols)
                    start = sum(s_ins[:rank])
                    piece = xs[start:start + s_ins[rank]]
                    if not torch.equal(y[pos:pos + piece.shape[0]], piece):
                        return f"piece from rank {s} wrong"
                    pos += piece.shape[0]
            c.run(f"all_to_all_single/{'uneven' if uneven else 'even'}/{str(dtype)[6:]}", f)

    def f(case):
        ins = [data(rank * W + d, case, d + 1, torch.float32) for d in range(W)]
        outs = [torch.empty(rank + 1) for _ in range(W)]
        dist.all_to_all(outs, ins)
        for s in range(W):
            if not torch.equal(outs[s], data(s * W + rank, case, rank + 1, torch.float32)):
                return f"from rank {s} wrong"
    c.run("all_to_all/list", f)

    # gather / scatter to and from every root
    for root in range(W):
        def f(case, root=root):
            x = data(rank, case, 777, torch.float32)
            outs = [torch.empty(777) for _ in range(W)] if rank == root else None
            dist.gather(x, outs, dst=root)
            if rank == root:
                for r in range(W):
                    if not torch.equal(outs[r], data(r, case, 777, torch.float32)):
                        return f"gather from {r} wrong"
            ins = [data(100 + r, case, 555, torch.float32) for r in range(W)] if rank == root else None
            y = torch.empty(555)
            dist.scatter(y, ins, src=root)
            return None if torch.equal(y, data(100 + rank, case, 555, torch.float32)) else "scatter wrong"
        c.run(f"gather_scatter/root{root}", f)

    # barrier, object collectives
    c.run("barrier", lambda case: dist.barrier())

    def f(case):
        objs = [None] * W
        dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
        if objs != [{"rank": r, "s": "x" * r} for r in range(W)]:
            return f"all_gather_object: {objs}"
        lst = [{"k": [1, 2, 3]}, "hello"] if rank == W - 1 else [None, None]
        dist.broadcast_object_list(lst, src=W - 1)
        return None if lst == [{"k": [1, 2, 3]}, "hello"] else f"broadcast_object_list: {lst}"
    c.run("object_collectives", f)

    # point to point: ring send/recv (crosses vendors or not, depending on the split)
    def f(case):
        nxt, prv = (rank + 1) % W, (rank - 1) % W
        x = data(rank, case, 4097, torch.float32)
        y = torch.empty(4097)
        if rank % 2 == 0:
            dist.send(x, nxt)
            dist.recv(y, prv)
        else:
            dist.recv(y, prv)
            dist.send(x, nxt)
        if not torch.equal(y, data(prv, case, 4097, torch.float32)):
            return "send/recv mismatch"
        # isend/irecv + batch_isend_irecv, every pair both ways
        ops, bufs = [], {}
        for p in range(W):
            if p == rank:
                continue
            bufs[p] = torch.empty(33, dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, data(rank * 100 + p, case, 33, torch.int64), p))
            ops.append(dist.P2POp(dist.irecv, bufs[p], p))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for p, b in bufs.items():
            if not torch.equal(b, data(p * 100 + rank, case, 33, torch.int64)):
                return f"batch_isend_irecv from {p} wrong"
    c.run("p2p", f)

    # coalescing manager
    def f(case):
        from torch.distributed.distributed_c10d import _coalescing_manager
        xs = [data(rank, case + k, 100 + k, torch.float32) for k in range(3)]
        with _coalescing_manager(async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x)
        cm.wait()
        for k, x in enumerate(xs):
            ref = reference([data(r, case + k, 100 + k, torch.float32) for r in range(W)], "sum",
                            torch.float32)
            e = close(x, ref, torch.float32, W)
            if e:
                return e
    c.run("coalescing_manager", f)
    c.case += 3

    # new_group: every vendor's own subgroup (pass-through) and a mixed subgroup
    def f(case):
        import hetccl
        labels = hetccl.vendor_of_ranks()
        groups = {}
        for lab in dict.fromkeys(labels):
            ranks = [r for r, l in enumerate(labels) if l == lab]
            groups[lab] = (ranks, dist.new_group(ranks, backend="hetccl"))
        mine, pg = groups[labels[rank]]
        if isinstance(pg, hetccl.HetcclProcessGroup):
            return "single-vendor subgroup did not take the native pass-through"
        x = data(rank, case, 64, torch.float32)
        dist.all_reduce(x, group=pg)
        ref = reference([data(r, case, 64, torch.float32) for r in mine], "sum", torch.float32)
        e = close(x, ref, torch.float32, len(mine))
        if e:
            return "vendor subgroup: " + e
        mixed = [r for r in range(W) if r != 0] if W > 2 else list(range(W))
        sub = dist.new_group(mixed, backend="hetccl")
        if rank in mixed:
            mixed_labels = {labels[r] for r in mixed}
            if len(mixed_labels) > 1 and not isinstance(sub, hetccl.HetcclProcessGroup):
                return "mixed subgroup is not a hetccl group"
            y = data(rank, case + 1, 999, torch.float32)
            dist.all_reduce(y, group=sub)
            ref = reference([data(r, case + 1, 999, torch.float32) for r in mixed], "sum",
                            torch.float32)
            return close(y, ref, torch.float32, len(mixed))
    c.run("new_group", f)
    c.case += 2

    dist.barrier()
    dist.destroy_process_group()
    return c.results


def run_all_gather_paths(ctx) -> dict:
    """all_gather (into one tensor and into a list) for several dtypes and sizes (0, 1, odd,
    multi-chunk), each rank's input distinct random data, compared exactly with the
    concatenation; plus which path carried it (engine stats)."""
    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size)
    W, bad = ctx.world_size, []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8):
        for n in (0, 1, 7, 1000, 70001):
            ins = [data(r, 17 + n, n, dtype) for r in range(W)]
            out = torch.empty(W * n, dtype=dtype)
            dist.all_gather_into_tensor(out, ins[ctx.rank])
            if not torch.equal(out, torch.cat(ins)):
                bad.append(f"into_tensor {dtype} n{n}")
            outs = [torch.empty(n, dtype=dtype) for _ in range(W)]
            dist.all_gather(outs, ins[ctx.rank])
            if not all(torch.equal(o, i) for o, i in zip(outs, ins)):
                bad.append(f"list {dtype} n{n}")
    # reduce_scatter (sum, max) against a float64 reference of every rank's input
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for op in ("sum", "max"):
            for n in (0, 1, 7, 1000, 70001):
                ins = [data(r, 31 + n, W * n, dtype, op) for r in range(W)]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, ins[ctx.rank].clone(), op=OPS[op])
                ref = reference([x[ctx.rank * n:(ctx.rank + 1) * n] for x in ins], op, dtype)
                err = close(out, ref, dtype, W)
                if err:
                    bad.append(f"reduce_scatter {dtype} {op} n{n}: {err}")
    stats = dict(dist.group.WORLD.engine.stats)
    dist.destroy_process_group()
    return {"bad": bad, "pairs": stats.get("algo_all_gather_pairs", 0),
            "rs_pairs": stats.get("algo_reduce_scatter_pairs", 0)}
