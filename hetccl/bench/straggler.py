"""`hetccl bench straggler`: data-parallel training with emulated slow ranks, balanced vs not.

Each configuration (world size x speed gap) runs `world` local processes over torch.distributed,
the ranks split into two emulated vendors (first half / second half, e.g. 1+1 or 2+2).
Rank r is made f_r times slower (HETCCL_SLOWDOWN=f_r, hetccl.balance.emulate.slow_down):
the slow half of the ranks by the gap, the others not (gap 1: nobody).

--device cpu (default): the compute of one micro-batch of b samples is a forward+backward of a
small MLP (real, 1 thread) plus an emulated device cost of b * per_sample_ms (a sleep), the
whole block stretched by f_r with a host sleep. The sleep dominates, so the emulated speeds do
not depend on how the host's cores are shared.
--device cuda: rank r uses GPU r; one sample is a [tokens, width] activation through `depth`
MLP blocks (width -> 4 width -> width, bf16 autocast, real forward+backward), and the slow-down
queues extra GPU matmuls of (f_r - 1) x the block's device time (GPU-consuming, no host sleep).
The Balancer times with CUDA events. Steps end with a device synchronise (wall time).

Phases, all in one job:
  alone       each rank, in turn while the others wait, computes the global batch alone;
              its throughput thr_r = B / (fastest of --alone-reps runs, measured both before
              and after the training phases): the efficiency denominator sums these (best
              case, so host-load noise can only lower the efficiency)
  unbalanced  equal split (what a homogeneous job does), gradient all-reduce, SGD step
  balanced    Balancer: fit each rank's step time (fixed + per-sample cost), exchange the
              models, re-plan when the predicted gain is real (equal split until measured);
              models travel inside the gradient all-reduce (--exchange allreduce) or in a
              separate all_gather (--exchange gather)
Step time = wall time per optimizer step on rank 0 (after warm-up steps), including the
gradient all-reduce and the Balancer's exchange. The Balancer times only the local compute
(begin_step before the first micro-batch, closed before the all-reduce).
efficiency = (B / step_time) / sum_r thr_r.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

BACKEND = "hetccl"   # torch.distributed backend; "gloo" works too (--backend gloo)


def _factors(world: int, gap: float) -> list[float]:
    """Half of the ranks (at least one) run `gap` times slower: [1, g], [1, 1, g, g], ..."""
    slow = max(1, world // 2)
    return [1.0] * (world - slow) + [float(gap)] * slow


def _vendors(world: int) -> str:
    """Two emulated vendors: the fast half and the slow half of the ranks (1+1, 2+2, 1 for 1)."""
    slow = max(1, world // 2)
    return "+".join(str(n) for n in (world - slow, slow) if n)


def _worker(ctx, cfg):
    import torch
    import torch.distributed as dist

    from hetccl.balance import Balancer, allreduce_gradients, equal_plan, micro_loss_scales
    from hetccl.balance.emulate import emulated_work, slow_down

    torch.set_num_threads(1)
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group(cfg["backend"], store=ctx.store(), rank=ctx.rank,
                            world_size=ctx.world_size)
    try:
        rank, W, B, cap = ctx.rank, ctx.world_size, cfg["global_batch"], cfg["max_micro"]
        per_sample = cfg["per_sample_ms"] / 1e3
        torch.manual_seed(0)
        if cuda:
            D, L, T = cfg["gpu_width"], cfg["gpu_depth"], cfg["gpu_tokens"]
            layers = []
            for _ in range(L):
                layers += [torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D)]
            model = torch.nn.Sequential(*layers).to(dev)
            X = torch.randn(cap, T, D, device=dev)
            Y = torch.randn(cap, T, D, device=dev)
        else:
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 1))
            X, Y = torch.randn(B, 32), torch.randn(B, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        slow = slow_down(device=dev if cuda else None)   # factor from HETCCL_SLOWDOWN
        sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)

        def compute(sizes, scales):
            for b, sc in zip(sizes, scales):
                with slow.block(b):
                    if cuda:
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            out = model(X[:b])
                        loss = torch.nn.functional.mse_loss(out.float(), Y[:b]) * sc
                        loss.backward()
                    else:
                        loss = torch.nn.functional.mse_loss(model(X[:b]), Y[:b]) * sc
                        loss.backward()
                        emulated_work(b, per_sample)

        # -- alone: one rank at a time computes the whole global batch --------------------
        def solo() -> list[float]:
            thr = 0.0
            for r in range(W):
                dist.barrier()
                if r == rank:
                    plan = equal_plan(B, 1, cap)
                    for _ in range(2):                   # warm-up (and the slow-down's fit)
                        compute(plan.per_rank[0], micro_loss_scales(plan, 0))
                    sync()
                    best = float("inf")
                    for _ in range(cfg["alone_reps"]):   # best of reps: load spikes only slow
                        t0 = time.perf_counter()
                        compute(plan.per_rank[0], micro_loss_scales(plan, 0))
                        sync()
                        best = min(best, time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
                    thr = B / best
            dist.barrier()
            out = [None] * W
            dist.all_gather_object(out, thr)
            return out

        # -- data-parallel training ---------------------------------------------------------
        def train(balanced: bool):
            bal = Balancer(B, cap, min_gain=cfg["min_gain"], device=dev) if balanced else None
            plan = bal.plan if bal else equal_plan(B, W, cap)
            times, comp, xchg, ared, replans, plans = [], [], [], [], 0, []
            dist.barrier()
            sync()
            t_prev = time.perf_counter()
            for step in range(cfg["warmup"] + cfg["steps"]):
                if bal:
                    plan = bal.plan
                    bal.begin_step()
                plans.append(plan.counts())
                opt.zero_grad(set_to_none=True)
                tc = time.perf_counter()
                if cuda:                # device time of the compute (host time is launches)
                    ev = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
                    ev[0].record()
                compute(plan.per_rank[rank], micro_loss_scales(plan, rank))
                if cuda:
                    ev[1].record()
                tc = time.perf_counter() - tc
                tx = time.perf_counter()
                if bal and cfg["exchange"] == "gather":
                    replans += bal.end_step(plan.samples(rank))
                ta = time.perf_counter()
                if bal and cfg["exchange"] == "allreduce":
                    replans += allreduce_gradients(model, balancer=bal)
                else:
                    allreduce_gradients(model)
                tb = time.perf_counter()
                opt.step()
                sync()
                t = time.perf_counter()
                if step >= cfg["warmup"]:
                    times.append(t - t_prev)
                    comp.append(ev[0].elapsed_time(ev[1]) / 1e3 if cuda else tc)
                    xchg.append(ta - tx)
                    ared.append(tb - ta)
                t_prev = t
            models = None
            if bal:
                models = [None if m is None else {"fixed_ms": 1e3 * m.fixed,
                                                  "per_sample_ms": 1e3 * m.per_sample,
                                                  "count": m.count} for m in bal.models]
            return {"step_s": statistics.mean(times), "step_med_s": statistics.median(times),
                    "plan": plan.counts(), "micro": plan.per_rank, "plans": plans,
                    "replans": replans, "compute_s": statistics.mean(comp),
                    "exchange_s": statistics.mean(xchg), "allreduce_s": statistics.mean(ared),
                    "models": models}

        before = solo()
        out = {"unbalanced": train(False), "balanced": train(True)}
        after = solo()          # solo speeds before and after the runs; the faster counts
        out["alone"] = [max(a, b) for a, b in zip(before, after)]
        comps = [None] * W
        dist.all_gather_object(comps, [out["unbalanced"]["compute_s"],
                                       out["balanced"]["compute_s"]])
        out["compute_s"] = comps
        return out
    finally:
        dist.destroy_process_group()


def run_config(world: int, gap: float, args) -> list[dict]:
    from hetccl.launch import spawn

    factors = _factors(world, gap)
    cfg = {"backend": args.backend, "global_batch": args.global_batch,
           "max_micro": args.max_micro, "per_sample_ms": args.per_sample_ms,
           "steps": args.steps, "warmup": args.warmup, "alone_reps": args.alone_reps,
           "min_gain": args.min_gain, "exchange": args.exchange, "device": args.device,
           "gpu_width": args.gpu_width, "gpu_depth": args.gpu_depth,
           "gpu_tokens": args.gpu_tokens}
    vendors = _vendors(world)
    env_v = vendors if args.backend == "hetccl" else None
    res = spawn(_worker, world, args=(cfg,), vendors=env_v,
                rank_env=[{"HETCCL_SLOWDOWN": str(f)} for f in factors],
                timeout=args.timeout)
    r0 = res[0]
    sum_thr = sum(r0["alone"])
    rows = []
    for i, mode in enumerate(("unbalanced", "balanced")):
        m = r0[mode]
        achieved = args.global_batch / m["step_s"]
        rows.append({
            "bench": "straggler", "backend": args.backend, "device": args.device,
            "world": world, "gap": gap, "slowdown": factors, "vendors": vendors, "mode": mode,
            "global_batch": args.global_batch, "max_micro": args.max_micro,
            "per_sample_ms": args.per_sample_ms if args.device == "cpu" else None,
            "gpu_model": None if args.device == "cpu" else
            {"width": args.gpu_width, "depth": args.gpu_depth, "tokens": args.gpu_tokens},
            "steps": args.steps, "warmup": args.warmup,
            "exchange": args.exchange if mode == "balanced" else None,
            "step_ms": m["step_s"] * 1e3, "step_median_ms": m["step_med_s"] * 1e3,
            "throughput": achieved, "alone_throughput": r0["alone"],
            "sum_alone_throughput": sum_thr, "efficiency": achieved / sum_thr,
            "plan_samples": m["plan"], "plan_micro": m["micro"], "plans_per_step": m["plans"],
            "replans": m["replans"], "compute_ms": [1e3 * c[i] for c in r0["compute_s"]],
            # the balancer's own part: ideal compute time (B / sum of solo throughputs) over
            # the slowest rank's mean compute time per step (no communication in either)
            "compute_efficiency": (args.global_batch / sum_thr) / max(c[i] for c in
                                                                      r0["compute_s"]),
            "models": m["models"],
            "rank0_exchange_ms": 1e3 * m["exchange_s"], "rank0_allreduce_ms": 1e3 * m["allreduce_s"],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from hetccl.bench.report import Table, hardware, today

    p = argparse.ArgumentParser(prog="hetccl bench straggler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--gaps", default="2,3",
                   help="slow-down of the slow half of the ranks, comma-separated (default 2,3; "
                        "1: identical ranks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: MLP + emulated per-sample sleep; cuda: GPU r per rank, real MLP "
                        "blocks, GPU-consuming slow-down")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--max-micro", type=int, default=8, help="micro-batch cap of every rank")
    p.add_argument("--per-sample-ms", type=float, default=5.0,
                   help="cpu: emulated device time per sample at speed 1 (default 5.0)")
    p.add_argument("--gpu-width", type=int, default=512, help="cuda: MLP width (default 512)")
    p.add_argument("--gpu-depth", type=int, default=2, help="cuda: MLP blocks (default 2)")
    p.add_argument("--gpu-tokens", type=int, default=32768,
                   help="cuda: rows per sample (default 32768: about 0.8 ms of H200 per sample, "
                        "so the 17 MB gradient all-reduce is a small part of a step)")
    p.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=8,
                   help="unmeasured steps per mode (the Balancer's first plan needs 1 warm-up "
                        "+ 3 measured steps, then settles)")
    p.add_argument("--alone-reps", type=int, default=2,
                   help="solo repetitions per rank and phase; the fastest counts (default 2)")
    p.add_argument("--min-gain", "--threshold", dest="min_gain", type=float, default=0.03,
                   help="Balancer: smallest predicted relative gain that changes the plan")
    p.add_argument("--exchange", choices=("allreduce", "gather"), default="allreduce",
                   help="how the Balancer exchanges its models: carried in the gradient "
                        "all-reduce (allreduce_gradients(model, balancer=...), default) or its "
                        "own all_gather per step (Balancer.end_step, what DDP/framework loops "
                        "use)")
    p.add_argument("--backend", default=BACKEND)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--jsonl", default=None, help="append one JSON row per (config, mode)")
    args = p.parse_args(argv)
    if args.backend == "hetccl":
        import hetccl  # noqa: F401  (registers the backend)
    worlds = [int(x) for x in args.world.split(",") if x]
    gaps = [float(x) for x in args.gaps.split(",") if x]
    if any(g < 1 for g in gaps):
        p.error("--gaps must be >= 1")
    if args.device == "cuda":
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(worlds) > n:
            p.error(f"--device cuda needs one GPU per rank: {max(worlds)} ranks, {n} GPUs")

    command = "hetccl bench straggler " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"date": today(), "hardware": hardware(), "command": command.strip()}
    if args.device == "cuda":
        import torch
        meta["gpu"] = torch.cuda.get_device_name(0)
    what = (f"{args.per_sample_ms} ms/sample" if args.device == "cpu" else
            f"MLP {args.gpu_depth}x{args.gpu_width} x {args.gpu_tokens} rows/sample on "
            f"{meta.get('gpu')}")
    print(f"# hetccl bench straggler  backend={args.backend}  device={args.device}  "
          f"exchange={args.exchange}  B={args.global_batch}  cap={args.max_micro}  {what}  "
          f"{meta['hardware']}  {meta['date']}")
    table = Table([("world", 5), ("slowdown", 16), ("mode", 10), ("plan", 16),
                   ("step_ms", 8), ("samples/s", 9), ("sum_alone", 9), ("eff_%", 6)],
                  jsonl=args.jsonl)
    table.header()
    configs = [(w, g) for w in worlds for g in gaps]
    summary = []
    for w, g in tqdm(configs, desc="straggler", unit="config", file=sys.stderr):
        rows = run_config(w, g, args)
        for row in rows:
            row.update(meta)
            table.row([w, "/".join(f"{f:g}" for f in row["slowdown"]), row["mode"],
                       "/".join(map(str, row["plan_samples"])), row["step_ms"],
                       row["throughput"], row["sum_alone_throughput"],
                       100 * row["efficiency"]], record=row)
        summary.append((w, g, rows[0]["efficiency"], rows[1]["efficiency"],
                        rows[0]["step_ms"] / rows[1]["step_ms"], rows[1]["plan_samples"],
                        rows[1]["compute_efficiency"], rows[1]["rank0_allreduce_ms"]))
    table.close()
    print("\nsummary (efficiency = achieved / sum of ranks' solo throughputs):")
    for w, g, eu, eb, sp, plan, ce, ar in summary:
        print(f"  {w} ranks, {g:g}x gap: unbalanced {100 * eu:5.1f}%  ->  balanced "
              f"{100 * eb:5.1f}%   ({sp:.2f}x faster steps, plan {'/'.join(map(str, plan))}; "
              f"compute alone {100 * ce:5.1f}%, all-reduce {ar:.1f} ms/step on rank 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
