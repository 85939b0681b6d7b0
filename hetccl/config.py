"""The one place where hetccl reads environment settings.

Every knob is declared here once (name, type, default, meaning), in the spirit of NCCL_PARAM.
Other modules call ``config.get("NAME")``; nothing else in the package reads ``os.environ``
for HETCCL_* settings, except the two modules that must import nothing of hetccl (harnesses load
them without torch): capi.py (HETCCL_CAPI_LIB) and nccl_dropin.py (HETCCL_NCCL_LIBRARY,
HETCCL_RCCL_LIBRARY, HETCCL_NCCL_H) read theirs directly, and they are declared here all the
same. Launchers write settings for their children (run.py, bench/). ``hetccl doctor`` prints
this table with the values in force.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _bool(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


def _check_mode(s: str) -> str:
    v = s.strip().lower()
    # full: the former name of what on does now (every call checked before data moves)
    v = {"1": "on", "true": "on", "yes": "on", "full": "on", "0": "off", "false": "off",
         "no": "off"}.get(v, v)
    if v not in ("on", "async", "off"):
        raise ValueError("expected on, async or off")
    return v


def _face_route(s: str) -> str:
    v = s.strip().lower()
    if v not in ("engine", "capi"):
        raise ValueError("expected engine or capi")
    return v


def _group_links_mode(s: str) -> str:
    v = s.strip().lower()
    if v not in ("auto", "off"):
        raise ValueError("expected auto or off")
    return v


def _share_mode(s: str) -> str:
    v = s.strip().lower()
    if v not in ("auto", "on", "off"):
        raise ValueError("expected auto, on or off")
    return v


def _lanes(s: str):
    v = s.strip().lower()
    if v == "auto":
        return "auto"
    n = int(v)
    if not 1 <= n <= 16:
        raise ValueError("expected auto or a lane count from 1 to 16")
    return n


def parse_size(s: str) -> int:
    """A size in bytes as users write it: 4096, 512K, 1M, 1.5G, 64MiB, 2MB (powers of 1024).
    The one parser for settings and the benchmarks' --sizes / --minbytes."""
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _byte_count(s: str) -> int:
    """A size in bytes, 0 or more (K/M/G suffixes: 512K, 1M)."""
    n = parse_size(s)
    if n < 0:
        raise ValueError("expected a byte count of 0 or more (K/M/G suffixes allowed)")
    return n


def _auto_or_bytes(s: str):
    v = s.strip().lower()
    return "auto" if v == "auto" else _byte_count(v)


def _nonneg_int(s: str) -> int:
    n = int(s.strip())
    if n < 0:
        raise ValueError("expected a whole number of 0 or more")
    return n


def _device_mode(s: str) -> str:
    v = s.strip().lower()
    if v not in ("auto", "off", "force"):
        raise ValueError("expected auto, off or force")
    return v


def _async_mode(s: str) -> str:
    v = s.strip().lower()
    if v not in ("abort", "raise"):
        raise ValueError("expected abort or raise")
    return v


