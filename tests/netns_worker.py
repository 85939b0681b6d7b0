"""Rank-side scenarios of tests/test_netns.py, run under torchrun on emulated hosts
(hetccl/netns.py): `python netns_worker.py SCENARIO OUT_DIR [JSON args]`.

Each rank writes OUT_DIR/<scenario>-r<RANK>-a<restart>.json. Vendor labels come from
HETCCL_NETNS_VENDORS (comma list indexed by LOCAL_RANK; every host's agent gets its own list),
set before hetccl is imported, so the split inside and across hosts is the test's choice
whatever global ranks the c10d rendezvous hands out.
"""
from __future__ import annotations

import gc
import glob
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

_vendors = os.environ.get("HETCCL_NETNS_VENDORS")
if _vendors:
    os.environ["HETCCL_VENDOR"] = _vendors.split(",")[int(os.environ["LOCAL_RANK"])]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import faulthandler  # noqa: E402
import signal  # noqa: E402

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests' way to see a stuck rank
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Ctx:
    """The RankContext shape collective_cases / soak expect, for a torchrun worker."""
    rank, world_size = RANK, WORLD

    @staticmethod
    def init_method():
        return "env://"


def _init(timeout_s: float):
    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", timeout=timedelta(seconds=timeout_s))


def _where() -> dict:
    import hetccl.vendor as v

    return {"hostname": socket.gethostname(), "host_id": v.host_identity(),
            "vendor": os.environ.get("HETCCL_VENDOR"), "pid": os.getpid()}


def _bridge_view() -> dict:
    e = dist.group.WORLD.engine
    return {"kind_of": {str(p): k for p, k in e.bridge.kind_of.items()},
            "hosts": [i.hostname for i in e.topo.infos]}


def _shm_segments() -> list[str]:
    return sorted(glob.glob("/dev/shm/hetccl*"))


def _leaks(base_fds: set, base_threads: int) -> dict:
    gc.collect()
    time.sleep(0.5)
    fds = []
    for fd in set(os.listdir("/proc/self/fd")) - base_fds:
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return {"shm": _shm_segments(), "fds": sorted(fds),
            "threads": [t.name for t in threading.enumerate()][base_threads:]}


def collectives(args: dict) -> dict:
    import collective_cases as cc

    view = {}
    real_destroy = dist.destroy_process_group

    def destroy(*a, **k):  # run_all destroys the group: read the bridge's choice first
        if not view:
            view.update(_bridge_view())
        return real_destroy(*a, **k)

    dist.destroy_process_group = destroy
    try:
        results = cc.run_all(Ctx) if args.get("full", True) else cc.run_all_reduce(Ctx)["results"]
    finally:
        dist.destroy_process_group = real_destroy
    return {"results": results, **view}


def fault(args: dict) -> dict:
    """Large all_reduces until the test injects a fault; reports the error, when it came
    (wall clock, the test knows when it struck), and what was left behind."""
    base_fds = set(os.listdir("/proc/self/fd"))
    base_threads = threading.active_count()
    _init(args["timeout_s"])
    view = _bridge_view()
    n = args.get("numel", 16 << 20)  # 64 MiB of float32: long enough to be cut in the middle
    x = torch.ones(n)
    dist.all_reduce(x)
    ok = bool(torch.all(x == WORLD))
    open(os.path.join(args["out"], f"ready-r{RANK}"), "w").close()
    err, t_err, ops = None, None, 0
    t0 = time.time()
    try:
        while time.time() - t0 < args.get("max_s", 120):
            x.fill_(1.0)
            dist.all_reduce(x)
            ops += 1
    except Exception as e:  # noqa: BLE001
        t_err = time.time()
        err = f"{type(e).__name__}: {e}"
    # a rank that cannot wind down after the fault prints where it is stuck and exits
    faulthandler.dump_traceback_later(args.get("wind_down_s", 15), exit=True)
    t_again = time.time()
    again = None
    if err is not None:
        try:
            dist.all_reduce(torch.ones(3))
            again = "second op succeeded"
        except Exception as e:  # noqa: BLE001
            again = f"{type(e).__name__}: {e}"
    # the engine drops the traceback of the failure it keeps: the big buffer is freed once
    # this frame lets go of it (weakref check), even while the broken group still exists
    import weakref
    ref = weakref.ref(x)
    del x
    # A native library's worker thread may still hold its failed work (and so the buffer) for
    # a moment after the error reached this thread (gloo's runLoop resets its work in progress
    # after marking the future): bounded wait, and who holds it if it stays.
    t_free = time.time()
    gc.collect()
    while ref() is not None and time.time() - t_free < 5:
        time.sleep(0.05)
        gc.collect()
    buffer_freed = ref() is None
    buffer_free_s = round(time.time() - t_free, 3)
    holders = []
    if not buffer_freed:  # who keeps it: the chain of referrers from the frame outwards
        for o in gc.get_referrers(ref()):
            holders.append(f"{type(o).__name__} {str(o)[:100]}")
            if type(o).__name__ == "frame":
                holders.append(f"frame {o.f_code.co_name} {o.f_code.co_filename}:{o.f_lineno}")
                for tb in gc.get_referrers(o):
                    holders.append(f"  <- {type(tb).__name__}")
                    for ex in gc.get_referrers(tb):
                        holders.append(f"    <- {type(ex).__name__} {str(ex)[:60]}")
                        for h in gc.get_referrers(ex):
                            holders.append(f"      <- {type(h).__name__} {str(h)[:100]}")
    t_destroy = time.time()
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        err = (err or "") + f" | destroy: {e}"
    faulthandler.cancel_dump_traceback_later()
    return {"again_s": t_destroy - t_again, "destroy_s": time.time() - t_destroy,"ok_before": ok, "error": err, "t_err": t_err, "ops": ops, "again": again,
            "buffer_freed": buffer_freed, "buffer_free_s": buffer_free_s, "holders": holders, **view, **_leaks(base_fds, base_threads)}


