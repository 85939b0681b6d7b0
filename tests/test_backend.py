"""Every collective over the hetccl backend, on CPU, for several vendor splits, against
references (tests/collective_cases.py). One spawn per split; each case is its own test."""
from __future__ import annotations

import functools

import pytest

from hetccl.launch import spawn

import collective_cases

# "2+1/native": the same group with same-vendor links off (HETCCL_GROUP_LINKS=off), so the
# hierarchical paths with native (gloo) steps keep their coverage beside the linked ones
# "/capi": the torch face on the C API (HETCCL_FACE_ROUTE=capi, hetccl/face_capi.py)
SPLITS = ["1+1", "2+1", "2+1/native", "1+2+1", "2+2", "1+1/capi", "2+1/capi"]
# Small pipeline chunks so that multi-chunk paths run on test-sized tensors.
ENV = {"HETCCL_CHUNK_BYTES": "65536"}


@functools.lru_cache(maxsize=None)
def results(split: str) -> dict[str, dict[str, str]]:
    split, _, variant = split.partition("/")
    world = sum(int(x) for x in split.split("+"))
    env = dict(ENV, **({"HETCCL_GROUP_LINKS": "off"} if variant == "native" else {}),
               **({"HETCCL_FACE_ROUTE": "capi"} if variant == "capi" else {}))
    per_rank = spawn(collective_cases.run_all, world, vendors=split, env=env, timeout=420)
    merged: dict[str, dict[str, str]] = {}
    for r, res in enumerate(per_rank):
        for case, verdict in res.items():
            merged.setdefault(case, {})[r] = verdict
    return merged


@pytest.mark.parametrize("split", SPLITS)
def test_collectives(split):
    res = results(split)
    # "skip: ..." marks a device-only case (collective_cases.py runs on CPU tensors here)
    failed = {case: v for case, v in res.items()
              if any(x != "ok" and not x.startswith("skip: ") for x in v.values())}
    # every family of collectives was exercised
    families = {case.split("/")[0] for case in res}
    assert {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
            "all_to_all_single", "all_to_all", "gather_scatter", "barrier",
            "object_collectives", "p2p", "coalescing_manager", "new_group"} <= families
    assert len(res) > 200
    assert not failed, f"{len(failed)} failing cases: {sorted(failed)[:40]}\n" + "\n".join(
        f"{case}: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(vs.items()) if v != "ok")
        for case, vs in sorted(failed.items())[:20])


@functools.lru_cache(maxsize=None)
def all_reduce_results(split: str, host_kernel: str, algo: str = "", links: str = "auto") -> list[dict]:
    world = sum(int(x) for x in split.split("+"))
    env = dict(ENV, HETCCL_HOST_KERNEL=host_kernel, HETCCL_GROUP_LINKS=links)
    if algo:
        env["HETCCL_ALGO"] = algo
    return spawn(collective_cases.run_all_reduce, world, vendors=split, env=env, timeout=300)


@pytest.mark.parametrize("split,host_kernel,algo,path", [
    ("1+1", "1", "", None), ("1+1", "0", "", None),
    ("2+2", "1", "", "pairs"),                      # hier hands 2+2 over to pairs
    ("2+2", "0", "", "split"),                      # no C++ round trip: pairs falls back to split
    ("2+2", "1", "all_reduce=split", "split"),
    ("4+4", "1", "all_reduce=pairs", "pairs"),      # three rounds (masks 0, 1, 2)
])
def test_all_reduce_host_paths(split, host_kernel, algo, path):
    """The host paths of the two-group all-reduce (the C++ pair kernel, default, and the
    Python chunk pipeline, HETCCL_HOST_KERNEL=0; for equal groups of n > 1 the pairs and split
    algorithms) give the reference results for every op and dtype, and the one asked for is
    the one that ran (no silent fallback)."""
    per_rank = all_reduce_results(split, host_kernel, algo)
    bad = {f"rank {r} {case}": v for r, res in enumerate(per_rank)
           for case, v in res["results"].items() if v != "ok"}
    assert len(per_rank[0]["results"]) > 50
    assert not bad, sorted(bad.items())[:10]
    for r, res in enumerate(per_rank):
        used = res["stats"]["pair_kernel_bytes"]
        assert (used > 0) if host_kernel == "1" else (used == 0), (r, res["stats"])
        runs = {k: v for k, v in res["stats"].items() if k.startswith("algo_all_reduce")}
        if path is None:
            assert not runs, (r, runs)
        else:
            other = "split" if path == "pairs" else "pairs"
            assert runs.get(f"algo_all_reduce_{path}", 0) > 0, (r, runs)
            assert runs.get(f"algo_all_reduce_{other}", 0) == 0, (r, runs)


