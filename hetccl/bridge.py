"""The bridge: moves bytes between vendor groups over the C++ transports.

A Bridge belongs to one multi-vendor process group. At creation it links this rank to every
rank of the *other* vendor groups (shm rings at once, each within its share of the rank's
budget: shm_segment_budget; tcp connections on first use: HETCCL_TCP_LAZY; ucx at once); traffic inside a vendor group stays on the native library,
except host data of a job on one host whose groups are not two of equal size 2^m: then the
rest of its own vendor group is linked through shared memory too (group_links), and host
collectives run on the engine alone (algorithms/linked.py). The transport of a pair is chosen
from the capability tables both ranks publish
(hetccl/transports.py: the most preferred transport of both tables that reaches the pair,
shm on one host, ucx or tcp between hosts; HETCCL_TRANSPORT forces one), together with whether
device memory goes to it directly. Addresses, tables and the group's random secret go through
the group's torch store: no rendezvous of our own.

The collectives' data does not go through this module: the C++ engine (engine.py,
csrc/engine.h) drives these transports directly. isend/irecv here serve point-to-point
operations on host tensors; device data crosses through host memory, exactly as between real
vendors, whose devices share nothing but the host, unless the pair's transport moves the
device's memory without runtime calls off the issuing thread (TransportCaps::runtime_free,
under HETCCL_UCX_DEVICE=auto) or HETCCL_UCX_DEVICE=force hands it to UCX anyway
(Choice.device_direct; the engine's direct links).
"""
from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from datetime import timedelta

import torch