_SETTINGS = [
    Setting("HETCCL_VENDOR", str, "",
            "Vendor label of this rank; ranks with equal labels form one vendor group. "
            "Empty: detected (cuda->nvidia, rocm->amd, xpu->intel, else host). "
            "Set it to emulate several vendors on homogeneous hardware."),
    Setting("HETCCL_VENDOR_SPLIT", str, "",
            "Emulation shorthand such as '2+2': when HETCCL_VENDOR is unset, the process of "
            "rank r gets label v<k> of the k-th block of consecutive ranks (set by the "
            "launchers' --vendors). r: RANK if the launcher sets it, else the rank passed to "
            "init_process_group (mp.spawn)."),
    Setting("HETCCL_TRANSPORT", str, "auto",
            "Bridge transport: auto (per peer, the most preferred transport of both ranks' "
            "capability tables that reaches it: shm on this host; ucx before tcp where UCX has "
            "RDMA, or device memory with HETCCL_UCX_DEVICE=auto), or one name for every peer "
            "(shm, tcp, ucx)."),
    Setting("HETCCL_TCP_NCONN", int, 4, "TCP connections per peer; large messages are striped."),
    Setting("HETCCL_TCP_LAZY", _bool, True,
            "tcp bridge connections made on first use (the first send to a peer dials its "
            "HETCCL_TCP_NCONN connections, used both ways) instead of to every cross-vendor "
            "peer at start; a peer no collective uses costs no socket. 0: all at start (an "
            "unreachable peer is then an error at init instead of at its first use)."),
    Setting("HETCCL_SOCKET_IFNAME", str, "",
            "Network interface the bridge listens on (like NCCL_SOCKET_IFNAME). Empty: the "
            "address torch's store uses to reach the master (loopback for local jobs)."),
    Setting("HETCCL_SHM_SLOT_BYTES", int, 0,
            "Largest shared-memory ring slot in bytes (also the staging slot of device data on "
            "message links); 0: the largest chunk of the tuning table of the data this build "
            "moves (hetccl/tuning.py: 256 KiB host, 4 MiB where a GPU is driven)."),
    Setting("HETCCL_SHM_NSLOTS", int, 8,
            "Most shared-memory ring slots per direction and peer (fewer when the budget "
            "requires: HETCCL_SHM_BUDGET_BYTES)."),
    Setting("HETCCL_SHM_BUDGET_BYTES", int, 0,
            "Bound on the shared memory one rank creates for all its shared-memory peers "
            "together, whatever the job size (its rings get fewer, then smaller slots as peers "
            "grow); 0: 8 MiB on CPU-only builds, 64 MiB where a GPU is driven (pinned). The "
            "smallest value of the ranks on a host applies to the host."),
    Setting("HETCCL_REDUCE_THREADS", int, 0, "Host reduction threads (0: all cores)."),
    Setting("HETCCL_TIMEOUT_S", int, 300,
            "C API (csrc/hetccl.h) only: seconds that bootstrap, init and every operation may "
            "take before they fail naming the peer waited for (the torch face takes the "
            "process group's timeout instead)."),
    Setting("HETCCL_CAPI_ALGO", str, "auto",
            "C API only: auto (csrc/api/select.cc's table: up to 64 KiB the latency "
            "algorithms -- recursive doubling for all_reduce and reduce_scatter, a binomial "
            "tree for broadcast, Bruck's all_gather -- rings and the chain above), ring (rings "
            "and the chain everywhere, the argument check's ring all-gather too), rd (the "
            "latency algorithms at every size), or hier (all_reduce hierarchical across "
            "vendor groups at every size: a reduce-scatter in each group, rings of the owners "
            "across groups, an all-gather in each group; the other collectives as auto)."),
    Setting("HETCCL_CRASH_BACKTRACE", _bool, False,
            "Debugging aid: on SIGSEGV/SIGBUS/SIGFPE print the native frames as "
            "'hetccl-frame <object> +<offset>' lines (addr2line names them; csrc/crash.h). "
            "Read when hetccl/_core.py loads the core (before any transport starts) and by the C "
            "API's communicator."),
    Setting("HETCCL_DROPIN", _bool, False,
            "Set by `hetccl run --dropin` for its workers: the drop-in NCCL is preloaded, so "
            "hetccl.shim leaves init_process_group as the script wrote it."),
    Setting("HETCCL_NCCL_LIBRARY", str, "",
            "The drop-in NCCL's real library (path; 'none': no real library). Default: the first "
            "libnccl.so.2 on LD_LIBRARY_PATH and the system directories that is not the drop-in; "
            "`hetccl run --dropin` sets torch's (the nvidia-nccl wheel)."),
    Setting("HETCCL_RCCL_LIBRARY", str, "",
            "The drop-in RCCL's (librccl.so.1) real library, as HETCCL_NCCL_LIBRARY."),
    Setting("HETCCL_NCCL_H", str, "",
            "nccl.h to check the drop-in's ABI against (tests/test_dropin.py) where the real "
            "library found has none beside it (the nvidia-nccl wheel ships one). Read by "
            "hetccl/nccl_dropin.py, which imports nothing of hetccl."),
    Setting("HETCCL_CAPI_LIB", str, "",
            "The C API library (libhetccl.so) that hetccl/capi.py loads (default: the one built "
            "beside the package); harnesses point it at the drop-in too. Read by hetccl/capi.py, "
            "which imports nothing of hetccl."),
    Setting("HETCCL_DROPIN_NATIVE", _bool, True,
            "Drop-in: a communicator of one vendor is the real library's (0: hetccl serves it "
            "too, for tests and comparisons)."),
    Setting("HETCCL_CAPI_DEVICE", str, "cuda",
            "C API only: the device runtime of calls with a stream (csrc/api/stream_path.h): "
            "cuda, hip, or emulated / emulated-hip (tests: host threads as streams)."),
    Setting("HETCCL_CAPI_DEVICE_LIBRARY", str, "",
            "C API only: the device runtime's library (default libcuda.so.1 / libamdhip64.so, "
            "the one the process has loaded under that name)."),
    Setting("HETCCL_STREAM_CHUNK_BYTES", int, 0,
            "C API / drop-in only: a stream-ordered all_reduce larger than this many bytes "
            "runs chunk by chunk, each chunk's copies to and from pinned staging overlapping "
            "the host collective of its neighbours (csrc/api/stream_path.h; at most 32 "
            "chunks). 0 (default): whole calls, the path the GPU suite has measured. Must be "
            "equal on every rank."),
    Setting("HETCCL_STREAM_DEVICE_BYTES", str, "1048576",
            "C API / drop-in only: stream-ordered collectives of at least this many bytes (the "
            "larger of input and output) take the device route: engine device plans on the "
            "communicator's own streams, reductions by hetccl's kernels, no staging copies "
            "(csrc/api/device_route.h); smaller ones are staged through host memory, whose "
            "latency is lower. 'off': every call staged. Must be equal on every rank (where "
            "ranks differ, the argument check runs the call staged on all of them)."),
    Setting("HETCCL_CAPI_DEVICE_CHUNK_BYTES", int, 0,
            "C API / drop-in only, for measurements: every device-route plan's chunk in bytes "
            "(at most one ring slot; 0, default: the device table's chunk for the plan's "
            "size). Fewer, larger chunks mean fewer stream operations per call (issue cost) "
            "and less copy overlap. Must be equal on every rank."),
    Setting("HETCCL_CAPI_ROUTE_LAUNCH", str, "streams",
            "C API / drop-in only: how the device route runs a call. 'streams' (default): its "
            "plans' stream operations on the communicator's own streams, enqueued by the "
            "executor (the issuing thread waits until they are). 'kernel': one program kernel "
            "per call on the caller's stream, launched by the issuing thread, its instructions "
            "written by the executor (csrc/api/device_program.h): the issue is one launch at "
            "any size."),
    Setting("HETCCL_CAPI_PROGRAM_BLOCKS", int, 4,
            "C API / drop-in only, with HETCCL_CAPI_ROUTE_LAUNCH=kernel: thread blocks per stream "
            "of a device program (1-16): more move and reduce a call's data faster, each takes an "
            "SM for the call's whole time."),
    Setting("HETCCL_EMULATED_STRICT", _bool, False,
            "Tests only: the emulated device (csrc/device/emulated_ops.cc) aborts the process "
            "on a stream operation that touches registered host memory after it was "
            "unregistered (default: the operation is skipped and reported once on stderr)."),
    Setting("HETCCL_CAPI_SHM", _bool, True,
            "C API only: ring neighbours on one host reach each other through shared memory; "
            "0: tcp for every peer."),
    Setting("HETCCL_CHUNK_BYTES", int, 0,
            "Engine chunk size in bytes for every cross-vendor transfer; 0 (default): the "
            "measured tables of hetccl/tuning.py (one chunk for small messages, pipelined "
            "chunks for large ones). Must be equal on every rank."),
    Setting("HETCCL_DEVICE_MESSAGES", _bool, True,
            "send/recv/isend/irecv of device tensors with another vendor's rank: stream-ordered "
            "messages through the C++ engine (csrc/engine_messages.cc; the host does not wait, as "
            "with NCCL). 0: the earlier path (a synchronous copy to host memory, the transport's "
            "host message, the copy back at wait()), for comparison. Ranks may differ: both paths "
            "send the same message."),
    Setting("HETCCL_HOST_KERNEL", _bool, True,
            "Two vendor groups of equal size, host tensors, peers on shared memory: the "
            "cross-vendor step of all-reduce is a round trip through the shared slots (the peer "
            "reduces in place and the sum comes back: three passes over memory per byte). "
            "0: a plain exchange in both directions (for comparison). Must be equal on every "
            "rank."),
    # --- issue 18: transport choice by capability, UCX tuning and device memory (kept together)
    Setting("HETCCL_EMULATE_HOSTS", _bool, False,
            "TEST ONLY: each vendor group counts as its own host for the bridge: auto picks the "
            "other-host transport (tcp, or ucx per preference) and UCX between the groups is "
            "limited to network transports (no shared memory, no device IPC)."),
    Setting("HETCCL_UCX_LANES", _lanes, "auto",
            "UCX lanes per transport, each with its own connections to every peer (and, with "
            "HETCCL_UCX_LANE_THREADS, its own UCX context and threads); messages of one (peer, "
            "tag) rotate over them. auto: 1 where any rank's UCX has RDMA (UCX stripes over "
            "rails itself), else the job's smallest cores / (2 x ranks on the host), from 1 to 8 "
            "(1 on a 2-core machine; 4 for two ranks on a 16-core box, where it is 1.2-2.8x one "
            "lane: docs/benchmarks.md); or a count from 1 to 16. Must be equal on every rank."),
    Setting("HETCCL_UCX_LANE_THREADS", _bool, True,
            "With HETCCL_UCX_LANES > 1: each lane is a UCX context of its own with its own "
            "progress and copy threads, so lanes copy on as many cores (0: the lanes share one "
            "progress thread, as before; docs/transports.md). Must be equal on every rank."),
    Setting("HETCCL_UCX_STRIPE_BYTES", _byte_count, 0,
            "With HETCCL_UCX_LANES > 1 and lane threads, > 0: every host message goes as one part "
            "per lane, cut evenly into as many parts of at least this size as there are lanes "
            "(smaller messages whole on one lane, empty parts on the others), so one large "
            "message keeps several lanes' threads busy. 0 (default): each message whole on one "
            "lane; striping was slower at 1-4 MiB on the GPU box, where every message waits for "
            "every lane (docs/benchmarks.md). Must be equal on every rank."),
    Setting("HETCCL_UCX_SPIN_US", _nonneg_int, 50,
            "UCX transport: microseconds each progress thread keeps polling after its last event "
            "before it sleeps (a message arriving meanwhile needs no wake-up; a spinning thread "
            "holds a core)."),
    Setting("HETCCL_UCX_MAX_MESSAGE", _auto_or_bytes, "auto",
            "UCX transport without RDMA: the engine cuts host data on UCX links into messages "
            "of at most this many bytes (each link takes the smaller of its two ends' values). "
            "auto (default): the largest message UCX's tcp moves zero-copy, 2 x the tcp send "
            "segment in force (UCX_TCP_TX_SEG_SIZE, else HETCCL_UCX_TUNING's) less 4 KiB, where "
            "that segment is 256 KiB or more, else no bound; larger messages go through UCX's "
            "segments (\"fragmented copy-in copy-out\", 0.6x on the 2-core machine: "
            "docs/benchmarks.md). 0: no bound."),
    Setting("HETCCL_UCX_TUNING", str, "TCP_TX_SEG_SIZE=1M;TCP_RX_SEG_SIZE=4M",
            "UCX settings hetccl applies to its UCX contexts ('KEY=VALUE;...', UCX names "
            "without UCX_), each only where the environment does not set UCX_<KEY> itself; "
            "'none': UCX's own defaults. The default's larger tcp segments cost about 70 MB "
            "more resident memory on a receiving rank. Must be equal on every rank."),
    Setting("HETCCL_UCX_DEVICE", _device_mode, "auto",
            "Device tensors over UCX. auto (default): handed to UCX directly only where both "
            "ranks' transport moves their device's memory without calling the device runtime "
            "on any thread but the issuing one (its capability table's runtime_free, with a "
            "peer-memory module; ranks on different hosts with no other vendor on theirs), else "
            "staged through pinned host memory by the engine; UCX lists no such memory yet, so "
            "auto stages (docs/transports.md). off: always staged. force: directly wherever UCX handles the "
            "memory type (cuda_copy / rocm_copy), for diagnostics only: UCX's thread then calls "
            "the runtime and deadlocks against an application thread blocked in a runtime call "
            "behind the collective's stream, e.g. `x.cpu()` right after the collective "
            "(docs/transports.md, tests/gpu_ucx_probe.py). Must be equal on every rank."),
    Setting("HETCCL_UCX_COPY_THREAD", _bool, True,
            "UCX transport: copies out of the unexpected-message buffer and irecv_reduce's "
            "reductions run on a thread of their own beside UCX's progress thread (0: on the "
            "progress thread, as before; docs/transports.md)."),
    Setting("HETCCL_UCX_REDUCE_UNPACK", _bool, True,
            "UCX transport: a reducing receive posted before its message arrives reduces each "
            "piece UCX delivers straight from UCX's receive buffer (a UCP generic datatype), "
            "instead of landing the whole message in a bounce buffer first (0: the bounce "
            "buffer, as before; docs/transports.md). Ranks may differ: the wire is the same."),
    Setting("HETCCL_UCX_DEVICE_PREPARE", _bool, True,
            "Where device memory goes to UCX directly: the thread that issues a collective maps its device "
            "buffers for UCX (ucp_mem_map, cached per range) so that the engine's proxy posts "
            "them with the handle and UCX makes no memory query -- whose cuCtxSetFlags takes "
            "the CUDA context's lock in UCX 1.22 -- on the proxy's thread (docs/transports.md). "
            "0: the landed behaviour (diagnostics: tests/gpu_ucx_probe.py compares both)."),
    Setting("HETCCL_ALGO", str, "",
            "Algorithm overrides, e.g. 'all_reduce=flat,all_gather=hier' (see docs/algorithms.md)."),
    Setting("HETCCL_LOG_LEVEL", str, "NOTICE",
            "Log level of the 'hetccl' logger. NOTICE (default): warnings plus the one line "
            "rank 0 logs when the default group starts (vendor groups, bridge transport, "
            "whether `hetccl run` replaced the script's backend); WARNING silences that line; "
            "INFO adds per-group details."),
    Setting("HETCCL_CHECK_ARGS", _check_mode, "on",
            "Argument checks across ranks (hetccl/checks.py): on (default: every call is "
            "checked before data moves, host and device tensors; full is a synonym), async "
            "(device collectives never wait: the headers travel with the data and a mismatch "
            "found afterwards breaks the group on every rank, see HETCCL_ASYNC_ERROR_HANDLING), "
            "off."),
    Setting("HETCCL_FACE_ROUTE", _face_route, "engine",
            "Where the torch face sends a cross-vendor group's single-tensor collectives "
            "(hetccl/face_capi.py): engine (default: the face's own schedule on the engine), "
            "capi (opt-in: straight to the C API, libhetccl.so, the core under the drop-in; "
            "CUDA calls stream-ordered with NCCL's asynchronous errors, CPU calls blocking)."),
    Setting("HETCCL_FACE_DEFER_JOIN", _bool, True,
            "With HETCCL_FACE_ROUTE=capi: a CUDA call that takes the C API's device route "
            "returns once handed to the communicator's executor, and its work's wait() orders "
            "the then-current stream after it (hetcclCommDeferJoin; torch's NCCL process group's "
            "semantics), so issuing does not wait for the route's work to be enqueued; 0: the "
            "caller's stream is ordered at issue."),
    Setting("HETCCL_ASYNC_ERROR_HANDLING", _async_mode, "abort",
            "A device collective that fails after it was issued (peer died, timeout, arguments "
            "found to differ): abort (default) logs the error and stops the process, as torch's "
            "NCCL backend does, so a result of a failed collective is never consumed; raise "
            "releases the streams and raises the error at the next call on the group."),
    Setting("HETCCL_GROUP_LINKS", _group_links_mode, "auto",
            "Same-vendor ranks of one host linked through shared memory for host tensors "
            "(hetccl.bridge.group_links): auto (default: when the whole job is on one host and "
            "the groups are not two of equal size 2^m, host collectives then run on the "
            "engine alone, no gloo step), off (native gloo inside each vendor group)."),
    Setting("HETCCL_SHARE_GPUS", _share_mode, "auto",
            "Workers of an emulated mixed-vendor job on a host with fewer GPUs than workers "
            "(hetccl.launch.share_gpus): auto (default: under vendor emulation each worker sees "
            "one GPU, local rank % GPUs, as its GPU 0, and LOCAL_RANK=0), on (also without "
            "emulation), off (leave CUDA_VISIBLE_DEVICES and LOCAL_RANK as launched)."),
    Setting("HETCCL_DS_COMM_BACKEND", str, "",
            "hetccl.integrations.deepspeed.init_distributed: the backend when neither its "
            "comm_backend argument nor args.comm_backend names one (hetccl, nccl, gloo, ccl, "
            "mpi, hccl, xccl); empty: the accelerator's default."),
    Setting("HETCCL_SLOWDOWN", float, 1.0,
            "TEST ONLY: emulate a slower device; hetccl.balance.emulate multiplies this rank's "
            "compute time by this factor."),
]
SETTINGS = {s.name: s for s in _SETTINGS}

