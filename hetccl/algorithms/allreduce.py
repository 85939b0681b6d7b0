"""All-reduce across vendor groups.

hier (default): 1) reduce-scatter inside each vendor group (native library), so rank i of
group g holds g's partial sum of shard i (padded sharding, n_g shards); 2) every rank exchanges
its shard with the ranks of every other group whose shards intersect it and reduces what it
receives; 3) all-gather inside each group. Per rank, cross-vendor traffic is (G-1) * N / n_g
bytes each way (G groups, N bytes, n_g ranks in its group): the minimum for G = 2, spread over
all ranks, no leader. With G > 2 the same range goes to several groups while received data is
reduced into it: the engine lets no reduction touch a range before every send of it has left.

pairs (host memory, two vendor groups of equal size n = 2^m, peers on shared memory; hier
hands over to it when n = 2): m + 1 rounds of the two-rank round trip on the whole buffer, no
native step. Round 0 pairs rank i of each group with rank i of the other, so both hold their
pair's sum; round k >= 1 pairs rank i with rank i XOR 2^(k-1) of the other group, whose value is
the sum over the neighbouring block of pairs, so after round k every rank holds the sum over
2^k pairs. Each rank moves (m + 1) N through the bridge and none through the native library:
on one host the shared-memory round trip beats gloo over TCP loopback (2+2 on the 2-core
machine: 1.2-1.3x gloo at 16 MiB where split gives 0.9x, docs/benchmarks.md). Every partial
sum is computed once per chunk and copied to both partners, and a + b == b + a in IEEE
arithmetic, so all ranks end bit-identical. Not for GPUs (there the native library is the fast
path and the bridge the slow one).

flat: native all-reduce inside each group, then rank i of group g exchanges the whole buffer
with rank i mod n_h of every other group h (and answers every rank j of h with j mod n_g = i).
Two latency steps instead of three: used for small messages, where latency dominates.

linked (host memory, every pair of ranks on shared memory, three or more ranks: linked.py): hier
and the latency path hand over to it; no native step.

split (host memory, two vendor groups of equal size n > 2, peers on shared memory; hier hands
over to it then): 1) rank i of each group and rank i of the other run the two-rank round trip
on the whole buffer (both then hold their pair's sum); 2) each group's native library
all-reduces one half of the buffer -- group 0 the first half, group 1 the second -- so each
group's native library does half the work the others would; 3) the pair swaps halves. The
native host library (gloo) moves bytes far slower than the shared-memory bridge (its
reduce-scatter is slower than its all-reduce), so moving work from it to the bridge wins on one
host: per rank, gloo all-reduces N/2 bytes instead of reduce-scattering and all-gathering N;
the bridge moves 1.5 N each way, all of it through shared memory.
"""
from __future__ import annotations

import torch

from .common import CollCtx, copy, pad_to
from .layout import padded_ranges, padded_shard, pairs_masks, peer_pieces
from .linked import all_reduce_linked, linked_applies