def train(args: dict) -> dict:
    """w <- w - lr * mean over ranks of g(step, rank), g integer-valued so that every sum is
    exact: the final parameters equal the test's float64 reference bit for bit, also after a
    failure at step `kill_at` of the first attempt and an elastic restart from the checkpoint."""
    _init(args.get("timeout_s", 20))
    ckpt = os.path.join(args["out"], "ckpt.pt")
    w = torch.zeros(args.get("numel", 4096), dtype=torch.float64)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        w, start = state["w"], state["step"]
    resumed_at = start
    for step in range(start, args["steps"]):
        mark = os.path.join(args["out"], "killed")
        if step == args["kill_at"] and RANK == args["victim"] and not os.path.exists(mark):
            # once per job: the agents' restart counts differ (only the failed host's counts a
            # restart; the other host's agent re-forms on the membership change), ranks may move
            open(mark, "w").close()
            os.kill(os.getpid(), 9)
        g = torch.Generator().manual_seed(1000 * step + RANK)
        grad = torch.randint(-8, 9, w.shape, generator=g).to(torch.float64)
        dist.all_reduce(grad)
        w -= 0.25 * grad / WORLD
        if RANK == 0:
            tmp = ckpt + ".tmp"
            torch.save({"w": w, "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
    out = {"w": w.tolist()[:64], "w_sum": float(w.sum()), "resumed_at": resumed_at,
           "restart": RESTART}
    torch.save(w, os.path.join(args["out"], f"w-r{RANK}.pt"))
    dist.destroy_process_group()
    return out


def steady(args: dict) -> dict:
    """Verified all_reduces until OUT/stop exists or `seconds` passed (the security test's
    intruder works meanwhile)."""
    import collective_cases as cc

    _init(args.get("timeout_s", 30))
    view = _bridge_view()
    open(os.path.join(args["out"], f"ready-r{RANK}"), "w").close()
    ops = wrong = 0
    t0 = time.monotonic()
    while True:
        stop = os.path.exists(os.path.join(args["out"], "stop"))
        flag = torch.tensor([float(stop or time.monotonic() - t0 > args["seconds"])])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        n = [7, 70001, 1 << 20][ops % 3]
        x = cc.data(RANK, ops, n, torch.float32)
        dist.all_reduce(x)
        ref = cc.reference([cc.data(r, ops, n, torch.float32) for r in range(WORLD)], "sum",
                           torch.float32)
        wrong += cc.close(x, ref, torch.float32, WORLD) is not None
        ops += 1
    dist.destroy_process_group()
    return {"ops": ops, "wrong": wrong, **view}


def bench(args: dict) -> dict:
    """all_reduce (sum, float32) timings per size: `iters` timed ops after 2 warm-ups, the
    slowest rank's mean; every size's result checked against a float64 reference once."""
    import collective_cases as cc

    _init(args.get("timeout_s", 120))
    view = _bridge_view()
    rows = []
    for size in args["sizes"]:
        n = size // 4
        x0 = cc.data(RANK, size, n, torch.float32)
        ref = cc.reference([cc.data(r, size, n, torch.float32) for r in range(WORLD)], "sum",
                           torch.float32)
        x = x0.clone()
        dist.all_reduce(x)
        wrong = int(cc.close(x, ref, torch.float32, WORLD) is not None)
        dist.all_reduce(x)
        iters = max(2, min(args["iters"], int(args["budget_bytes"] // max(size, 1))))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        dt = torch.tensor([(time.perf_counter() - t0) / iters])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        rows.append({"size": size, "count": n, "time_us": dt.item() * 1e6, "wrong": wrong,
                     "iters": iters})
    dist.destroy_process_group()
    return {"rows": rows, **view}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    args["out"] = out
    res = {"rank": RANK, "world": WORLD, "restart": RESTART, **_where()}
    res.update(globals()[scenario](args))
    path = os.path.join(out, f"{scenario}-r{RANK}-a{RESTART}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
