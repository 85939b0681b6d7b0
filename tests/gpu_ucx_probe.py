"""Diagnostic for UCX's direct device path (`.ci/gpu-box.sh ucxprobe`; not a test): 1+1 emulated
vendors on emulated hosts over UCX, each step bounded in time, one JSON line per rank.

Steps: host memory through the bridge's UCX transport; device memory handed to it without and
with Transport.bind_device (the progress thread's device context, memory type declared); then
small and pipelined all-reduces through the engine. A step that does not finish reports
"timeout" instead of hanging the run, so one run on the box says which layer stalls.

Knobs: PROBE_UNBOUND=0 skips the raw device transfer before binding, PROBE_BIND=0 leaves the
binding to the engine, PROBE_SIZES / PROBE_DTYPES / PROBE_OPS the synchronized all-reduces,
PROBE_ASYNC sizes for eight all-reduces in flight and for the copy-in / reduce / copy-out pattern
of tests/gpu_ucx_cases.py. Results of 2026-12-01: docs/benchmarks/ucx_probe_h200x1.txt."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _bounded(fn, seconds):
    box: dict = {}

    def run():
        try:
            box["r"] = fn()
        except Exception as e:  # noqa: BLE001
            box["r"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    th = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    th.start()
    th.join(seconds)
    return (box.get("r", "timeout"), round(time.perf_counter() - t0, 3))


def rank_main(ctx) -> dict:
    import hetccl

    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=2, timeout=timedelta(seconds=60))
    pg = dist.group.WORLD
    assert isinstance(pg, hetccl.HetcclProcessGroup)
    b = pg.engine.bridge
    peer = 1 - ctx.rank
    t = b.transport_of(peer)
    out: dict = {"rank": ctx.rank, "choice": b.choices[(ctx.rank, peer)].describe(),
                 "ucx": dict(t.info())}

    def pair(nbytes, tag, device):
        if device:
            buf = torch.full((nbytes,), ctx.rank + 1, dtype=torch.uint8, device=dev)
        else:
            buf = torch.full((nbytes,), ctx.rank + 1, dtype=torch.uint8)
        got = torch.zeros_like(buf)
        torch.cuda.synchronize()
        if device:
            r = t.irecv_device(peer, got.data_ptr(), nbytes, tag)
            s = t.isend_device(peer, buf.data_ptr(), nbytes, tag)
        else:
            r = t.irecv(peer, got.data_ptr(), nbytes, tag)
            s = t.isend(peer, buf.data_ptr(), nbytes, tag)

        def wait(buf=buf):  # buf referenced: the send reads it until it completes
            s.wait(30000)
            r.wait(30000)
            return "ok" if bool((got == peer + 1).all().item()) else "wrong data"
        return wait

    dist.barrier()
    out["host_1MiB"] = _bounded(pair(1 << 20, (1 << 47) | 100, False), 15)
    if os.environ.get("PROBE_UNBOUND", "1") == "1":
        out["device_4KiB_unbound"] = _bounded(pair(4096, (1 << 47) | 200, True), 15)
    from hetccl import device as devices
    if os.environ.get("PROBE_BIND", "1") == "1":  # else the engine binds on its first message
        try:
            t.bind_device(devices.seam("cuda").runtime(), dev.index, "cuda")
            out["bind"] = "ok"
        except Exception as e:  # noqa: BLE001
            out["bind"] = f"error: {e}"
        time.sleep(0.2)
        out["device_4KiB_bound"] = _bounded(pair(4096, (1 << 47) | 300, True), 15)
        out["device_4MiB_bound"] = _bounded(pair(4 << 20, (1 << 47) | 301, True), 20)
    sizes = [int(v) for v in os.environ.get("PROBE_SIZES", "1001,1048576").split(",")]
    dtypes = os.environ.get("PROBE_DTYPES", "float32").split(",")
    ops = os.environ.get("PROBE_OPS", "SUM").split(",")
    for n, dt, opn in ((n, dt, opn) for n in sizes for dt in dtypes for opn in ops):
        x = torch.full((n,), float(ctx.rank + 1), device=dev, dtype=getattr(torch, dt))
        want = 3.0 if opn == "SUM" else 2.0

        def ar(x=x, opn=opn, want=want):  # synchronized before the result is read
            dist.all_reduce(x, op=getattr(dist.ReduceOp, opn))
            torch.cuda.synchronize()
            return "ok" if bool((x == want).all().item()) else "wrong data"
        key = f"all_reduce_{n}_{dt}_{opn}"
        out[key] = _bounded(ar, 20)
        print(key, out[key], flush=True)
        if out[key][0] != "ok":
            break
    for n in [int(v) for v in os.environ.get("PROBE_ASYNC", "").split(",") if v]:
        xs = [torch.full((n,), float(ctx.rank + 1), device=dev) for _ in range(8)]

        def many(xs=xs):  # eight in flight, one wait (how the bench issues them)
            for x in xs:
                dist.all_reduce(x)
            torch.cuda.synchronize()
            return "ok" if all(bool((x == 3.0).all().item()) for x in xs) else "wrong data"
        key = f"async8_{n}"
        out[key] = _bounded(many, 20)
        print(key, out[key], flush=True)
        host = torch.randn(n, generator=torch.Generator().manual_seed(n))

        def from_host(host=host):  # copied in on the stream, reduced at once (the test's pattern)
            x = host.to(dev)
            dist.all_reduce(x)
            return "ok" if torch.allclose(x.cpu(), 2 * host) else "wrong data"
        key = f"from_host_{n}"
        out[key] = _bounded(from_host, 20)
        print(key, out[key], flush=True)
    try:
        out["stats"] = {k: v for k, v in pg.engine.stats.items() if v}
    except Exception as e:  # noqa: BLE001
        out["stats"] = f"error: {e}"
    print(json.dumps(out, default=str), flush=True)  # also if the launcher's teardown stalls
    return out


def main() -> int:
    from hetccl.launch import spawn
    env = {"HETCCL_EMULATE_HOSTS": "1", "HETCCL_TRANSPORT": "ucx", "HETCCL_UCX_DEVICE": "auto",
           "CUDA_MODULE_LOADING": "EAGER"}
    try:
        res = spawn(rank_main, 2, vendors="1+1", env=env, timeout=200)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"probe": "failed", "error": str(e)[-3000:]}))
        return 1
    for r in res:
        print(json.dumps(r, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
