"""Who is in the group: each rank's vendor label and host, exchanged through the group's store.

Vendor groups are listed in order of their lowest rank, each as a sorted list of group ranks,
so every rank derives the same layout from the same labels.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

from . import vendor


@dataclass(frozen=True)
class RankInfo:
    vendor: str
    host: str           # shared-memory domain (vendor.host_identity): equal <=> shm reaches
    pid: int
    hostname: str = ""  # for messages only (vendor.host_name)


@dataclass
class Topology:
    rank: int
    size: int
    infos: list[RankInfo]

    def __post_init__(self):
        order: dict[str, list[int]] = {}
        for r, info in enumerate(self.infos):
            order.setdefault(info.vendor, []).append(r)
        self.groups: list[list[int]] = list(order.values())
        self.labels: list[str] = list(order.keys())
        self.group_of = [0] * self.size
        self.local_rank_of = [0] * self.size
        for g, ranks in enumerate(self.groups):
            for i, r in enumerate(ranks):
                self.group_of[r] = g
                self.local_rank_of[r] = i

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def my_group(self) -> int:
        return self.group_of[self.rank]

    @property
    def local_rank(self) -> int:
        return self.local_rank_of[self.rank]

    @property
    def local_ranks(self) -> list[int]:
        return self.groups[self.my_group]

    @property
    def local_size(self) -> int:
        return len(self.groups[self.my_group])

    def same_host(self, a: int, b: int) -> bool:
        return self.infos[a].host == self.infos[b].host

    def where(self, r: int) -> str:
        """'rank 3 (host h1, pid 1234)': how error messages name a rank."""
        i = self.infos[r]
        return f"rank {r} (host {i.hostname or '?'}, pid {i.pid})"

    def describe(self) -> str:
        return " + ".join(f"{lab}:{len(rs)}" for lab, rs in zip(self.labels, self.groups))

    @classmethod
    def exchange(cls, store, rank: int, size: int, timeout: timedelta,
                 label: str | None = None) -> "Topology":
        """label: this rank's vendor label (default: vendor.detect_vendor())."""
        me = RankInfo(label or vendor.detect_vendor(), vendor.host_identity(), os.getpid(),
                      vendor.host_name())
        from .rendezvous import all_gather

        rows = all_gather(store, "hetccl/topo", rank, size, json.dumps(me.__dict__), timeout)
        return cls(rank, size, [RankInfo(**json.loads(v)) for v in rows])


def butterfly_masks(groups: list[list[int]]) -> list[int] | None:
    """The rounds of the bridge check (checks.all_headers_over_bridge) and of the pairs
    all-gather / reduce-scatter (algorithms/layout.py) when the topology allows it:
    two vendor groups of equal size n = 2^m (n >= 2), else None. Round 0 pairs rank i of each
    group with rank i of the other; round k >= 1 with rank i XOR 2^(k-1) of the other group
    (as the pairs all-reduce, algorithms/allreduce.py), so after m + 1 rounds every rank has
    heard, directly or through a partner, from every rank of both groups."""
    if len(groups) != 2 or len(groups[0]) != len(groups[1]):
        return None
    n = len(groups[0])
    if n < 2 or n & (n - 1):
        return None
    return [0] + [1 << k for k in range(n.bit_length() - 1)]
