"""`hetccl bench transport`: point-to-point bandwidth of the bridge transports between two local
processes, beside single-core memcpy (the physical reference for a copy-based transport).

For each transport (shm, tcp with --nconn, ucx when built) and size, rank 0 streams --iters
messages to rank 1 with all of them in flight ("uni"), then both ranks stream to each other at
once ("bidir", GB/s per direction); "reduce" is bidir with every message received by
irecv_reduce (float32 sum into one buffer: the engine's reducing receive). Each measurement is
repeated --repeat times; the table shows the best and the median, because the machines are
shared and noisy. Every row is checked: the receiver verifies the last message, or the reduced
sum (#wrong counts corrupt ones). --emulate-hosts keeps UCX off shared memory, as the bridge
does between emulated hosts (HETCCL_EMULATE_HOSTS).

    python -m hetccl.cli bench transport [--transports shm,tcp] [--sizes 1M,4M,16M,64M]
        [--iters N] [--repeat 5] [--nconn 4] [--modes uni,bidir,reduce] [--emulate-hosts]
        [--jsonl FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from ..config import parse_size

GB = 1e9
DEFAULT_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]  # 1 MiB .. 64 MiB, powers of 4
SECRET = "hetccl-bench-" + "0123456789abcdef" * 2
COLUMNS = [("transport", 9), ("mode", 5), ("size", 10), ("count", 6), ("time_us", 10),
           ("GB/s", 7), ("med", 7), ("memcpy", 7), ("#wrong", 6)]


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Single-core memcpy bandwidth (bytes copied per second) for buffers of nbytes."""
    import numpy as np
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    iters = max(1, (256 << 20) // max(nbytes, 1))
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            np.copyto(dst, src)
        best = max(best, nbytes * iters / (time.perf_counter() - t0) / GB)
    return best


def _default_iters(size: int) -> int:
    return int(min(64, max(4, (256 << 20) // max(size, 1))))


def _rank_main(ctx, args) -> list[dict[str, Any]]:
    import numpy as np
    import torch.distributed as dist

    from hetccl._core import _C
    from hetccl.bench.report import Table, hardware, today

    base = ctx.store()
    rank, peer = ctx.rank, 1 - ctx.rank
    table = None
    if rank == 0:
        table = Table(COLUMNS, jsonl=args.jsonl)
        print(f"# hetccl bench transport: 2 local processes, {hardware()}, {today()}; "
              f"best and median of {args.repeat} runs; GB/s = 1e9 B/s (bidir: per direction)")
        table.header()
    rows = []
    copy_ref = {s: memcpy_gbps(s) for s in args.sizes} if rank == 0 else {}
    for name in args.transports:
        st = dist.PrefixStore(f"{name}/", base)
        # what the bridge runs (transports.options: HETCCL_UCX_LANES, HETCCL_UCX_TUNING, ...,
        # and UCX's exclusions for a peer on this host), then this command's own settings
        from hetccl import transports
        opts = transports.options(name, secret=SECRET, slot_bytes=1 << 20, bind_addr="127.0.0.1",
                                  my_host="here", peer_hosts=["here"], emulate_hosts=args.emulate_hosts)
        opts["nconn"] = str(args.nconn)
        opts["lanes"] = str(args.ucx_lanes)
        if args.slot_bytes:
            opts["slot_bytes"] = str(args.slot_bytes)
        if args.nslots:
            opts["nslots"] = str(args.nslots)
        t = _C.Transport(name, rank, 2, opts)
        st.set(f"addr{rank}", t.address())
        addrs = [b"" if r == rank else st.get(f"addr{r}") for r in range(2)]
        t.connect(addrs, 60000)
        label = f"tcp/{args.nconn}" if name == "tcp" else \
            f"ucx/{args.ucx_lanes}" if name == "ucx" else name
        tag = 0
        for size in args.sizes:
            iters = args.iters or _default_iters(size)
            src = (np.arange(size, dtype=np.uint32) * (rank + 3) % 251).astype(np.uint8)
            expect = (np.arange(size, dtype=np.uint32) * (peer + 3) % 251).astype(np.uint8)
            dst = np.zeros(size, np.uint8)
            go = np.zeros(1, np.uint8)
            # reduce: each message into its own part of dst32 (reductions into one buffer
            # from messages in flight together would race), holding 1.0 + the peer's values
            n32 = size // 4
            src32 = (np.arange(n32, dtype=np.uint32) * (rank + 3) % 251).astype(np.float32)
            sum32 = (np.arange(n32, dtype=np.uint32) * (peer + 3) % 251).astype(np.float32) + 1
            dst32 = np.zeros(n32 * iters if "reduce" in args.modes else 0, np.float32)
            for mode in args.modes:
                rates, wrong = [], 0
                for rep in range(args.warmup + args.repeat):
                    tag += 1
                    dst[:] = 0
                    dst32[:] = 1
                    sending = mode in ("bidir", "reduce") or rank == 0
                    receiving = mode in ("bidir", "reduce") or rank == 1
                    if mode == "reduce":
                        recvs = [t.irecv_reduce(peer, dst32.ctypes.data + i * n32 * 4, n32 * 4,
                                                tag, "sum", "float32") for i in range(iters)]
                    else:
                        recvs = [t.irecv(peer, dst.ctypes.data, size, tag)
                                 for _ in range(iters)] if receiving else []
                    # Start together: each rank tells the other it has posted its receives.
                    # The clock starts BEFORE this rank's "go" leaves, so no data can arrive
                    # before it (the rates include one small-message latency: conservative).
                    t0 = time.perf_counter()
                    t.isend(peer, go.ctypes.data, 1, tag + 1_000_000).wait(60000)
                    t.irecv(peer, go.ctypes.data, 1, tag + 1_000_000).wait(60000)
                    if not receiving:  # the sender's clock matters only in bidir mode
                        t0 = time.perf_counter()
                    data, nbytes = (src32.ctypes.data, n32 * 4) if mode == "reduce" else \
                        (src.ctypes.data, size)
                    sends = [t.isend(peer, data, nbytes, tag) for _ in range(iters)] \
                        if sending else []
                    _C.wait_all(recvs + sends, 120000)
                    dt = time.perf_counter() - t0
                    if mode == "reduce":
                        wrong += int(not all(np.array_equal(part, sum32)
                                             for part in dst32.reshape(iters, n32)))
                    elif receiving and not np.array_equal(dst, expect):
                        wrong += 1
                    if rep >= args.warmup:
                        rates.append(size * iters / dt / GB)
                # The receiver's clock defines one-way rates; bidir takes the slower rank.
                st.set(f"r/{tag}/{rank}", json.dumps([rates, wrong]))
                both = [json.loads(st.get(f"r/{tag}/{r}")) for r in range(2)]
                if mode == "uni":
                    rates, wrong = both[1]
                else:
                    rates = [min(a, b) for a, b in zip(both[0][0], both[1][0])]
                    wrong = both[0][1] + both[1][1]
                if rank == 0:
                    best, med = max(rates), statistics.median(rates)
                    rec = {"bench": "transport", "transport": name, "nconn": args.nconn
                           if name == "tcp" else None, "mode": mode, "size": size,
                           "ucx": {"lanes": args.ucx_lanes, **{
                               k: v for k, v in t.info().items()
                               if k in ("tls", "tuning", "version")}} if name == "ucx" else None,
                           "count": iters, "gbps_best": round(best, 3),
                           "gbps_median": round(med, 3), "gbps_all": [round(r, 3) for r in rates],
                           "memcpy_gbps": round(copy_ref[size], 3), "wrong": wrong,
                           "hardware": hardware(), "date": today()}
                    table.row([label, mode, size, iters, size / (best * GB) * 1e6, best, med,
                               copy_ref[size], wrong], rec)
                    rows.append(rec)
        t.close()
    if table:
        table.close()
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "hetccl bench transport: nothing measured"
    big = max(r["size"] for r in rows)
    mode = next((m for m in ("uni", "reduce", "bidir") if any(r["mode"] == m for r in rows)))
    parts = []
    for r in rows:
        if r["size"] == big and r["mode"] == mode:
            name = f"tcp/{r['nconn']}conn" if r["transport"] == "tcp" else \
                f"ucx/{r['ucx']['lanes']}lanes" if r["transport"] == "ucx" else r["transport"]
            parts.append(f"{name} {r['gbps_best']:.2f} GB/s (median {r['gbps_median']:.2f})")
    ref = next(r["memcpy_gbps"] for r in rows if r["size"] == big)
    wrong = sum(r["wrong"] for r in rows)
    what = {"uni": "one-way", "reduce": "reducing, per direction", "bidir": "per direction"}[mode]
    size = f"{big >> 20} MiB" if big >= 1 << 20 else f"{big >> 10} KiB"
    return (f"hetccl bench transport: {size} {what}: " + ", ".join(parts) +
            f"; single-core memcpy {ref:.2f} GB/s; " +
            ("all rows verified" if not wrong else f"{wrong} CORRUPT transfers"))


def main(argv: list[str] | None = None) -> int:
    from hetccl._core import _C
    from hetccl.launch import spawn

    ap = argparse.ArgumentParser(prog="hetccl bench transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default=",".join(_C.transport_names()),
                    help="comma-separated (default: all in this build: %(default)s)")
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="message sizes (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=0,
                    help="messages per run (default: 256 MiB worth, 4..64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row (best, median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="uni,bidir",
                    help="comma-separated subset of uni,bidir,reduce (default: uni,bidir)")
    ap.add_argument("--emulate-hosts", action="store_true",
                    help="ucx: no shared-memory transports between the two processes, as the "
                         "bridge between emulated hosts")
    ap.add_argument("--nconn", type=int, default=4, help="tcp connections per peer")
    ap.add_argument("--ucx-lanes", type=int, default=None,
                    help="UCX lanes (default: HETCCL_UCX_LANES, auto as for two ranks on this "
                         "host); lane threads: HETCCL_UCX_LANE_THREADS; UCX tuning: "
                         "HETCCL_UCX_TUNING")
    ap.add_argument("--slot-bytes", type=int, default=0, help="shm slot size (default 1 MiB)")
    ap.add_argument("--nslots", type=int, default=0, help="shm slots per ring (default 8)")
    ap.add_argument("--jsonl", default=None, help="append one JSON record per row to FILE")
    args = ap.parse_args(argv)
    args.transports = [x for x in args.transports.split(",") if x]
    unknown = [x for x in args.transports if x not in _C.transport_names()]
    if unknown:
        ap.error(f"unknown transport(s) {unknown}; this build has {_C.transport_names()}")
    if args.ucx_lanes is None:
        from hetccl import config
        from hetccl import transports
        args.ucx_lanes = transports.ucx_lanes(config.get("HETCCL_UCX_LANES"),
                                              [transports.usable_cores()] * 2, ["here"] * 2, False)
    args.sizes = [parse_size(x) for x in args.sizes.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    if bad := [m for m in args.modes if m not in ("uni", "bidir", "reduce")]:
        ap.error(f"unknown mode(s) {bad}; known: uni, bidir, reduce")
    rows = spawn(_rank_main, 2, args=(args,), timeout=1800)[0]
    print(summary(rows))
    return 0 if not any(r["wrong"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