from . import _core, config, device as devices, rendezvous, transports, vendor
from ._core import _C
from .topology import Topology, butterfly_masks

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
        # operations whose wait failed while the transport still held their buffer (_Req)
        self._parked: list = []
        self.peers = [r for r in range(topo.size) if topo.group_of[r] != topo.my_group]
        if topo.rank == 0:
            store.set("hetccl/secret", secrets.token_hex(16))
        store.wait(["hetccl/secret"], timeout)
        secret = store.get("hetccl/secret").decode()
        self.slot_bytes = int(config.get("HETCCL_SHM_SLOT_BYTES")) or (
            devices.build_seam().staging_slot_bytes)
        _check_settings_agree(store, topo, timeout, {
            **{k: config.get(k) for k in config.MUST_AGREE},
            "HETCCL_SHM_SLOT_BYTES (in force)": self.slot_bytes,
            **transports.settings_in_force()})
        # Capability tables of every rank; every rank computes the choice of every cross-vendor
        # pair (not only its own), so a pair no transport can serve raises the same error on
        # every rank instead of leaving the others waiting in connect().
        caps = [json.loads(v) for v in rendezvous.all_gather(store, "hetccl/caps", topo.rank, topo.size, json.dumps({
            "table": transports.publishable(transports.local_table()),
            "kind": vendor.build_kind(),
            "cores": transports.usable_cores(),
            "shm_budget": int(config.get("HETCCL_SHM_BUDGET_BYTES")) or (
                devices.build_seam().shm_budget_bytes)}), timeout)]
        self.choices = choose_all(topo, caps)
        self.kind_of: dict[int, str] = {p: self.choices[(topo.rank, p)].transport
                                        for p in self.peers}
        # Same-vendor ranks of this host reached through shared memory too, for host tensors
        # only (group_links() says when): their data then needs no native (gloo) step.
        self.groups_linked = group_links(topo, caps)  # the same on every rank
        self.group_peers = [r for r in topo.groups[topo.my_group]
                            if r != topo.rank] if self.groups_linked else []
        ring = transports.shared_ring(c["table"] for c in caps) if self.group_peers else None
        for p in self.group_peers:
            self.kind_of[p] = ring
        # Every pair of ranks on a shared-memory ring (engine.py: host collectives on the
        # engine alone): a property of the job, from tables every rank has, so the same on
        # every rank -- never from this rank's own links, which differ across ranks.
        self.all_linked = (topo.size >= 3
                           and (self.groups_linked or max(len(g) for g in topo.groups) == 1)
                           and all(c.zero_copy for c in self.choices.values()))
        self.device_direct: dict[int, bool] = {p: self.choices[(topo.rank, p)].device_direct
                                               for p in self.peers}
        # Shared memory per rank is bounded whatever the job size (shm_segment_budget): each
        # outgoing ring segment gets an equal share of this host's budget.
        self.seg_budget = shm_segment_budget(topo, caps, self.choices, self.groups_linked)
        # Device data on message links (tcp, ucx host-staged) goes through pinned staging
        # slots the engine allocates per link: bounded by the same per-rank budget.
        self.staging_slots = staging_depth(topo, caps, self.choices, self.slot_bytes,
                                           int(config.get("HETCCL_SHM_NSLOTS")))
        kinds = sorted(set(self.kind_of.values()))
        local = {t["name"]: t for t in transports.local_table()}
        # each transport's options (transports.options knows their names); the peers it serves
        # decide its exclusions, whatever the transport; network transports listen on an address
        real_host = [i.host for i in topo.infos]
        # one lane count for the whole job, from every rank's cores, host and table
        self.ucx_lanes = transports.job_ucx_lanes(caps, real_host)
        bind_addr = _default_bind_addr(topo) if any(local[k]["other_host"] for k in kinds) else None
        opts_of = {}
        for k in kinds:
            served = [p for p in self.peers if self.kind_of[p] == k]
            opts_of[k] = transports.options(
                k, secret=secret, slot_bytes=self.slot_bytes, seg_budget=self.seg_budget,
                bind_addr=bind_addr, my_host=real_host[topo.rank],
                peer_hosts=[real_host[p] for p in served],
                emulate_hosts=bool(config.get("HETCCL_EMULATE_HOSTS")),
                any_direct=any(self.device_direct[p] for p in served),
                ucx_lanes_in_force=self.ucx_lanes)
        self.transports: dict[str, object] = {}
        try:
            for k in kinds:
                self.transports[k] = _C.Transport(k, topo.rank, topo.size, opts_of[k])
            # one table of every rank's addresses, {transport: address} per rank
            mine_addr = {k: _text(t.address()) for k, t in self.transports.items()}
            table = [json.loads(v) for v in rendezvous.all_gather(
                store, "hetccl/bridge/addresses", topo.rank, topo.size, json.dumps(mine_addr),
                timeout)]
            timeout_ms = int(timeout.total_seconds() * 1000)
            for k, t in self.transports.items():
                addrs = [b""] * topo.size
                for p in self.linked:
                    if self.kind_of[p] == k:
                        addrs[p] = table[p][k].encode("latin-1")  # binary-safe (ucx)
                t.connect(addrs, timeout_ms)
        except BaseException:
            self.close()
            raise
        self.info = {k: dict(t.info()) for k, t in self.transports.items()}
        by: dict[str, list[int]] = {}
        for p in self.peers:
            by.setdefault(self.choices[(topo.rank, p)].describe(), []).append(p)
        if config.get("HETCCL_UCX_DEVICE") == "force" and any(self.device_direct.values()):
            log.warning("hetccl bridge: rank %d: HETCCL_UCX_DEVICE=force hands device memory to "
                        "%s, whose own threads then call the device runtime: an application "
                        "thread blocked in a runtime call behind a collective's stream (a "
                        "pageable copy such as x.cpu()) deadlocks with them; for diagnostics "
                        "only (docs/transports.md)", topo.rank,
                        ",".join(sorted({self.kind_of[p] for p in self.peers
                                         if self.device_direct[p]})))
        log.info("hetccl bridge: rank %d (vendor %s) reaches %s%s", topo.rank,
                 topo.labels[topo.my_group],
                 "; ".join(f"ranks {ps} via {d}" for d, ps in sorted(by.items())),
                 transports.describe(self.info))

    @property
    def linked(self) -> list[int]:
        """Every rank this one has a link to: the cross-vendor peers, then group_peers."""
        return self.peers + self.group_peers

    def transport_of(self, peer: int):
        try:
            return self.transports[self.kind_of[peer]]
        except KeyError:
            raise ValueError(f"hetccl: rank {peer} is not a linked peer of rank "
                             f"{self.topo.rank}") from None

    # --- data movement (host tensors) ---
    def isend(self, peer: int, t: torch.Tensor, tag: int):
        tr = self.transport_of(peer)
        return _Req(tr.isend(peer, t.data_ptr(), _nbytes(t), tag), t, tr, self._parked)

    def irecv(self, peer: int, t: torch.Tensor, tag: int):
        tr = self.transport_of(peer)
        return _Req(tr.irecv(peer, t.data_ptr(), _nbytes(t), tag), t, tr, self._parked)

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
        self._parked.clear()  # closed transports write into no buffer


