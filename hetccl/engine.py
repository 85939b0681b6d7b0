"""Scheduling of one multi-vendor group's collectives, and the CollCtx the algorithms see.

An Engine belongs to one multi-vendor process group. It owns the group's topology, the native
communicator of this rank's vendor group, the bridge (the C++ transports to the other vendor
groups) and the C++ progress engine (hetccl._C.Engine, csrc/engine.h) that moves every
cross-vendor byte of a collective and the point-to-point messages of device tensors (host
point-to-point goes to the bridge's transports directly, backend.py): the algorithms
(hetccl/algorithms) decide what crosses vendors and hand each cross-vendor step to it as one
plan; no Python runs per chunk.

Ordering contract: the collectives of a group run in issue order on every rank, so sequence
numbers -- and therefore tags (tags.py) and ring positions -- agree without negotiation.
  * Device collectives run inline on the calling thread: they only enqueue stream work (native
    steps, the engine's copies and flag operations) and return in microseconds; the Work's
    future completes on the comm stream (device/cuda.py), so the caller's stream is what waits.
  * Synchronous host collectives run inline when nothing is queued (no thread hand-off); the
    calling thread drives the C++ engine while it waits (GIL released).
  * Asynchronous host collectives run on the group's worker thread, in order. A collective
    issued while the worker still has work queued is queued behind it, device ones too.
Failure: a communication error (peer death, timeout, protocol error) makes the group unusable:
later operations fail at once naming the first failure, never a hang. Argument errors
(checks.py) raise ValueError on every rank and leave the group usable.
"""
from __future__ import annotations

import atexit
import collections
import logging
import queue
import re
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch

from . import checks, config, device as devices, hostmem, tags, tuning
from .algorithms import overrides as algo_overrides
from ._core import HOST_REDUCE_DTYPES, CommError, _C
from .bridge import Bridge, torch_dtype_name
from .native import NativeGroup
from .topology import Topology, butterfly_masks
from .work import DeviceWork, HetcclWork, StreamWork

log = logging.getLogger("hetccl")

# How long a closing group waits for its device plans and messages still in flight.
DRAIN_MS = 5000

# Stats of the C++ engine under the names tests and `hetccl doctor` read.
STAT_NAMES = {"zero_copy_bytes": "zc_device_bytes", "pair_kernel_bytes": "roundtrip_bytes"}


# Every engine still open. At interpreter exit they are closed from an atexit hook, that is
# before Python starts finalizing. Contract: once Python finalizes, no hetccl thread may be
# inside C++ code that re-takes the GIL. A thread that tries to take the GIL during
# finalization is ended with pthread_exit (Python 3.11), and that forced unwind aborts the
# process ("terminate called without an active exception") if it passes a noexcept frame.
# torch's Future.set_result releases and re-takes the GIL in such a frame, so a worker that
# just completed the last Work of a script (whose main thread woke and ran to the end at
# once) killed the process at exit. Closing here lets the worker finish its item, see the
# stop marker and end while the GIL can still be taken.
_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for e in list(_LIVE):
        try:
            e.close()
        except Exception:  # noqa: BLE001 - best effort at exit; the process is ending
            pass
    # the any-source receive threads (backend._PostedRecv) wait inside torch's Work.wait, which
    # re-takes the GIL the same way; closing the native groups above ended their waits
    for t in threading.enumerate():
        if t.name.startswith("hetccl-recv-any-") and t is not threading.current_thread():
            t.join(timeout=2)


atexit.register(_close_all_at_exit)


