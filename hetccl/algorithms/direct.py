"""Collectives whose traffic is inherently point to point: all-to-all, gather, scatter.

Pairs inside one vendor group use the native library (one native all-to-all / gather /
scatter over the group); pairs across vendors use the bridge directly. There is nothing to
aggregate, so no hierarchy: every byte takes the one hop it needs.
"""
from __future__ import annotations

import torch

from .common import CollCtx, copy


def all_to_all_direct(ctx: CollCtx, out: torch.Tensor, inp: torch.Tensor,
                      out_counts: list[int], in_counts: list[int]) -> None:
    """out/inp flat; counts in elements per rank (group rank order)."""
    topo = ctx.topo
    in_off = [0]
    for c in in_counts:
        in_off.append(in_off[-1] + c)
    out_off = [0]
    for c in out_counts:
        out_off.append(out_off[-1] + c)
    local = topo.local_ranks
    native = None
    if len(local) > 1:
        lin = torch.cat([inp[in_off[r]:in_off[r + 1]] for r in local])
        lout = torch.empty(sum(out_counts[r] for r in local), dtype=out.dtype, device=out.device)
        native = ctx.local.all_to_all(lout, lin, [out_counts[r] for r in local],
                                      [in_counts[r] for r in local])
    else:
        me = topo.rank
        copy(out[out_off[me]:out_off[me + 1]], inp[in_off[me]:in_off[me + 1]])
    sends = [(r, 0, in_counts[r], inp[in_off[r]:in_off[r + 1]])
             for r in range(topo.size) if topo.group_of[r] != topo.my_group and in_counts[r]]
    recvs = [(r, 0, out_counts[r], out[out_off[r]:out_off[r + 1]])
             for r in range(topo.size) if topo.group_of[r] != topo.my_group and out_counts[r]]
    ctx.transfer(0, sends, recvs)
    if native is not None:
        ctx.wait_native(native)
        pos = 0
        for r in local:
            c = out_counts[r]
            copy(out[out_off[r]:out_off[r] + c], lout[pos:pos + c])
            pos += c


def gather_direct(ctx: CollCtx, outs: list[torch.Tensor] | None, x: torch.Tensor,
                  root: int) -> None:
    topo = ctx.topo
    g0 = topo.group_of[root]
    n = x.numel()
    if topo.my_group != g0:
        ctx.transfer(0, [(root, 0, n, x)], [])
        return
    native = None
    if topo.local_size > 1:
        louts = [outs[r] for r in topo.local_ranks] if topo.rank == root else []
        native = ctx.local.gather(louts, x, topo.local_rank_of[root])
    elif topo.rank == root:
        copy(outs[root], x)
    if topo.rank == root:
        recvs = [(r, 0, n, outs[r]) for r in range(topo.size) if topo.group_of[r] != g0]
        ctx.transfer(0, [], recvs)
    if native is not None:
        ctx.wait_native(native)


def scatter_direct(ctx: CollCtx, out: torch.Tensor, ins: list[torch.Tensor] | None,
                   root: int) -> None:
    topo = ctx.topo
    g0 = topo.group_of[root]
    n = out.numel()
    if topo.my_group != g0:
        ctx.transfer(0, [], [(root, 0, n, out)])
        return
    if topo.rank == root:
        sends = [(r, 0, n, ins[r]) for r in range(topo.size) if topo.group_of[r] != g0]
        ctx.transfer(0, sends, [])
    if topo.local_size > 1:
        lins = [ins[r] for r in topo.local_ranks] if topo.rank == root else []
        ctx.wait_native(ctx.local.scatter(out, lins, topo.local_rank_of[root]))
    elif topo.rank == root:
        copy(out, ins[root])
