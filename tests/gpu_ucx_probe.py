"""Diagnostic for UCX's direct device path (`.ci/gpu-box.sh ucxprobe`; not a test): 1+1 emulated
vendors on emulated hosts over UCX, every step bounded in time, one run that decides.

It runs the same steps under these configurations, each in a fresh pair of processes:
  direct-unprepared  HETCCL_UCX_DEVICE=force HETCCL_UCX_DEVICE_PREPARE=off: device memory to
                     UCX (cuda_copy), UCX querying every device buffer on the engine's proxy
  direct-prepared    HETCCL_UCX_DEVICE=force HETCCL_UCX_DEVICE_PREPARE=on: the issuing thread
                     maps each buffer once and posts carry the handle (csrc/ucx_transport.cc)
  direct-prepared-eager  the same with UCX_RNDV_THRESH=inf (no rendezvous fragments)
  staged             HETCCL_UCX_DEVICE=off: the engine stages device data through host memory
  auto               the default: must resolve to staged where the device path is not
                     runtime-free (every UCX of this build; docs/transports.md)
Steps: host memory through the transport; synchronized all-reduces (fp32 SUM, bf16 MAX); the
pattern that stalled on 2026-12-01 -- `x = host.to(dev); all_reduce(x); x.cpu()`, a pageable
copy right behind the collective -- at four sizes, three times each; eight all-reduces in flight;
all_gather / reduce_scatter checked; a timed 16 MiB bf16 all-reduce loop.

A step that does not finish within PROBE_STEP_TIMEOUT seconds is a stall: the rank records
which step, every thread's native stack (tid, thread name, top frames; the raw dump and, where
gdb exists, gdb's `thread apply all bt` go to $PROBE_OUT), the Python stacks, prints its result
and exits, so the next configuration still runs. The last lines say per configuration "ok" or
"STALL at <step>", the CAUSE where the stacks show a transport thread and an application
thread both inside the CUDA driver (deadlock()), and a verdict.

Found on one H100 (2026-12-05): UCX's progress thread in cuMemcpyAsync (uct_cuda_copy_ep_put_short
<- ucp_mem_type_unpack <- ucp_eager_only_handler: an eager message unpacked into device memory)
waiting for the driver's lock, while the application thread sat in cuMemcpyDtoHAsync_v2 (x.cpu(),
pageable) behind the collective's stream (docs/transports.md, docs/benchmarks/ucx_probe_h100x1_2026-12-05.txt).

Knobs: PROBE_CONFIGS (comma list, default all), PROBE_STEP_TIMEOUT (10), PROBE_CONFIG_TIMEOUT
(50, per configuration), PROBE_OUT (directory for raw stacks; default: none written).
Earlier results: docs/benchmarks/ucx_probe_h200x1.txt."""
from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

CONFIGS = {
    "direct-unprepared": {"HETCCL_UCX_DEVICE": "force", "HETCCL_UCX_DEVICE_PREPARE": "off"},
    "direct-prepared": {"HETCCL_UCX_DEVICE": "force", "HETCCL_UCX_DEVICE_PREPARE": "on"},
    # the prepared path with UCX's eager protocol only: no rendezvous fragments, whose first
    # registration per allocation (ucp_memh_get_slow) would still query memory on UCX's thread
    "direct-prepared-eager": {"HETCCL_UCX_DEVICE": "force", "HETCCL_UCX_DEVICE_PREPARE": "on",
                              "UCX_RNDV_THRESH": "inf"},
    "staged": {"HETCCL_UCX_DEVICE": "off"},
    # the default: must resolve to staged (no UCX of this build is runtime-free)
    "auto": {"HETCCL_UCX_DEVICE": "auto"},
}
# objects whose frames say where a stalled thread waits
_INTERESTING = ("libcuda", "libuct", "libucp", "libucs", "_C.cpython", "libtorch_cuda", "libcudart")


class Stall(Exception):
    pass