class Engine:
    def __init__(self, store, rank: int, size: int, timeout: timedelta, topo: Topology,
                 name: str = ""):
        self.rank, self.size, self.timeout, self.topo, self.name = rank, size, timeout, topo, name
        self.local = None
        self.bridge = None
        self.core = None
        self._seq = 0
        self._broken: BaseException | None = None
        self._closed = False
        # read once: the bridge checked across ranks at start that they agree (config.MUST_AGREE)
        self.check_mode = config.get("HETCCL_CHECK_ARGS")
        self.host_kernel = bool(config.get("HETCCL_HOST_KERNEL"))
        self.timeout_ms = int(timeout.total_seconds() * 1000)
        self.algo_overrides = algo_overrides()
        self.algo_runs: collections.Counter = collections.Counter()  # EngineCtx.count
        self.check_runs: collections.Counter = collections.Counter()  # bridge / native checks
        # rounds of the argument check through the bridge (topology.butterfly_masks), or None:
        # then a native all-gather inside the vendor group (checks.within_group)
        self.check_masks = butterfly_masks(topo.groups)
        self._check_table = hostmem.empty((size, 1 + checks.HEADER_LEN), torch.int64)
        self._check_rows: dict[tuple, tuple] = {}  # signature -> (table row, compared columns)
        self._headers: dict[tuple, tuple] = {}  # call -> (header, mask, signature key, tag bits)
        self._device_ops: dict[str, Any] = {}
        # this group's own streams: comm/side per device, message streams per (device, kind)
        self._launches: dict[Any, Any] = {}
        self._messages_ok: dict[tuple, bool] = {}  # (device type, index) -> stream memory ops
        try:
            if topo.local_size > 1:
                self.local = NativeGroup(store, topo.labels[topo.my_group], topo.local_rank,
                                         topo.local_size, timeout)
            self.bridge = Bridge(store, topo, timeout)
            self.core = _C.Engine(
                {p: self.bridge.transport_of(p) for p in self.bridge.linked}, rank,
                int(config.get("HETCCL_REDUCE_THREADS")), list(self.bridge.peers),
                [list(g) for g in topo.groups], list(topo.group_of), checks.FIELD_NAMES,
                self.bridge.slot_bytes, self.bridge.staging_slots, 8,
                tuning.HOST, tuning.DEVICE, tuning.MESSAGE,
                int(config.get("HETCCL_CHUNK_BYTES")),
                config.get("HETCCL_ASYNC_ERROR_HANDLING") == "abort",
                [p for p in self.bridge.peers if self.bridge.device_direct[p]])
        except BaseException:
            self.close()
            raise
        # Every rank linked to every rank by a shared-memory ring (one host; bridge.group_links
        # or groups of one): host collectives run on the engine alone (algorithms/linked.py),
        # and, where same-vendor peers are linked, the argument check is one exchange of the
        # headers over those links instead of a native all-gather in each vendor group.
        self.all_linked = self.bridge.all_linked  # the same on every rank (bridge.py)
        self.check_linked = self.all_linked and self.bridge.groups_linked
        self._q: queue.Queue = queue.Queue()
        self._exec = threading.Lock()
        self._queued = 0  # items put on the queue and not yet executed (under _exec)
        self._worker = threading.Thread(target=self._run, name=f"hetccl-{name or rank}",
                                        daemon=True)
        self._worker.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ state
    @property
    def stats(self) -> dict[str, int]:
        raw = dict(self.core.stats()) if self.core is not None else {}
        out = dict(raw)
        for name, key in STAT_NAMES.items():
            out[name] = raw.get(key, 0)
        out.update({f"algo_{k}": v for k, v in self.algo_runs.items()})
        out.update({f"check_{k}": v for k, v in self.check_runs.items()})
        return out

    def raise_if_broken(self) -> None:
        """Raises the failure that broke the group (also one found asynchronously by the C++
        engine after a device collective was issued)."""
        if self._broken is None and self.core is not None:
            msg = self.core.broken()
            if msg and not self._closed:
                self._broken = CommError(msg)
        if self._broken is not None:
            raise CommError(f"hetccl: process group {self.name!r} is unusable after an earlier "
                            f"failure: {self._broken}")

    def device_ops(self, device_type: str):
        """The vendor runtime of a device type, registered with the C++ engine once."""
        ops = self._device_ops.get(device_type)
        if ops is None:
            ops = devices.seam(device_type).runtime()
            self.core.set_device_ops(ops)
            self._device_ops[device_type] = ops
        return ops

    # ------------------------------------------------------------------ scheduling
    def _run(self) -> None:
        # Bodies write into the callers' tensors outside autograd, as c10d's C++ backends do
        # (backend.outside_autograd); grad mode is per thread and on in a new one.
        torch.set_grad_enabled(False)
        while True:
            item = self._q.get()
            if item is None:
                return
            with self._exec:
                try:
                    self._execute(*item)
                finally:
                    self._queued -= 1
            # the item's closure holds the collective's tensors: let go before blocking on the
            # queue, or they stay alive until the next operation is queued
            item = None

    def _execute(self, fn, fut, outputs, launch) -> None:
        try:
            self.raise_if_broken()
            if launch is not None:
                with launch:
                    fn(launch)
                    fut.set_result(outputs)
            else:
                fn(None)
                fut.set_result(outputs)
        except (ValueError, TypeError, NotImplementedError) as e:
            # argument errors: every rank reached the same verdict, the group stays usable
            fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001
            if self._broken is None:
                # a copy of its own: the one handed to the caller gets the frames of wherever
                # it is raised attached, this one stays without
                self._broken = self._with_hosts(e)
                log.error("hetccl: rank %d: %s", self.rank, self._broken)
            fut.set_exception(self._with_hosts(e))

    def _with_hosts(self, e: BaseException) -> BaseException:
        """The failure as the caller and later operations see it: a new exception of the same
        type whose text adds the host of every rank it names ("peer rank 3" -> "... [rank 3:
        host h1, pid 1234]"; an error of the native library, which names no rank, gets the
        ranks and hosts of this vendor group), without the original traceback, whose frames
        would keep this collective's tensors and scratch alive as long as the group remembers
        its first failure (self._broken). Other RuntimeErrors are copied with their text as it
        is; other exceptions pass unchanged."""
        if not isinstance(e, RuntimeError) or isinstance(e, NotImplementedError):
            return e
        text = str(e)
        native = (isinstance(e, torch.distributed.DistError)
                  or any(k in text.lower() for k in devices.native_names()))
        if "[rank " not in text and (isinstance(e, CommError) or native):
            if isinstance(e, CommError):
                named = sorted({int(m) for m in re.findall(r"rank (\d+)", text)
                                if int(m) < self.size and int(m) != self.rank})
                where = ""
            else:
                named = [r for r in self.topo.local_ranks if r != self.rank]
                where = f"native group of vendor {self.topo.labels[self.topo.my_group]}: "
            if named:
                text += " [" + where + "; ".join(
                    f"rank {r}: host {self.topo.infos[r].hostname or '?'}, pid "
                    f"{self.topo.infos[r].pid}" for r in named) + "]"
        try:
            return type(e)(text)
        except Exception:  # noqa: BLE001 - an exception type with another constructor
            return e

    def submit(self, fn: Callable[[Any], None], outputs: Any, tensors: list[torch.Tensor],
               async_op: bool = True) -> HetcclWork:
        """Runs fn(launch) in issue order (see the module docstring); returns its Work."""
        if self._closed:
            raise RuntimeError("hetccl: operation on a process group that was shut down")
        dev = next((t.device for t in tensors if t.device.type != "cpu"), None)
        launch = None
        if dev is not None:
            seam = devices.seam(dev.type)
            refuse_capture(seam, "collective")
            self.device_ops(dev.type)
            launch = seam.launch(dev, tensors, self._launches, self.core.stream_join)
            work = fut = DeviceWork(self, launch, outputs)
            inline = True
        else:
            fut = torch.futures.Future()
            work = HetcclWork(fut, outputs)
            inline = not async_op
        item = (fn, fut, outputs, launch)
        # Inline only when no queued item is pending: _queued drops only after the worker has
        # executed an item (under _exec), so an item the worker has taken off the queue but not
        # run yet still counts, and the issue order holds.
        with self._exec:
            if inline and self._queued == 0:
                self._execute(*item)
                return work
            self._queued += 1
            if launch is not None:
                work._issued = threading.Event()
            self._q.put(item)
        return work

    # ------------------------------------------------------------------ point to point
    def messages_apply(self, device: torch.device) -> bool:
        """Whether device tensors on `device` take the engine's message path (its runtime has
        stream memory operations); else the face stages them through host memory."""
        key = (device.type, device.index)
        ok = self._messages_ok.get(key)
        if ok is None:
            ops = self.device_ops(device.type)
            idx = device.index if device.index is not None else 0
            ok = self._messages_ok[key] = bool(config.get("HETCCL_DEVICE_MESSAGES")) and bool(
                ops.stream_mem_ops(idx))
        return ok

    def device_message(self, send: bool, peer: int, t: torch.Tensor, tag: int) -> StreamWork:
        """Point-to-point of a device tensor with cross-vendor `peer`, stream-ordered
        (csrc/engine_messages.cc): one tagged message with tag `tag` (wire-identical to the
        host path's), moved through engine-owned pinned staging by copies enqueued on this
        group's message stream of the device, which first waits for the caller's current
        stream. Returns at once; the Work's wait() orders the caller's stream after it."""
        self.raise_if_broken()
        if self._closed:
            raise RuntimeError("hetccl: operation on a process group that was shut down")
        seam = devices.seam(t.device.type)
        refuse_capture(seam, "send" if send else "recv")
        self.device_ops(t.device.type)
        # a non-contiguous tensor goes through a contiguous copy: made on the caller's stream
        # before the message stream joins it (send), copied back on the message stream (recv)
        buf = t if t.is_contiguous() else (t.contiguous() if send else
                                           torch.empty(t.shape, dtype=t.dtype, device=t.device))
        launch = seam.launch(t.device, [t] if buf is t else [t, buf], self._launches,
                             self.core.stream_join,
                             kind="send" if send else "recv")
        nbytes = buf.numel() * buf.element_size()
        what = f"{'send to' if send else 'recv from'} rank {peer}"
        self.core.post([(peer, send, buf.data_ptr(), nbytes)], tag, 0, "sum", "uint8", False,
                       False, 0, self.timeout_ms, what, False, [], 0, "", False, 0, False, True,
                       launch.index, launch.comm_handle, 0, message=True)
        if buf is not t and not send:
            with launch:
                t.copy_(buf)
        return StreamWork(self, launch, launch.record(), [t])

    def host_send(self, peer: int, flat: torch.Tensor, tag: int):
        """Point-to-point of host memory with cross-vendor `peer` (or a same-vendor one linked
        by the bridge: group_peers): one tagged message of `flat` (contiguous, 1-D), posted on
        the peer's transport at once; returns the request (wait(deadline) -> bytes, test(),
        finished(), unpost() for receives). Wire-identical to device_message's."""
        return self.bridge.isend(peer, flat, tag)

    def host_recv(self, peer: int, flat: torch.Tensor, tag: int):
        """The receive side of host_send: posted into `flat` at once."""
        return self.bridge.irecv(peer, flat, tag)

    @property
    def group_peers(self) -> set:
        """Same-vendor ranks whose host messages and collectives go over the bridge's links
        (bridge.group_links: one host) instead of the native library."""
        return self.bridge.group_peers

    def transport_kinds(self) -> list[str]:
        """The bridge transports this rank runs (for the start line and doctor-like reports)."""
        return sorted(set(self.bridge.kind_of.values()))

    def join_current(self, launch) -> None:
        """The caller's current stream waits for everything queued on the launch's comm stream."""
        self.core.stream_join(launch.index, launch.current_handle(), launch.comm_handle)

    def next_ctx(self, device: torch.device, launch) -> "EngineCtx":
        """A context with a fresh sequence number and deadline (called in issue order)."""
        self._seq += 1
        return EngineCtx(self, self._seq, time.monotonic() + self.timeout.total_seconds(),
                         device, launch)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        worker = getattr(self, "_worker", None)
        if worker is threading.current_thread():
            worker = None  # closed from its own thread (a __del__ run there): cannot join
        if worker is not None:
            self._q.put(None)  # after the queued items: they finish first (bounded below)
            worker.join(timeout=5)
        if self.core is not None:
            if self._broken is None and self._device_ops:
                # device collectives and messages issued just before the group is destroyed
                # (an isend never waited for, say) still reach their peers: bounded
                self.core.drain(DRAIN_MS)
            self.core.close()
            if self._device_ops:
                # The rings' registrations with the device runtime go before the bridge
                # unmaps the rings: a registration left behind (the core is freed only when
                # Python drops it) would cover the next group's segment mapped at the same
                # address, which the runtime then refuses to register, so device copies would
                # reach the old pages (engine.h, unregister_rings). Only once the group's
                # streams ran everything queued on them (bounded): else left to the core's
                # destructor, as before.
                if all(launch.idle(DRAIN_MS / 1000) for launch in self._launches.values()):
                    self.core.unregister_rings()
                else:
                    log.warning("hetccl: a stream of the destroyed group still has queued work; "
                                "its ring registrations stay until the engine is freed")
        if self.bridge is not None:
            self.bridge.close()
        if self.local is not None:
            self.local.close()
        if worker is not None and worker.is_alive():
            # it was still inside a collective: closing the core, the bridge and the native
            # group failed it, so it ends now
            worker.join(timeout=5)


