"""Diagnostic for UCX's direct device path (`.ci/gpu-box.sh ucxprobe`; not a test): 1+1 emulated
vendors on emulated hosts over UCX, each step bounded in time, one JSON line per rank.

Steps: host memory through the bridge's UCX transport; device memory handed to it without and
with Transport.bind_device (the progress thread's device context, memory type declared); then
small and pipelined all-reduces through the engine. A step that does not finish reports
"timeout" instead of hanging the run, so one run on the box says which layer stalls."""
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

        def wait():
            s.wait(30000)
            r.wait(30000)
            return "ok" if bool((got == peer + 1).all().item()) else "wrong data"
        return wait

    dist.barrier()
    out["host_1MiB"] = _bounded(pair(1 << 20, 100, False), 15)
    if os.environ.get("PROBE_UNBOUND", "1") == "1":
        out["device_4KiB_unbound"] = _bounded(pair(4096, 200, True), 15)
    from hetccl import device as devices
    try:
        t.bind_device(devices.seam("cuda").runtime(), dev.index, "cuda")
        out["bind"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["bind"] = f"error: {e}"
    time.sleep(0.2)
    out["device_4KiB_bound"] = _bounded(pair(4096, 300, True), 15)
    out["device_4MiB_bound"] = _bounded(pair(4 << 20, 301, True), 20)
    for n in (1001, 1 << 20):
        x = torch.full((n,), float(ctx.rank + 1), device=dev)

        def ar(x=x):
            dist.all_reduce(x)
            torch.cuda.synchronize()
            return "ok" if bool((x == 3.0).all().item()) else "wrong data"
        out[f"all_reduce_{n}"] = _bounded(ar, 25)
    try:
        out["stats"] = {k: v for k, v in pg.engine.stats().items() if v}
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
