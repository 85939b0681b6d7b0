"""GPU data path: device tensors across vendors through pinned shared memory, zero-copy.

Between two vendors' GPUs in one host the only shared medium is host memory. For peers on the
same host the shm transport exposes a dedicated zero-copy ring whose slots this module
registers as pinned memory (vendor.DeviceSeam.host_register): the sender copies device data
straight into a slot (D2H), the receiver copies straight out of it (H2D), so every byte crosses
PCIe once each way and the CPU copies nothing. D2H and H2D run on two streams, so the copy
engines of both directions work at once; received chunks are reduced on the device.

Ordering contract (same as algorithms/transfer.py): a received chunk is reduced into memory
only after the D2H copy of any send that reads the same memory has been issued before it on
the stream order (the H2D stream waits on that copy's event).

Peers on other hosts (tcp/ucx) take the generic path: engine.EngineCtx stages each chunk in
pinned bounce buffers.
"""
from __future__ import annotations

import ctypes
import time
from collections import deque

import torch

from ._core import CommTimeout

_REGISTERED: dict[int, list] = {}  # id(transport) -> [(base, nbytes, tensor)]


def _regions(transport, seam) -> list:
    key = id(transport)
    regs = _REGISTERED.get(key)
    if regs is None:
        regs = []
        for base, nbytes in transport.zc_regions():
            buf = (ctypes.c_uint8 * nbytes).from_address(base)
            tensor = torch.frombuffer(buf, dtype=torch.uint8)
            pinned = seam.host_register(base, nbytes)
            if not pinned:
                import logging

                logging.getLogger("hetccl").warning(
                    "hetccl: could not page-lock the zero-copy ring (%d bytes): device copies "
                    "through it run at pageable-memory speed", nbytes)
            regs.append((base, nbytes, tensor, pinned))
        _REGISTERED[key] = regs
    return regs


def forget(transport, seam) -> None:
    """Unregister a transport's rings (call before the transport closes)."""
    for base, _, _, pinned in _REGISTERED.pop(id(transport), []):
        if pinned:
            try:
                seam.host_unregister(base)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


def _slot(regs, ptr: int, nbytes: int) -> torch.Tensor:
    for base, size, tensor, _ in regs:
        if base <= ptr < base + size:
            return tensor[ptr - base:ptr - base + nbytes]
    raise RuntimeError("hetccl: zero-copy slot outside every registered region")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _TorchOps:
    """Copies and events through torch's own calls (fallback when vendor.raw_runtime() is
    None). Tokens are torch Events."""

    raw = False

    def __init__(self, d2h, h2d, red):
        self.streams = {"d2h": d2h, "h2d": h2d, "red": red}

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str) -> None:
        with torch.cuda.stream(self.streams[kind]):
            dst.copy_(src, non_blocking=True)

    def mark(self, kind: str):
        ev = torch.cuda.Event()
        ev.record(self.streams[kind])
        return ev

    def done(self, token) -> bool:
        return token.query()

    def wait(self, kind: str, token) -> None:
        self.streams[kind].wait_event(token)


class _RawOps:
    """Copies and events through the vendor runtime (vendor.RawRuntime): one ctypes call each
    instead of torch's Python wrappers. Events come from a pool owned by the engine (destroyed
    when it closes) and are
    reused from call to call. Re-recording an event is safe: a stream wait already enqueued
    keeps the state the event had when it was enqueued, and a call only queries events it
    recorded itself."""

    raw = True

    def __init__(self, rt, d2h, h2d, red, pool: list):
        self.rt = rt
        self.handles = {"d2h": d2h.cuda_stream, "h2d": h2d.cuda_stream, "red": red.cuda_stream}
        self.kinds = {"d2h": rt.D2H, "h2d": rt.H2D}
        self.pool = pool
        self.next = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str) -> None:
        self.rt.memcpy_async(dst.data_ptr(), src.data_ptr(), src.numel(), self.kinds[kind],
                             self.handles[kind])

    def mark(self, kind: str):
        if self.next == len(self.pool):
            self.pool.append(self.rt.event())
        ev = self.pool[self.next]
        self.next += 1
        self.rt.record(ev, self.handles[kind])
        return ev

    def done(self, token) -> bool:
        return self.rt.done(token)

    def wait(self, kind: str, token) -> None:
        self.rt.stream_wait(self.handles[kind], token)


def _ops(ctx, device: torch.device, d2h, h2d, red):
    from . import vendor

    rt = vendor.raw_runtime()
    if rt is None:
        return _TorchOps(d2h, h2d, red)
    return _RawOps(rt, d2h, h2d, red, ctx.engine.raw_events.setdefault(device.index, []))


