"""`hetccl bench footprint`: what one rank costs as the job grows.

For each vendor split (e.g. 1+1, 2+2, 4+4) and host mode (one shared host: shared-memory
bridge; emulated hosts: every vendor group a host of its own, tcp bridge), launches the ranks
as local processes (torch face, emulated vendors, CPU tensors) and has every rank report, from
inside itself:
  bridge_peers ranks this rank's bridge may reach (every cross-vendor peer, plus same-vendor
               peers linked by shared memory)
  tcp_peers    of those, the ones the tcp bridge has connected to (connections are made on
               first use: HETCCL_TCP_LAZY), and tcp_conns their connections
  sockets      open sockets of the process (/proc/self/fd): bridge connections and listener,
               the store client, and gloo's own inside a vendor group
  shm_MB       shared memory the rank created for its bridge rings (the shm transport's
               info(): created_bytes; on GPU hosts this memory is also pinned)
  threads      threads of the process
  init_s       init_process_group("hetccl") (bridge set-up included)
  first_us     the first 1 KiB all_reduce (any first-use set-up included)
  later_us     median of later 1 KiB all_reduces
and prints one row per configuration (max over ranks; later_us: the slowest rank's median),
a progress bar over configurations, and a short summary. --jsonl appends the rows, --plot
draws sockets and shared memory per rank against the number of ranks.

    hetccl bench footprint --vendors 1+1,2+2,4+4 --hosts shared,emulated

The default is bounded (8 ranks at most). Several hundred ranks need the torch-free C API
(issue 24): each rank here is a torch process (~300 MB of memory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

from .report import hardware, today


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def _rank(ctx, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    import hetccl  # noqa: F401

    t0 = time.perf_counter()
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=300))
    init_s = time.perf_counter() - t0
    x = torch.ones(256)
    t1 = time.perf_counter()
    dist.all_reduce(x)
    first_us = (time.perf_counter() - t1) * 1e6
    wrong = int((x != ctx.world_size).sum())
    times = []
    for _ in range(iters):
        x.fill_(1)
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append((time.perf_counter() - t) * 1e6)
    wrong += int((x != ctx.world_size).sum())
    pg = dist.group.WORLD
    bridge = pg.engine.bridge
    shm = bridge.info.get("shm", {})
    tcp = dict(bridge.transports["tcp"].info()) if "tcp" in bridge.transports else {}
    out = {"sockets": _sockets(), "threads": len(os.listdir("/proc/self/task")),
           "shm_bytes": int(shm.get("created_bytes", 0)), "init_s": init_s,
           "first_us": first_us, "later_us": statistics.median(times), "wrong": wrong,
           "transports": sorted(set(bridge.kind_of.values())),
           "bridge_peers": len(bridge.linked),
           "tcp_peers": int(tcp.get("connected_peers", 0)),
           "tcp_conns": int(tcp.get("connections", 0))}
    dist.barrier()
    dist.destroy_process_group()
    return out


def measure(split: str, hosts: str, iters: int = 20, timeout: float = 600) -> dict:
    from ..launch import spawn

    world = sum(int(x) for x in split.split("+"))
    env = {"HETCCL_EMULATE_HOSTS": "1"} if hosts == "emulated" else {}
    t0 = time.perf_counter()
    per = spawn(_rank, world, args=(iters,), vendors=split, env=env, timeout=timeout)
    return {"vendors": split, "n": world, "hosts": hosts,
            "transports": ",".join(per[0]["transports"]),
            "bridge_peers": max(p["bridge_peers"] for p in per),
            "tcp_peers": max(p["tcp_peers"] for p in per),
            "tcp_conns": max(p["tcp_conns"] for p in per),
            "sockets": max(p["sockets"] for p in per),
            "shm_MB": max(p["shm_bytes"] for p in per) / 1e6,
            "shm_total_MB": sum(p["shm_bytes"] for p in per) / 1e6,
            "threads": max(p["threads"] for p in per),
            "init_s": max(p["init_s"] for p in per),
            "first_us": max(p["first_us"] for p in per),
            "later_us": max(p["later_us"] for p in per),
            "wrong": sum(p["wrong"] for p in per),
            "wall_s": time.perf_counter() - t0}


COLUMNS = [("vendors", "{:>8}"), ("n", "{:>4}"), ("hosts", "{:>9}"), ("transports", "{:>10}"),
           ("bridge_peers", "{:>6}"), ("tcp_peers", "{:>6}"), ("tcp_conns", "{:>6}"),
           ("sockets", "{:>8}"), ("shm_MB", "{:>8.1f}"),
           ("shm_total_MB", "{:>10.1f}"), ("threads", "{:>8}"), ("init_s", "{:>7.2f}"),
           ("first_us", "{:>9.0f}"), ("later_us", "{:>9.0f}"), ("wrong", "{:>6}")]


def _header() -> str:
    return "# " + " ".join(f"{name:>{len(fmt.format(0) if 'f' in fmt else fmt.format('x'))}}"
                           for name, fmt in COLUMNS)


def _row(r: dict) -> str:
    return "  " + " ".join(fmt.format(r[name]) for name, fmt in COLUMNS)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for hosts in sorted({r["hosts"] for r in rows}):
        rs = sorted((r for r in rows if r["hosts"] == hosts), key=lambda r: r["n"])
        axes[0].plot([r["n"] for r in rs], [r["sockets"] for r in rs], "o-",
                     label=f"{hosts}: all sockets")
        if any(r.get("tcp_conns") for r in rs):
            axes[0].plot([r["n"] for r in rs], [r["tcp_conns"] for r in rs], "s--",
                         label=f"{hosts}: hetccl tcp connections")
        axes[1].plot([r["n"] for r in rs], [r["shm_MB"] for r in rs], "o-", label=hosts)
    for ax, what in zip(axes, ("sockets per rank", "shared memory per rank (MB)")):
        ax.set_xlabel("ranks")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("hetccl bench footprint (max over ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hetccl bench footprint",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vendors", default="1+1,2+2,4+4",
                    help="comma list of vendor splits (default 1+1,2+2,4+4)")
    ap.add_argument("--hosts", default="shared,emulated",
                    help="comma list: shared (one host, shm bridge), emulated (a host per "
                         "vendor group, tcp bridge)")
    ap.add_argument("--iters", type=int, default=20, help="later small all_reduces per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--jsonl", help="append one JSON object per row")
    ap.add_argument("--plot", help="write sockets and shared memory per rank vs ranks (PNG)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    configs = [(v.strip(), h.strip()) for v in a.vendors.split(",") if v.strip()
               for h in a.hosts.split(",") if h.strip()]
    for _, h in configs:
        if h not in ("shared", "emulated"):
            ap.error(f"--hosts: {h!r} is neither 'shared' nor 'emulated'")
    print(f"# hetccl bench footprint: {len(configs)} configurations, 1 KiB all_reduce, "
          f"{a.iters} later iters, {today()}, {hardware()}")
    print(_header())
    rows = []
    it = configs
    if not a.no_progress:
        from tqdm import tqdm
        it = tqdm(configs, desc="footprint", unit="config", file=sys.stderr)
    for split, hosts in it:
        r = measure(split, hosts, a.iters, a.timeout)
        rows.append(r)
        print(_row(r), flush=True)
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps({"bench": "footprint", **r}) + "\n")
    print("\n# summary (max over ranks)")
    for hosts in sorted({r["hosts"] for r in rows}):
        rs = sorted((r for r in rows if r["hosts"] == hosts), key=lambda r: r["n"])
        print(f"#  {hosts:>8} hosts: " + "; ".join(
            f"n={r['n']}: {r['sockets']} sockets, {r['shm_MB']:.1f} MB shm, init "
            f"{r['init_s']:.2f} s" for r in rs))
    bad = sum(r["wrong"] for r in rows)
    print(f"# rows: {len(rows)}, wrong elements: {bad}")
    if a.plot:
        plot(rows, a.plot)
        print(f"# plot: {a.plot}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