def pair_same_host(topo: Topology, a: int, b: int) -> bool:
    """Whether ranks a and b count as one host for the transport choice: the same host identity,
    unless HETCCL_EMULATE_HOSTS makes every vendor group a host of its own."""
    if config.get("HETCCL_EMULATE_HOSTS") and topo.group_of[a] != topo.group_of[b]:
        return False
    return topo.same_host(a, b)


def group_links(topo: Topology, caps: list[dict]) -> bool:
    """Whether same-vendor ranks link to each other through shared memory too, for host
    tensors (every rank to the rest of its vendor group): when every rank of the job is on
    this host, every rank's table has shm, no transport is forced, hosts are not emulated, HETCCL_GROUP_LINKS is auto, and the
    topology is not two groups of equal size 2^m (those have the pairs paths, which need no
    native step and no extra links). Then every pair of ranks has a shared-memory ring, and
    host collectives run on the engine alone (algorithms/linked.py): on one host the native host
    library (gloo over TCP loopback, a loop thread per call) is the slow part of a 2+1 group.
    Trade-off: one more ring per same-vendor pair (shm memory). A property of the job, the same
    on every rank (a rank alone in its group links nobody more, but runs the same protocols)."""
    if (config.get("HETCCL_GROUP_LINKS") != "auto" or config.get("HETCCL_TRANSPORT") != "auto"
            or config.get("HETCCL_EMULATE_HOSTS") or topo.num_groups < 2
            or max(len(g) for g in topo.groups) < 2):
        return False
    if not all(topo.same_host(0, r) for r in range(topo.size)):
        return False
    if transports.shared_ring(c["table"] for c in caps) is None:
        return False
    return butterfly_masks(topo.groups) is None