def all_reduce_hier(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    topo = ctx.topo
    n = x.numel()
    ng, li = topo.local_size, topo.local_rank
    if linked_applies(ctx, x):
        all_reduce_linked(ctx, x, op)  # every pair on shared memory: no native step (linked.py)
        return
    if topo.local_size == 2 and _pairs_applies(ctx, x):
        _pairs(ctx, x, op)  # measured faster than split only for n = 2 so far
        return
    if _split_applies(ctx, x):
        all_reduce_split(ctx, x, op)
        return
    if ng > 1:
        s = padded_shard(n, ng)
        full = pad_to(x, s * ng)
        shard = torch.empty(s, dtype=x.dtype, device=x.device)
        ctx.wait_native(ctx.local.reduce_scatter(shard, full, op))
    else:
        s, full, shard = n, x, x
    mine = padded_ranges(n, ng)[li]
    my = shard[: mine[1] - mine[0]]
    if topo.num_groups == 2 and x.device.type == "cpu":
        _exchange_pairwise_ring(ctx, my, mine, n, op)
    else:
        _exchange_direct(ctx, my, mine, n, op)
    if ng > 1:
        ctx.wait_native(ctx.local.all_gather(full, shard))
        if full is not x:
            copy(x, full[:n])


def _exchange_pairwise_ring(ctx: CollCtx, my: torch.Tensor, mine, n: int, op: str) -> None:
    """Two groups, host memory: each intersecting pair runs a two-rank ring on its range.
    The lower rank owns the lower half: both send the other's half and reduce the incoming
    copy of their own half straight from the transport (fused, the memory sent is not the
    memory reduced), then send their reduced half back. Same bytes on the wire as a direct
    exchange, one pass less over memory per byte (docs/algorithms.md)."""
    topo = ctx.topo
    base = mine[0]
    a_s, a_r, b_s, b_r = [], [], [], []
    pieces = list(peer_pieces(mine, n, [topo.groups[1 - topo.my_group]]))
    for peer, lo, hi in pieces:
        mid = lo + (hi - lo) // 2
        own, other = ((lo, mid), (mid, hi)) if topo.rank < peer else ((mid, hi), (lo, mid))
        v_own = my[own[0] - base:own[1] - base]
        v_other = my[other[0] - base:other[1] - base]
        # Equal group sizes shard identically, so every rank has at most one peer and so does
        # that peer: then the whole exchange runs as one C++ loop on this thread when the
        # pair's transport allows. Both ends take the same decision: it depends on the
        # topology, the pair's (shared) transport and settings that every rank must agree on
        # (checked when the bridge starts, bridge.py).
        if (len(pieces) == 1 and len(topo.groups[0]) == len(topo.groups[1])
                and ctx.pair_allreduce(peer, v_other, v_own, op)):
            return
        a_s.append((peer, other[0], other[1], v_other))
        a_r.append((peer, own[0], own[1], v_own))
        b_s.append((peer, own[0], own[1], v_own))
        b_r.append((peer, other[0], other[1], v_other))
    ctx.transfer(0, a_s, a_r, op)
    ctx.transfer(1, b_s, b_r)


def _exchange_direct(ctx: CollCtx, my: torch.Tensor, mine, n: int, op: str) -> None:
    topo = ctx.topo
    others = [r for g, r in enumerate(topo.groups) if g != topo.my_group]
    pieces = list(peer_pieces(mine, n, others))
    sends = [(p, lo, hi, my[lo - mine[0]:hi - mine[0]]) for p, lo, hi in pieces]
    if topo.num_groups <= 2:
        # two groups: a + b is b + a, so reducing each arrival into place gives every rank
        # the same bits
        recvs = [(p, lo, hi, my[lo - mine[0]:hi - mine[0]]) for p, lo, hi in pieces]
        ctx.transfer(0, sends, recvs, op)
        return
    # Three or more: the arrival order differs between ranks and floating point does not
    # associate, so the groups' sums land in buffers of their own and are reduced in group
    # order, the same fold on every rank (ranks of a group then agree bit for bit with the
    # other groups', as DDP replicas must).
    bufs = {g: torch.empty_like(my) for g in range(topo.num_groups) if g != topo.my_group}
    recvs = [(p, lo, hi, bufs[topo.group_of[p]][lo - mine[0]:hi - mine[0]])
             for p, lo, hi in pieces]
    ctx.transfer(0, sends, recvs)
    _fold_in_group_order(ctx, my, bufs, op)


def _fold_in_group_order(ctx: CollCtx, mine: torch.Tensor, others: dict, op: str) -> None:
    """mine = others[0] op others[1] op ... op others[G-1], mine standing at this group's index:
    the same order of operations on every rank."""
    g = ctx.topo.my_group
    order = [mine.clone() if h == g else others[h] for h in range(ctx.topo.num_groups)]
    mine.copy_(order[0])
    for t in order[1:]:
        ctx.reduce_into(mine, t, op)


def _split_applies(ctx: CollCtx, x: torch.Tensor) -> bool:
    """Every rank decides alike: topology, device type (checked equal across ranks) and the
    pair's transport (symmetric) only."""
    topo = ctx.topo
    return (x.device.type == "cpu" and topo.num_groups == 2 and topo.local_size > 1
            and len(topo.groups[0]) == len(topo.groups[1]) and x.numel() >= 2
            and ctx.zero_copy([topo.groups[1 - topo.my_group][topo.local_rank]]))


def _pairs_applies(ctx: CollCtx, x: torch.Tensor) -> bool:
    """As _split_applies (every rank decides alike), with n a power of two, at most six rounds
    (one phase each) and every round's partner on a zero-copy link."""
    masks = pairs_masks(ctx, x)
    if masks is None or len(masks) > 6 or x.numel() < 2:
        return False
    other = ctx.topo.groups[1 - ctx.topo.my_group]
    return ctx.zero_copy([other[ctx.topo.local_rank ^ m] for m in masks])


def all_reduce_pairs(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    if _pairs_applies(ctx, x):
        _pairs(ctx, x, op)
    else:
        all_reduce_hier(ctx, x, op)


def _pairs(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    """pairs where _pairs_applies holds."""
    topo = ctx.topo
    g, li, n = topo.my_group, topo.local_rank, x.numel()
    mid = n // 2
    for phase, m in enumerate(pairs_masks(ctx, x)):
        peer = topo.groups[1 - g][li ^ m]
        # the lower rank keeps (reduces) the lower half, as in split
        own, other = ((0, mid), (mid, n)) if topo.rank < peer else ((mid, n), (0, mid))
        if not ctx.pair_allreduce(peer, x[other[0]:other[1]], x[own[0]:own[1]], op, phase=phase):
            # no C++ round trip for this dtype or HETCCL_HOST_KERNEL=0: equal on every rank,
            # so every rank leaves here in round 0, before anything was posted
            assert phase == 0, "the round trip applied in round 0 but not later"
            all_reduce_split(ctx, x, op)
            return
    ctx.count("all_reduce_pairs")


def all_reduce_split(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    topo = ctx.topo
    g, li = topo.my_group, topo.local_rank
    peer = topo.groups[1 - g][li]
    n = x.numel()
    mid = n // 2
    # 1. pair sum on the whole buffer (the lower rank keeps the lower half)
    own, other = ((0, mid), (mid, n)) if topo.rank < peer else ((mid, n), (0, mid))
    v_own, v_other = x[own[0]:own[1]], x[other[0]:other[1]]
    if not ctx.pair_allreduce(peer, v_other, v_own, op):
        ctx.transfer(0, [(peer, other[0], other[1], v_other)], [(peer, own[0], own[1], v_own)], op)
        ctx.transfer(1, [(peer, own[0], own[1], v_own)], [(peer, other[0], other[1], v_other)])
    # 2. this group's half, summed over the group's pairs by the native library
    lo, hi = (0, mid) if g == 0 else (mid, n)
    if ctx.local is not None and hi > lo:
        ctx.wait_native(ctx.local.all_reduce(x[lo:hi], op))
    # 3. swap halves with the pair
    olo, ohi = (mid, n) if g == 0 else (0, mid)
    ctx.transfer(2, [(peer, lo, hi, x[lo:hi])], [(peer, olo, ohi, x[olo:ohi])])
    ctx.count("all_reduce_split")


def all_reduce_latency(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    """Small messages: pairs where it applies (host memory, two groups of 2^m ranks on
    zero-copy links: m + 1 shared-memory round trips and no native step), else flat. On the
    2-core machine at 8 KiB: 2+2 1.8 ms against flat's 3.2-3.5 ms, 4+4 6.7 ms against 16 ms
    (docs/algorithms.md)."""
    if _pairs_applies(ctx, x):
        _pairs(ctx, x, op)
    elif linked_applies(ctx, x):
        all_reduce_linked(ctx, x, op)
    else:
        all_reduce_flat(ctx, x, op)


def all_reduce_flat(ctx: CollCtx, x: torch.Tensor, op: str) -> None:
    topo = ctx.topo
    ng, li = topo.local_size, topo.local_rank
    if ng > 1:
        ctx.wait_native(ctx.local.all_reduce(x, op))
    n = x.numel()
    sends, recvs = [], []
    for h, ranks in enumerate(topo.groups):
        if h == topo.my_group:
            continue
        nh = len(ranks)
        recvs.append((ranks[li % nh], 0, n, None))
        for j in range(nh):
            if j % ng == li:
                sends.append((ranks[j], 0, n, x))
    # Received sums land in separate buffers, reduced after the transfer: every peer gets
    # this group's sum, not a partly reduced one; then folded in group order, the same order
    # of operations on every rank (floating point does not associate: with three or more
    # groups, each group starting from its own sum gave each group other bits).
    bufs = [torch.empty_like(x) for _ in recvs]
    ctx.transfer(0, sends, [(p, lo, hi, b) for (p, lo, hi, _), b in zip(recvs, bufs)])
    others = [h for h in range(len(topo.groups)) if h != topo.my_group]
    _fold_in_group_order(ctx, x, dict(zip(others, bufs)), op)
