"""The one cross-vendor data-movement primitive every algorithm is built from.

transfer(ctx, phase, sends, recvs, op) moves ranges of a global coordinate space between this
rank and its cross-vendor peers:
  sends: (peer, lo, hi, view)  -- view holds elements [lo, hi) to send to peer
  recvs: (peer, lo, hi, view)  -- view receives elements [lo, hi) from peer; with op set, the
                                  incoming data is reduced into view instead of copied
Both ends list the same (lo, hi) ranges for a pair, so both cut them into the same chunks and
tags. The whole call is one plan of the C++ engine (csrc/engine.h), which guarantees: a receive
never writes (or reduces into) memory before every send of the same call that reads that memory
has taken its bytes -- so a range may be sent to several peers and reduced into in the same call.
For device tensors the call returns once the copies are enqueued on the collective's streams.
"""
from __future__ import annotations

from .common import CollCtx


def transfer(ctx: CollCtx, phase: int, sends, recvs, op: str | None = None) -> None:
    ctx.transfer(phase, sends, recvs, op)
