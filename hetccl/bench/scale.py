"""`hetccl bench scale`: per-rank cost of the C API (csrc/hetccl.h) as the job grows, with
ranks as torch-free processes on this machine (hetccl/bench/scale_worker.py).

For each n, launches n ranks that each create a communicator from one unique id (its bootstrap
root runs in this process) and report: init_s (hetcclCommInitRank), first_us (the first 1 KiB
all_reduce, first-use connections included), later_us (median of later ones), sockets and
threads of the process, shm_MB (hetccl shared memory mapped into it), links (peers reached by
shm / tcp) and the tcp connections actually made. One row per n (max over ranks; later_us: the
slowest rank's median), a progress bar over the ranks' completion, a summary with fits of
sockets, tcp peers, shm and the bootstrap table per rank against n (constant, log n or linear),
--jsonl rows, --plot.

    hetccl bench scale --ranks 8,32,64

The default is bounded (8, 32, 64: about a minute on 2 cores); 128 and 256 take minutes each.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from .. import config
from .report import hardware, today

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_worker.py")


def measure(n: int, iters: int, timeout: float, progress=None) -> dict:
    from .. import capi  # this process may import hetccl; only the ranks stay torch-free

    uid = capi.unique_id().hex()
    env = {**os.environ, "HETCCL_TIMEOUT_S": str(int(timeout)), "OMP_NUM_THREADS": "1",
           "HETCCL_REDUCE_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hetccl-scale-") as d:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, WORKER, uid, str(r), str(n), str(iters),
                                   os.path.join(d, f"r{r}.json")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(n)]
        errs = []
        end = time.monotonic() + timeout + 30
        for p in procs:
            try:
                _, e = p.communicate(timeout=max(1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"n={n}: ranks did not finish within {timeout:.0f} s")
            if p.returncode:
                errs.append(e.decode(errors="replace")[-800:])
            if progress is not None:
                progress.update(1)
        wall = time.perf_counter() - t0
        if errs:
            raise RuntimeError(f"n={n}: {len(errs)} ranks failed; first:\n{errs[0]}")
        per = [json.load(open(os.path.join(d, f"r{r}.json"))) for r in range(n)]
    return {"n": n, "sockets": max(p["sockets"] for p in per),
            "sockets_mean": sum(p["sockets"] for p in per) / n,
            "threads": max(p["threads"] for p in per),
            "shm_MB": max(p["shm_bytes"] for p in per) / 1e6,
            "shm_total_MB": sum(p["shm_bytes"] for p in per) / 1e6 / 2,  # each segment is mapped by both ends
            "links_shm": max(p["links_shm"] for p in per), "links_tcp": max(p["links_tcp"] for p in per),
            "tcp_conns": max(p["tcp_conns"] for p in per),
            "tcp_peers": max(p["tcp_peers"] for p in per),
            "table_KB": max(p.get("table_bytes", 0) for p in per) / 1e3,
            "init_s": max(p["init_s"] for p in per), "first_us": max(p["first_us"] for p in per),
            "later_us": max(p["later_us"] for p in per), "wrong": sum(p["wrong"] for p in per),
            "wall_s": wall}


COLUMNS = [("n", "{:>5}"), ("links_shm", "{:>9}"), ("links_tcp", "{:>9}"), ("tcp_peers", "{:>9}"),
           ("tcp_conns", "{:>9}"), ("table_KB", "{:>8.1f}"),
           ("sockets", "{:>7}"), ("threads", "{:>7}"), ("shm_MB", "{:>7.1f}"),
           ("shm_total_MB", "{:>12.1f}"), ("init_s", "{:>7.2f}"), ("first_us", "{:>9.0f}"),
           ("later_us", "{:>9.0f}"), ("wrong", "{:>6}")]


def _lsq(xs, ys):
    """a, b and the residual sum of squares of y = a + b*x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    return a, b, sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))


def fit(rows, key) -> str:
    """Which of a constant, a + b*log2(n) or a + b*n describes rows[key] best (least squares)."""
    ys = [float(r[key]) for r in rows]
    if len(rows) < 2:
        return f"{ys[0]:.1f} (one point)"
    my = sum(ys) / len(ys)
    if max(ys) - min(ys) <= 0.05 * max(1.0, abs(my)):
        return f"constant {my:.1f}"
    a1, b1, e1 = _lsq([math.log2(r["n"]) for r in rows], ys)
    a2, b2, e2 = _lsq([float(r["n"]) for r in rows], ys)
    return f"{a1:.1f} + {b1:.2f}*log2(n)" if e1 <= e2 else f"{a2:.2f} + {b2:.3f}*n (linear)"


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ns = [r["n"] for r in rows]
    ax[0].plot(ns, [r["sockets"] for r in rows], "o-", label="sockets (max per rank)")
    ax[0].plot(ns, [r["tcp_conns"] for r in rows], "s--", label="hetccl tcp connections")
    ax[1].plot(ns, [r["shm_MB"] for r in rows], "o-", label="shm per rank (MB)")
    ax[2].plot(ns, [r["init_s"] for r in rows], "o-", label="init (s)")
    ax2 = ax[2].twinx()
    ax2.plot(ns, [r["later_us"] / 1000 for r in rows], "s--", color="C1", label="1 KiB all_reduce (ms)")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("ranks")
        a.grid(True, alpha=0.3)
        a.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle("hetccl bench scale: C API ranks on one machine (max over ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hetccl bench scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,32,64", help="comma list of rank counts (default 8,32,64)")
    ap.add_argument("--iters", type=int, default=20, help="later 1 KiB all_reduces per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--jsonl", help="append one JSON object per row")
    ap.add_argument("--plot", help="write a PNG of sockets, shm and times against n")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ranks.split(",") if x.strip()]
    print(f"# hetccl bench scale: C API, ranks {ns}, 1 KiB float32 all_reduce, HETCCL_CAPI_ALGO={config.get('HETCCL_CAPI_ALGO')}, {a.iters} "
          f"later iters, {today()}, {hardware()}")
    print("# " + " ".join(f"{k:>{len(f.format(0))}}" for k, f in COLUMNS))
    bar = None
    if not a.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(ns), desc="ranks done", unit="rank", file=sys.stderr)
    rows = []
    for n in ns:
        r = measure(n, a.iters, a.timeout, bar)
        rows.append(r)
        print("  " + " ".join(f.format(r[k]) for k, f in COLUMNS), flush=True)
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps({"bench": "scale", "date": today(), **r}) + "\n")
    if bar is not None:
        bar.close()
    print("\n# summary (max over ranks)")
    print(f"#   sockets per rank: {fit(rows, 'sockets')}; hetccl tcp peers: {fit(rows, 'tcp_peers')}, "
          f"connections: {fit(rows, 'tcp_conns')}; bootstrap table per rank (KB): {fit(rows, 'table_KB')}")
    print(f"#   shm per rank (MB): {fit(rows, 'shm_MB')}; init (s): " +
          ", ".join(f"n={r['n']}: {r['init_s']:.2f}" for r in rows))
    print("#   1 KiB all_reduce (us; algorithm: csrc/api/select.cc, HETCCL_CAPI_ALGO): " +
          ", ".join(f"n={r['n']}: {r['later_us']:.0f}" for r in rows))
    bad = sum(r["wrong"] for r in rows)
    print(f"# rows: {len(rows)}, wrong elements: {bad}")
    if a.plot:
        plot(rows, a.plot)
        print(f"# plot: {a.plot}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
