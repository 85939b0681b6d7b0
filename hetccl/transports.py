"""Which bridge transport carries each cross-vendor pair, chosen from the transports' declared
capabilities (docs/transports.md, "Choosing a transport").

Each transport file in csrc/ declares what it can do next to its factory (TransportCaps in
csrc/transport.h: reaches peers on this host / other hosts, memory it accepts, preference) and
registers both with one line; `_C.transport_table()` lists them. This module is the one place
that turns those tables into choices, like NCCL asking each transport's canConnect:

* every rank publishes its own table (its build may differ: one rank without UCX, another
  whose UCX handles device memory);
* a pair (a, b) gets the transport both tables list that reaches the pair's locality, with the
  lowest preference -- a pair's preference is the larger of its two ranks' values, ties by
  name -- so both ends choose alike from the same two tables;
* HETCCL_TRANSPORT=<name> forces one transport, validated for every pair (a clear error names
  the pair it cannot serve and why);
* device memory goes to the transport directly when both ends' tables list their own device's
  memory type for it (UCX with cuda_copy / rocm_copy), else through the engine's host staging.

Everything here is a pure function of the exchanged tables, so every rank derives the same
matrix and raises the same error.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from . import config, device as devices

#: UCX transports that move data between two devices' memories, or map another process's device
#: memory (IPC, GDRCopy): never between emulated vendor groups on one host, whose devices a real
#: vendor pair would not share.
UCX_DEVICE_PATHS = devices.ucx_device_paths()  # every vendor's (the device seams')
#: UCX's shared-memory transports: removed too when hosts are emulated (HETCCL_EMULATE_HOSTS), so
#: that the emulated hosts share only the network.
UCX_SHM_PATHS = ("posix", "sysv", "xpmem", "cma", "knem")


#: UCX's copy transports between device and host memory: needed only where device memory is handed
#: to UCX (the direct path). Without it they are removed: the engine's staging hands UCX host
#: memory only, and a context that lists cuda_copy checks every buffer's memory type (UCX's
#: memory-type cache lookup on every post; UCX issue 11652: lower throughput where it carries no
#: traffic) and calls the CUDA driver from UCX's threads.
UCX_COPY_PATHS = devices.ucx_copy_paths()  # every vendor's (the device seams')


def ucx_copy_exclusions(any_direct: bool) -> list[str]:
    """UCX's device copy transports to remove from this rank's UCX context: all of them unless
    one of its UCX peers gets device memory directly (``any_direct``)."""
    return [] if any_direct else list(UCX_COPY_PATHS)


@functools.lru_cache(maxsize=1)
def local_table() -> tuple[dict, ...]:
    """This process's transport table, most preferred first (computed once: UCX's entry needs a
    UCP context)."""
    from ._core import _C

    return tuple(dict(t) for t in _C.transport_table())


def peer_memory_kinds(modules=None) -> set[str]:
    """Device kinds whose memory an RDMA NIC registers through a loaded peer-memory module (no
    runtime call at registration; the modules are the device seams')."""
    if modules is None:
        from .rdma import loaded_modules
        modules = loaded_modules()
    return devices.peer_memory_kinds(set(modules))


def publishable(table, peer_kinds=None) -> dict[str, dict]:
    """The part of a table other ranks need, keyed by transport name (JSON-able).

    "direct_safe": the device memory types this rank may hand to the transport directly under
    HETCCL_UCX_DEVICE=auto: those it moves with no runtime call off the issuing thread
    (TransportCaps::runtime_free; UCX lists none yet, docs/transports.md) whose RDMA
    registration goes through a peer-memory module (``peer_kinds``, default: the loaded
    modules). A dma-buf registration is not enough: UCX 1.22 gets the dma-buf through
    cuda_copy's memory query (cuCtxSetFlags, the context's lock) on the thread that registers."""
    peer = peer_memory_kinds() if peer_kinds is None else set(peer_kinds)
    return {t["name"]: {"preference": int(t["preference"]), "same_host": bool(t["same_host"]),
                        "other_host": bool(t["other_host"]), "memory": list(t["memory"]),
                        "rdma": bool(t.get("rdma", False)),
                        "direct_safe": [m for m in t.get("runtime_free", []) if m in peer],
                        "zero_copy": bool(t.get("zero_copy", False))}
            for t in table}


def direct_kinds(entry: dict, device: str) -> list[str]:
    """Device memory types a rank hands to this transport directly under HETCCL_UCX_DEVICE
    ``device``: none when off; those it moves without runtime calls on its threads when auto;
    every device type it handles when force (diagnostics: can deadlock, docs/transports.md)."""
    if device == "off":
        return []
    if device == "force":
        return [m for m in entry["memory"] if m != "host"]
    return list(entry.get("direct_safe", []))


def shared_ring(tables) -> str | None:
    """The transport with a zero-copy ring that reaches peers on this host in every one of the
    given (publishable) tables, the most preferred such one (ties by name); None when the tables
    share none. What links same-vendor ranks of one host (bridge.group_links)."""
    tables = list(tables)
    names = [n for n in (tables[0] if tables else {})
             if all(n in t and t[n].get("zero_copy", False) and t[n]["same_host"]
                    for t in tables)]
    if not names:
        return None
    return min(names, key=lambda n: (max(t[n]["preference"] for t in tables), n))


@dataclass(frozen=True)
class Choice:
    transport: str
    device_direct: bool  # device memory handed to the transport (else host-staged by the engine)
    # the transport has a zero-copy ring (TransportCaps::zero_copy: both tables say so): the
    # engine's link to the peer is then a ring link, else a message link (docs/engine.md)
    zero_copy: bool = False

    def describe(self) -> str:
        return f"{self.transport}" + (" (device memory direct)" if self.device_direct else "")


def _where(same_host: bool) -> str:
    return "on this host" if same_host else "on another host"


# Where a transport whose published preference rests on device memory ranks while that memory
# is not handed to it: after tcp (30), where UCX ranks without RDMA or device memory.
_NO_DEVICE_EDGE_PREFERENCE = 40


def _preference(entry: dict, device: str, can_direct: bool = True) -> int:
    """A transport's rank for the automatic choice. A transport that takes device memory
    (UCX: 20, before tcp, when it brings RDMA or device memory) gains nothing from it where
    device memory does not go to it directly (HETCCL_UCX_DEVICE=off, or auto where its device
    path would call the runtime from its threads): staged through host memory, UCX without RDMA
    is UCX's tcp against hetccl's striped tcp (1.5 against 4.4 GB/s at 64 MiB on the H200 box,
    docs/benchmarks.md), so without RDMA it then ranks after tcp. ``entry``: a publishable()
    entry; ``can_direct``: whether the pair could take the direct path at all (choose())."""
    takes_device_memory = any(m != "host" for m in entry["memory"])
    direct = can_direct and direct_kinds(entry, device)
    if takes_device_memory and not direct and not entry.get("rdma", False):
        return max(entry["preference"], _NO_DEVICE_EDGE_PREFERENCE)
    return entry["preference"]


def choose(a: int, b: int, table_a: dict, table_b: dict, same_host: bool, forced: str = "auto",
           kind_a: str = "cpu", kind_b: str = "cpu", device: str = "auto",
           alone_a: bool = True, alone_b: bool = True) -> Choice:
    """Transport of the pair (a, b), symmetric in (a, table_a, kind_a, alone_a) <-> (b, ...).

    table_*: publishable() tables of the two ranks; same_host: whether the pair counts as one host
    (shared memory possible); forced: HETCCL_TRANSPORT; kind_*: what each rank's torch drives
    ("cuda", "rocm", "cpu"); device: HETCCL_UCX_DEVICE ("auto", "off" or "force"); alone_*:
    whether no rank of another vendor shares that rank's real host (else its UCX context loses
    the device paths, GDRCopy included: ucx_exclusions), which auto's direct path needs.
    Raises ValueError naming the pair when no transport (or the forced one) can serve it."""
    reach = "same_host" if same_host else "other_host"
    # auto's direct path needs the two ranks on different hosts, each keeping its device paths
    can_direct = device == "force" or (device == "auto" and not same_host and alone_a and alone_b)
    if forced != "auto":
        for r, t in ((a, table_a), (b, table_b)):
            if forced not in t:
                raise ValueError(
                    f"hetccl: HETCCL_TRANSPORT={forced!r} is not available in rank {r}'s build "
                    f"(it has: {', '.join(sorted(t)) or 'none'}); choose one every rank has, or "
                    f"'auto'")
        if not (table_a[forced][reach] and table_b[forced][reach]):
            raise ValueError(
                f"hetccl: HETCCL_TRANSPORT={forced!r} cannot reach rank {b} from rank {a}: they "
                f"are {'on one host' if same_host else 'on different hosts'} and {forced} does "
                f"not connect such peers; use 'auto' or a transport that reaches every pair")
        name = forced
    else:
        both = [n for n in table_a if n in table_b and table_a[n][reach] and table_b[n][reach]]
        if not both:
            raise ValueError(
                f"hetccl: no bridge transport reaches rank {b} from rank {a} ({_where(same_host)}): "
                f"rank {a} has {sorted(table_a)}, rank {b} has {sorted(table_b)}")
        name = min(both, key=lambda n: (max(_preference(table_a[n], device, can_direct),
                                            _preference(table_b[n], device, can_direct)), n))
    direct = (can_direct and kind_a in direct_kinds(table_a[name], device)
              and kind_b in direct_kinds(table_b[name], device))
    zero_copy = table_a[name].get("zero_copy", False) and table_b[name].get("zero_copy", False)
    return Choice(name, direct, zero_copy)


def ucx_exclusions(my_host: str, peer_hosts: list[str], emulate_hosts: bool) -> list[str]:
    """UCX transports to remove from this rank's UCX context (ucx option exclude_tls): device
    paths whenever a UCX peer is on this very host (emulated vendors share a box; between real
    vendors these paths could not connect anyway, so removing them costs nothing), and shared
    memory too when hosts are emulated."""
    if not any(h == my_host for h in peer_hosts):
        return []
    return list(UCX_DEVICE_PATHS) + (list(UCX_SHM_PATHS) if emulate_hosts else [])


def ucx_lanes(setting, cores: list[int], hosts: list[str], rdma_any: bool) -> int:
    """The UCX lane count every rank runs (HETCCL_UCX_LANES ``setting``: a count, or "auto").
    auto: 1 where any rank's UCX has RDMA (UCX stripes over its rails itself; a lane per context
    would register memory once per lane), else the smallest over the ranks of cores / (2 x
    ranks on that rank's host) -- a lane has a progress and a copy thread -- clamped to 1..8.
    ``cores``/``hosts``: every rank's usable cores and host identity (the same lists on every
    rank, so every rank gets the same count)."""
    if setting != "auto":
        return int(setting)
    if rdma_any or not cores:
        return 1
    per_host = {h: hosts.count(h) for h in hosts}
    return max(1, min(8, min(c // (2 * per_host[h]) for c, h in zip(cores, hosts))))


def job_ucx_lanes(caps: list[dict], hosts: list[str]) -> int:
    """ucx_lanes() of the job under HETCCL_UCX_LANES, from every rank's published caps
    ({"cores", "table"}, as the bridge gathers them) and real host: the same on every rank."""
    return ucx_lanes(config.get("HETCCL_UCX_LANES"), [int(c.get("cores", 1)) for c in caps],
                     hosts, any(c["table"].get("ucx", {}).get("rdma", False) for c in caps))


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), as ucx_lanes counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def settings_in_force() -> dict[str, object]:
    """Transport settings every rank of a job must share beyond config.MUST_AGREE, as in force
    on this rank (the bridge checks them with the rest): UCX's tcp send segments must fit the
    peer's receive segments (HETCCL_UCX_TUNING less what UCX_* in the environment overrides)."""
    return {"HETCCL_UCX_TUNING (in force)": config.ucx_tuning()}


def ucx_max_message() -> int:
    """The ucx transport's "max_message" option (HETCCL_UCX_MAX_MESSAGE; the transport drops it
    where UCX has RDMA): under auto, 2 x the tcp send segment in force less 4 KiB -- UCX 1.22
    sends a host message of up to 2 x TCP_TX_SEG_SIZE - 32 bytes as a zero-copy rendezvous over
    tcp and a larger one through its segments (`UCX_PROTO_INFO=y`: "fragmented copy-in
    copy-out") -- where the segment is 256 KiB or more (smaller segments would cut the engine's
    chunks too fine), else 0 (no bound; also for UCX's default segment, 8 KiB, and for a
    spelling hetccl does not read, such as "inf")."""
    value = config.get("HETCCL_UCX_MAX_MESSAGE")
    if value != "auto":
        return int(value)
    seg = config.ucx_value_in_force("TCP_TX_SEG_SIZE")
    try:
        n = config.parse_size(seg) if seg else 0
    except (ValueError, OverflowError):
        n = 0
    return (2 * n - 4096) // 4096 * 4096 if n >= 256 * 1024 else 0


def options(name: str, *, secret: str, slot_bytes: int, seg_budget: int = 0, bind_addr: str | None = None,
            my_host: str = "", peer_hosts: list[str] = (), emulate_hosts: bool = False,
            any_direct: bool = False, ucx_lanes_in_force: int | None = None) -> dict[str, str]:
    """The options of transport ``name`` on this rank (it reads the keys it knows,
    csrc/<name>_transport.cc), from the settings in force (config.py) and what the caller
    computed: the group's secret, the ring slot size and this rank's shared-memory budget
    (shm), the address network transports listen on, and for UCX the hosts of its UCX peers
    (which of UCX's own transports to remove: ucx_exclusions) and whether any of them gets
    device memory directly (ucx_copy_exclusions), and the UCX lane count the job resolved
    (ucx_lanes; default: HETCCL_UCX_LANES, auto counting this process alone). The one place
    that knows each transport's option names besides the transport itself."""
    opts = {
        "secret": secret,
        "slot_bytes": str(slot_bytes),
        "seg_budget": str(seg_budget),
        "nslots": str(config.get("HETCCL_SHM_NSLOTS")),
        "nconn": str(config.get("HETCCL_TCP_NCONN")),
        "lazy": "1" if config.get("HETCCL_TCP_LAZY") else "0",
    }
    if bind_addr:
        opts["bind_addr"] = bind_addr
    if name == "ucx":
        opts["lanes"] = str(ucx_lanes_in_force if ucx_lanes_in_force is not None else ucx_lanes(
            config.get("HETCCL_UCX_LANES"), [usable_cores()], [my_host], False))
        opts["lane_threads"] = "on" if config.get("HETCCL_UCX_LANE_THREADS") else "off"
        opts["stripe_bytes"] = str(config.get("HETCCL_UCX_STRIPE_BYTES"))
        opts["spin_us"] = str(config.get("HETCCL_UCX_SPIN_US"))
        opts["ucx_config"] = config.ucx_tuning()
        opts["max_message"] = str(ucx_max_message())
        opts["copy_thread"] = "on" if config.get("HETCCL_UCX_COPY_THREAD") else "off"
        opts["reduce_unpack"] = "on" if config.get("HETCCL_UCX_REDUCE_UNPACK") else "off"
        opts["device_prepare"] = "on" if config.get("HETCCL_UCX_DEVICE_PREPARE") else "off"
        opts["exclude_tls"] = ",".join(ucx_exclusions(my_host, list(peer_hosts), emulate_hosts)
                                       + ucx_copy_exclusions(any_direct))
    return opts


def describe(info: dict[str, dict]) -> str:
    """What the log line of a bridge adds about its transports' setup (``info``: name ->
    Transport.info()), "" when nothing: UCX's version, UCX_TLS, lanes (with threads of their
    own, striped from how many bytes)."""
    ucx = info.get("ucx")
    if not ucx:
        return ""
    lanes = f"lanes {ucx.get('lanes')}"
    if ucx.get("lane_threads") == "on":
        lanes += " with threads"
        if int(ucx.get("stripe_bytes") or 0) > 0:
            lanes += f", messages striped in parts of >= {ucx['stripe_bytes']} bytes"
    return f" [UCX {ucx.get('version')}: UCX_TLS={ucx.get('tls')}, {lanes}]"
