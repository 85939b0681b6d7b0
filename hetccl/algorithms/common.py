"""What an algorithm sees: a CollCtx (topology, native vendor-group ops, cross-vendor
transfers, reductions) and small helpers. Algorithms never touch a transport or a device API
directly; the engine (hetccl/engine.py over csrc/engine.h) implements CollCtx for host and
device tensors alike. Tags belong to hetccl/tags.py.
"""
from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from ..topology import Topology

MAX_CHUNKS_PER_PAIR = 8191


class CollCtx(Protocol):
    topo: Topology
    local: object      # hetccl.native.NativeGroup (or None in a group of one)
    deadline: float
    all_linked: bool   # every pair of ranks on a shared-memory ring (algorithms/linked.py)

    def tag(self, phase: int, index: int) -> int: ...
    # The one cross-vendor data-movement primitive every algorithm is built from: moves ranges
    # of a global coordinate space between this rank and its cross-vendor peers.
    #   sends: (peer, lo, hi, view) -- view holds elements [lo, hi) to send to peer
    #   recvs: (peer, lo, hi, view) -- view receives elements [lo, hi) from peer; with op set,
    #                                  the incoming data is reduced into view instead of copied
    # Both ends list the same (lo, hi) ranges for a pair, so both cut them into the same chunks
    # and tags. The whole call is one plan of the C++ engine (csrc/engine.h), which guarantees:
    # a receive never writes (or reduces into) memory before every send of the same call that
    # reads that memory has taken its bytes -- so a range may be sent to several peers and
    # reduced into in the same call. For device tensors the call returns once the copies are
    # enqueued on the collective's streams.
    def transfer(self, phase: int, sends, recvs, op: str | None = None) -> None: ...
    # two-rank round trip of one range (engine.h); False when it does not apply
    def pair_allreduce(self, peer: int, give: torch.Tensor, keep: torch.Tensor,
                       op: str) -> bool: ...
    def reduce_into(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> None: ...
    # every peer reached through a shared-memory ring (same host)
    def zero_copy(self, peers) -> bool: ...
    def wait_native(self, work) -> None: ...

    def count(self, what: str) -> None: ...  # one run of a named path (engine stats "algo_<what>")


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