@pytest.mark.parametrize("split,links,path", [
    ("2+1", "auto", "linked"),       # same-vendor ranks linked too: no native step
    ("1+1+1", "auto", "linked"),     # groups of one: every pair already on shared memory
    ("3+1", "auto", "linked"),
    ("2+1", "off", None),            # links off: hier / flat with gloo inside the group
])
def test_all_reduce_linked_path(split, links, path):
    """Host all-reduce when every pair of ranks shares a memory ring (algorithms/linked.py):
    every op and dtype against the reference, and the path that ran is the one expected
    (engine stats), with the argument check over the links where same-vendor ranks are
    linked (no native all-gather of the headers)."""
    per_rank = all_reduce_results(split, "1", "", links)
    bad = {f"rank {r} {case}": v for r, res in enumerate(per_rank)
           for case, v in res["results"].items() if v != "ok"}
    assert len(per_rank[0]["results"]) > 50
    assert not bad, sorted(bad.items())[:10]
    for r, res in enumerate(per_rank):
        st = res["stats"]
        runs = {k for k, v in st.items() if k.startswith("algo_all_reduce") and v}
        if path is None:
            assert "algo_all_reduce_linked" not in runs and st.get("check_linked", 0) == 0, st
        else:
            assert runs == {f"algo_all_reduce_{path}"}, (r, runs)
            grouped = max(int(x) for x in split.split("+")) > 1
            assert (st.get("check_linked", 0) > 0) == grouped, (r, st)
            assert st.get("check_native", 0) == 0, (r, st)


def _interleaved_gather_paths(ctx):
    """run_all_gather_paths with vendors v0, v1, v0 by rank: the group of two is not
    consecutive in rank order."""
    import os
    os.environ["HETCCL_VENDOR"] = "v1" if ctx.rank == 1 else "v0"
    return collective_cases.run_all_gather_paths(ctx)


@pytest.mark.parametrize("split,hosts,pairs,in_place,views", [
    ("2+2", False, True, (), ()),            # hier hands two groups of 2^m over to pairs
    ("4+4", False, True, (), ()),            # three rounds (masks 0, 1, 2)
    ("2+1", False, False, (), ()),           # unequal groups: the hierarchical path
    # each group its own host (message links): a group of one receives another group's block
    # in place in the output where that group's ranks are consecutive, and sends its
    # reduce_scatter input as a view where all other ranks are (1+1+1: not for rank 1, whose
    # others are 0 and 2; v0 v1 v0: rank 1's other group is ranks 0 and 2, staged)
    ("1+1", True, False, (0, 1), (0, 1)),
    ("1+1+1", True, False, (0, 1, 2), (0, 2)),
    ("v0,v1,v0", True, False, (), ()),
])
def test_all_gather_host_paths(split, hosts, pairs, in_place, views):
    """all_gather on host tensors, exact against the concatenation of every rank's input, and
    reduce_scatter (sum, max) against a float64 reference, for several dtypes and sizes, out
    of place and in place; the path asked for is the one that ran: pairs (m + 1 rounds
    through the bridge, no native step) for two equal groups of 2^m ranks, else hier, and the
    groups of one on message links receive in place (`in_place`: those ranks) and send their
    reduce_scatter input as a view (`views`)."""
    env = dict(ENV, **({"HETCCL_EMULATE_HOSTS": "1"} if hosts else {}))
    if split == "v0,v1,v0":
        per_rank = spawn(_interleaved_gather_paths, 3, env=env, timeout=300)
    else:
        world = sum(int(x) for x in split.split("+"))
        per_rank = spawn(collective_cases.run_all_gather_paths, world, vendors=split, env=env,
                         timeout=300)
    collective_cases.check_gather_paths(per_rank, in_place, views, pairs)


def _repeated_reduce_scatter(ctx):
    """40 int64 sum reduce_scatters, exact against the sum of every rank's block."""
    import torch
    import torch.distributed as dist
    import hetccl  # noqa: F401
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size)
    W, n, wrong = ctx.world_size, 70_001, 0
    for it in range(40):
        g = torch.Generator().manual_seed(it)
        ins = [torch.randint(-1000, 1000, (W * n,), generator=g, dtype=torch.int64) for _ in range(W)]
        out = torch.empty(n, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, ins[ctx.rank].clone())
        wrong += int((out != sum(x[ctx.rank * n:(ctx.rank + 1) * n] for x in ins)).sum())
    dist.destroy_process_group()
    return wrong


def test_reductions_from_several_peers_into_one_buffer_do_not_race():
    """1+1+1 between hosts (message links): each rank's reduce_scatter output takes both
    peers' contributions, reduced by the tcp transport's threads as they arrive. Before the
    engine ordered overlapping reducing receives (engine_plan.cc), two peers' chunks of the
    same range were reduced at once and updates were lost: 2 of 2 runs of this loop had
    wrong elements (4 and 5911)."""
    per_rank = spawn(_repeated_reduce_scatter, 3, vendors="1+1+1",
                     env=dict(ENV, HETCCL_EMULATE_HOSTS="1", HETCCL_TRANSPORT="tcp"), timeout=300)
    assert per_rank == [0, 0, 0], per_rank


