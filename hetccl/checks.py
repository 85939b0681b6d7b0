"""Argument checks: every rank must call the same collective with matching tensors.

A check header is six integers -- collective, element count, dtype, reduction op, root, device
type. How the headers travel depends on the topology (engine.py EngineCtx.begin, the same
choice on every rank):
  * in general the engine carries this rank's header to every cross-vendor peer with the
    collective's first transfer (csrc/engine.h: no extra round trip) and compares what it
    receives; inside a vendor group, where data moves on the native library, the headers are
    all-gathered natively first (one tiny native collective) so that a call that is wrong inside
    one group is refused before any native call, and the verdict travels to the other groups in
    the header's error text;
  * two groups of equal size 2^m, when the check waits: m + 1 small exchanges through the bridge
    leave every rank with every header (all_headers_over_bridge), before any data;
  * every pair of ranks linked (engine.check_linked), when the check waits: one exchange of
    every rank's header row over the links, before any data.
Every rank thus raises the same ValueError, and an error raised this way leaves the group
usable.

HETCCL_CHECK_ARGS:
  on   (default) every call, host and device tensors, is checked before data moves: the calling
       thread waits until every rank's header is known (for device tensors that is a wait for
       the peers to *issue* the call, never for the data or the GPU). Every rank reaches the same
       verdict at the call, whatever each rank called before, and an error leaves the group
       usable. (Until 2026-12 device calls skipped the wait for signatures a rank had checked
       before; a rank that had used its size and one that had not then ran different protocols.
       A rank cannot know that its peer's arguments are the ones it checked before, so a
       per-rank cache cannot be correct.) `full` is accepted as a synonym.
  async device collectives never wait: the headers ride with the data and the engine compares
       them as they arrive, so issuing never waits for the peers. Every rank takes the same
       path whatever it called before; a call's stream passes it only once its headers are
       compared (csrc/engine.h, the verdict word), so a rank that synchronized after a
       mismatching call knows it before its next call; a mismatch breaks the group on every rank
       (HETCCL_ASYNC_ERROR_HANDLING: abort the process, or raise at the next call), and a
       mismatch only inside one vendor group is not caught (as with the native library). A rank
       that did wait (host tensors on it) raises ValueError at the call and breaks its group too,
       since its peers already issued their data.
  off  no checks (a mismatch then fails as a timeout or a protocol error, never silently).
"""
from __future__ import annotations

import torch

from . import device as devices, hostmem
from ._core import _C

COLL_CODES = {name: i + 1 for i, name in enumerate(
    ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
     "gather", "scatter", "barrier"])}
OP_CODES = {None: 0, "sum": 1, "prod": 2, "min": 3, "max": 4, "avg": 5, "band": 6, "bor": 7,
            "bxor": 8}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.int16, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
DEVICE_CODES = devices.device_codes()  # the device seams' (hetccl/device/: device_code)
HEADER_LEN = 6
UNKNOWN = -(2**63)  # a row of all_headers_over_bridge's table not heard of yet
FIELDS = list(_C.check_field_whats())  # csrc/check_text.h: one list for every check
# bit i set: field i must agree (all_to_all: element counts differ by design)
MASK_ALL = 0x3F
MASK_NO_NUMEL = MASK_ALL & ~(1 << 1)

# The element count (or, where counts are not compared, the dtype code) a rank puts in its
# header when it refuses the call on its own (an output of the wrong size, say:
# EngineCtx.begin's refusal): every other rank's check then fails naming that rank, instead of
# waiting for data that never comes.
REFUSED = -1
REFUSED_TEXT = "none: the call was refused on that rank (its error names why)"

# code -> name per field, for messages (the C++ engine formats with the same table)
FIELD_NAMES: list[dict[int, str]] = [
    {v: k for k, v in COLL_CODES.items()},
    {REFUSED: REFUSED_TEXT},
    {**{v: str(k) for k, v in DTYPE_CODES.items()},
     REFUSED: REFUSED_TEXT},
    {v: str(k) for k, v in OP_CODES.items()},
    {},
    {v: k for k, v in DEVICE_CODES.items()},
]