# Settings that decide how both ends of a cross-vendor transfer route and cut their data (the
# algorithm, its chunks, which ring carries them): every rank of a group must use the same
# values. The bridge compares them across ranks when it starts and names any difference.
MUST_AGREE = ("HETCCL_TRANSPORT", "HETCCL_ALGO", "HETCCL_CHUNK_BYTES", "HETCCL_HOST_KERNEL",
              "HETCCL_GROUP_LINKS", "HETCCL_FACE_ROUTE",
              "HETCCL_CHECK_ARGS", "HETCCL_EMULATE_HOSTS", "HETCCL_UCX_LANES", "HETCCL_UCX_LANE_THREADS",
              "HETCCL_UCX_STRIPE_BYTES",
              "HETCCL_UCX_DEVICE")


def get(name: str) -> Any:
    """Value of a declared setting (environment, else default). Raises ValueError naming the
    variable when its value does not parse."""
    s = SETTINGS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return s.default
    try:
        return s.parse(raw)
    except ValueError as e:
        raise ValueError(f"hetccl: environment variable {name}={raw!r} is invalid: {e}") from None


def set_for_this_process(name: str, value: str) -> None:
    """Tell the C++ core loaded in this process a setting the Python side decided, unless the
    user set it (the C API reads its settings from the environment when a communicator is made:
    hetccl/face_capi.py gives it the device runtime of this torch build this way)."""
    if name not in SETTINGS:
        raise KeyError(f"unknown hetccl setting {name}")
    os.environ.setdefault(name, value)


