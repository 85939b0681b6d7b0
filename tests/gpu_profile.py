"""Where a small cross-vendor GPU all-reduce spends its time (run by hand on the GPU box:
python tests/gpu_profile.py [OUTDIR]). Rank 0 prints: time per synchronous all_reduce of
8 KiB bf16 (as the benchmark times them) and the time to issue them; the same with argument
checks off; the cost of the pieces of the issue path measured alone (torch calls, the C++
engine's post of a device plan); and the top functions by own time under cProfile."""
import cProfile
import io
import os
import pstats
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
from hetccl.launch import spawn  # noqa: E402


def _loop(x, iters):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / iters * 1e6, (t1 - t0) / iters * 1e6


def _each(fn, n=2000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def rank(ctx, nelem, iters, profile):
    import hetccl  # noqa: F401
    from hetccl import checks, tags, tuning  # noqa: F401

    # GPU rank % device_count: on a one-GPU box both emulated vendors' processes share it
    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    x = torch.ones(nelem, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        dist.all_reduce(x)
    out = []
    tot, iss = _loop(x, iters)
    out.append(f"{nelem * 2} bytes, HETCCL_CHECK_ARGS={os.environ.get('HETCCL_CHECK_ARGS', 'on')}:"
               f" {tot:.1f} us per all_reduce (issue {iss:.1f} us)")
    if not profile:
        dist.destroy_process_group()
        return "\n".join(out)
    # pieces, alone
    y = torch.ones_like(x)
    s = torch.cuda.Stream()
    out.append(f"  x.add_(y)                  {_each(lambda: x.add_(y)):.1f} us")
    out.append(f"  torch.empty_like(x)        {_each(lambda: torch.empty_like(x)):.1f} us")
    out.append(f"  current_stream()           {_each(lambda: torch.cuda.current_stream(dev)):.1f} us")
    out.append(f"  record_stream              {_each(lambda: x.record_stream(s)):.1f} us")

    def fut():
        f = torch.futures.Future(devices=[dev])
        f.set_result([x])
        f.wait()
    out.append(f"  Future(devices)+set+wait   {_each(fut):.1f} us")

    def sw():
        prev = torch.cuda.current_stream(dev)
        torch.cuda.set_stream(s)
        torch.cuda.set_stream(prev)
    out.append(f"  set_stream x2              {_each(sw):.1f} us")
    pg = dist.group.WORLD
    eng = pg.engine
    out.append(f"  core.broken()              {_each(lambda: eng.core.broken()):.1f} us")
    out.append(f"  stream_join                {_each(lambda: eng.core.stream_join(dev.index, s.cuda_stream, 0)):.1f} us")
    torch.cuda.synchronize()
    dist.barrier()
    # the C++ post of a device plan alone (both ranks post the same sequence)
    peer = 1 - ctx.rank
    buf = torch.empty_like(x)
    items = [(peer, True, x.data_ptr(), x.numel() * 2), (peer, False, buf.data_ptr(), x.numel() * 2)]
    side = torch.cuda.Stream()
    base = 500
    t0 = time.perf_counter()
    for k in range(iters):
        eng.core.post(items, tags.collective(base + k, 0), tags.INDEX_BITS, "sum", "bfloat16",
                      False, False, 0, 60000, "raw", False, [], 0, "", False, 0, False, True,
                      dev.index, s.cuda_stream, side.cuda_stream)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    out.append(f"  core.post (device, no check) {(t1 - t0) / iters * 1e6:.1f} us issue, "
               f"{(t2 - t0) / iters * 1e6:.1f} us per plan end to end")
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    prof.disable()
    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(25)
    out.append(sio.getvalue())
    dist.destroy_process_group()
    return "\n".join(out)


if __name__ == "__main__":
    text = spawn(rank, 2, args=(4096, 500, True), vendors="1+1", timeout=300)[0]
    text += "\n" + spawn(rank, 2, args=(4096, 500, False), vendors="1+1", timeout=300,
                         env={"HETCCL_CHECK_ARGS": "off"})[0]
    print(text[:7000])
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "profile.txt"), "w") as f:
            f.write(text)
