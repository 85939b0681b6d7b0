"""All-gather and broadcast across vendor groups (data is copied, never reduced).

all_gather: the output is the concatenation of every rank's input (N elements each) in group
rank order. Rank j of group h sends its own input once to every other group g, split over g's
ranks by the padded sharding of h's block (n_h * N elements) into n_g shards; meanwhile the
native all-gather collects g's own block. Each rank of g then all-gathers (natively) the shards
it received, and every rank has every block. Cross-vendor traffic per rank: N * (G-1) bytes
sent, the minimum: each input crosses to each other group once.

pairs (host memory, two vendor groups of equal size n = 2^m; all_gather hands over to it then):
m + 1 rounds through the bridge, no native step. Round 0 swaps inputs with rank i of the other
group; round k >= 1 swaps everything gathered so far with rank i XOR 2^(k-1) of the other group
(the pairs all-reduce's partners), whose set is the mirror of ours, so after round k a rank
holds the blocks of 2^(k+1) ranks. Each rank sends (2n - 1) N through the bridge instead of
N plus two native all-gathers: on one host the shared-memory bridge beats gloo, whose per-call
cost with 4 processes on 2 cores was 1.5-2.5 ms (docs/algorithms.md).

broadcast: the root's group broadcasts natively; then rank j of the root's group sends shard j
(padded sharding over the root group) to the ranks of every other group whose shards
(padded sharding over that group) intersect it; each group all-gathers natively. Per sender:
(G-1) * N / n_root bytes, no single rank sends everything.
"""
from __future__ import annotations

import torch

from .common import CollCtx, copy
from .layout import consecutive, intersect, padded_ranges, padded_shard, pair_set, pairs_masks, peer_pieces
from .linked import all_gather_linked, linked_applies


def all_gather_pairs(ctx: CollCtx, out: torch.Tensor, x: torch.Tensor, phase: int = 0) -> None:
    masks = pairs_masks(ctx, x, phase)
    if masks is None:
        all_gather_hier(ctx, out, x, phase, pairs=False)
        return
    topo = ctx.topo
    n = x.numel()
    g, li = topo.my_group, topo.local_rank
    copy(out[topo.rank * n:(topo.rank + 1) * n], x)
    if n == 0:
        ctx.flush()  # nothing to move; the check header (if any) still travels
        return
    other = topo.groups[1 - g]

    for k, m in enumerate(masks):
        peer_li = li ^ m
        peer = other[peer_li]
        mine = pair_set(topo, g, li, k)
        theirs = pair_set(topo, 1 - g, peer_li, k)
        sends = [(peer, r * n, (r + 1) * n, out[r * n:(r + 1) * n]) for r in mine]
        recvs = [(peer, r * n, (r + 1) * n, out[r * n:(r + 1) * n]) for r in theirs]
        ctx.transfer(phase + k, sends, recvs)
    ctx.count("all_gather_pairs")


