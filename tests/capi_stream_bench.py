"""The C API's stream path (csrc/api/stream_path.h), whole calls beside chunked ones
(HETCCL_STREAM_CHUNK_BYTES), on the emulated device runtime (host threads as streams: runs on the
CPU machine) or, with --device cuda, not at all (torch-free C API streams exist only emulated;
the GPU figures come from tests/gpu_dropin_bench.py with the same variable).

  python3 tests/capi_stream_bench.py [--vendors 1+1] [--sizes 1M,16M,64M] [--chunks 0,4M,1M]
                                     [--iters 5] [--rounds 2] [--jsonl rows.jsonl]

Each (round, chunk setting) starts fresh rank processes (vendor groups emulated by
HETCCL_VENDOR); the settings alternate within a round, so drift hits them alike. One row per
size and setting, nccl-tests columns: size count type redop time algbw busbw #wrong, plus the
chunk bytes. Time: median over --iters of (issue the call on a stream, wait for the stream), after
one warm-up; #wrong: elements not equal to the exact sum (integer-valued float32 data)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def worker(cfg_path: str) -> None:
    import numpy as np

    sys.path.insert(0, HERE)
    from capi_worker import load_capi

    capi = load_capi()
    cfg = json.load(open(cfg_path))
    rank, n = cfg["rank"], cfg["n"]
    comm = capi.Comm(n, bytes.fromhex(cfg["uid"]), rank)
    s = comm.stream_create()
    rows = []
    for nbytes in cfg["sizes"]:
        count = nbytes // 4
        x = np.full(count, float(rank + 1), np.float32)
        times = []
        for it in range(cfg["iters"] + 1):
            x.fill(float(rank + 1))
            t0 = time.perf_counter()
            comm.all_reduce(x, x, count, "float32", "sum", stream=s)
            comm.stream_sync(s)
            if it:
                times.append(time.perf_counter() - t0)
        wrong = int((x != n * (n + 1) / 2).sum())
        rows.append({"size": nbytes, "count": count, "time_us": statistics.median(times) * 1e6,
                     "wrong": wrong})
    info = comm.info()
    comm.destroy()
    json.dump({"rows": rows, "chunked_jobs": int(info.get("stream_chunked_jobs", 0))},
              open(cfg["out"], "w"))


def run_once(labels: list[str], sizes: list[int], chunk: int, iters: int) -> dict:
    sys.path.insert(0, HERE)
    from capi_worker import load_capi

    uid = load_capi().unique_id().hex()
    tmp = tempfile.mkdtemp(prefix="hetccl-stream-bench-")
    procs, outs = [], []
    for r, lab in enumerate(labels):
        out, cfg = os.path.join(tmp, f"r{r}.json"), os.path.join(tmp, f"r{r}.cfg")
        json.dump({"uid": uid, "rank": r, "n": len(labels), "sizes": sizes, "iters": iters,
                   "out": out}, open(cfg, "w"))
        env = {**os.environ, "HETCCL_VENDOR": lab, "HETCCL_STREAM_CHUNK_BYTES": str(chunk)}
        env.setdefault("HETCCL_CAPI_DEVICE", "emulated")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", cfg],
                                      env=env))
        outs.append(out)
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
    res = [json.load(open(o)) for o in outs]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--vendors", default="1+1")
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--chunks", default="0,4M,1M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jsonl")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
        return
    labels = [f"v{g}" for g, k in enumerate(a.vendors.split("+")) for _ in range(int(k))]
    n = len(labels)
    sizes = [_bytes(x) for x in a.sizes.split(",")]
    chunks = [_bytes(x) for x in a.chunks.split(",")]
    print(f"# C API stream path, all_reduce float32 sum, {a.vendors} ({n} ranks), device "
          f"{os.environ.get('HETCCL_CAPI_DEVICE', 'emulated')}, median of {a.iters}")
    print(f"{'size':>12} {'count':>10} {'type':>7} {'redop':>5} {'time(us)':>10} {'algbw':>7} "
          f"{'busbw':>7} {'#wrong':>6} {'chunk':>9} round")
    f = open(a.jsonl, "a") if a.jsonl else None
    for rnd in range(a.rounds):
        for chunk in chunks:
            res = run_once(labels, sizes, chunk, a.iters)
            if chunk and min(r["chunked_jobs"] for r in res) == 0 and max(sizes) > chunk:
                raise SystemExit(f"chunk {chunk}: no call took the chunked path")
            for i, row in enumerate(res[0]["rows"]):
                t = max(r["rows"][i]["time_us"] for r in res)
                wrong = sum(r["rows"][i]["wrong"] for r in res)
                algbw = row["size"] / t / 1e3
                busbw = algbw * 2 * (n - 1) / n
                print(f"{row['size']:>12} {row['count']:>10} {'float':>7} {'sum':>5} {t:>10.1f} "
                      f"{algbw:>7.2f} {busbw:>7.2f} {wrong:>6} {chunk:>9} {rnd}")
                if f:
                    f.write(json.dumps({"coll": "all_reduce", "backend": "hetccl-capi-stream",
                                        "vendors": a.vendors, "dtype": "float32", "size": row["size"],
                                        "count": row["count"], "time_us": t, "algbw": algbw,
                                        "busbw": busbw, "wrong": wrong, "chunk_bytes": chunk,
                                        "round": rnd,
                                        "device": os.environ.get("HETCCL_CAPI_DEVICE", "emulated")}) + "\n")
    if f:
        f.close()


if __name__ == "__main__":
    main()
