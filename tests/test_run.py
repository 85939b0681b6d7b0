"""`hetccl run`: an unchanged script that asks for NCCL runs over hetccl under torchrun."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_unchanged_nccl_script_runs_over_hetccl(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("nccl")          # unchanged user code
        import hetccl
        x = torch.full((1000,), float(dist.get_rank() + 1))
        dist.all_reduce(x)
        labels = hetccl.vendor_of_ranks()
        print(f"rank {dist.get_rank()} backend {type(dist.group.WORLD).__name__} "
              f"sum {x[0].item():.0f} vendors {'+'.join(labels)}", flush=True)
        dist.destroy_process_group()
    """))
    r = subprocess.run([sys.executable, "-m", "hetccl.cli", "run", "--vendors", "1+1",
                        "--standalone", "--nproc_per_node", "2", str(script)],
                       capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank} backend HetcclProcessGroup sum 3 vendors v0+v1" in out, out
