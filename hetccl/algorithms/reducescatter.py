"""Reduce-scatter and reduce across vendor groups.

reduce_scatter: input W*N elements, rank r keeps the reduction of chunk r. Inside group g the
chunks of g's own ranks stay with their owners; the chunks of all other ranks (the "others
region", (W - n_g) * N elements in rank order) are split over g's ranks by padded sharding.
1) one native reduce-scatter in g gives each rank g's partial of its own chunk and of its share
of the others region; 2) each rank sends its share, piece by piece, to the owners of those
chunks, and each owner reduces the partials it receives from every other group into its own.
Per rank, cross-vendor traffic is about (W - n_g) * N / n_g elements sent and (G-1) * N received.

reduce: native reduce-scatter in every group; every group other than the root's sends its
partial shards to the root group's ranks whose shards intersect them; those reduce what they
receive; a native gather inside the root group assembles the result on the root.
"""
from __future__ import annotations

import torch

from .common import CollCtx, copy, pad_to
from .layout import consecutive, intersect, padded_ranges, padded_shard, pair_set, pairs_masks, peer_pieces
from .linked import linked_applies, reduce_scatter_linked


def reduce_scatter_pairs(ctx: CollCtx, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
    """Two host groups of 2^m ranks: the pairs all-gather's rounds backwards (recursive
    halving, layout.pair_set). Before round k a rank holds partial sums of the blocks of its
    set for round k + 1; it sends the partner's half (the partner's set for round k) and
    reduces the partner's partials of its own half, which come from disjoint contributors; after
    round 0 its own block holds every rank's contribution. m + 1 bridge rounds, no native step;
    sends (2n - 1) N in all."""
    masks = pairs_masks(ctx, inp, 0)
    if masks is None:
        reduce_scatter_hier(ctx, out, inp, op, pairs=False)
        return
    topo = ctx.topo
    n = out.numel()
    g, li, me = topo.my_group, topo.local_rank, topo.rank
    work = inp.clone()  # partial sums; the caller's input stays as it was
    for k in reversed(range(len(masks))):
        peer_li = li ^ masks[k]
        peer = topo.groups[1 - g][peer_li]
        sends = [(peer, r * n, (r + 1) * n, work[r * n:(r + 1) * n])
                 for r in pair_set(topo, 1 - g, peer_li, k)]
        recvs = [(peer, r * n, (r + 1) * n, work[r * n:(r + 1) * n])
                 for r in pair_set(topo, g, li, k)]
        ctx.transfer(k, sends, recvs, op)
    copy(out, work[me * n:(me + 1) * n])
    ctx.count("reduce_scatter_pairs")


def reduce_scatter_hier(ctx: CollCtx, out: torch.Tensor, inp: torch.Tensor, op: str,
                        pairs: bool = True) -> None:
    if pairs and pairs_masks(ctx, inp, 0) is not None:
        reduce_scatter_pairs(ctx, out, inp, op)
        return
    if linked_applies(ctx, inp):
        reduce_scatter_linked(ctx, out, inp, op)
        return
    topo = ctx.topo
    n = out.numel()
    w = topo.size
    g, ng, li = topo.my_group, topo.local_size, topo.local_rank

    def others(grp):
        return [r for r in range(w) if topo.group_of[r] != grp]

    o = others(g)
    region = len(o) * n
    ps = padded_shard(region, ng)
    if ng > 1:
        lay = torch.zeros(ng * (n + ps), dtype=inp.dtype, device=inp.device)
        for i, r in enumerate(topo.groups[g]):
            base = i * (n + ps)
            copy(lay[base:base + n], inp[r * n:(r + 1) * n])
            lo, hi = padded_ranges(region, ng)[i]
            # elements [lo, hi) of the others region, gathered from the ranks' chunks
            for k, q in enumerate(o):
                x = intersect((lo, hi), (k * n, (k + 1) * n))
                if x:
                    copy(lay[base + n + x[0] - lo:base + n + x[1] - lo],
                         inp[q * n + x[0] - k * n:q * n + x[1] - k * n])
        mine = torch.empty(n + ps, dtype=inp.dtype, device=inp.device)
        ctx.wait_native(ctx.local.reduce_scatter(mine, lay, op))
        own, share = mine[:n], mine[n:]
    else:
        own = out
        copy(own, inp[topo.rank * n:(topo.rank + 1) * n])
        if consecutive(o):
            share = inp[o[0] * n:(o[-1] + 1) * n]  # a view (the sends only read it): no copy
            ctx.count("reduce_scatter_hier_view")
        else:
            share = torch.cat([inp[q * n:(q + 1) * n] for q in o]) if o else inp[:0]
    my_lo, my_hi = padded_ranges(region, ng)[li]
    sends = []
    for k, q in enumerate(o):
        x = intersect((my_lo, my_hi), (k * n, (k + 1) * n))
        if x:
            sends.append((q, x[0], x[1], share[x[0] - my_lo:x[1] - my_lo]))
    recvs = []
    me = topo.rank
    for h, ranks in enumerate(topo.groups):
        if h == g:
            continue
        oh = others(h)
        idx = oh.index(me)
        for i2, r2 in enumerate(ranks):
            x = intersect(padded_ranges(len(oh) * n, len(ranks))[i2], (idx * n, (idx + 1) * n))
            if x:
                recvs.append((r2, x[0], x[1], own[x[0] - idx * n:x[1] - idx * n]))
    ctx.transfer(0, sends, recvs, op)
    if own is not out:
        copy(out, own)


def reduce_hier(ctx: CollCtx, x: torch.Tensor, root: int, op: str) -> None:
    topo = ctx.topo
    n = x.numel()
    g, ng, li = topo.my_group, topo.local_size, topo.local_rank
    g0 = topo.group_of[root]
    s = padded_shard(n, ng)
    if ng > 1:
        full = pad_to(x, s * ng)
        shard = torch.empty(s, dtype=x.dtype, device=x.device)
        ctx.wait_native(ctx.local.reduce_scatter(shard, full, op))
    else:
        shard = x
    mine = padded_ranges(n, ng)[li]
    my = shard[: mine[1] - mine[0]]
    if g != g0:
        sends = [(p, lo, hi, my[lo - mine[0]:hi - mine[0]])
                 for p, lo, hi in peer_pieces(mine, n, [topo.groups[g0]])]
        ctx.transfer(0, sends, [])
        return
    others = [r for h, r in enumerate(topo.groups) if h != g0]
    recvs = [(p, lo, hi, my[lo - mine[0]:hi - mine[0]]) for p, lo, hi in peer_pieces(mine, n, others)]
    ctx.transfer(0, [], recvs, op)
    if ng > 1:
        lroot = topo.local_rank_of[root]
        outs = [torch.empty(s, dtype=x.dtype, device=x.device) for _ in range(ng)] \
            if topo.rank == root else []
        ctx.wait_native(ctx.local.gather(outs, shard, lroot))
        if topo.rank == root:
            copy(x, torch.cat(outs)[:n])
