"""Where a small cross-vendor GPU all-reduce spends its time (run by hand on the GPU box:
python tests/gpu_profile.py [OUTDIR]). Rank 0 prints the time per all_reduce of 8 KiB bf16
(synchronous calls in a loop, as the benchmark times them), the time to issue them without
waiting, and the top functions by own time under cProfile."""
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


def rank(ctx, n, iters):
    import hetccl  # noqa: F401

    torch.cuda.set_device(ctx.rank)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    out = []
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    out.append(f"{n * 2} bytes: {(t2 - t0) / iters * 1e6:.1f} us per all_reduce "
               f"(issue {(t1 - t0) / iters * 1e6:.1f} us)")
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    out.append(s.getvalue())
    dist.destroy_process_group()
    return "\n".join(out)


if __name__ == "__main__":
    text = spawn(rank, 2, args=(4096, 500), vendors="1+1", timeout=300)[0]
    print(text[:6000])
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "profile.txt"), "w") as f:
            f.write(text)
