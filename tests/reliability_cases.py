"""Rank-side scenarios for tests/test_reliability.py."""
from __future__ import annotations

import glob
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _init(ctx, timeout_s: float):
    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s))


def peer_dies(ctx, victim: int, how: str, size: int, timeout_s: float):
    """The victim kills (SIGKILL) or stops (SIGSTOP) itself while a collective is in flight;
    the others must raise an error naming it, within the timeout."""
    _init(ctx, timeout_s)
    x = torch.ones(size)
    dist.all_reduce(x)  # everyone connected and working
    if ctx.rank == victim:
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP

        def die():
            time.sleep(0.05)
            os.kill(os.getpid(), sig)

        threading.Thread(target=die, daemon=True).start()
        for _ in range(1000):
            dist.all_reduce(x)
        return None
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        elapsed = time.monotonic() - t0
        # later operations fail at once too
        t1 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3))
            again = "second op succeeded"
        except Exception as e2:  # noqa: BLE001
            again = f"{type(e2).__name__}: {e2}"
        return {"error": f"{type(e).__name__}: {e}", "elapsed": elapsed,
                "again": again, "again_s": time.monotonic() - t1}
    return {"error": None}


def reinit_and_cleanup(ctx):
    """destroy_process_group frees threads and shared memory; a new init works."""
    out = {}
    base_threads = threading.active_count()
    base_tasks = len(os.listdir("/proc/self/task"))
    for round_ in range(2):
        _init(ctx, 30)
        x = torch.full((100_000,), float(ctx.rank))
        dist.all_reduce(x)
        out[f"round{round_}"] = bool((x == sum(range(ctx.world_size))).all())
        out[f"shm_while_live{round_}"] = sorted(glob.glob("/dev/shm/hetccl*"))
        dist.destroy_process_group()
    import gc
    gc.collect()
    time.sleep(0.5)
    out["py_threads_leaked"] = threading.active_count() - base_threads
    out["os_tasks_leaked"] = len(os.listdir("/proc/self/task")) - base_tasks
    return out


def threads_and_groups(ctx):
    """Several process groups, many async ops in flight, issued from several threads."""
    _init(ctx, 60)
    w = ctx.world_size
    groups = [dist.new_group(list(range(w)), backend="hetccl") for _ in range(3)]
    errors = []

    def worker(k, pg):
        try:
            works, bufs = [], []
            for i in range(20):
                t = torch.full((1000 + 37 * i,), float(ctx.rank + k + i))
                works.append(dist.all_reduce(t, group=pg, async_op=True))
                bufs.append((t, sum(r + k + i for r in range(w))))
            for wk in works:
                wk.wait()
            for t, want in bufs:
                if not bool((t == want).all()):
                    errors.append(f"group {k}: wrong result")
        except Exception as e:  # noqa: BLE001
            errors.append(f"group {k}: {e}")

    threads = [threading.Thread(target=worker, args=(k, pg)) for k, pg in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    dist.destroy_process_group()
    return errors


def foreign_socket(ctx):
    """A stranger connects to a live group's TCP listener (sends garbage, or stays silent):
    collectives keep completing correctly."""
    import hetccl

    _init(ctx, 60)
    pg = dist.group.WORLD
    assert isinstance(pg, hetccl.HetcclProcessGroup)
    tr = pg.engine.bridge.transports["tcp"]
    host, port = tr.address().decode().rsplit(":", 1)
    socks = []
    if ctx.rank == 0:
        s1 = socket.create_connection((host, int(port)))
        s1.sendall(os.urandom(4096))
        s2 = socket.create_connection((host, int(port)))  # silent
        s3 = socket.create_connection((host, int(port)))
        s3.sendall(b"HCCL" + b"\x00" * 60)  # looks like a handshake, wrong secret
        socks = [s1, s2, s3]
    ok = True
    for i in range(20):
        x = torch.arange(50_000, dtype=torch.float32) + ctx.rank + i
        dist.all_reduce(x)
        want = torch.arange(50_000, dtype=torch.float32) * ctx.world_size + sum(
            r + i for r in range(ctx.world_size))
        ok = ok and torch.equal(x, want)
    for s in socks:
        s.close()
    dist.destroy_process_group()
    return ok