def device_transfer(ctx, phase: int, sends, recvs, op, seam, slot_bytes: int) -> None:
    """transfer() for device tensors whose peers all have a zero-copy ring."""
    from .engine import reduce_into

    bridge = ctx.engine.bridge
    comm = torch.cuda.current_stream()
    d2h, h2d, red = ctx.engine.copy_streams(comm.device)
    start = torch.cuda.Event()
    start.record(comm)
    for s in (d2h, h2d, red):
        s.wait_event(start)
    ops = _ops(ctx, comm.device, d2h, h2d, red)
    ctx.engine.stats["raw_runtime"] = ops.raw

    per_peer = {}
    send_ptrs = set()

    def chunks(peer, lo, hi, view, kind):
        es = view.element_size()
        per = max(1, slot_bytes // es)
        q = per_peer.setdefault(peer, {"send": deque(), "recv": deque(), "ps": deque(),
                                       "pr": deque(), "k": {"send": 0, "recv": 0}})
        for a in range(lo, hi, per):
            b = min(a + per, hi)
            k = q["k"][kind]
            q["k"][kind] = k + 1
            v = view[a - lo:b - lo]
            q[kind].append((ctx.tag(phase, k), v))
            if kind == "send":
                send_ptrs.add(v.data_ptr())

    for peer, lo, hi, view in sorted(sends, key=lambda s: (s[0], s[1])):
        chunks(peer, lo, hi, view, "send")
    for peer, lo, hi, view in sorted(recvs, key=lambda s: (s[0], s[1])):
        chunks(peer, lo, hi, view, "recv")
    regs = {p: _regions(bridge.transport_of(p), seam) for p in per_peer}
    sent_events: dict[int, object] = {}
    nslots = min(bridge.transport_of(p).zc_depth(p) for p in per_peer) if per_peer else 1
    # Received chunks to reduce land in bounce buffers (2 x nslots per peer, reused in turn);
    # each remembers the reduction that last read it, which the next H2D into it waits for.
    bounce: dict[tuple, tuple] = {}
    nbounce = 2 * nslots
    received = {p: 0 for p in per_peer}

    idle = 0
    # Reductions (the only kernels launched here) run on their own stream: the H2D stream only
    # copies, so a slot is released as soon as its bytes are on the device.
    with torch.cuda.stream(red):
        while True:
            progressed, busy = False, False
            for peer, q in per_peer.items():
                t = bridge.transport_of(peer)
                # 1. D2H into free slots of the ring to peer
                while q["send"] and len(q["ps"]) < nslots:
                    ptr, cap = t.zc_send_try(peer)  # never waits: this loop serves every ring
                    if not ptr:
                        break
                    tag, v = q["send"].popleft()
                    src = _bytes(v)
                    if src.numel() > cap:
                        raise RuntimeError(f"hetccl: chunk of {src.numel()} bytes exceeds the "
                                           f"zero-copy slot ({cap} bytes)")
                    ops.copy(_slot(regs[peer], ptr, src.numel()), src, "d2h")
                    ev = ops.mark("d2h")
                    sent_events[v.data_ptr()] = ev
                    q["ps"].append((ev, src.numel(), tag))
                    ctx.engine.stats["zero_copy_bytes"] += src.numel()
                    progressed = True
                # 2. commit slots whose copy finished, in order
                while q["ps"] and ops.done(q["ps"][0][0]):
                    _, n, tag = q["ps"].popleft()
                    t.zc_send_commit(peer, n, tag)
                    progressed = True
                # 3. H2D out of filled slots from peer
                while q["recv"] and len(q["pr"]) < nslots:
                    tag, v = q["recv"][0]
                    if op is not None and v.data_ptr() in send_ptrs and \
                            v.data_ptr() not in sent_events:
                        break  # its own send has not been issued yet: reduce must follow it
                    ptr, n, got_tag = t.zc_recv_try(peer)
                    if not ptr:
                        break
                    q["recv"].popleft()
                    dst = _bytes(v)
                    if got_tag != tag or n != dst.numel():
                        raise RuntimeError(f"hetccl: zero-copy stream from rank {peer} out of "
                                           f"step: expected tag {tag} with {dst.numel()} bytes, "
                                           f"got tag {got_tag} with {n} bytes")
                    slot = _slot(regs[peer], ptr, n)
                    if op is None:
                        ops.copy(dst, slot, "h2d")
                    else:
                        key = (peer, received[peer] % nbounce)
                        received[peer] += 1
                        buf, last = bounce.get(key, (None, None))
                        if buf is None or buf.numel() < n:
                            buf = torch.empty(max(n, slot_bytes), dtype=torch.uint8,
                                              device=v.device)
                        elif last is not None:
                            ops.wait("h2d", last)  # the reduction that read it has run
                        tmp = buf[:n]
                        ops.copy(tmp, slot, "h2d")
                        copied = ops.mark("h2d")
                        ops.wait("red", copied)
                        sev = sent_events.get(v.data_ptr())
                        if sev is not None:
                            ops.wait("red", sev)  # our own send of this range has read it
                        reduce_into(v, tmp.view(v.dtype), op)
                        bounce[key] = (buf, ops.mark("red"))
                        q["pr"].append(copied)
                        progressed = True
                        continue
                    q["pr"].append(ops.mark("h2d"))
                    progressed = True
                # 4. release slots whose copy finished, in order
                while q["pr"] and ops.done(q["pr"][0]):
                    q["pr"].popleft()
                    t.zc_recv_release(peer)
                    progressed = True
                if q["send"] or q["recv"] or q["ps"] or q["pr"]:
                    busy = True
            if not busy:
                break
            if progressed:
                idle = 0
            else:
                idle += 1
                if time.monotonic() > ctx.deadline:
                    waiting = [p for p, q in per_peer.items()
                               if q["send"] or q["recv"] or q["ps"] or q["pr"]]
                    raise CommTimeout(f"hetccl: timed out moving device data with peer ranks "
                                      f"{waiting}")
                # spin while copies are short-lived, then wait a little on the transport (GIL
                # released; it also notices a dead or closed peer: PeerFailure)
                if idle > 2000:
                    for peer, q in per_peer.items():
                        if q["send"] or q["recv"] or q["ps"] or q["pr"]:
                            bridge.transport_of(peer).zc_wait(peer, 0)
                            break
    # later work on the comm stream sees the copied and reduced data
    for s in (h2d, d2h, red):
        done = torch.cuda.Event()
        done.record(s)
        comm.wait_event(done)
    for buf, _ in bounce.values():
        buf.record_stream(h2d)
