"""Profile of small cross-vendor GPU all-reduces (run by hand on the GPU box:
python tests/gpu_profile.py). Prints the top functions of rank 0 by cumulative time."""
import cProfile
import pstats
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
from hetccl.launch import spawn  # noqa: E402


def rank(ctx, n):
    import io

    import hetccl  # noqa: F401

    torch.cuda.set_device(ctx.rank)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(50):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    prof.disable()
    dt = (time.perf_counter() - t0) / 50
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    dist.destroy_process_group()
    return f"{n * 2} bytes: {dt * 1e6:.0f} us per all_reduce\n" + s.getvalue()


if __name__ == "__main__":
    for n in (1 << 19, 1 << 27):
        print(spawn(rank, 2, args=(n,), vendors="1+1", timeout=300)[0][:4000])