def ucx_tuning() -> str:
    """HETCCL_UCX_TUNING without the keys the user sets as UCX_<KEY> in the environment (theirs
    win), as the ucx transport's "ucx_config" option. Raises ValueError for a malformed entry."""
    keep = []
    value = str(get("HETCCL_UCX_TUNING")).strip()
    if value.lower() == "none":
        return ""
    for item in [x.strip() for x in value.split(";") if x.strip()]:
        key, eq, val = item.partition("=")
        if not eq or not key.strip() or not val.strip():
            raise ValueError(f"hetccl: HETCCL_UCX_TUNING entry {item!r} is not KEY=VALUE")
        key = key.strip().upper().removeprefix("UCX_")
        if ("UCX_" + key) not in os.environ:
            keep.append(f"{key}={val.strip()}")
    return ";".join(keep)


def ucx_value_in_force(key: str) -> str | None:
    """The value UCX's contexts get for UCX_<key> (a UCX name without UCX_, upper case): the
    environment's where it sets it (UCX reads it itself), else HETCCL_UCX_TUNING's, else None
    (UCX's own default)."""
    if ("UCX_" + key) in os.environ:
        return os.environ["UCX_" + key]
    for item in ucx_tuning().split(";"):
        k, _, v = item.partition("=")
        if k.strip().upper() == key:
            return v.strip()
    return None


def table() -> list[tuple[str, Any, bool, str]]:
    """(name, value, is_set, doc) for every setting, for `hetccl doctor`."""
    return [(s.name, get(s.name), s.name in os.environ, s.doc) for s in _SETTINGS]
