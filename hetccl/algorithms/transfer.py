"""The one cross-vendor data-movement primitive every algorithm is built from.

transfer(ctx, phase, sends, recvs, op) moves ranges of a global coordinate space between this
rank and its cross-vendor peers, chunked and pipelined:
  sends: (peer, lo, hi, view)  -- view holds elements [lo, hi) to send to peer
  recvs: (peer, lo, hi, view)  -- view receives elements [lo, hi) from peer; with op set, the
                                  incoming data is reduced into view instead of copied
Both ends list the same (lo, hi) for a pair and chunk it identically, so chunk k of a pair in
a phase has the same tag on both sides. A received chunk is reduced only after every earlier
item (in particular the send of the same range, listed first) has completed, so an exchange
that sends and reduces the same memory is safe as long as no range is sent to two peers;
callers that send one range to several peers pass a snapshot as the send view.
"""
from __future__ import annotations

from .common import CollCtx, chunk_ranges, interleave, run_pipeline

WINDOW = 8


def transfer(ctx: CollCtx, phase: int, sends, recvs, op: str | None = None,
             fused: bool = False) -> None:
    """fused=True promises that no send of this call reads memory that a receive reduces
    into; host receives then reduce straight out of the transport's buffers (irecv_reduce:
    one pass over memory instead of a copy plus a reduction)."""
    fast = getattr(ctx, "device_transfer", None)
    if fast is not None and fast(phase, sends, recvs, op):
        return
    per_peer: dict[int, list] = {}
    counters: dict[tuple[int, str], int] = {}

    def add(kind: str, peer: int, lo: int, hi: int, view):
        es = view.element_size()
        for a, b in chunk_ranges(lo, hi, es, ctx.chunk_bytes):
            k = counters.get((peer, kind), 0)
            counters[(peer, kind)] = k + 1
            per_peer.setdefault(peer, []).append(
                (kind, peer, ctx.tag(phase, k), view[a - lo:b - lo]))

    # Sends before receives of the same peer: a reduce into a range follows its send.
    for peer, lo, hi, view in sorted(sends, key=lambda s: (s[0], s[1])):
        add("send", peer, lo, hi, view)
    for peer, lo, hi, view in sorted(recvs, key=lambda s: (s[0], s[1])):
        add("recv", peer, lo, hi, view)
    # Put each peer's sends and receives side by side so both directions flow at once.
    lists = []
    for peer in sorted(per_peer):
        items = per_peer[peer]
        s = [x for x in items if x[0] == "send"]
        r = [x for x in items if x[0] == "recv"]
        lists.append(interleave([s, r]))
    items = interleave(lists)
    if not items:
        return
    window = WINDOW
    state: dict[int, object] = {}

    def post(i, item):
        kind, peer, tag, view = item
        if kind == "send":
            return [ctx.isend(peer, view, tag, i % window)]
        if op is None:
            req = ctx.irecv(peer, view, tag, i % window)
        elif fused and not view.is_cuda:
            state[i] = None
            req = ctx.irecv_reduce(peer, view, tag, op)
        else:
            buf = ctx.bounce(i % window, view, view.numel())
            state[i] = buf
            req = ctx.irecv(peer, buf, tag, None)
        return [req]

    def finish(i, item):
        kind, peer, tag, view = item
        if kind == "send":
            return
        if op is None:
            ctx.finish_recv(view, i % window)
        else:
            buf = state.pop(i)
            if buf is not None:  # None: reduced by the transport (fused)
                ctx.reduce_into(view, buf, op)

    run_pipeline(items, post, finish, window, ctx.deadline)
