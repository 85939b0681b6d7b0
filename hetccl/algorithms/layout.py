"""Index math shared by every algorithm (kept in one place).

A buffer of `n` elements is sharded over a vendor group of `parts` ranks by *padded sharding*:
shard i is [i * s, min((i + 1) * s, n)) with s = ceil(n / parts), because the native
reduce-scatter and all-gather need equal shards (the last shards may be short or empty).
Cross-vendor traffic is planned by intersecting the shard ranges of two groups: rank i of group
A exchanges with rank j of group B exactly the elements in range_A(i) ∩ range_B(j). When group
sizes are equal this is a one-to-one pairing; when they differ each rank talks to the (few)
ranks whose shards overlap its own, so every byte crosses once and no rank acts as a leader.
"""
from __future__ import annotations

from typing import Iterator, Sequence


def padded_shard(n: int, parts: int) -> int:
    """Shard length when a buffer is padded to parts * ceil(n / parts)."""
    return -(-n // parts) if parts else 0


def padded_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of every shard of an n-element buffer over `parts` ranks (padded sharding)."""
    s = padded_shard(n, parts)
    return [(min(i * s, n), min((i + 1) * s, n)) for i in range(parts)]


def consecutive(ranks) -> bool:
    """Whether the ranks are r, r+1, ..., in that order: their blocks of a buffer laid out in
    rank order are one contiguous range (groups of one receive or send it as one view)."""
    return bool(ranks) and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def overlaps(mine: tuple[int, int], theirs: list[tuple[int, int]]) -> Iterator[tuple[int, tuple[int, int]]]:
    """(index j, intersection) for every shard of `theirs` that overlaps `mine`."""
    for j, r in enumerate(theirs):
        x = intersect(mine, r)
        if x is not None:
            yield j, x


def peer_pieces(mine: tuple[int, int], n: int,
                groups: Sequence[Sequence[int]]) -> Iterator[tuple[int, int, int]]:
    """(peer rank, lo, hi) for every rank of `groups` whose padded shard of the n-element
    buffer intersects `mine`: the pieces this rank exchanges with those groups."""
    for ranks in groups:
        for j, (lo, hi) in overlaps(mine, padded_ranges(n, len(ranks))):
            yield ranks[j], lo, hi


def pairs_masks(ctx, x, phase: int = 0):
    """The rounds of the pairs all-gather / reduce-scatter (topology.butterfly_masks: two vendor
    groups of equal size 2^m) when they apply, else None. Every rank decides alike: topology,
    device type (checked equal across ranks) and the first phase the caller gives (one phase
    per round, tags.PHASES of them)."""
    from ..topology import butterfly_masks
    from ..tags import PHASES
    masks = butterfly_masks(ctx.topo.groups)
    if masks is None or x.device.type != "cpu" or phase + len(masks) > PHASES:
        return None
    return masks


def pair_set(topo, group: int, i: int, k: int) -> list[int]:
    """Ranks whose blocks local rank i of `group` holds before round k of the pairs all-gather
    (round 0 partners rank i of the two groups, round k >= 1 rank i with i XOR 2^(k-1) of the
    other group): itself before round 0, then both groups' ranks of a block of 2^(k-1) local
    ranks. The pairs reduce-scatter walks the rounds backwards and keeps this set in round k.
    Sorted, so both ends of a round list the same blocks in the same order."""
    if k == 0:
        return [topo.groups[group][i]]
    size = 1 << (k - 1)
    base = i & ~(size - 1)
    return sorted(r for j in range(base, base + size) for r in (topo.groups[0][j], topo.groups[1][j]))
