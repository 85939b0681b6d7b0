"""The bridge: moves bytes between vendor groups over the C++ transports.

A Bridge belongs to one multi-vendor process group. At creation it connects this rank to every
rank of the *other* vendor groups (never to its own group: that traffic stays on the native
library). The transport of a pair is chosen symmetrically from both ranks' hosts:
shm when they share a host, tcp otherwise, ucx when HETCCL_TRANSPORT=ucx (HETCCL_TRANSPORT=tcp
forces tcp even on one host). Addresses and the group's random secret go through the group's
torch store: no rendezvous of our own.

The collectives' data does not go through this module: the C++ engine (engine.py,
csrc/engine.h) drives these transports directly. isend/irecv here serve point-to-point
operations on host tensors; device data crosses only through host memory, exactly as between
real vendors, whose devices share nothing but the host.
"""
from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from datetime import timedelta

import torch

from . import _core, config, vendor
from ._core import _C
from .topology import Topology

log = logging.getLogger("hetccl")


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _iface_addr(ifname: str) -> str:
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        raise ValueError(f"hetccl: HETCCL_SOCKET_IFNAME={ifname!r}: no IPv4 address on that "
                         f"interface ({e})") from None
    finally:
        s.close()


def _default_bind_addr(topo: Topology) -> str:
    ifname = config.get("HETCCL_SOCKET_IFNAME")
    if ifname:
        return _iface_addr(ifname)
    if all(topo.same_host(topo.rank, r) for r in range(topo.size)):
        return "127.0.0.1"
    # The interface that routes to the store's master is one every peer can reach.
    import os
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((master, 1))
            return s.getsockname()[0]
        except OSError:
            pass
        finally:
            s.close()
    return socket.gethostbyname(socket.gethostname())


class Bridge:
    def __init__(self, store, topo: Topology, timeout: timedelta):
        self.topo = topo
        self.timeout = timeout
        self.peers = [r for r in range(topo.size) if topo.group_of[r] != topo.my_group]
        forced = config.get("HETCCL_TRANSPORT")
        known = _core.transport_names()
        if forced not in ("auto", *known):
            raise ValueError(f"hetccl: HETCCL_TRANSPORT={forced!r} is not available in this "
                             f"build (available: auto, {', '.join(known)})")
        # Kind of transport for each peer; symmetric because it depends on both hosts only.
        self.kind_of: dict[int, str] = {}
        for p in self.peers:
            if forced != "auto":
                self.kind_of[p] = forced
            else:
                self.kind_of[p] = "shm" if topo.same_host(topo.rank, p) else "tcp"
        if topo.rank == 0:
            store.set("hetccl/secret", secrets.token_hex(16))
        store.wait(["hetccl/secret"], timeout)
        secret = store.get("hetccl/secret").decode()
        self.slot_bytes = int(config.get("HETCCL_SHM_SLOT_BYTES")) or (
            8 << 20 if vendor.build_kind() in ("cuda", "rocm") else 1 << 20)
        _check_settings_agree(store, topo, timeout, {
            **{k: config.get(k) for k in config.MUST_AGREE},
            "HETCCL_SHM_SLOT_BYTES (in force)": self.slot_bytes})
        opts = {
            "secret": secret,
            "nconn": str(config.get("HETCCL_TCP_NCONN")),
            "slot_bytes": str(self.slot_bytes),
            "nslots": str(config.get("HETCCL_SHM_NSLOTS")),
            "threads": str(config.get("HETCCL_REDUCE_THREADS")),
        }
        kinds = sorted(set(self.kind_of.values()))
        if any(k in ("tcp", "ucx") for k in kinds):
            opts["bind_addr"] = _default_bind_addr(topo)
        self.transports: dict[str, object] = {}
        try:
            for k in kinds:
                t = _C.Transport(k, topo.rank, topo.size, opts)
                self.transports[k] = t
                store.set(f"hetccl/bridge/{k}/{topo.rank}", t.address())
            timeout_ms = int(timeout.total_seconds() * 1000)
            for k, t in self.transports.items():
                mine = [p for p in self.peers if self.kind_of[p] == k]
                store.wait([f"hetccl/bridge/{k}/{p}" for p in mine], timeout)
                addrs = [b""] * topo.size
                for p in mine:
                    addrs[p] = store.get(f"hetccl/bridge/{k}/{p}")
                t.connect(addrs, timeout_ms)
        except BaseException:
            self.close()
            raise
        log.info("hetccl bridge: rank %d connected to %d peers via %s", topo.rank,
                 len(self.peers), dict(sorted(self.kind_of.items())))

    def transport_of(self, peer: int):
        try:
            return self.transports[self.kind_of[peer]]
        except KeyError:
            raise ValueError(f"hetccl: rank {peer} is not a cross-vendor peer of rank "
                             f"{self.topo.rank}") from None

    # --- data movement (host tensors) ---
    def isend(self, peer: int, t: torch.Tensor, tag: int):
        return _Req(self.transport_of(peer).isend(peer, t.data_ptr(), _nbytes(t), tag), t)

    def irecv(self, peer: int, t: torch.Tensor, tag: int):
        return _Req(self.transport_of(peer).irecv(peer, t.data_ptr(), _nbytes(t), tag), t)

    def irecv_reduce(self, peer: int, t: torch.Tensor, tag: int, op: str):
        req = self.transport_of(peer).irecv_reduce(peer, t.data_ptr(), _nbytes(t), tag, op,
                                                   torch_dtype_name(t.dtype))
        return _Req(req, t)

    def zero_copy(self, peers) -> bool:
        """True when every peer is reached through a transport with a zero-copy ring."""
        return all(getattr(self.transport_of(p), "zc_supported", False) for p in peers)

    def close(self) -> None:
        for t in self.transports.values():
            try:
                t.close()
            except Exception as e:  # noqa: BLE001
                log.warning("hetccl: closing transport failed: %s", e)
        self.transports = {}