def all_gather_hier(ctx: CollCtx, out: torch.Tensor, x: torch.Tensor, phase: int = 0,
                    pairs: bool = True) -> None:
    """out: (W * N,) flat, x: (N,) flat."""
    if pairs and pairs_masks(ctx, x, phase) is not None:
        all_gather_pairs(ctx, out, x, phase)
        return
    if linked_applies(ctx, x):
        all_gather_linked(ctx, out, x, phase)
        return
    topo = ctx.topo
    n = x.numel()
    g, ng, li = topo.my_group, topo.local_size, topo.local_rank
    native = None
    own_block = None
    if ng > 1:
        own_block = torch.empty(ng * n, dtype=x.dtype, device=x.device)
        native = ctx.local.all_gather(own_block, x)
    # Cross: for each other group h, this rank receives shard li (over ng) of h's block, and
    # sends its own input (range [me*n, (me+1)*n) of its group's block) to every other group.
    sends, recvs, stages, in_place = [], [], {}, set()
    for h, ranks in enumerate(topo.groups):
        if h == g:
            continue
        nh = len(ranks)
        # what I receive of h's block
        lo, hi = padded_ranges(nh * n, ng)[li]
        if ng == 1 and consecutive(ranks):
            # a group of one receives h's whole block, and h's ranks are consecutive: it lands
            # in its place in out (no staging buffer, no copy after), host or device memory.
            stage = out[ranks[0] * n:(ranks[0] + nh) * n]
            in_place.add(h)
        else:
            stage = torch.empty(padded_shard(nh * n, ng), dtype=x.dtype, device=x.device)
        stages[h] = stage
        for j, r in enumerate(ranks):
            x_rng = intersect((lo, hi), (j * n, (j + 1) * n))
            if x_rng:
                recvs.append((r, x_rng[0], x_rng[1], stage[x_rng[0] - lo:x_rng[1] - lo]))
        # what I send to h: my input, split over h's ranks by the sharding of my block
        my_rng = (li * n, (li + 1) * n)
        for j, r in enumerate(ranks):
            rng = intersect(my_rng, padded_ranges(ng * n, nh)[j])
            if rng:
                sends.append((r, rng[0], rng[1], x[rng[0] - li * n:rng[1] - li * n]))
    ctx.transfer(phase, sends, recvs)
    if native is not None:
        ctx.wait_native(native)
        for i, r in enumerate(topo.groups[g]):
            copy(out[r * n:(r + 1) * n], own_block[i * n:(i + 1) * n])
    else:
        me = topo.rank
        copy(out[me * n:(me + 1) * n], x)
    if not stages:
        return
    order = sorted(stages)
    if ng == 1:
        # each other group's block arrived whole: in place, or scattered to its ranks' slots
        if in_place:
            ctx.count("all_gather_hier_in_place")
        for h in order:
            if h not in in_place:
                for j, r in enumerate(topo.groups[h]):
                    copy(out[r * n:(r + 1) * n], stages[h][j * n:(j + 1) * n])
        return
    cat = torch.cat([stages[h] for h in order]) if len(order) > 1 else stages[order[0]]
    if ng > 1:
        gathered = torch.empty(ng * cat.numel(), dtype=x.dtype, device=x.device)
        ctx.wait_native(ctx.local.all_gather(gathered, cat))
    else:
        gathered = cat
    per_rank = cat.numel()
    for i in range(ng):
        off = i * per_rank
        for h in order:
            ranks = topo.groups[h]
            nh = len(ranks)
            lo, hi = padded_ranges(nh * n, ng)[i]
            piece = gathered[off:off + (hi - lo)]
            off += stages[h].numel()
            # piece holds elements [lo, hi) of h's block; scatter them to their ranks' slots
            for j, r in enumerate(ranks):
                rng = intersect((lo, hi), (j * n, (j + 1) * n))
                if rng:
                    a, b = rng
                    copy(out[r * n + (a - j * n):r * n + (b - j * n)], piece[a - lo:b - lo])


def broadcast_hier(ctx: CollCtx, x: torch.Tensor, root: int) -> None:
    topo = ctx.topo
    n = x.numel()
    g0 = topo.group_of[root]
    g, ng, li = topo.my_group, topo.local_size, topo.local_rank
    if g == g0:
        if ng > 1:
            ctx.wait_native(ctx.local.broadcast(x, topo.local_rank_of[root]))
        mine = padded_ranges(n, ng)[li]
        others = [r for h, r in enumerate(topo.groups) if h != g0]
        sends = [(p, lo, hi, x[lo:hi]) for p, lo, hi in peer_pieces(mine, n, others)]
        ctx.transfer(0, sends, [])
        return
    senders = topo.groups[g0]
    mine = padded_ranges(n, ng)[li]
    s = padded_shard(n, ng)
    full = torch.empty(s * ng, dtype=x.dtype, device=x.device) if ng > 1 else x
    shard = full[li * s:li * s + (mine[1] - mine[0])] if ng > 1 else x
    recvs = [(p, lo, hi, shard[lo - mine[0]:hi - mine[0]])
             for p, lo, hi in peer_pieces(mine, n, [senders])]
    ctx.transfer(0, [], recvs)
    if ng > 1:
        mine_shard = full[li * s:(li + 1) * s].clone()
        ctx.wait_native(ctx.local.all_gather(full, mine_shard))
        copy(x, full[:n])