def header(coll: str, numel: int, dtype: torch.dtype | None, op: str | None, root: int,
           device: torch.device) -> list[int]:
    """dtype None: the call refused on this rank (REFUSED in the dtype field, for collectives
    whose element counts differ by design and are not compared)."""
    return [COLL_CODES[coll], int(numel), REFUSED if dtype is None else DTYPE_CODES.get(dtype, 0),
            OP_CODES[op], int(root), DEVICE_CODES.get(device.type, 3)]


def mismatch_text(coll: str, table: dict[int, list[int]], mask: int) -> str | None:
    """The error every rank prints when headers differ (the first differing field), or None.
    The wording is the C++ core's, shared with the engine's and the C API's checks
    (csrc/check_text.h): ranks grouped by value in order of their lowest rank."""
    for f, what in enumerate(FIELDS):
        if not mask & (1 << f):
            continue
        names = FIELD_NAMES[f]
        text = _C.mismatch_text(coll, what, [(r, row[f], str(names.get(row[f], row[f])))
                                             for r, row in table.items()])
        if text:
            return text
    return None


def all_headers_over_bridge(table: torch.Tensor, row: torch.Tensor, groups: list[list[int]],
                            my_group: int, local_rank: int, rank: int, masks: list[int],
                            exchange) -> torch.Tensor:
    """Every rank's header, gathered through the bridge in len(masks) rounds of one small
    exchange with one cross-vendor partner each (topology.butterfly_masks), instead of a native
    all-gather inside each vendor group plus the headers the data carries: on host tensors the
    native all-gather (gloo: a work queue and a loop thread per call) cost 2.5-3 ms per
    collective with 2+2 ranks on the 2-core machine, where the rounds through shared memory
    take a fraction of that. Every rank ends with the same table, so every rank reaches the
    same verdict (bridge_verdict) before any data moves.
    table: int64 (world, 1 + HEADER_LEN), overwritten; row: this rank's (1, header...).
    exchange(round, peer, table) merges the partner's table into ours (elementwise max, in
    place, the same result on both ends). Returns table."""
    # unknown rows hold the smallest int64, known ones real values (all >= -1): merging two
    # tables is their elementwise max, which the two-rank round trip computes in C++
    table.fill_(UNKNOWN)
    table[rank] = row
    other = groups[1 - my_group]
    for k, m in enumerate(masks):
        exchange(k, other[local_rank ^ m], table)
    return table


def bridge_verdict(coll: str, table: torch.Tensor, cols: torch.Tensor, mask: int) -> str | None:
    """The mismatch text of a table from all_headers_over_bridge, or None when every rank's
    compared fields agree. cols: column 0 (known) and the header fields `mask` compares, each
    shifted by one (cached per signature by the caller)."""
    t = table.index_select(1, cols)
    if bool((t == t[0]).all()):
        return None
    rows = table.tolist()
    missing = [r for r in range(len(rows)) if rows[r][0] != 1]
    if missing:  # cannot happen with topology.butterfly_masks' rounds; never judge a partial table
        raise RuntimeError(f"hetccl: internal error: the argument check missed ranks {missing}")
    return mismatch_text(coll, {r: rows[r][1:] for r in range(len(rows))}, mask)


def within_group(local, local_ranks: list[int], mine: list[int], coll: str, mask: int) -> str | None:
    """All-gathers the headers inside this rank's vendor group on the native library (host
    tensors; a group of one has nothing to compare) and returns the mismatch text, or None."""
    if local is None or len(local_ranks) < 2:
        return None
    t = hostmem.tensor(mine, torch.int64)
    got = hostmem.empty(len(local_ranks) * HEADER_LEN, torch.int64)
    local.all_gather(got, t).wait()
    rows = got.view(len(local_ranks), HEADER_LEN).tolist()
    return mismatch_text(coll, dict(zip(local_ranks, rows)), mask)
