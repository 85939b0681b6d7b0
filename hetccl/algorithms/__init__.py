"""Algorithm registry and selection.

Selection is data: TABLE lists, per collective, (largest message size in bytes, algorithm);
the first row whose size bound is >= the message size wins. HETCCL_ALGO overrides it,
e.g. HETCCL_ALGO="all_reduce=flat,all_gather=hier". docs/algorithms.md explains each
algorithm and its cross-vendor traffic.
"""
from __future__ import annotations

import math

from .. import config
from .allgather import all_gather_hier, all_gather_pairs, broadcast_hier
from .allreduce import (all_reduce_flat, all_reduce_hier, all_reduce_latency, all_reduce_pairs,
                        all_reduce_split)
from .direct import all_to_all_direct, gather_direct, scatter_direct
from .linked import all_gather_linked, all_reduce_linked, reduce_scatter_linked
from .reducescatter import reduce_hier, reduce_scatter_hier, reduce_scatter_pairs

ALGORITHMS = {
    "all_reduce": {"hier": all_reduce_hier, "flat": all_reduce_flat, "split": all_reduce_split,
                   "pairs": all_reduce_pairs, "latency": all_reduce_latency,
                   "linked": all_reduce_linked},
    "all_gather": {"hier": all_gather_hier, "pairs": all_gather_pairs,
                   "linked": all_gather_linked},
    "reduce_scatter": {"hier": reduce_scatter_hier, "pairs": reduce_scatter_pairs,
                       "linked": reduce_scatter_linked},
    "broadcast": {"hier": broadcast_hier},
    "reduce": {"hier": reduce_hier},
    "all_to_all": {"direct": all_to_all_direct},
    "gather": {"direct": gather_direct},
    "scatter": {"direct": scatter_direct},
}

# (collective, max bytes inclusive, algorithm). Small all-reduces take the latency path:
# pairs where it applies (no native step), else flat, which saves one latency step over hier
# (two instead of three); both win while latency dominates (measured: docs/algorithms.md).
TABLE = [
    ("all_reduce", 64 * 1024, "latency"),
    ("all_reduce", math.inf, "hier"),
    ("all_gather", math.inf, "hier"),
    ("reduce_scatter", math.inf, "hier"),
    ("broadcast", math.inf, "hier"),
    ("reduce", math.inf, "hier"),
    ("all_to_all", math.inf, "direct"),
    ("gather", math.inf, "direct"),
    ("scatter", math.inf, "direct"),
]


_cache: dict[str, dict[str, str]] = {}


def _overrides() -> dict[str, str]:
    raw = config.get("HETCCL_ALGO")
    if raw in _cache:
        return _cache[raw]
    out = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        coll, _, algo = item.partition("=")
        coll, algo = coll.strip(), algo.strip()
        if coll not in ALGORITHMS or algo not in ALGORITHMS[coll]:
            known = {c: sorted(a) for c, a in ALGORITHMS.items()}
            raise ValueError(f"hetccl: HETCCL_ALGO entry {item!r} is invalid; known: {known}")
        out[coll] = algo
    _cache[raw] = out
    return out


def overrides() -> dict[str, str]:
    """HETCCL_ALGO, parsed (an engine reads it once: it must agree across ranks anyway)."""
    return dict(_overrides())


def select(coll: str, nbytes: int, forced: dict[str, str] | None = None):
    """(name, function) of the algorithm to run for this collective and message size."""
    algo = (_overrides() if forced is None else forced).get(coll)
    if algo is None:
        algo = next(a for c, limit, a in TABLE if c == coll and nbytes <= limit)
    return algo, ALGORITHMS[coll][algo]
