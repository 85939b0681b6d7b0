"""Rank side of tests/test_gpu_regressions.py: the defects found on the GPU box (issue 23),
each checked where it was found. Ranks use GPU rank % device_count."""
from __future__ import annotations

import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _case(out, name, fn):
    try:
        r = fn()
        out[name] = "ok" if r in (True, None) else str(r)
    except BaseException:  # noqa: BLE001 - reported per case
        out[name] = traceback.format_exc()[-3000:]


def _p2p_ring(rank, world, dev, make):
    """send/recv, isend/irecv, batch_isend_irecv and recv from any source around the ring, with
    tensors from make(n, value) (the default device, or an explicit one)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    n = 100_003
    x = make(n, float(rank))
    y = make(n, -1.0)
    if rank % 2 == 0:
        dist.send(x, nxt)
        dist.recv(y, prv)
    else:
        dist.recv(y, prv)
        dist.send(x, nxt)
    ok = bool((y == float(prv)).all())
    y2 = make(7, -1.0)
    reqs = [dist.isend(make(7, 10.0 + rank), nxt), dist.irecv(y2, prv)]
    for q in reqs:
        q.wait()
    ok = ok and bool((y2 == 10.0 + prv).all())
    y3 = make(5, -1.0)
    ops = [dist.P2POp(dist.isend, make(5, 20.0 + rank), nxt), dist.P2POp(dist.irecv, y3, prv)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    ok = ok and bool((y3 == 20.0 + prv).all())
    # any source: rank 0 takes one message from whichever rank sends (rank 1 here). Its own tag,
    # and one sender only: a receive from any source stays posted at the ranks that did not win
    # and takes their next message with that tag (backend.recv_anysource's contract).
    if rank == 0:
        z = make(3, -1.0)
        src = dist.recv(z, tag=9)
        ok = ok and src == 1 and bool((z == 31.0).all())
    elif rank == 1:
        dist.send(make(3, 31.0), 0, tag=9)
    torch.cuda.synchronize()
    return ok or "wrong values"


def _mismatch(rank, world, dev, before, now):
    """Every rank first runs all-reduces of the sizes in `before` (the same on every rank, so
    they succeed, and each rank has then used some sizes and not others), then one of size
    now(rank): every rank must raise a ValueError naming the difference, and the group must
    work afterwards."""
    for n in before:
        dist.all_reduce(torch.ones(n, device=dev))
    torch.cuda.synchronize()
    try:
        dist.all_reduce(torch.ones(now(rank), device=dev))
        torch.cuda.synchronize()
        return "no error"
    except ValueError as e:
        if "number of elements differs" not in str(e):
            return f"unclear error: {e}"
    z = torch.full((77,), float(rank), device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    return bool((z == sum(range(world))).all()) or "group unusable after the error"


def run(ctx, on_cpu: bool = False) -> dict:
    """on_cpu: the same cases on CPU tensors (a check of the test logic on machines without a
    GPU: `python tests/gpu_regression_cases.py`)."""
    import hetccl  # noqa: F401

    if on_cpu:
        dev = torch.device("cpu")
        torch.cuda.synchronize = lambda *a: None  # this process only
    else:
        dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    rank, world = ctx.rank, ctx.world_size
    out: dict[str, str] = {}
    cpu = torch.device("cpu")

    # point-to-point crashed (segfault in bridge.irecv) under set_default_device("cuda"): the
    # staging buffers followed the default device
    torch.set_default_device(dev)
    try:
        _case(out, "p2p/default_cuda/cuda_tensors",
              lambda: _p2p_ring(rank, world, dev, lambda n, v: torch.full((n,), v)))
        _case(out, "p2p/default_cuda/cpu_tensors",
              lambda: _p2p_ring(rank, world, dev, lambda n, v: torch.full((n,), v, device=cpu)))

        def coll():
            x = torch.full((1001,), float(rank + 1))
            dist.all_reduce(x)
            g = torch.empty(world * 3)
            dist.all_gather_into_tensor(g, torch.full((3,), float(rank)))
            dist.barrier()
            objs = [None] * world
            dist.all_gather_object(objs, {"r": rank})
            torch.cuda.synchronize()
            return (bool((x == sum(range(1, world + 1))).all())
                    and bool(torch.equal(g.cpu(), torch.arange(world).float().repeat_interleave(3)))
                    and objs == [{"r": r} for r in range(world)]) or "wrong values"
        _case(out, "collectives/default_cuda", coll)
    finally:
        torch.set_default_device(None)
    _case(out, "p2p/explicit_cuda",
          lambda: _p2p_ring(rank, world, dev, lambda n, v: torch.full((n,), v, device=dev)))

    # size mismatches whatever each rank called before (the check cache let ranks take
    # different protocols): rank 0 reuses its size while the others use a new one, and back
    base = 4096
    _case(out, "mismatch/first_rank_cached",   # rank 0 has used its size, the others not
          lambda: _mismatch(rank, world, dev, [base], lambda r: base + (r > 0)))
    _case(out, "mismatch/others_cached",       # the others have used theirs, rank 0 not
          lambda: _mismatch(rank, world, dev, [base + 8], lambda r: base + 8 + (r == 0)))
    _case(out, "mismatch/both_cached",         # every rank has used the size it now uses
          lambda: _mismatch(rank, world, dev, [base + 16, base + 17],
                            lambda r: base + 16 + (r > 0)))
    _case(out, "mismatch/fresh",               # no rank has used its size
          lambda: _mismatch(rank, world, dev, [13], lambda r: base + 24 + r))

    def dtype_after_use():
        dist.all_reduce(torch.ones(999, device=dev))
        try:
            dist.all_reduce(torch.ones(999, device=dev,
                                       dtype=torch.float32 if rank == 0 else torch.bfloat16))
            torch.cuda.synchronize()
            return "no error"
        except ValueError as e:
            return ("dtype differs" in str(e)) or f"unclear: {e}"
    _case(out, "mismatch/dtype_after_use", dtype_after_use)

    def op_after_use():
        dist.all_reduce(torch.ones(555, device=dev))
        try:
            dist.all_reduce(torch.ones(555, device=dev),
                            op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
            torch.cuda.synchronize()
            return "no error"
        except ValueError as e:
            return ("reduction op differs" in str(e)) or f"unclear: {e}"
    _case(out, "mismatch/op_after_use", op_after_use)

    def root_after_use():
        dist.broadcast(torch.ones(333, device=dev), src=0)
        try:
            dist.broadcast(torch.ones(333, device=dev), src=0 if rank == 0 else 1)
            torch.cuda.synchronize()
            return "no error"
        except ValueError as e:
            return ("root differs" in str(e)) or f"unclear: {e}"
    _case(out, "mismatch/root_after_use", root_after_use)

    z = torch.full((1 << 20,), 1.0, device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    out["usable_at_end"] = "ok" if bool((z == world).all()) else "wrong"
    out["stats"] = dict(dist.group.WORLD.engine.stats) if hasattr(dist.group.WORLD, "engine") else {}
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    import sys

    from hetccl.launch import spawn
    for vendors in ("1+1", "1+1+1"):
        res = spawn(run, sum(int(v) for v in vendors.split("+")), args=(True,), vendors=vendors,
                    timeout=300)
        bad = {(r, k): v for r, o in enumerate(res) for k, v in o.items()
               if k != "stats" and v != "ok"}
        print(vendors, "all ok" if not bad else bad)
        if bad:
            sys.exit(1)
