"""What an algorithm sees: a CollCtx (topology, native vendor-group ops, bridge transfers,
reductions) and a chunked transfer pipeline. Algorithms never touch a transport or a device
API directly; the engine implements CollCtx for host and device tensors alike.

Tags: a collective owns the tag space seq<<16 | phase<<13 | index (phase < 8, index < 8192);
both ends of a transfer derive (phase, index) from the same shard intersection, so they agree
without negotiation.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Protocol, Sequence

import torch

from ..topology import Topology

MAX_CHUNKS_PER_PAIR = 8191


class Req(Protocol):
    def wait(self, deadline: float) -> int: ...


class CollCtx(Protocol):
    topo: Topology
    local: object      # hetccl.native.NativeGroup (or None in a group of one)
    deadline: float
    chunk_bytes: int

    def tag(self, phase: int, index: int) -> int: ...
    def isend(self, peer: int, t: torch.Tensor, tag: int) -> Req: ...
    def irecv(self, peer: int, t: torch.Tensor, tag: int) -> Req: ...
    def irecv_reduce(self, peer: int, t: torch.Tensor, tag: int, op: str) -> Req: ...
    def pair_allreduce(self, peer: int, give: torch.Tensor, keep: torch.Tensor, op: str,
                       tag: int) -> bool: ...
    def bounce(self, slot: int, like: torch.Tensor, numel: int) -> torch.Tensor: ...
    def reduce_into(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> None: ...
    def finish_recv(self, req: Req) -> None: ...
    def wait_native(self, work) -> None: ...


def chunk_ranges(lo: int, hi: int, elem_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into pipeline chunks of about chunk_bytes (at most MAX_CHUNKS_PER_PAIR)."""
    n = hi - lo
    if n <= 0:
        return []
    per = max(1, chunk_bytes // max(1, elem_size))
    per = max(per, -(-n // MAX_CHUNKS_PER_PAIR))
    return [(a, min(a + per, hi)) for a in range(lo, hi, per)]


def run_pipeline(items: Sequence, post: Callable, finish: Callable, window: int,
                 deadline: float) -> None:
    """post(i, item) -> list of requests; finish(i, item) runs after they complete.
    Keeps `window` items in flight and finishes them in order (item i may reuse the
    resources of item i - window)."""
    inflight: list[tuple[int, list]] = []
    nxt = 0
    for i in range(len(items)):
        while nxt < len(items) and nxt < i + window:
            inflight.append((nxt, post(nxt, items[nxt])))
            nxt += 1
        j, reqs = inflight.pop(0)
        for r in reqs:
            r.wait(deadline)
        finish(j, items[j])


def interleave(per_peer: list[list]) -> list:
    """Round-robin merge so that every peer's transfer progresses at once."""
    out = []
    for k in range(max((len(x) for x in per_peer), default=0)):
        for lst in per_peer:
            if k < len(lst):
                out.append(lst[k])
    return out


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src. Contiguous host tensors are copied with one memmove on this thread (GIL
    released): torch's own copy may fan out to intra-op threads, which on a busy host (ranks,
    communication threads) costs far more than it saves for the sizes collectives move."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous() and dst.dtype == src.dtype and dst.numel() == src.numel()):
        n = dst.numel() * dst.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)


def pad_to(t: torch.Tensor, n: int) -> torch.Tensor:
    """t (1-D) itself when it already has n elements, else a copy padded with zeros."""
    if t.numel() == n:
        return t
    out = torch.zeros(n, dtype=t.dtype, device=t.device)
    copy(out[: t.numel()], t)
    return out
