"""The one owner of the bridge's tag space (transport tags are below 2**48, transport.h).

    bit 47         point-to-point (send/recv/isend/irecv across vendors): user tag in bits 0..39
    bits 26..45    signature of the collective's arguments (checks.py; 0 when not checked):
                   data of a collective whose arguments differ from the receiver's never
                   matches, and on shared-memory rings it is refused on arrival
    bits 16..25    sequence number of the group's collective, modulo SEQ_WINDOW
    bits 13..15    phase inside the collective (0..6: data; 7: control)
    bits 0..12     chunk index inside (peer, phase), modulo 2**INDEX_BITS; in the control
                   phase: all ones for the check header that rides with the data, round << 8
                   for the rounds of the argument check through the bridge (check_round)

Collectives of one group run one after another in the same order on every rank, so a
sequence window of 1024 cannot match a stale message: matching is FIFO per (peer, tag), and
a tag comes back only 1024 collectives later. Both ends of a transfer derive (phase, index)
from the same shard intersection, so they agree without negotiation; the engine numbers
chunks (csrc/engine_plan.cc) with the index bits.
"""
from __future__ import annotations

SEQ_WINDOW = 1024
SEQ_SHIFT = 16
PHASE_SHIFT = 13
INDEX_BITS = 13
PHASES = 7  # data phases 0..6
SIG_SHIFT = 26
SIG_BITS = 20
CONTROL_PHASE = 7
P2P_BIT = 1 << 47
P2P_USER_BITS = 40


def collective(seq: int, phase: int, sig: int = 0) -> int:
    """Tag base of data phase `phase` of collective number `seq` (chunk index goes below)."""
    if not 0 <= phase < PHASES:
        raise ValueError(f"hetccl: internal error: phase {phase} outside 0..{PHASES - 1}")
    return (((sig & ((1 << SIG_BITS) - 1)) << SIG_SHIFT) | ((seq % SEQ_WINDOW) << SEQ_SHIFT)
            | (phase << PHASE_SHIFT))


def signature(header: list[int]) -> int:
    """A 20-bit digest of a check header, equal on every rank for equal headers."""
    import zlib

    return zlib.crc32(b",".join(str(v).encode() for v in header)) & ((1 << SIG_BITS) - 1)


def header(seq: int) -> int:
    """Tag of the argument-check headers of collective `seq`."""
    return ((seq % SEQ_WINDOW) << SEQ_SHIFT) | (CONTROL_PHASE << PHASE_SHIFT) | ((1 << INDEX_BITS) - 1)


CHECK_INDEX_BITS = 8  # chunk index bits of one argument-check round (control phase)


def check_round(seq: int, rnd: int) -> int:
    """Tag base of round `rnd` of collective `seq`'s argument check through the bridge
    (checks.all_headers_over_bridge): control phase, index rnd << CHECK_INDEX_BITS, below the
    header's index (all ones)."""
    if not 0 <= rnd < (1 << (INDEX_BITS - CHECK_INDEX_BITS)) - 1:
        raise ValueError(f"hetccl: internal error: check round {rnd} out of range")
    return ((seq % SEQ_WINDOW) << SEQ_SHIFT) | (CONTROL_PHASE << PHASE_SHIFT) | (
        rnd << CHECK_INDEX_BITS)


def p2p(user_tag: int) -> int:
    """Tag of a cross-vendor point-to-point message with torch's user tag."""
    return P2P_BIT | (int(user_tag) & ((1 << P2P_USER_BITS) - 1))
