"""all_reduce between emulated hosts (network namespaces, hetccl/netns.py) beside the same job
on one loopback (HETCCL_EMULATE_HOSTS=1): nccl-tests columns per transport and size.

    python3 tests/netns_bench.py [--transports tcp,ucx] [--min 64K] [--max 64M] [--iters 20]

4 ranks, vendors a,a on host 0 and b,b on host 1 (every cross-vendor pair crosses hosts; on
loopback the same split with each vendor group an emulated host). Bounded: at most --iters
timed operations per size and about --budget MiB moved per size and rank. Needs root (skips
the namespace rows, saying why, where namespaces cannot be created).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hetccl import netns  # noqa: E402
from hetccl.bench.report import BUS_FACTOR, Table, hardware, today  # noqa: E402


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def _env(transport: str, vendors: str, **extra) -> dict:
    env = dict(os.environ, HETCCL_TRANSPORT=transport, HETCCL_NETNS_VENDORS=vendors,
               TORCH_CPP_LOG_LEVEL="ERROR", HETCCL_LOG_LEVEL="WARNING", **extra)
    for k in ("HETCCL_VENDOR_SPLIT", "HETCCL_VENDOR"):
        env.pop(k, None)
    return env


def _collect(out: str) -> dict:
    with open(os.path.join(out, "bench-r0-a0.json")) as f:
        return json.load(f)


def run_netns(transport: str, args_json: str, port: int) -> dict:
    out = tempfile.mkdtemp(prefix="hetccl-nsbench-")
    with netns.Hosts(2) as h:
        procs = [h.torchrun(i, [os.path.join(HERE, "netns_worker.py"), "bench", out, args_json],
                            nproc=2, port=port, env=_env(transport, ["a,a", "b,b"][i]),
                            stdout=open(os.path.join(out, f"host{i}.log"), "w"),
                            stderr=subprocess.STDOUT) for i in range(2)]
        codes = netns.wait_all(procs, 900)
        if codes != [0, 0]:
            raise RuntimeError(f"netns {transport}: launchers ended {codes}; logs in {out}")
    return _collect(out)


def run_loopback(transport: str, args_json: str, port: int) -> dict:
    out = tempfile.mkdtemp(prefix="hetccl-lobench-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           os.path.join(HERE, "netns_worker.py"), "bench", out, args_json]
    r = subprocess.run(cmd, env=_env(transport, "a,a,b,b", HETCCL_EMULATE_HOSTS="1"),
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"loopback {transport}: rc {r.returncode}\n{r.stderr[-3000:]}")
    return _collect(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="tcp,ucx")
    p.add_argument("--min", default="64K")
    p.add_argument("--max", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget", type=int, default=512, help="MiB per size and rank (bounds time)")
    p.add_argument("--jsonl", default=None)
    a = p.parse_args(argv)
    sizes, s = [], _size(a.min)
    while s <= _size(a.max):
        sizes.append(s)
        s *= 4
    args_json = json.dumps({"sizes": sizes, "iters": a.iters, "budget_bytes": a.budget << 20})
    ok, why = netns.available()
    if not ok:
        print(f"# namespace rows skipped: {why}")
    from tqdm import tqdm
    runs = [(w, t) for t in a.transports.split(",") for w in (["netns"] if ok else []) + ["loopback"]]
    results = {}
    port = 29400 + os.getpid() % 400
    for i, (where, t) in enumerate(tqdm(runs, desc="runs", file=sys.stderr)):
        fn = run_netns if where == "netns" else run_loopback
        results[(where, t)] = fn(t, args_json, port + i)
    print(f"# all_reduce sum float32, 4 ranks (2 vendors x 2), {hardware()}, {today()}")
    table = Table([("where", 9), ("transport", 9), ("size", 10), ("count", 10), ("type", 6),
                   ("redop", 5), ("time(us)", 10), ("algbw", 7), ("busbw", 7), ("#wrong", 6)],
                  jsonl=a.jsonl)
    table.header()
    for (where, t), res in results.items():
        for r in res["rows"]:
            algbw = r["size"] / r["time_us"] / 1e3
            table.row([where, t, r["size"], r["count"], "float", "sum", r["time_us"], algbw,
                       algbw * BUS_FACTOR["all_reduce"](4), r["wrong"]],
                      {"bench": "netns_allreduce", "where": where, "transport": t, **r,
                       "algbw": algbw, "hardware": hardware(), "date": today()})
    return 1 if any(r["wrong"] for res in results.values() for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
