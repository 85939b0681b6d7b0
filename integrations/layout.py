"""Vendor-aware rank layout for Megatron-style 5-D parallelism (no Megatron import).

Megatron-core derives every process group from the global rank through a mixed-radix rank
order (default ``tp-cp-ep-dp-pp``: TP varies fastest, PP slowest). It never asks which GPU sits
behind a rank, so on a mixed cluster the only lever is *which process gets which global rank*.
This module computes that permutation.

Algorithm (`plan_layout`):

1. Work in "slot" space: slot s is Megatron global rank s. Enumerate Megatron's groups exactly as
   its RankGenerator does (dense generator: tp, cp, dp, pp; expert generator: etp, ep, edp, pp).
2. Hard constraint: every tensor-, context-, expert(-tensor)-parallel group and every pipeline
   stage of a replica (the ``tp-cp`` block, and the expert ``tp-ep`` block) lies inside one
   vendor group. Union-find over those groups gives indivisible *blocks* of slots.
3. Soft preference: a whole model replica (blocks joined along ``pp``) inside one vendor, so that
   only data-parallel traffic crosses the bridge. If every vendor group's size is a multiple of
   the replica size this is what we get ("replica" placement); otherwise pipeline neighbours may
   sit on different vendors ("stage" placement: p2p crosses the bridge, and the layout says so).
4. Blocks (or replicas) are handed to vendors in slot order, vendors in order of their first
   launch rank. If the sizes do not fit, `LayoutError` explains why and which sizes would.
5. Inside a vendor, its processes in launch-rank order take its slots in ascending order, so
   neighbouring launch ranks (same host, usually) stay neighbours in TP groups.

The result maps launch rank (torchrun's RANK) <-> layout rank (what torch.distributed and
Megatron see). Data-parallel groups then span vendors; nothing else does (in "replica" mode).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Groups that must stay inside one vendor group (generator, token). "tp-cp" is a pipeline
# stage's model-parallel block; "tp-ep" the expert block (expert-tensor x expert-parallel).
_HARD = [("dense", "tp"), ("dense", "cp"), ("dense", "tp-cp"),
         ("expert", "tp"), ("expert", "ep"), ("expert", "tp-ep")]


class LayoutError(ValueError):
    """A requested parallel layout cannot be placed on the cluster's vendor groups."""


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: same as tp (Megatron's default)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def check(self, world: int) -> tuple[int, int]:
        """(dp, expert_dp) for `world` ranks; LayoutError names the product that does not divide."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        mp = self.tp * self.cp * self.pp
        if world % mp:
            raise LayoutError(f"world size {world} is not divisible by tp*cp*pp = "
                              f"{self.tp}*{self.cp}*{self.pp} = {mp}")
        emp = self.expert_tp * self.ep * self.pp
        if world % emp:
            raise LayoutError(f"world size {world} is not divisible by etp*ep*pp = "
                              f"{self.expert_tp}*{self.ep}*{self.pp} = {emp}")
        return world // mp, world // emp


def orthogonal_groups(world: int, order: str, sizes: dict[str, int], token: str) -> list[list[int]]:
    """Megatron's generate_masked_orthogonal_rank_groups, by enumeration: the ranks whose
    coordinates differ only in the dimensions named by `token` ("tp", "tp-cp", ...) form one group.
    Rank = sum(coord[i] * prod(size[:i])) over the dimensions of `order` (first = fastest)."""
    dims = order.split("-")
    for d in sizes:
        if d not in dims:
            if sizes[d] != 1:
                raise LayoutError(f"order {order!r} lacks {d!r} but {d} = {sizes[d]}")
            dims.append(d)
    radix = [sizes.get(d, 1) for d in dims]
    if math.prod(radix) != world:
        raise LayoutError(f"sizes {dict(zip(dims, radix))} do not multiply to world size {world}")
    masked = set(token.split("-"))
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        rem, key = r, []
        for d, n in zip(dims, radix):
            c, rem = rem % n, rem // n
            if d not in masked:
                key.append(c)
        groups.setdefault(tuple(reversed(key)), []).append(r)
    return [groups[k] for k in sorted(groups)]


def megatron_groups(world: int, sizes: ParallelSizes, order: str = DEFAULT_ORDER
                    ) -> dict[str, list[list[int]]]:
    """The rank groups Megatron-core builds (in layout-rank space), keyed by a short name:
    tp, cp, pp, dp, dp_cp, mp (tp-pp), tp_cp, ep, etp, edp, tp_ep."""
    dp, edp = sizes.check(world)
    dense = dict(tp=sizes.tp, cp=sizes.cp, ep=1, dp=dp, pp=sizes.pp)
    expert = dict(tp=sizes.expert_tp, cp=1, ep=sizes.ep, dp=edp, pp=sizes.pp)
    if not order.endswith("pp") and sizes.pp > 1 and edp != dp:
        raise LayoutError("with a rank order that does not end in pp, attention and MoE layers "
                          "need the same data-parallel size (Megatron asserts this)")
    g = lambda spec, tok: orthogonal_groups(world, order, spec, tok)  # noqa: E731
    out = {"tp": g(dense, "tp"), "cp": g(dense, "cp"), "pp": g(dense, "pp"), "dp": g(dense, "dp"),
           "dp_cp": g(dense, "dp-cp"), "mp": g(dense, "tp-pp"), "tp_cp": g(dense, "tp-cp"),
           "ep": g(expert, "ep"), "etp": g(expert, "tp"), "edp": g(expert, "dp"),
           "tp_ep": g(expert, "tp-ep")}
    if sorted(map(sorted, out["pp"])) != sorted(map(sorted, g(expert, "pp"))):
        raise LayoutError("pipeline groups of the dense and expert parts differ for this order")
    return out


class _DSU:
    def __init__(self, n: int):
        self.p = list(range(n))

    def find(self, x: int) -> int:
        while self.p[x] != x:
            self.p[x] = self.p[self.p[x]]
            x = self.p[x]
        return x

    def union_all(self, groups: Iterable[Sequence[int]]) -> None:
        for grp in groups:
            for r in grp[1:]:
                a, b = self.find(grp[0]), self.find(r)
                if a != b:
                    self.p[max(a, b)] = min(a, b)

    def components(self, n: int) -> list[list[int]]:
        comp: dict[int, list[int]] = {}
        for r in range(n):
            comp.setdefault(self.find(r), []).append(r)
        return sorted(comp.values())


@dataclasses.dataclass
class Layout:
    """A placement of Megatron ranks on vendor groups.

    rank_of_launch[l]: the torch.distributed / Megatron rank of the process with launch rank l.
    launch_of_rank[r]: the inverse. vendor_of_rank[r]: vendor label of layout rank r.
    groups: Megatron's groups in layout-rank space (see megatron_groups).
    placement: "replica" (whole model replicas per vendor; only DP crosses vendors) or
    "stage" (pipeline p2p crosses vendors too). cross_vendor: group kinds that span vendors.
    """
    sizes: ParallelSizes
    order: str
    vendors: list[str]                 # vendor groups, in order of first launch rank
    rank_of_launch: list[int]
    launch_of_rank: list[int]
    vendor_of_rank: list[str]
    groups: dict[str, list[list[int]]]
    placement: str
    block: int                         # ranks that must share a vendor (TP x CP, expert block)
    replica: int                       # ranks of one model replica (TP x CP x PP)

    @property
    def world_size(self) -> int:
        return len(self.rank_of_launch)

    @property
    def dp_size(self) -> int:
        return len(self.groups["dp"][0])

    def dp_rank(self, rank: int) -> int:
        for grp in self.groups["dp"]:
            if rank in grp:
                return grp.index(rank)
        raise KeyError(rank)

    def replica_vendors(self) -> list[list[str]]:
        """For each data-parallel rank d: the vendors its model replica runs on (one in
        "replica" placement). The balancer plans micro-batches per DP rank from this."""
        out: list[set[str]] = [set() for _ in range(self.dp_size)]
        for r in range(self.world_size):
            out[self.dp_rank(r)].add(self.vendor_of_rank[r])
        return [sorted(s, key=self.vendors.index) for s in out]

    @property
    def cross_vendor(self) -> list[str]:
        return [k for k, gs in self.groups.items()
                if any(len({self.vendor_of_rank[r] for r in g}) > 1 for g in gs)]

    def describe(self) -> str:
        counts = {v: self.vendor_of_rank.count(v) for v in self.vendors}
        s = self.sizes
        lines = [f"hetccl layout: world {self.world_size} = "
                 + " + ".join(f"{n} {v}" for v, n in counts.items())
                 + f"; tp={s.tp} cp={s.cp} pp={s.pp} ep={s.ep} etp={s.expert_tp} "
                 f"dp={self.dp_size} order={self.order}",
                 f"  placement: {self.placement} (indivisible blocks of {self.block} ranks; "
                 f"a replica with its pipeline stages = {self.replica} ranks)",
                 "  groups crossing vendors: " + (", ".join(self.cross_vendor) or "none")]
        for d, vs in enumerate(self.replica_vendors()):
            ranks = [r for r in range(self.world_size) if self.dp_rank(r) == d]
            lines.append(f"  dp rank {d}: vendor {'+'.join(vs)}, ranks {ranks} "
                         f"(launch ranks {[self.launch_of_rank[r] for r in ranks]})")
        return "\n".join(lines)


def _vendor_order(labels: Sequence[str]) -> list[str]:
    seen: list[str] = []
    for v in labels:
        if v not in seen:
            seen.append(v)
    return seen


def _impossible(labels: Sequence[str], sizes: ParallelSizes, block: int, why: str) -> LayoutError:
    counts = {v: list(labels).count(v) for v in _vendor_order(labels)}
    g = math.gcd(*counts.values())
    tp_ok = [t for t in range(1, g + 1) if g % t == 0]
    return LayoutError(
        f"cannot place tp={sizes.tp} cp={sizes.cp} ep={sizes.ep} etp={sizes.expert_tp} "
        f"pp={sizes.pp} on vendor groups "
        + ", ".join(f"{v}: {n} GPUs" for v, n in counts.items())
        + f": {why}. Tensor-, context- and expert-parallel groups must stay inside one vendor "
        f"group, so every vendor group must hold whole blocks of {block} ranks "
        f"(lcm(tp*cp, etp*ep)). The vendor sizes have gcd {g}: choose tp*cp and etp*ep among "
        f"the divisors {tp_ok}, or change the vendor groups.")


def plan_layout(labels: Sequence[str], sizes: ParallelSizes, order: str = DEFAULT_ORDER
                ) -> Layout:
    """Vendor-aware placement of Megatron ranks. `labels[l]` is the vendor of launch rank l."""
    labels = list(labels)
    world = len(labels)
    if world == 0:
        raise LayoutError("no ranks")
    groups = megatron_groups(world, sizes, order)
    dsu = _DSU(world)
    names = {("dense", "tp"): "tp", ("dense", "cp"): "cp", ("dense", "tp-cp"): "tp_cp",
             ("expert", "tp"): "etp", ("expert", "ep"): "ep", ("expert", "tp-ep"): "tp_ep"}
    for key in _HARD:
        dsu.union_all(groups[names[key]])
    blocks = dsu.components(world)
    dsu.union_all(groups["pp"])
    replicas = dsu.components(world)
    block = max(len(b) for b in blocks)
    replica = max(len(r) for r in replicas)

    vendors = _vendor_order(labels)
    need = {v: labels.count(v) for v in vendors}

    def fill(units: list[list[int]]) -> list[str] | None:
        """Hand units (slot lists) to vendors in order; None if the counts do not come out."""
        slot_vendor: list[str | None] = [None] * world
        left = dict(need)
        vi = 0
        for u in units:  # first-fit in vendor order keeps each vendor's slots contiguous
            while vi < len(vendors) and left[vendors[vi]] == 0:
                vi += 1
            cand = [v for v in vendors[vi:] if left[v] >= len(u)]
            if not cand:
                return None
            v = cand[0]
            left[v] -= len(u)
            for s in u:
                slot_vendor[s] = v
        return slot_vendor if all(n == 0 for n in left.values()) else None

    placement, slot_vendor = "replica", fill(replicas)
    if slot_vendor is None:
        placement = "stage"
        # Order blocks replica by replica so a pipeline spans as few vendors as possible.
        rep_of = {s: i for i, rep in enumerate(replicas) for s in rep}
        slot_vendor = fill(sorted(blocks, key=lambda b: (rep_of[b[0]], b[0])))
    if slot_vendor is None:
        bad = [f"{v} has {n} GPUs" for v, n in need.items() if n % block]
        why = ("; ".join(bad) + f", not a multiple of {block}") if bad else \
            "the blocks do not pack into the vendor groups"
        raise _impossible(labels, sizes, block, why)

    # Processes of each vendor, in launch order, take that vendor's slots in ascending order.
    rank_of_launch = [-1] * world
    for v in vendors:
        slots = [s for s in range(world) if slot_vendor[s] == v]
        procs = [l for l in range(world) if labels[l] == v]
        for l, s in zip(procs, slots):
            rank_of_launch[l] = s
    launch_of_rank = [0] * world
    for l, s in enumerate(rank_of_launch):
        launch_of_rank[s] = l
    return Layout(sizes=sizes, order=order, vendors=vendors, rank_of_launch=rank_of_launch,
                  launch_of_rank=launch_of_rank, vendor_of_rank=[labels[l] for l in launch_of_rank],
                  groups=groups, placement=placement, block=block, replica=replica)
