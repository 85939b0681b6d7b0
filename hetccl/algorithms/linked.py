"""Host collectives on the engine alone, when every pair of ranks shares a memory ring.

Applies to host tensors when the job has three or more ranks and every rank reaches every other
rank through a zero-copy (shared-memory) link: a job on one host whose vendor groups are linked
among themselves too (bridge.group_links: same-vendor ranks get rings for host data when the
groups are not two of equal size 2^m), or one whose groups all have one rank (1+1+1). Then no
native step is needed, and on one host the native host library (gloo: TCP loopback and a loop
thread per call) is what made 2+1 slower than gloo alone.

all_reduce "linked": 1) every rank sends shard j (padded sharding over all W ranks) to rank j
and receives its own shard from every other rank, reducing it in as it arrives, one engine plan;
2) every rank sends its reduced shard to every other rank and receives theirs in place, one
plan. Per rank 2 (W-1)/W N bytes each way, two latency steps, every shard reduced once (by its
owner), so all ranks end bit-identical.
all_gather "linked": one plan, each rank sends its input to every other rank.
reduce_scatter "linked": step 1 of the all-reduce on the W chunks.
"""
from __future__ import annotations

import torch

from .common import CollCtx, copy
from .layout import padded_ranges


def linked_applies(ctx: CollCtx, x: torch.Tensor) -> bool:
    """Host tensor and every rank linked to every rank by a shared-memory ring (the same answer
    on every rank: it depends on the topology, the settings and the device type only, which the
    argument check compares)."""
    return x.device.type == "cpu" and ctx.all_linked


def _others(ctx: CollCtx) -> list[int]:
    return [r for r in range(ctx.topo.size) if r != ctx.topo.rank]


def _reduce_scatter_into(ctx: CollCtx, dst: torch.Tensor, src: torch.Tensor,
                         ranges: list[tuple[int, int]], op: str, phase: int) -> None:
    """dst, which holds this rank's own part of its range (src's range itself, or a copy of
    it), becomes op over every rank's part; src's other ranges go to their owners. The receives reduce into dst as
    their chunks arrive (the engine reduces one chunk at a time, so chunks of several peers
    never reduce into dst at once; the order of arrival decides the order of the sum, but only
    this rank reduces this range, so every rank ends with the same values)."""
    me = ctx.topo.rank
    lo, hi = ranges[me]
    others = _others(ctx)
    sends = [(r, ranges[r][0], ranges[r][1], src[ranges[r][0]:ranges[r][1]]) for r in others
             if ranges[r][1] > ranges[r][0]]
    recvs = [(r, lo, hi, dst) for r in others if hi > lo]
    ctx.transfer(phase, sends, recvs, op)


def all_reduce_linked(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    n = x.numel()
    ranges = padded_ranges(n, ctx.topo.size)
    me = ctx.topo.rank
    lo, hi = ranges[me]
    _reduce_scatter_into(ctx, x[lo:hi], x, ranges, op, 0)
    others = _others(ctx)
    sends = [(r, lo, hi, x[lo:hi]) for r in others if hi > lo]
    recvs = [(r, ranges[r][0], ranges[r][1], x[ranges[r][0]:ranges[r][1]]) for r in others
             if ranges[r][1] > ranges[r][0]]
    ctx.transfer(1, sends, recvs)
    ctx.count("all_reduce_linked")


def all_gather_linked(ctx: CollCtx, out: torch.Tensor, x: torch.Tensor, phase: int = 0) -> None:
    """out: (W * N,) flat in rank order, x: (N,) flat."""
    n, me = x.numel(), ctx.topo.rank
    others = _others(ctx)
    mine = out[me * n:(me + 1) * n]
    copy(mine, x)
    if n:
        ctx.transfer(phase, [(r, me * n, (me + 1) * n, mine) for r in others],
                 [(r, r * n, (r + 1) * n, out[r * n:(r + 1) * n]) for r in others])
    else:
        ctx.transfer(phase, [], [])  # the argument header still travels
    ctx.count("all_gather_linked")


def reduce_scatter_linked(ctx: CollCtx, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    """inp: (W * N,) flat, out: (N,): the reduction of chunk rank."""
    n, w, me = out.numel(), ctx.topo.size, ctx.topo.rank
    copy(out, inp[me * n:(me + 1) * n])
    _reduce_scatter_into(ctx, out, inp, [(r * n, (r + 1) * n) for r in range(w)], op, 0)
    ctx.count("reduce_scatter_linked")