def refuse_capture(seam, what: str) -> None:
    """A cross-vendor operation cannot be part of a device graph (seam.graph_name): the engine's
    proxy plays the host side of every device plan when it is issued, and a replay would run
    against flag positions that no longer hold. Refused before anything is enqueued or
    exchanged, so every rank that captures raises alike and the group stays usable (each rank
    decides from its own capture state: a program that captures on some ranks only is not
    supported)."""
    if seam.capturing():
        raise RuntimeError(
            f"hetccl: a cross-vendor {what} cannot be captured in a {seam.graph_name} (the "
            f"current stream is capturing); run it outside the graph, or capture only the "
            f"vendor-local part (a one-vendor group is the native library and captures as it "
            f"does)")


class EngineCtx:
    """The CollCtx (algorithms/common.py) of one collective, for host and device tensors."""

    def __init__(self, engine: Engine, seq: int, deadline: float, device: torch.device,
                 launch):
        self.engine = engine
        self.topo = engine.topo
        self.local = engine.local
        self.seq = seq
        self.deadline = deadline
        self.device = device
        self.launch = launch
        self.all_linked = engine.all_linked
        self.what = "collective"
        self._header = None  # the check header the next transfer carries
        self._sig = 0        # tags.signature of this collective's header (in every data tag)

    def tag(self, phase: int, index: int) -> int:
        return tags.collective(self.seq, phase, self._sig) | index

    # ------------------------------------------------------------------ argument checks
    def begin(self, coll: str, numel: int, dtype: torch.dtype, op: str | None = None,
              root: int = -1, same_numel: bool = True,
              refusal: BaseException | None = None) -> None:
        """Checks this collective's arguments across ranks (checks.py). Raises ValueError on
        every rank when they differ and the check waits for the headers.

        refusal: this rank's own verdict on arguments only it can see (an output of the wrong
        size): its header then carries checks.REFUSED as the element count (as the dtype where
        counts are not compared: all_to_all), so every other rank's check fails naming this
        rank, and this rank raises `refusal` itself -- no rank goes on to wait for data that
        never comes."""
        e = self.engine
        self.what = coll
        if refusal is not None:
            if same_numel:
                numel = checks.REFUSED
            else:
                dtype = None
        try:
            self._begin(coll, numel, dtype, op, root, same_numel)
        except (ValueError, TypeError):
            if refusal is not None:
                raise refusal from None
            raise
        if refusal is not None:
            try:
                self.flush()  # a header still pending (it rides with data elsewhere): sent now
            except (ValueError, TypeError):
                pass  # the mismatch the refusal caused: this rank raises its own reason
            raise refusal

    def _begin(self, coll: str, numel: int, dtype: torch.dtype, op: str | None,
               root: int, same_numel: bool) -> None:
        e = self.engine
        if e.check_mode == "off":
            return
        if self._header is not None:
            # every begin() sends exactly one header (a body may check several tensors, and a
            # rank may have had no cross-vendor transfer for the previous one)
            self.flush()
        key = (coll, numel, dtype, op, root, self.device.type, same_numel)
        cached = e._headers.get(key)
        if cached is None:
            mine = checks.header(coll, numel, dtype, op, root, self.device)
            mask = checks.MASK_ALL if same_numel else checks.MASK_NO_NUMEL
            cached = e._headers[key] = (
                mine, mask, (tuple(mine), mask),
                tags.signature([v for f, v in enumerate(mine) if mask & (1 << f)]))
        mine, mask, sig, self._sig = cached
        # Whether this rank holds the collective until every rank's arguments are known. The
        # choice must be the same on every rank whatever each rank called before, so it depends
        # only on the mode (equal on every rank: config.MUST_AGREE) and the device type (which
        # the header compares): never on a rank's own history. A per-signature cache ("this rank
        # checked these arguments before") let a rank that had used its size skip the wait
        # while a rank with a new size waited; the two then ran different protocols.
        wait = self.launch is None or e.check_mode != "async"
        err = None
        if wait and e.check_linked:
            # every rank has a link to every rank: one exchange of the header rows gives
            # every rank the whole table (host and device tensors alike; the same branch on
            # every rank: topology and mode)
            row, cols = self._check_row(sig, mine, mask)
            table = e._check_table
            table.fill_(checks.UNKNOWN)
            table[self.topo.rank] = row
            nb = row.numel() * row.element_size()
            items = []
            for p in range(self.topo.size):
                if p != self.topo.rank:
                    items += [(p, True, row.data_ptr(), nb), (p, False, table[p].data_ptr(), nb)]
            self._post(items, 0, None, None, False,
                       tag=(tags.check_round(self.seq, 0), tags.CHECK_INDEX_BITS,
                            f"argument check of {coll} #{self.seq}"))
            err = checks.bridge_verdict(coll, table, cols, mask)
            e.check_runs["linked"] += 1
            if err:
                raise ValueError(err)  # every rank has the same table: the same error
            return
        if wait and e.check_masks is not None:
            # every rank takes this branch alike (topology and mode), host and device alike
            row, cols = self._check_row(sig, mine, mask)
            table = checks.all_headers_over_bridge(
                e._check_table, row, self.topo.groups, self.topo.my_group,
                self.topo.local_rank, self.topo.rank, e.check_masks, self._check_exchange)
            err = checks.bridge_verdict(coll, table, cols, mask)
            e.check_runs["bridge"] += 1
            if err:
                raise ValueError(err)  # every rank has the same table: the same error
            return  # checked everywhere: no header rides with the data
        if wait and self.local is not None:
            err = checks.within_group(self.local, self.topo.local_ranks, mine, coll, mask)
            e.check_runs["native"] += 1
        self._header = (mine, mask, err or "", wait, wait, sig)
        if err:
            self.flush()  # tells the other groups, then raises the same error here

    def _check_row(self, sig, mine, mask):
        """(this rank's table row, the compared columns) of a signature, made once."""
        e = self.engine
        got = e._check_rows.get(sig)
        if got is None:
            got = e._check_rows[sig] = (
                hostmem.tensor([1] + list(mine), torch.int64),
                hostmem.tensor([0] + [f + 1 for f in range(checks.HEADER_LEN) if mask & (1 << f)],
                               torch.int64))
        return got

    def _check_exchange(self, rnd: int, peer: int, table: torch.Tensor) -> None:
        """One round of the argument check through the bridge: merges the partner's table into
        this rank's (elementwise max, checks.all_headers_over_bridge), on both ends alike.
        Control-phase tags. On a zero-copy link it is the two-rank round trip with MAX (C++,
        on this thread); elsewhere the tables are swapped and merged here."""
        e = self.engine
        tag = (tags.check_round(self.seq, rnd), tags.CHECK_INDEX_BITS,
               f"argument check of {self.what} #{self.seq}")
        flat = table.view(-1)
        if e.host_kernel and e.bridge.zero_copy([peer]):
            mid = flat.numel() // 2
            own, other = (flat[:mid], flat[mid:]) if self.topo.rank < peer else (
                flat[mid:], flat[:mid])
            self._post([(peer, True, other.data_ptr(), other.numel() * 8),
                        (peer, False, own.data_ptr(), own.numel() * 8)], 0, "max", None, False,
                       dtype=torch.int64, roundtrip=True, chunk=tuning.ROUNDTRIP_CHUNK, tag=tag)
            return
        got = torch.empty_like(table)
        nbytes = table.numel() * 8
        self._post([(peer, True, table.data_ptr(), nbytes), (peer, False, got.data_ptr(), nbytes)],
                   0, None, None, False, tag=tag)
        torch.maximum(table, got, out=table)

    def check_settled(self) -> bool:
        """Whether no argument-check verdict of this collective is still to come: the check
        completed at begin() (or is off). False while the header rides with the data (a native
        check inside the vendor group, then the other groups' verdict with their transfer):
        a body that would overwrite its input before moving data then works on a copy."""
        return self._header is None

    def _take_header(self):
        h, self._header = self._header, None
        return h

    def flush(self) -> None:
        """Sends a header still pending (this rank had no cross-vendor transfer in the
        collective) so that every peer's check completes."""
        h = self._take_header()
        if h is not None:
            self._post([], 0, None, h, dev=self.launch is not None)

    # ------------------------------------------------------------------ data movement
    def _post(self, items, phase: int, op: str | None, header, dev: bool, dtype=None,
              roundtrip: bool = False, chunk: int = 0, tag=None) -> int:
        """One engine plan. tag: (tag base, index bits, name) instead of the data phase's
        (the argument check's control-phase rounds)."""
        e = self.engine
        core = e.core
        mine, mask, err, for_group, wait, sig = header if header else ([], 0, "", False, False, None)
        launch = self.launch if dev else None
        if dev:
            e.device_ops(self.device.type)
        reduce = op is not None and not dev
        dname = _DTYPE_NAMES.get(dtype) or ("uint8" if dtype is None else torch_dtype_name(dtype))
        left = max(0, int((self.deadline - time.monotonic()) * 1000))
        tag_base, index_bits, what = tag or (tags.collective(self.seq, phase, self._sig),
                                             tags.INDEX_BITS, f"{self.what} #{self.seq}")
        pid = core.post(items, tag_base, index_bits, op or "sum", dname, reduce, roundtrip, chunk,
                        left, what, header is not None,
                        mine, mask, err, for_group, tags.header(self.seq), wait, dev,
                        launch.index if launch else 0, launch.comm_handle if launch else 0,
                        launch.side_handle if launch else 0)
        if not dev:
            core.wait(pid)
        return pid

    def transfer(self, phase: int, sends, recvs, op: str | None = None) -> None:
        """CollCtx.transfer (algorithms/common.py): one plan for the C++ engine."""
        views = [v for *_, v in sends] + [v for *_, v in recvs]
        if not views:  # nothing crosses vendors from this rank: the check header still does
            self.flush()
            return
        dev = views[0].device.type != "cpu"
        items = []
        for peer, _, _, view in sorted(sends, key=lambda s: (s[0], s[1])):
            if view.numel():
                items.append((peer, True, view.data_ptr(), view.numel() * view.element_size()))
        # Reductions the engine cannot do itself (device data; dtypes without a C++ kernel)
        # receive into scratch buffers and are reduced here once the data is in.
        in_engine = op is not None and not dev and (
            torch_dtype_name(views[0].dtype) in HOST_REDUCE_DTYPES)
        scratch = []
        for peer, _, _, view in sorted(recvs, key=lambda s: (s[0], s[1])):
            if not view.numel():
                continue
            target = view
            if op is not None and not in_engine:
                target = torch.empty_like(view)
                scratch.append((view, target))
            items.append((peer, False, target.data_ptr(), view.numel() * view.element_size()))
        header = self._take_header()
        self._post(items, phase, op if in_engine else None, header, dev,
                   dtype=views[0].dtype if views else None)
        for view, buf in scratch:
            reduce_into(view, buf, op)

    def pair_allreduce(self, peer: int, give: torch.Tensor, keep: torch.Tensor, op: str,
                       phase: int = 0) -> bool:
        """Two-rank round-trip all-reduce of give|keep with `peer` (engine.h, roundtrip); False
        when it does not apply (device tensors, no zero-copy ring, a dtype without a C++ kernel,
        HETCCL_HOST_KERNEL=0) and the caller takes the general path."""
        if (self.launch is not None or not self.engine.host_kernel
                or torch_dtype_name(keep.dtype) not in HOST_REDUCE_DTYPES
                or not self.engine.bridge.zero_copy([peer])):
            return False
        es = keep.element_size()
        items = [(peer, True, give.data_ptr(), give.numel() * es),
                 (peer, False, keep.data_ptr(), keep.numel() * es)]
        self._post([i for i in items if i[3]], phase, op, self._take_header(), False,
                   dtype=keep.dtype, roundtrip=True, chunk=tuning.ROUNDTRIP_CHUNK)
        return True

    def reduce_into(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
        reduce_into(dst, src, op)

    def zero_copy(self, peers) -> bool:
        return self.engine.bridge.zero_copy(peers)

    def count(self, what: str) -> None:
        self.engine.algo_runs[what] += 1

    def wait_native(self, work) -> None:
        # host: blocks until the native collective is done; device: orders the current (comm)
        # stream after it, the host does not wait
        work.wait()


_DTYPE_NAMES = {d: torch_dtype_name(d) for d in checks.DTYPES}

_TORCH_OPS = {
    "sum": lambda d, s: d.add_(s),
    "prod": lambda d, s: d.mul_(s),
    "min": lambda d, s: torch.minimum(d, s, out=d),
    "max": lambda d, s: torch.maximum(d, s, out=d),
    "band": lambda d, s: d.bitwise_and_(s),
    "bor": lambda d, s: d.bitwise_or_(s),
    "bxor": lambda d, s: d.bitwise_xor_(s),
}


_THREADS: list[int] = []


def _reduce_threads() -> int:
    if not _THREADS:
        _THREADS.append(int(config.get("HETCCL_REDUCE_THREADS")))
    return _THREADS[0]


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = op(dst, src), elementwise. Host tensors of the core's dtypes use the C++ kernels;
    device tensors and other dtypes use torch's own kernels (on the current stream)."""
    if dst.numel() == 0:
        return
    if dst.device.type != "cpu":
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=False)
        _TORCH_OPS[op](dst, src)
        return
    name = torch_dtype_name(dst.dtype)
    if name in HOST_REDUCE_DTYPES and op in ("sum", "prod", "min", "max"):
        _C.reduce_into(op, name, dst.data_ptr(), src.data_ptr(), dst.numel(), _reduce_threads())
    elif dst.dtype == torch.bool and op in ("sum", "max", "prod", "min"):
        r = {"sum": torch.logical_or, "max": torch.logical_or, "prod": torch.logical_and,
             "min": torch.logical_and}[op]
        r(dst, src, out=dst)
    else:
        _TORCH_OPS[op](dst, src)
