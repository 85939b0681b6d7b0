"""Figures of the drop-in NCCL on the GPU box (issue 25), every baseline in the same run:

  * one vendor, world size 1: plain NCCL (nothing preloaded) beside torch over the drop-in
    (which forwards to the same real NCCL), interleaved twice: all_reduce time per size and the
    host issue cost of an async all_reduce;
  * 1+1 emulated vendors on the one GPU: torch's "nccl" process group over the drop-in (hetccl's
    stream path) beside the torch face (backend "hetccl") on the same script.

    python3 tests/gpu_dropin_bench.py --jsonl $OUT/dropin.jsonl [--maxbytes 64M] [--iters 20]
                                      [--variants staged:HETCCL_STREAM_DEVICE_BYTES=off,...]

  * --variants NAME:VAR=VALUE[;VAR=VALUE],...: 1+1 through the drop-in again with those settings,
    configs dropin-1+1-NAME, beside the default rows of the same run: e.g. the C API's staged
    route alone (HETCCL_STREAM_DEVICE_BYTES=off, the landed path before the device route), the
    device route at every size (=1), chunked staged calls (HETCCL_STREAM_CHUNK_BYTES).

Rows (JSON lines, nccl-tests columns): config, backend, vendors, size, count, type, redop,
time_us, algbw, busbw, wrong, and issue_us (median host time of dist.all_reduce(async_op=True)
over --issue calls) at the sizes of --issue-sizes. A short table is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_variants(s: str) -> dict[str, dict[str, str]]:
    """"NAME:VAR=VALUE[;VAR=VALUE],..." -> {NAME: {VAR: VALUE}} (in order)."""
    out = {}
    for v in s.split(","):
        if v.strip():
            name, _, settings = v.partition(":")
            out[name] = dict(kv.split("=", 1) for kv in settings.split(";") if kv)
    return out


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def issue_profiler():
    """Inclusive host time of the torch face's issue steps on the C API route, per call
    (--profile-issue, rank 0): (on, report). on(True) starts timing, report() gives
    {step: [calls per issue, median us, mean us]}. Each wrapper adds ~0.3 us to its step."""
    import hetccl.backend as be
    import hetccl.capi as capi_mod
    import hetccl.face_capi as fc
    from hetccl.device import cuda as cu

    # the steps of a routed all_reduce (backend.allreduce -> CollRoute -> the C API), and the
    # work's wait (its async-error query is Comm._call)
    targets = [(be.HetcclProcessGroup, "allreduce"), (fc.CollRoute, "all_reduce_if_taken"),
               (fc.CollRoute, "all_reduce"), (fc.CollRoute, "_issue"), (fc.CollRoute, "comm"),
               (fc.CollRoute, "_op_code"), (capi_mod.Comm, "check"), (capi_mod.Comm, "_call"),
               (cu.CudaSeam, "caller_stream"), (cu.CallerStream, "current"), (cu.CallerStream, "keep"),
               (cu.CallerStream, "record"), (fc.CapiWork, "__init__"), (fc.CapiWork, "wait")]
    times: dict[str, list[int]] = {}
    state = {"on": False, "issues": 0}

    def wrap(owner, name):
        f = owner.__dict__.get(name)
        if f is None or isinstance(f, (staticmethod, classmethod)):
            return
        key = f"{owner.__name__}.{name}"
        acc = times.setdefault(key, [])

        def timed(*args, **kw):
            if not state["on"]:
                return f(*args, **kw)
            t0 = time.perf_counter_ns()
            try:
                return f(*args, **kw)
            finally:
                acc.append(time.perf_counter_ns() - t0)
        setattr(owner, name, timed)

    for owner, name in targets:
        wrap(owner, name)

    def on(flag: bool, issues: int = 0):
        state["on"] = flag
        state["issues"] += issues
        if flag and not issues:
            for v in times.values():
                v.clear()
            state["issues"] = 0

    def report():
        n = max(state["issues"], 1)
        return {k: [round(len(v) / n, 2), round(statistics.median(v) / 1e3, 2),
                    round(sum(v) / len(v) / 1e3, 2)] for k, v in times.items() if v}
    return on, report


def rank_main(a) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.backend == "hetccl":
        import hetccl  # noqa: F401 - registers the torch face
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group(a.backend, rank=rank, world_size=world)
    sizes = []
    s = parse_size(a.minbytes)
    while s <= parse_size(a.maxbytes):
        sizes.append(s)
        s *= a.factor
    rows = []
    dt = torch.bfloat16
    prof = issue_profiler() if a.profile_issue and rank == 0 and a.backend == "hetccl" else None

    def route_info():
        # the torch face's C API communicator (HETCCL_FACE_ROUTE=capi): its route's counters
        c = getattr(getattr(dist.group.WORLD, "_route", None), "_comm", None)
        return {k: int(v) for k, v in c.info().items()
                if k.startswith("stream_route_") or k.startswith("stream_issue_")} if c else None

    for nbytes in sizes:
        n = nbytes // 2
        t = torch.ones(n, dtype=dt, device=dev)
        for _ in range(3):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        iters = a.iters if nbytes < (32 << 20) else max(5, a.iters // 2)
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            dist.all_reduce(t)
        e1.record()
        torch.cuda.synchronize()
        us = e0.elapsed_time(e1) * 1000 / iters
        # correctness on fresh data: rank r contributes r + 1 (exact in bf16 for small worlds)
        t.fill_(rank + 1)
        dist.all_reduce(t)
        wrong = int((t.float() != world * (world + 1) / 2).sum().item())
        issue = issue_idle = None
        route = profile = None
        if nbytes in [parse_size(x) for x in a.issue_sizes.split(",")]:
            before = route_info()
            dts, waits = [], []
            if prof:
                prof[0](True)
            for _ in range(a.issue):
                c0 = time.perf_counter_ns()
                w = dist.all_reduce(t, async_op=True)
                c1 = time.perf_counter_ns()
                w.wait()
                dts.append((c1 - c0) / 1000)
                # the host time of wait() (a deferred join waits there for the route's enqueue)
                waits.append((time.perf_counter_ns() - c1) / 1000)
                if len(dts) % 50 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            issue = statistics.median(dts)
            if prof:  # the calls above again, timed step by step (the wrappers' cost included)
                prof[0](False, a.issue)
                profile = prof[1]()
                print(f"issue profile {a.config} {nbytes} B (calls/issue, median us, mean us; plain "
                      f"issue median {issue:.1f} us): " + json.dumps(profile), flush=True)
            after = route_info()
            # the same with nothing queued: the stream drained before each call (what a call
            # costs to issue by itself, without back-pressure from the calls ahead of it)
            idle = []
            for _ in range(min(a.issue, 30)):
                torch.cuda.synchronize()
                dist.barrier()
                c0 = time.perf_counter_ns()
                w = dist.all_reduce(t, async_op=True)
                idle.append((time.perf_counter_ns() - c0) / 1000)
                w.wait()
            torch.cuda.synchronize()
            issue_idle = statistics.median(idle)
            if before and after:  # the C API route's issue cost by phase, us per call (stream_path.h)
                route = {k[len("stream_route_"):-3]: round((after[k] - before[k]) / len(dts) / 1e3, 2)
                         for k in after if k.startswith("stream_route_") and k in before}
                # the issuing thread's time inside the C API's stream path, per call
                calls = after.get("stream_issue_calls", 0) - before.get("stream_issue_calls", 0)
                if calls:
                    route["c_issue"] = round((after["stream_issue_ns"] - before["stream_issue_ns"]) / calls / 1e3, 2)
        algbw = nbytes / us / 1e3 if us else 0.0
        rows.append({"config": a.config, "backend": a.backend, "vendors": a.vendors, "size": nbytes,
                     "count": n, "type": "bfloat16", "redop": "sum", "time_us": round(us, 2),
                     "algbw": round(algbw, 3), "busbw": round(algbw * 2 * (world - 1) / world, 3),
                     "wrong": wrong, "issue_us": None if issue is None else round(issue, 2),
                     "issue_idle_us": None if issue_idle is None else round(issue_idle, 2),
                     **({"wait_us": round(statistics.median(waits), 2)} if issue is not None else {}),
                     **({"route_us": route} if route else {}),
                     **({"issue_profile": profile} if prof and issue is not None else {}),
                     "get_backend": dist.get_backend()})
    dist.destroy_process_group()
    if rank == 0:
        with open(a.rows, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, config: str, backend: str, vendors: str, dropin: bool, tmp: str,
           extra_env: dict | None = None) -> list[dict]:
    from hetccl import nccl_dropin

    world = sum(int(x) for x in vendors.split("+"))
    port = free_port()
    rows = os.path.join(tmp, f"{config}.rows")
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        if world > 1:
            env["HETCCL_VENDOR_SPLIT"] = vendors
        if dropin:
            env = nccl_dropin.launch_env("nccl", env)
        env.update(extra_env or {})
        cmd = [sys.executable, __file__, "--rank-main", "--backend", backend, "--config", config,
               "--vendors", vendors, "--rows", rows, "--minbytes", a.minbytes, "--maxbytes", a.maxbytes,
               "--factor", str(a.factor), "--iters", str(a.iters), "--issue", str(a.issue),
               "--issue-sizes", a.issue_sizes] + (["--profile-issue"] if a.profile_issue else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=a.timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append("timed out")
    if any(p.returncode for p in procs) or not os.path.exists(rows):
        print(f"--- {config} failed:\n" + "\n".join(x[-3000:] for x in logs), flush=True)
        return []
    first = [ln for ln in logs[0].splitlines() if ln.startswith("hetccl:")][:3]
    first += [ln for ln in logs[0].splitlines() if ln.startswith("issue profile")]
    for ln in first:
        print(f"  [{config}] {ln}")
    return [json.loads(ln) for ln in open(rows)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank-main", action="store_true")
    p.add_argument("--backend", default="nccl")
    p.add_argument("--config", default="")
    p.add_argument("--vendors", default="1")
    p.add_argument("--rows", default="")
    p.add_argument("--jsonl", default="dropin.jsonl")
    p.add_argument("--minbytes", default="8K")
    p.add_argument("--maxbytes", default="64M")
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--issue", type=int, default=200)
    p.add_argument("--issue-sizes", default="8K,512K,32M")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--profile-issue", action="store_true", help="rank 0 of the torch face times "
                   "each step of its issue path (printed, and 'issue_profile' in the rows)")
    p.add_argument("--skip-face", action="store_true")
    p.add_argument("--only", default="", help="CONFIG,... run only these configurations (e.g. "
                   "facecapi-1+1,nccl-1)")
    p.add_argument("--variants", default="", help="NAME:VAR=VALUE[;VAR=VALUE],... more 1+1 drop-in configs")
    p.add_argument("--face-variants", default="", help="NAME:VAR=VALUE[;VAR=VALUE],... more 1+1 configs of the "
                   "torch face on the C API (facecapi-1+1-NAME), e.g. kernel:HETCCL_CAPI_ROUTE_LAUNCH=kernel")
    a = p.parse_args()
    if a.rank_main:
        rank_main(a)
        return
    import tempfile

    tmp = tempfile.mkdtemp()
    plan = [("nccl-1", "nccl", "1", False, {}), ("dropin-1", "nccl", "1", True, {}),
            ("nccl-1b", "nccl", "1", False, {}), ("dropin-1b", "nccl", "1", True, {}),
            ("dropin-1+1", "nccl", "1+1", True, {})]
    variants = parse_variants(a.variants)
    plan += [(f"dropin-1+1-{name}", "nccl", "1+1", True, env) for name, env in variants.items()]
    face_variants = {}
    if not a.skip_face:
        plan.append(("face-1+1", "hetccl", "1+1", False, {}))
        # the torch face on the C API (HETCCL_FACE_ROUTE=capi, hetccl/face_capi.py)
        plan.append(("facecapi-1+1", "hetccl", "1+1", False, {"HETCCL_FACE_ROUTE": "capi"}))
        face_variants = parse_variants(a.face_variants)
        plan += [(f"facecapi-1+1-{name}", "hetccl", "1+1", False, {"HETCCL_FACE_ROUTE": "capi", **env})
                 for name, env in face_variants.items()]
    if a.only:
        plan = [x for x in plan if x[0] in a.only.split(",")]
    allrows = []
    for config, backend, vendors, dropin, extra in plan:
        t0 = time.time()
        rows = launch(a, config, backend, vendors, dropin, tmp, extra)
        print(f"{config}: {len(rows)} rows in {time.time() - t0:.0f} s", flush=True)
        allrows += rows
    with open(a.jsonl, "a") as f:
        for r in allrows:
            f.write(json.dumps(r) + "\n")
    by = {}
    for r in allrows:
        by.setdefault(r["config"].rstrip("b"), {}).setdefault(r["size"], []).append(r)
    print(f"\n{'size':>10} {'nccl us':>9} {'dropin us':>9} {'ratio':>6} {'nccl iss':>8} {'drop iss':>8}"
          f" | {'1+1 drop':>9} {'1+1 face':>9} {'ratio':>6} {'drop iss':>8} {'face iss':>8} wrong")
    for size in sorted(by.get("nccl-1", {})):
        def med(cfg, key):
            vals = [r[key] for r in by.get(cfg, {}).get(size, []) if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        n, d = med("nccl-1", "time_us"), med("dropin-1", "time_us")
        x, y = med("dropin-1+1", "time_us"), med("face-1+1", "time_us")
        wrong = sum(r["wrong"] for c in by.values() for r in c.get(size, []))
        f = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
        rat = lambda u, v: f"{u / v:6.3f}" if u and v else f"{'-':>6}"  # noqa: E731
        print(f"{size:>10} {f(n)} {f(d)} {rat(d, n)} {f(med('nccl-1', 'issue_us'))[1:]} "
              f"{f(med('dropin-1', 'issue_us'))[1:]} | {f(x)} {f(y)} {rat(x, y)} "
              f"{f(med('dropin-1+1', 'issue_us'))[1:]} {f(med('face-1+1', 'issue_us'))[1:]} {wrong}")
    if by.get("facecapi-1+1"):
        print(f"\n1+1 torch face: {'size':>10} {'engine us':>9} {'capi us':>9} {'ratio':>6} "
              f"{'eng iss':>8} {'capi iss':>8} {'nccl iss':>8} wrong")
        for size in sorted(by["facecapi-1+1"]):
            def med(cfg, key):
                vals = [r[key] for r in by.get(cfg, {}).get(size, []) if r.get(key) is not None]
                return statistics.median(vals) if vals else None
            e, c = med("face-1+1", "time_us"), med("facecapi-1+1", "time_us")
            wrong = sum(r["wrong"] for cfg in ("face-1+1", "facecapi-1+1")
                        for r in by.get(cfg, {}).get(size, []))
            f = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
            print(f"{'':15}{size:>10} {f(e)} {f(c)} {c / e if c and e else float('nan'):6.3f} "
                  f"{f(med('face-1+1', 'issue_us'))[1:]} {f(med('facecapi-1+1', 'issue_us'))[1:]} "
                  f"{f(med('nccl-1', 'issue_us'))[1:]} {wrong}")
        phases = [(size, r["route_us"]) for size in sorted(by["facecapi-1+1"])
                  for r in by["facecapi-1+1"][size][:1] if r.get("route_us")]
        if phases:
            print("\nC API route's issue cost by phase, us per call (stream_path.h): size, "
                  + ", ".join(phases[0][1]) + "; issue us queued, idle (stream drained first)")
            for size, ph in phases:
                r = by["facecapi-1+1"][size][0]
                print(f"{size:>10} " + " ".join(f"{v:9.1f}" for v in ph.values())
                      + f" {r['issue_us']:9.1f} {r['issue_idle_us']:9.1f}")
        print("\nissue us with the stream drained before each call: size, "
              + ", ".join(sorted(by)))
        for size in sorted(by["facecapi-1+1"]):
            vals = [by[c].get(size, [{}])[0].get("issue_idle_us") for c in sorted(by)]
            print(f"{size:>10} " + " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in vals))
        print("\nhost us of issue + wait() (queued calls, medians): size, "
              + ", ".join(sorted(by)))
        for size in sorted(by["facecapi-1+1"]):
            vals = []
            for c in sorted(by):
                r = by[c].get(size, [{}])[0]
                vals.append(None if r.get("wait_us") is None else r["issue_us"] + r["wait_us"])
            print(f"{size:>10} " + " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in vals))
    for name in face_variants:
        cfg = f"facecapi-1+1-{name}"
        print(f"\n1+1 torch face on the C API, variant {name}: size, us, / facecapi, / face (engine), "
              f"issue us queued, idle, nccl-1 issue us, wrong")
        for size in sorted(by.get(cfg, {})):
            r = by[cfg][size][0]
            w = by.get("facecapi-1+1", {}).get(size, [{}])[0].get("time_us")
            fc = by.get("face-1+1", {}).get(size, [{}])[0].get("time_us")
            ni = by.get("nccl-1", {}).get(size, [{}])[0].get("issue_us")
            print(f"{size:>10} {r['time_us']:9.1f} {r['time_us'] / w if w else float('nan'):6.3f} "
                  f"{r['time_us'] / fc if fc else float('nan'):6.3f} {r.get('issue_us') or '-'} "
                  f"{r.get('issue_idle_us') or '-'} {ni or '-'} {r['wrong']}")
    for name in variants:
        cfg = f"dropin-1+1-{name}"
        print(f"\n1+1 drop-in, variant {name}: size, us, / default drop-in, / torch face, issue us, wrong")
        for size in sorted(by.get(cfg, {})):
            r = by[cfg][size][0]
            w = by.get("dropin-1+1", {}).get(size, [{}])[0].get("time_us")
            fc = by.get("face-1+1", {}).get(size, [{}])[0].get("time_us")
            print(f"{size:>10} {r['time_us']:9.1f} {r['time_us'] / w if w else float('nan'):6.3f} "
                  f"{r['time_us'] / fc if fc else float('nan'):6.3f} {r.get('issue_us') or '-'} {r['wrong']}")


if __name__ == "__main__":
    main()
