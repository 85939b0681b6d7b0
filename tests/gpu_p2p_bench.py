"""Cross-vendor point-to-point of device tensors on the GPU box (run by hand or by
`.ci/gpu-box.sh p2p`: python3 tests/gpu_p2p_bench.py [OUTDIR]). 1+1 emulated vendors, both
processes on one GPU, bf16. For the engine's stream-ordered messages (HETCCL_DEVICE_MESSAGES=1,
the default) and the earlier host-staged path (=0), interleaved, each in fresh processes:
  * ping-pong: rank 0 sends, rank 1 receives and sends back, rank 0 receives; time = half a
    round trip (median of the iterations), algbw = bytes / time; every received buffer is
    compared with what was sent (#wrong counts the iterations that differ);
  * issue: host time of dist.isend of a device tensor (median), the call a pipeline stage makes
    before it computes on.
Rows are nccl-tests columns plus mode and issue_us; --jsonl rows go to OUTDIR/p2p_gpu.jsonl."""
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
from hetccl.launch import spawn  # noqa: E402

SIZES = [8 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def rank(ctx, iters):
    import hetccl  # noqa: F401

    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    peer = 1 - ctx.rank
    rows = []
    for nbytes in SIZES:
        n = nbytes // 2
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        y = torch.empty_like(x)
        times, wrong = [], 0
        for it in range(iters + 3):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            if ctx.rank == 0:
                dist.send(x, peer)
                dist.recv(y, peer)
            else:
                dist.recv(y, peer)
                dist.send(y, peer)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if ctx.rank == 0 and it >= 3:
                times.append(dt / 2)
                wrong += int(not torch.equal(y, x))
        issue = []
        for _ in range(20):
            torch.cuda.synchronize()
            dist.barrier()
            if ctx.rank == 0:
                t0 = time.perf_counter()
                w = dist.isend(x, peer)
                issue.append(time.perf_counter() - t0)
                w.wait()
            else:
                dist.recv(y, peer)
            torch.cuda.synchronize()
        if ctx.rank == 0:
            t = statistics.median(times)
            rows.append({"size": nbytes, "count": n, "type": "bfloat16", "redop": "none",
                         "time_us": round(t * 1e6, 1), "algbw": round(nbytes / t / 1e9, 3),
                         "busbw": round(nbytes / t / 1e9, 3), "wrong": wrong,
                         "issue_us": round(statistics.median(issue) * 1e6, 1)})
    dist.destroy_process_group()
    return rows


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    iters = int(os.environ.get("P2P_ITERS", "20"))
    allrows = []
    for rnd in range(2):
        for mode in ("messages", "staged"):
            env = {"HETCCL_DEVICE_MESSAGES": "1" if mode == "messages" else "0"}
            rows = spawn(rank, 2, args=(iters,), vendors="1+1", env=env, timeout=300)[0]
            for r in rows:
                r.update(mode=mode, round=rnd, collective="send_recv", vendors="1+1")
            allrows += rows
            print(f"# round {rnd} {mode}", flush=True)
            print(f"{'size':>10} {'count':>9} {'type':>9} {'redop':>6} {'time(us)':>10} "
                  f"{'algbw':>8} {'busbw':>8} {'#wrong':>6} {'issue(us)':>9}")
            for r in rows:
                print(f"{r['size']:>10} {r['count']:>9} {r['type']:>9} {r['redop']:>6} "
                      f"{r['time_us']:>10} {r['algbw']:>8} {r['busbw']:>8} {r['wrong']:>6} "
                      f"{r['issue_us']:>9}", flush=True)
    print("# summary: messages / staged, time per message and issue time (best of 2 rounds)")
    for size in SIZES:
        best = {m: min((r for r in allrows if r["mode"] == m and r["size"] == size),
                       key=lambda r: r["time_us"]) for m in ("messages", "staged")}
        m, s = best["messages"], best["staged"]
        print(f"{size:>10}: time {m['time_us']} / {s['time_us']} us "
              f"({s['time_us'] / m['time_us']:.2f}x faster), issue {m['issue_us']} / "
              f"{s['issue_us']} us, wrong {m['wrong']} / {s['wrong']}")
    if out:
        with open(os.path.join(out, "p2p_gpu.jsonl"), "w") as f:
            for r in allrows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