def _bounded(fn, seconds):
    """(result, seconds) of fn() run on a helper thread; "timeout" when it did not finish."""
    box: dict = {}

    def run():
        try:
            box["r"] = fn()
        except Exception as e:  # noqa: BLE001
            box["r"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    th = threading.Thread(target=run, daemon=True, name="probe-step")
    t0 = time.perf_counter()
    th.start()
    th.join(seconds)
    return (box.get("r", "timeout"), round(time.perf_counter() - t0, 3))


def _symbolize(obj: str, off: str) -> str:
    if not shutil.which("addr2line") or "libcuda" in obj:  # libcuda has no symbols to give
        return "?"
    try:
        r = subprocess.run(["addr2line", "-f", "-C", "-e", obj, off], capture_output=True,
                           text=True, timeout=10)
        name = r.stdout.splitlines()[0] if r.stdout else "?"
        return name if name != "??" else "?"
    except Exception:  # noqa: BLE001
        return "?"


def native_stacks(tag: str) -> list:
    """Every thread's native frames (hetccl._C.dump_thread_stacks, stderr captured), summarised:
    [{"tid", "name", "top": ["object:symbol+offset", ...]}] for threads with a frame in CUDA,
    UCX, hetccl or torch's CUDA code. Raw text (and gdb's backtraces where gdb exists) to
    $PROBE_OUT/ucx_probe_stacks_<tag>.txt."""
    from hetccl._core import _C
    f = tempfile.TemporaryFile(mode="w+b")
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        answered = _C.dump_thread_stacks()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    f.seek(0)
    text = f.read().decode(errors="replace")
    out_dir = os.environ.get("PROBE_OUT")
    raw = os.path.join(out_dir, f"ucx_probe_stacks_{tag}.txt") if out_dir else ""
    if raw:  # written at once: a configuration killed at its time limit keeps it
        with open(raw, "w") as g:
            g.write(f"# {answered} threads answered\n{text}\n")
    gdb_text = ""
    if shutil.which("gdb"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER_ANY
            gdb_text = subprocess.run(
                ["gdb", "-p", str(os.getpid()), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                capture_output=True, text=True, timeout=10).stdout
        except Exception as e:  # noqa: BLE001
            gdb_text = f"gdb failed: {e}"
    if raw and gdb_text:
        with open(raw, "a") as g:
            g.write("# gdb\n" + gdb_text)
    threads, cur = [], None
    for line in text.splitlines():
        m = re.match(r"hetccl-stack (\d+) (.*)", line)
        if m:
            cur = {"tid": int(m.group(1)), "name": m.group(2), "frames": []}
            threads.append(cur)
            continue
        m = re.match(r"hetccl-frame (\S+) \+(0x[0-9a-f]+) (\S+)", line)
        if m and cur is not None:
            cur["frames"].append(m.groups())
    summary = []
    for t in threads:
        if not any(any(k in fr[0] for k in _INTERESTING) for fr in t["frames"]):
            continue
        top = []
        for obj, off, sym in t["frames"][:10]:
            base = os.path.basename(obj)
            # UCX's and hetccl's own objects: addr2line names static functions too; elsewhere
            # dladdr's name is the nearest exported symbol before the frame (marked "~")
            exact = _symbolize(obj, off) if base.startswith(("libuc", "_C.")) else "?"
            name = exact if exact != "?" else (f"~{sym}" if sym != "?" else "?")
            top.append(f"{base}:{name}+{off}")
        summary.append({"tid": t["tid"], "name": t["name"], "top": top,
                        # every frame's object and exported symbol (for deadlock())
                        "all": [f"{os.path.basename(o)}:{sym}" for o, _, sym in t["frames"]]})
    return summary


def deadlock(threads: list) -> str:
    """One line naming the runtime deadlock the stacks show, "" when they do not show one: a
    transport thread (UCX's progress thread, the engine's proxy or copy thread) inside the CUDA
    driver, called from UCX, while an application thread (one with torch frames) is inside the
    driver too -- a blocking call behind the collective's stream, holding the lock that the
    transport thread's call waits for."""
    def in_driver(t):
        return any(f.startswith("libcuda.so") for f in t["all"])

    def first_api(t, prefix):  # the outermost exported driver/runtime entry, e.g. cuMemcpyAsync
        names = [f.split(":", 1)[1] for f in t["all"]
                 if f.startswith(prefix) and f.split(":", 1)[1] not in ("?", "")]
        return names[-1] if names else "?"
    transport = [t for t in threads if t["name"].startswith("hetccl-") and in_driver(t)
                 and any(f.startswith(("libuct", "libucp")) for f in t["all"])]
    app = [t for t in threads if not t["name"].startswith(("hetccl-", "cuda")) and in_driver(t)
           and any(f.startswith(("libtorch", "libcudart")) for f in t["all"])]
    if not (transport and app):
        return ""
    tt, at = transport[0], app[0]
    via = [f.split(":", 1)[1] for f in tt["all"] if f.startswith(("libuct", "libucp"))
           and not f.endswith(":?")][:2]
    return (f"thread {tt['tid']} {tt['name']} is in the CUDA driver ({first_api(tt, 'libcuda.so')} "
            f"from {' <- '.join(via) or 'UCX'}) while application thread {at['tid']} is in it "
            f"too ({first_api(at, 'libcuda.so')}, from torch): the application's call waits for the "
            "collective's stream, which waits for the message UCX's driver call would finish")


def rank_main(ctx) -> dict:
    import hetccl
    from hetccl._core import _C

    cfg = os.environ.get("PROBE_CONFIG", "?")
    step_s = float(os.environ.get("PROBE_STEP_TIMEOUT", "10"))
    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=2, timeout=timedelta(seconds=60))
    pg = dist.group.WORLD
    assert isinstance(pg, hetccl.HetcclProcessGroup)
    b = pg.engine.bridge
    peer = 1 - ctx.rank
    t = b.transport_of(peer)
    out: dict = {"config": cfg, "rank": ctx.rank, "choice": b.choices[(ctx.rank, peer)].describe(),
                 "ucx": dict(t.info()), "steps": {}}

    def step(name, fn, seconds=step_s):
        r = _bounded(fn, seconds)
        out["steps"][name] = r
        print(f"[{cfg} rank {ctx.rank}] {name}: {r[0]} ({r[1]} s)", flush=True)
        if r[0] == "timeout":
            out["stall"] = {"step": name, "threads": native_stacks(f"{cfg}_rank{ctx.rank}")}
            faulthandler.dump_traceback(all_threads=True)
            raise Stall(name)
        return r[0]

    def host_pair():
        n, tag = 1 << 20, (1 << 47) | 100
        buf = torch.full((n,), ctx.rank + 1, dtype=torch.uint8)
        got = torch.zeros_like(buf)
        r = t.irecv(peer, got.data_ptr(), n, tag)
        s = t.isend(peer, buf.data_ptr(), n, tag)
        s.wait(10000)
        r.wait(10000)
        return "ok" if bool((got == peer + 1).all().item()) else "wrong data"

    def synced(n, dt, opn):
        def fn():
            x = torch.full((n,), float(ctx.rank + 1), device=dev, dtype=dt)
            dist.all_reduce(x, op=getattr(dist.ReduceOp, opn))
            torch.cuda.synchronize()
            want = 3.0 if opn == "SUM" else 2.0
            return "ok" if bool((x == want).all().item()) else "wrong data"
        return fn

    def from_host(n, seed):
        host = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        other = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
        mine, theirs = (host, other) if ctx.rank == 0 else (other, host)

        def fn():  # the pattern that stalled: pageable copy in, collective, pageable copy out
            x = mine.to(dev)
            dist.all_reduce(x)
            got = x.cpu()
            want = mine.double() + theirs.double()
            return "ok" if torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5) else "wrong data"
        return fn

    def many(n):
        def fn():
            xs = [torch.full((n,), float(ctx.rank + 1), device=dev) for _ in range(8)]
            for x in xs:
                dist.all_reduce(x)
            torch.cuda.synchronize()
            return "ok" if all(bool((x == 3.0).all().item()) for x in xs) else "wrong data"
        return fn

    def size_change():
        # stalled on one H100 (2026-12-05, session 20): 4096 elements, then 2 -- the second call
        # never finished on rank 0 while rank 1's did; runs of equal sizes (2 x 8, 4096 x 6)
        # passed. Synchronized after each call, as the sequence that stalled.
        for n in (4096, 2, 1, 4096, 3, 1 << 20, 5):
            x = torch.full((n,), float(ctx.rank + 1), device=dev)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            if not bool((x == 3.0).all().item()):
                return f"wrong data at {n} elements"
        return "ok"

    def gather_scatter():
        n = 1 << 18
        x = torch.arange(n, device=dev, dtype=torch.float32) + ctx.rank
        outs = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(outs, x)
        ok = all(torch.equal(outs[r].cpu(), (torch.arange(n) + r).float()) for r in range(2))
        inp = [torch.full((n,), float(ctx.rank + 1 + 10 * r), device=dev) for r in range(2)]
        res = torch.empty(n, device=dev)
        dist.reduce_scatter(res, inp)
        ok = ok and bool((res.cpu() == float(3 + 20 * ctx.rank)).all())
        return "ok" if ok else "wrong data"

    def timed():
        n = 8 << 20  # 16 MiB of bf16
        x = torch.ones(n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        iters = 10
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        out["all_reduce_16MiB_bf16"] = {"us": round(dt * 1e6, 1), "busbw_GBps": round(2 * n / dt / 1e9, 2)}
        return "ok" if bool(torch.isfinite(x.float()).all()) else "wrong data"

    try:
        dist.barrier()
        # the test's first call (tests/gpu_ucx_cases.py: one element copied in from the host),
        # which stalled there on one H100 (2026-12-05) before any other device message
        step("first_from_host_1", from_host(1, 3))
        step("host_1MiB", host_pair)
        for n, dt, opn in ((1001, torch.float32, "SUM"), (1 << 20, torch.float32, "SUM"),
                           (4194311, torch.float32, "SUM"), (1 << 20, torch.bfloat16, "MAX"),
                           (16 << 20, torch.float32, "SUM")):
            step(f"sync_{n}_{str(dt)[6:]}_{opn}", synced(n, dt, opn))
        for n in (1, 1001, 262144, 4194311):
            for i in range(3):
                step(f"from_host_{n}_#{i}", from_host(n, 7 * n + i))
        for n in (1001, 1 << 20):
            step(f"async8_{n}", many(n))
        step("size_change", size_change)
        step("all_gather_reduce_scatter", gather_scatter)
        step("timed_all_reduce_16MiB", timed, 3 * step_s)
        out["verdict"] = "ok"
    except Stall as s:
        out["verdict"] = f"STALL at {s}"
    out["device_handles"] = dict(t.info()).get("device_handles", "")
    try:
        out["stats"] = {k: v for k, v in pg.engine.stats.items() if v}
    except Exception as e:  # noqa: BLE001
        out["stats"] = f"error: {e}"
    print("PROBE-RESULT " + json.dumps(out, default=str), flush=True)
    if out["verdict"] != "ok":
        os._exit(3)  # stuck threads would hold the teardown; the result line is out
    return out


def _run_config(name: str, env: dict, timeout: float) -> list[dict]:
    """Both ranks' results of one configuration (parsed from their PROBE-RESULT lines: a rank
    that stalled exits without returning)."""
    cmd = [sys.executable, __file__, "--config", name]
    full = {**os.environ, **env, "PROBE_CONFIG": name}
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)
        text, note = p.stdout + p.stderr, f"exit {p.returncode}"
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        note = f"killed after {timeout:.0f} s"
    print(f"=== {name} ({note}, {time.time() - t0:.0f} s)", flush=True)
    res = []
    for line in text.splitlines():
        if line.startswith("PROBE-RESULT "):
            res.append(json.loads(line[len("PROBE-RESULT "):]))
        elif line.startswith("[") or "Traceback" in line or "Error" in line:
            print("  " + line[:300])
    out_dir = os.environ.get("PROBE_OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"ucx_probe_{name}.log"), "w") as f:
            f.write(text)
    return res


def _child(name: str) -> int:
    from hetccl.launch import spawn
    env = {"HETCCL_EMULATE_HOSTS": "1", "HETCCL_TRANSPORT": "ucx", "CUDA_MODULE_LOADING": "EAGER",
           "PROBE_CONFIG": name, **CONFIGS[name]}
    try:
        spawn(rank_main, 2, vendors="1+1", env=env,
              timeout=float(os.environ.get("PROBE_CONFIG_TIMEOUT", "50")) - 5)
    except Exception as e:  # noqa: BLE001  (a stalled rank exits 3: reported from its result)
        print(f"spawn: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return 1
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--config":
        return _child(sys.argv[2])
    names = [n for n in os.environ.get("PROBE_CONFIGS", ",".join(CONFIGS)).split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        print(f"unknown PROBE_CONFIGS {bad}; known: {list(CONFIGS)}")
        return 2
    timeout = float(os.environ.get("PROBE_CONFIG_TIMEOUT", "50"))
    verdicts, causes, choices = {}, {}, {}
    for name in names:
        res = _run_config(name, CONFIGS[name], timeout)
        for r in sorted(res, key=lambda r: r["rank"]):
            print(json.dumps(r, default=str))
        lines = []
        for r in sorted(res, key=lambda r: r["rank"]):
            choices.setdefault(name, r.get("choice"))
            v = f"rank {r['rank']}: {r['verdict']} ({r.get('choice')})"
            if "all_reduce_16MiB_bf16" in r:
                v += f", 16 MiB bf16 all_reduce {r['all_reduce_16MiB_bf16']['busbw_GBps']} GB/s"
            if r.get("device_handles"):
                v += f", handles: {r['device_handles']}"
            lines.append(v)
            for th in r.get("stall", {}).get("threads", []):
                lines.append(f"    thread {th['tid']} {th['name']}: " + " <- ".join(th["top"][:6]))
            cause = deadlock(r.get("stall", {}).get("threads", []))
            if cause:
                causes[name] = cause
                lines.append(f"  CAUSE: {cause}")
        if len(res) < 2:
            lines.append(f"only {len(res)} of 2 ranks reported (killed before their result)")
        ok = len(res) == 2 and all(r["verdict"] == "ok" for r in res)
        verdicts[name] = ok
        print(f"--- {name}: {'ok' if ok else 'NOT ok'}\n  " + "\n  ".join(lines), flush=True)
    print("=== summary: " + ", ".join(f"{n} {'ok' if v else 'STALL/FAIL'}" for n, v in verdicts.items()))
    if "auto" in verdicts:
        staged = choices.get("auto") == "ucx"
        print("auto (the default): " + ("ran every step, device data host-staged (no runtime-free "
                                        "device path on this box)" if verdicts["auto"] and staged
                                        else f"NOT as expected: {choices.get('auto')}, "
                                        f"{'ok' if verdicts['auto'] else 'stalled/failed'}"))
    for n, c in causes.items():
        print(f"CAUSE ({n}): {c}")
    forced = [n for n in verdicts if n.startswith("direct")]
    if forced and not any(verdicts[n] for n in forced):
        print("VERDICT: every forced direct configuration stalled" + (
            "; the stacks name the runtime deadlock (UCX's cuda_copy on its own thread against "
            "the application's blocking call): direct stays limited to runtime-free device paths "
            "(HETCCL_UCX_DEVICE=auto, docs/transports.md)" if causes else
            "; the stacks did not show a driver call on a transport thread: read them"))
    elif forced:
        print("VERDICT: some forced direct configurations ran every step (" + ", ".join(
            n for n in forced if verdicts[n]) + "): the deadlock is timing-dependent; a clean "
            "run does not make force safe")
    return 0


if __name__ == "__main__":
    sys.exit(main())
