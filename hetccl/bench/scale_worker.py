"""One rank of `hetccl bench scale` (hetccl/bench/scale.py): torch-free and without importing the
hetccl package (hetccl/capi.py is loaded by path). argv: uid_hex rank n iters out_path.
Reports, from inside the rank: init time, the first and the median later 1 KiB all_reduce,
its sockets, threads, shared memory mapped, and the C API's own counters (hetcclCommInfo)."""
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("hetccl_capi", os.path.join(_here, "..", "capi.py"))
capi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capi)


def sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def shm_mapped() -> int:
    """Bytes of hetccl shared-memory segments mapped into this process (created or opened)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/hetccl" in line:
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def main():
    uid, rank, n, iters, out = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    t0 = time.perf_counter()
    c = capi.Comm(n, uid, rank)
    init_s = time.perf_counter() - t0
    x = np.ones(256, np.float32)
    t1 = time.perf_counter()
    c.all_reduce(x, x, x.size, "float32", "sum")
    first_us = (time.perf_counter() - t1) * 1e6
    wrong = int((x != n).sum())
    times = []
    for _ in range(iters):
        x.fill(1)
        t = time.perf_counter()
        c.all_reduce(x, x, x.size, "float32", "sum")
        times.append((time.perf_counter() - t) * 1e6)
        wrong += int((x != n).sum())
    info = c.info()
    res = {"init_s": init_s, "first_us": first_us, "later_us": statistics.median(times) if times else 0,
           "wrong": wrong, "sockets": sockets(), "threads": len(os.listdir("/proc/self/task")),
           "shm_bytes": shm_mapped(), "links_shm": int(info.get("links_shm", 0)),
           "links_tcp": int(info.get("links_tcp", 0)),
           "tcp_peers": int(info.get("tcp_connected_peers", 0)),
           "tcp_conns": int(info.get("tcp_connections", 0)),
           "table_bytes": int(info.get("bootstrap_table_bytes", 0))}
    c.all_reduce(x, x, 1, "float32", "sum")  # nobody leaves before every rank has measured
    c.destroy()
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
