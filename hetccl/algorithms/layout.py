"""Index math shared by every algorithm (kept in one place).

A buffer of `n` elements is sharded over a vendor group of `parts` ranks in contiguous,
near-equal ranges: the first n % parts shards get one extra element. Cross-vendor traffic is
planned by intersecting the shard ranges of two groups: rank i of group A exchanges with rank j
of group B exactly the elements in range_A(i) ∩ range_B(j). When group sizes are equal this is a
one-to-one pairing; when they differ each rank talks to the (few) ranks whose shards overlap its
own, so every byte crosses once and no rank acts as a leader.
"""
from __future__ import annotations

from typing import Iterator


def shard_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def padded_shard(n: int, parts: int) -> int:
    """Shard length when a buffer is padded to parts * ceil(n / parts) (native collectives
    need equal shards)."""
    return -(-n // parts) if parts else 0


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def overlaps(mine: tuple[int, int], theirs: list[tuple[int, int]]) -> Iterator[tuple[int, tuple[int, int]]]:
    """(index j, intersection) for every shard of `theirs` that overlaps `mine`."""
    for j, r in enumerate(theirs):
        x = intersect(mine, r)
        if x is not None:
            yield j, x