def shm_segment_budget(topo: Topology, caps: list[dict], choices: dict,
                       groups_linked: bool) -> int:
    """Bytes one outgoing shared-memory segment of this rank may take (the shm transport's
    seg_budget: it fits its ring geometry into them): the smallest budget a rank of this host
    publishes (HETCCL_SHM_BUDGET_BYTES, default per device seam) divided by the most
    shared-memory peers any rank of this host links to. Every rank of the host computes the
    same value from the same tables, so the two segments of a pair get one geometry, and no
    rank creates more than its budget: memory per rank stays bounded as the job grows (the
    rings get fewer, then smaller slots instead)."""
    host = [r for r in range(topo.size) if topo.same_host(topo.rank, r)]
    shm = _links_per_rank(choices, lambda c: c.zero_copy)

    def shm_peers(r: int) -> int:
        return shm.get(r, 0) + (len(topo.groups[topo.group_of[r]]) - 1 if groups_linked else 0)

    most = max(shm_peers(r) for r in host)
    budget = min(int(caps[r]["shm_budget"]) for r in host)
    return max(1, budget // max(1, most))


def _links_per_rank(choices: dict, which) -> dict[int, int]:
    """rank -> how many cross-vendor peers it reaches over a link `which(choice)` accepts
    (one pass over the pairs of choose_all)."""
    out: dict[int, int] = {}
    for (a, _), c in choices.items():
        if which(c):
            out[a] = out.get(a, 0) + 1
    return out


def staging_depth(topo: Topology, caps: list[dict], choices: dict, slot_bytes: int,
                  most: int) -> int:
    """Staging slots per direction of each message link (the engine's device_slots: pinned
    slot_bytes each, for device data on tcp / host-staged ucx links): as many as fit the
    smallest published budget (HETCCL_SHM_BUDGET_BYTES) over the most message links any rank
    of the job has, between 2 (copies overlap the transfer) and `most` (HETCCL_SHM_NSLOTS). The
    same on every rank."""
    links = max(_links_per_rank(choices, lambda c: not c.zero_copy).values(), default=0)
    if not links:
        return max(2, most)
    budget = min(int(c["shm_budget"]) for c in caps)
    return max(2, min(most, budget // (links * 2 * max(1, slot_bytes))))


def choose_all(topo: Topology, caps: list[dict]) -> dict:
    """{(a, b): transports.Choice} for every ordered cross-vendor pair, from every rank's published
    capabilities ({"table": ..., "kind": ...}). The same on every rank."""
    forced = config.get("HETCCL_TRANSPORT")
    device = config.get("HETCCL_UCX_DEVICE")
    # no rank of another vendor on the same real host (emulation aside): such a rank's UCX
    # context keeps its device paths (transports.ucx_exclusions)
    alone = [not any(topo.same_host(r, p) for p in range(topo.size)
                     if topo.group_of[p] != topo.group_of[r]) for r in range(topo.size)]
    out = {}
    for a in range(topo.size):
        for b in range(topo.size):
            if topo.group_of[a] == topo.group_of[b]:
                continue
            out[(a, b)] = transports.choose(a, b, caps[a]["table"], caps[b]["table"],
                                            pair_same_host(topo, a, b), forced,
                                            caps[a]["kind"], caps[b]["kind"], device,
                                            alone[a], alone[b])
    return out


def _check_settings_agree(store, topo: Topology, timeout: timedelta, mine: dict) -> None:
    """Raise the same ValueError on every rank when ranks run with different values of a
    setting both ends of a transfer depend on (config.MUST_AGREE): otherwise the two ends of
    a transfer would cut or route it differently and fail later with a timeout."""
    table = [json.loads(v) for v in rendezvous.all_gather(
        store, "hetccl/settings", topo.rank, topo.size, json.dumps(mine, sort_keys=True),
        timeout)]
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


def _text(addr) -> str:
    """A transport address (opaque bytes; UCX's is binary) as str for JSON: latin-1 maps every
    byte to one code point and back."""
    return addr.decode("latin-1") if isinstance(addr, bytes) else addr


def _left_ms(deadline: float) -> int:
    """Milliseconds until `deadline` (time.monotonic() seconds), never negative."""
    return max(0, int((deadline - time.monotonic()) * 1000))


def _nbytes(t: torch.Tensor) -> int:
    # the transports read and write these pointers from the host: a device pointer here would
    # crash the process (hostmem.py), so it is refused before anything is posted
    if t.device.type != "cpu":
        raise ValueError(f"hetccl: internal error: the bridge moves host memory only, got a "
                         f"tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("hetccl: internal error: bridge tensors must be contiguous")
    return t.numel() * t.element_size()


class _Req:
    """A posted transport operation plus the tensor it reads or writes.

    Contract: the transport holds only the raw pointer, so the tensor must outlive the
    operation. A wait that fails or times out (a p2p recv whose peer never sends, say) leaves
    the operation posted; withdraw() then cancels a receive that no data has reached
    (Transport::cancel) or, where it cannot, parks this _Req on its bridge until the bridge
    closes, so the caller may drop its work and the tensor without the transport ever writing
    into freed memory."""

    __slots__ = ("req", "tensor", "transport", "parked")

    def __init__(self, req, tensor, transport=None, parked=None):
        self.req, self.tensor, self.transport, self.parked = req, tensor, transport, parked

    def wait(self, deadline: float) -> int:
        try:
            return self.req.wait(_left_ms(deadline))
        except BaseException:
            self.withdraw()
            raise

    def unpost(self) -> bool:
        """Withdraw this receive as if it had never been posted (its message goes to the next
        receive of its peer and tag); False where the transport cannot (Transport::cancel)."""
        try:
            return self.transport is not None and bool(self.transport.cancel(self.req, True))
        except Exception:  # noqa: BLE001 - a closed transport: nothing to withdraw
            return False

    def finished(self) -> bool:
        """True once the operation completed or failed: either way the transport is done with
        the buffer (wait() then returns or raises)."""
        try:
            return bool(self.req.test())
        except Exception:  # noqa: BLE001 - failed counts as finished
            return True

    def withdraw(self) -> None:
        if self.finished():
            return
        # As if never posted first: point-to-point tags are posted again (the next recv from
        # that peer with that tag must get the message this one gave up on; a plain cancel on
        # tcp keeps the message's sequence number and discards it on arrival). Else a plain
        # cancel: the message is dropped when it comes.
        if self.unpost():
            return
        try:
            if self.transport is not None and self.transport.cancel(self.req):
                return
        except Exception:  # noqa: BLE001 - a closed transport: park it, dropped at close
            pass
        if self.parked is not None:
            self.parked[:] = [p for p in self.parked if not p.finished()]
            self.parked.append(self)