def _check_settings_agree(store, topo: Topology, timeout: timedelta, mine: dict) -> None:
    """Raise the same ValueError on every rank when ranks run with different values of a
    setting both ends of a transfer depend on (config.MUST_AGREE): otherwise the two ends of
    a transfer would cut or route it differently and fail later with a timeout."""
    store.set(f"hetccl/settings/{topo.rank}", json.dumps(mine, sort_keys=True))
    keys = [f"hetccl/settings/{r}" for r in range(topo.size)]
    store.wait(keys, timeout)
    table = [json.loads(store.get(k)) for k in keys]
    problems = []
    for name in sorted(mine):
        by_value: dict[str, list[int]] = {}
        for r, theirs in enumerate(table):
            by_value.setdefault(json.dumps(theirs.get(name)), []).append(r)
        if len(by_value) > 1:
            problems.append(f"{name}: " + ", ".join(
                f"{v} on ranks {rs}" for v, rs in sorted(by_value.items(), key=lambda x: x[1])))
    if problems:
        raise ValueError("hetccl: ranks run with different values of settings that both ends of "
                         "a cross-vendor transfer must share; set them identically on every "
                         "rank: " + "; ".join(problems))


def _left_ms(deadline: float) -> int:
    """Milliseconds until `deadline` (time.monotonic() seconds), never negative."""
    return max(0, int((deadline - time.monotonic()) * 1000))


def _nbytes(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("hetccl: internal error: bridge tensors must be contiguous")
    return t.numel() * t.element_size()


class _Req:
    """A posted transport operation plus the tensor it reads or writes (kept alive until done)."""

    __slots__ = ("req", "tensor")

    def __init__(self, req, tensor):
        self.req, self.tensor = req, tensor

    def wait(self, deadline: float) -> int:
        return self.req.wait(_left_ms(deadline))