@pytest.mark.parametrize("op", ["sum", "max", "prod", "min", "avg", "band"])
def test_bool_reductions_run_on_bytes(op):
    """bool SUM/MAX/PRODUCT/MIN reduce the bytes with MAX/MIN, as ProcessGroupNCCL's (bool is
    ncclUint8 there, SUM mapped to ncclMax): the same answer as OR/AND, on a dtype every
    device's kernels have. The views share the caller's memory; other ops are left as they are
    (AVG is refused later, bitwise ops have their own path)."""
    import torch

    from hetccl.backend import _bool_as_bytes

    g = torch.Generator().manual_seed(5)
    xs = [torch.rand(257, generator=g) > 0.5 for _ in range(3)]
    mapped, views = _bool_as_bytes(op, *xs)
    if op in ("avg", "band"):
        assert mapped == op and all(v is x for v, x in zip(views, xs))
        return
    assert all(v.dtype == torch.uint8 and v.data_ptr() == x.data_ptr() for v, x in zip(views, xs))
    fn = {"max": torch.maximum, "min": torch.minimum}[mapped]
    got = functools.reduce(fn, views)
    want = functools.reduce(torch.logical_or if op in ("sum", "max") else torch.logical_and, xs)
    assert torch.equal(got.to(torch.bool), want)
    mixed_op, mixed = _bool_as_bytes("sum", xs[0], torch.zeros(3))  # not all bool: unchanged
    assert mixed_op == "sum" and mixed[0].dtype == torch.bool


