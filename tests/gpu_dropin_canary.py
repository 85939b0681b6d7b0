"""Which case under the drop-in leaves a communicator giving wrong results (GPU box, a tool, not
a test): every family of collective_cases under `init_process_group("nccl")` with the drop-in
preloaded, and after each case a canary -- an all_reduce on the world group and on each rank's
one-vendor subgroup, against float64 references. The first failing canary names the case after
which the state went wrong (found 2026-12-03: p2p/batch_with_self, torch's coalescing manager
left the NCCL group open after refusing a non-dense receive).

    python3 tests/gpu_dropin_canary.py 1+1      # or 1+1+1; about 40 s on one H200
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist

import collective_cases as cc
from hetccl import nccl_dropin
from test_gpu_suite import recorded

_orig_run = cc.Cases.run


def _canary_run(self, name, fn):
    import hetccl
    _orig_run(self, name, fn)
    st = self.__dict__.setdefault("_canary", {})
    rank, W = self.rank, self.world
    dev = torch.device("cuda", 0)
    if "pg" not in st:
        labels = hetccl.vendor_of_ranks()
        groups = {}
        for lab in dict.fromkeys(labels):
            ranks = [r for r, l in enumerate(labels) if l == lab]
            groups[lab] = (ranks, dist.new_group(ranks, backend="hetccl"))
        st["mine"], st["pg"] = groups[labels[rank]]
        st["n"] = 0
    st["n"] += 1
    k = 5000 + st["n"]
    x = cc.data(rank, k, 64, torch.float32).to(dev)
    dist.all_reduce(x, group=st["pg"])
    ref = cc.reference([cc.data(r, k, 64, torch.float32) for r in st["mine"]], "sum", torch.float32)
    e = cc.close(x, ref, torch.float32, len(st["mine"]))
    y = cc.data(rank, k, 64, torch.float32).to(dev)
    dist.all_reduce(y)
    ref2 = cc.reference([cc.data(r, k, 64, torch.float32) for r in range(W)], "sum", torch.float32)
    e2 = cc.close(y, ref2, torch.float32, W)
    if (e or e2) and not st.get("reported"):
        st["reported"] = True
        if self.record:
            self.record("CANARY", f"after case {name!r}: sub {e} world {e2}; sub got {x[:3].tolist()} want {ref[:3].tolist()}")


def families(ctx, record=None):
    cc.Cases.run = _canary_run
    cc.run_all(ctx, device="cuda", backend="nccl", timeout_s=60, record=record)


if __name__ == "__main__":
    for k, v in nccl_dropin.launch_env("nccl", {}).items():
        os.environ[k] = v
    os.environ["HETCCL_NCCL_LIBRARY"] = nccl_dropin.real_library("nccl")
    os.environ["HETCCL_TIMEOUT_S"] = "30"
    split = sys.argv[1] if len(sys.argv) > 1 else "1+1"
    t0 = time.monotonic()
    cases, failure = recorded(families, split, {}, timeout=200)
    print(f"=== {split} ({time.monotonic() - t0:.1f} s), {len(cases)} cases")
    for c, v in cases.items():  # execution order of the first rank's file
        if any(x != "ok" and not x.startswith("skip") for x in v.values()):
            print(f"  {c}: " + "; ".join(f"{r}: {x[-300:]!r}" for r, x in sorted(v.items())))
    if failure:
        print("  FAILURE:", failure[-3000:])