def _face_capi_rank(ctx):
    """HETCCL_FACE_ROUTE=capi: each collective the route takes runs on the C API (its
    communicator's algorithm counters move), with results against float64 references; a count
    mismatch is ArgMismatch on every rank and the group stays usable; what the route does not
    take (a bitwise op, a list of tensors) runs on the face's own path; ranks that disagree on
    the route (one declined, one routed) fail on every rank at once, and the group goes on."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import hetccl
    from hetccl._core import ArgMismatch

    rank, W = ctx.rank, ctx.world_size
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank, world_size=W,
                            timeout=timedelta(seconds=60))
    pg = dist.group.WORLD
    out = {"bad": []}

    def runs():
        c = pg._route._comm
        # the routed collectives' algorithms (not the check's, nor the marker's all_to_all:
        # CollRoute.declined)
        return 0 if c is None else sum(int(v) for k, v in c.info().items() if k.startswith("algo_")
                                       and not k.startswith(("algo_check", "algo_all_to_all")))

    def inp(r, n, dtype=torch.float32):
        return torch.rand(n, generator=torch.Generator().manual_seed(7 * r + n), dtype=torch.float64
                          ).mul(2).sub(1).to(dtype)

    for n in (0, 1, 1000, 70001):
        allx = [inp(r, n * W).double() for r in range(W)]
        cases = {
            "all_reduce": (lambda: dist.all_reduce(x := inp(rank, n * W)) or x,
                           sum(allx)),
            "all_reduce_max": (lambda: dist.all_reduce(x := inp(rank, n * W), dist.ReduceOp.MAX) or x,
                               torch.stack(allx).max(0).values),
            "broadcast": (lambda: dist.broadcast(x := inp(rank, n * W), src=W - 1) or x, allx[W - 1]),
            "reduce": (lambda: dist.reduce(x := inp(rank, n * W), dst=0) or x,
                       sum(allx) if rank == 0 else allx[rank]),
            "all_gather": (lambda: dist.all_gather_into_tensor(
                o := torch.empty(n * W * W), inp(rank, n * W)) or o, torch.cat(allx)),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(
                o := torch.empty(n), inp(rank, n * W)) or o, sum(allx)[rank * n:(rank + 1) * n]),
        }
        for name, (fn, want) in cases.items():
            before = runs()
            got = fn()
            if n and runs() == before:
                out["bad"].append(f"{name} n={n}: the C API ran nothing")
            if not torch.allclose(got.double(), want, atol=1e-5 * W):
                out["bad"].append(f"{name} n={n}: wrong values")
    # in place all_gather (input is this rank's block of the output)
    o = torch.zeros(10 * W)
    o[rank * 10:(rank + 1) * 10] = rank + 1
    dist.all_gather_into_tensor(o, o[rank * 10:(rank + 1) * 10])
    if not torch.equal(o, torch.arange(1, W + 1).float().repeat_interleave(10)):
        out["bad"].append("in-place all_gather: wrong values")
    try:
        dist.all_reduce(torch.ones(10 + rank))
        out["bad"].append("count mismatch: no error")
    except ArgMismatch as e:
        out["mismatch"] = str(e)
    x = torch.ones(5)
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((5,), float(W))):
        out["bad"].append("after the mismatch: wrong values")
    before = runs()
    y = [torch.full((9,), rank + 1.0), torch.full((3,), rank + 2.0)]  # a list: the face's path
    pg.allreduce(y).wait()
    z = torch.full((9,), 6 + rank, dtype=torch.int32)
    dist.all_reduce(z, dist.ReduceOp.BAND)
    if runs() != before:
        out["bad"].append("a list / BAND went to the C API")
    if (y[0].tolist() != [W * (W + 1) / 2] * 9 or y[1].tolist() != [W * (W + 3) / 2] * 3
            or z.tolist() != [functools.reduce(lambda a, b: a & b, [6 + r for r in range(W)])] * 9):
        out["bad"].append("a list / BAND: wrong values")
    # ranks that disagree on the route (rank 0 a bitwise op, declined; the others SUM, routed):
    # every rank fails, none waits for the timeout, and the group goes on
    w = torch.full((6,), 3 + rank, dtype=torch.int32)
    t0 = time.monotonic()
    try:
        dist.all_reduce(w, dist.ReduceOp.BAND if rank == 0 else dist.ReduceOp.SUM)
        out["bad"].append("route disagreement: no error")
    except ValueError as e:
        out["disagree"] = str(e)
    if time.monotonic() - t0 > 20:
        out["bad"].append(f"route disagreement took {time.monotonic() - t0:.0f} s")
    x = torch.ones(5)
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((5,), float(W))):
        out["bad"].append("after the route disagreement: wrong values")
    # a routed call facing a collective the route never takes (rank 0 all_reduce, the others
    # barrier): every rank fails at once too
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.barrier()
        out["bad"].append("all_reduce against barrier: no error")
    except ValueError as e:
        out["against_barrier"] = str(e)
    if time.monotonic() - t0 > 20:
        out["bad"].append(f"all_reduce against barrier took {time.monotonic() - t0:.0f} s")
    dist.barrier()
    x = torch.ones(5)
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((5,), float(W))):
        out["bad"].append("after all_reduce against barrier: wrong values")
    out["routed"] = isinstance(pg, hetccl.HetcclProcessGroup) and pg._route is not None
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("split", ["1+1", "2+1"])
def test_face_capi_route(split):
    world = sum(int(x) for x in split.split("+"))
    per_rank = spawn(_face_capi_rank, world, vendors=split,
                     env={"HETCCL_FACE_ROUTE": "capi"}, timeout=300)
    texts = {r["mismatch"] for r in per_rank if "mismatch" in r}
    for r, res in enumerate(per_rank):
        assert res["routed"], r
        assert not res["bad"], (r, res["bad"])
        assert "collective differs across ranks" in res.get("disagree", ""), (r, res)
        assert "collective differs across ranks" in res.get("against_barrier", ""), (r, res)
    # the same text on every rank, in the wording of every hetccl check (csrc/check_text.h)
    want = "number of elements differs across ranks (ranks [0]: 10; ranks [1]: 11"
    assert len(texts) == 1 and want in next(iter(texts)), (texts, per_rank)


def _avg_refused_rank(ctx):
    """A half-precision AVG all_reduce refused by a peer's check (a count mismatch seen only
    once the header reaches the other vendor group) leaves every rank's tensor as it was."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, W = ctx.rank, ctx.world_size
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank, world_size=W,
                            timeout=timedelta(seconds=60))
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        n = 64 if rank < W - 1 else 65  # the last rank (a group of its own) differs
        x = torch.full((n,), float(rank + 1), dtype=dtype)
        before = x.clone()
        try:
            dist.all_reduce(x, dist.ReduceOp.AVG)
            out[str(dtype)] = "no error"
        except ValueError:
            out[str(dtype)] = "intact" if torch.equal(x, before) else f"changed: {x[:3].tolist()}"
        y = torch.full((8,), float(rank + 1), dtype=dtype)
        dist.all_reduce(y, dist.ReduceOp.AVG)  # the group goes on
        # (the half-precision sum of premultiplied values rounds by reduction order: a few ulps)
        if not torch.allclose(y.float(), torch.full((8,), (W + 1) / 2), atol=0.02, rtol=0):
            out[str(dtype)] += f"; next call wrong: {y.tolist()}"
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("links", ["auto", "off"])
def test_half_avg_refused_leaves_the_tensor(links):
    """links off: the vendor group of two checks natively and the header rides with the data
    to the other group (the check completes after the transfer began)."""
    per_rank = spawn(_avg_refused_rank, 3, vendors="2+1", env={"HETCCL_GROUP_LINKS": links},
                     timeout=300)
    for r, res in enumerate(per_rank):
        assert set(res.values()) == {"intact"}, (r, res)
