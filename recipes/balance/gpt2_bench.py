"""GPT-2-small-shaped model under DDP over hetccl: balanced vs unbalanced with one rank emulated
slower, and one rank with a quarter of the memory (issue 16 figures; recipes/balance_gpu.sh).

    python recipes/balance/gpt2_bench.py gaps   --gaps 2,3 --jsonl out.jsonl     # 2 GPUs
    python recipes/balance/gpt2_bench.py memcap --mem-fraction 0.25 --jsonl out.jsonl
    python recipes/balance/gpt2_bench.py gaps --device cpu --smoke                 # CPU check

The model is built from a config, nothing is downloaded: transformers' GPT2LMHeadModel with
GPT-2 small's shape (12 layers, d=768, 12 heads, vocab 50257, context 1024: 124M parameters;
--smoke: 2 layers, d=64, vocab 256, context 32). Data: token sequences of a fixed random
first-order Markov chain (learnable), generated once per job; sample i of step s is the same in
every run. bf16 autocast on CUDA, fp32 parameters, AdamW, DDP (gradient all-reduce overlapped
with the last micro-batch's backward; earlier micro-batches under no_sync()).

Ranks: 2 local processes (hetccl.launch.spawn), emulated vendors 1+1, rank r on GPU r.
Slow-down (TEST ONLY): rank 1's forward and backward run `gap` times longer, with extra GPU
matmuls sized from the measured kernels (hetccl.balance.emulate.slow_down_module; host sleep on
CPU).

gaps: for every gap: solo throughput of each rank (it computes the whole global batch alone,
the other waits; best of 2), then an unbalanced run (equal split) and a balanced run (Balancer:
forwards timed with CUDA events, fixed + per-sample model, hysteresis), plus one homogeneous
reference run (no slow-down, equal split) whose per-step losses the others are compared with.
efficiency = (B / mean step time) / (sum of the ranks' solo throughputs).
memcap: rank 1 limits itself with torch.cuda.set_per_process_memory_fraction(F); every rank
measures its largest micro-batch (probe_max_micro: doubling + bisection until out-of-memory,
with the optimizer's state allocated, 15 % margin) and the plans use those caps (no out-of-memory); balanced run and solo throughputs
as above (no slow-down). On CPU (--smoke) the cap is emulated: rank 1's probe step raises
torch.OutOfMemoryError above --smoke-cap samples.

One JSON row per run (--jsonl): config, per-step plan and loss, step times, efficiency.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def model_config(smoke: bool) -> dict:
    if smoke:
        return dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def build_model(cfg: dict, device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    conf = GPT2Config(**cfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(conf).to(device)
    model.train()
    return model


def make_pool(n: int, seq: int, vocab: int, device, seed: int = 1234):
    """n sequences of seq tokens of a random first-order Markov chain (successor perm[t] with
    probability 3/4, else uniform)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    seqs = torch.empty(n, seq, dtype=torch.long)
    seqs[:, 0] = torch.randint(vocab, (n,), generator=g)
    follow = torch.rand(n, seq, generator=g) < 0.75
    noise = torch.randint(vocab, (n, seq), generator=g)
    for t in range(seq - 1):
        seqs[:, t + 1] = torch.where(follow[:, t], perm[seqs[:, t]], noise[:, t])
    return seqs.to(device)


class Job:
    """Everything one rank needs; runs inside the spawned process."""

    def __init__(self, ctx, a: dict):
        import torch
        import torch.distributed as dist

        import hetccl  # noqa: F401
        self.a, self.rank, self.W = a, ctx.rank, ctx.world_size
        self.cuda = a["device"] == "cuda"
        if self.cuda:
            torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
            self.dev = torch.device("cuda", torch.cuda.current_device())
            if a.get("mem_fraction") and self.rank == 1:
                torch.cuda.set_per_process_memory_fraction(float(a["mem_fraction"]), self.dev)
        else:
            self.dev = torch.device("cpu")
            torch.set_num_threads(1)
        dist.init_process_group("hetccl", store=ctx.store(), rank=ctx.rank,
                                world_size=ctx.world_size)
        self.cfg = model_config(a["smoke"])
        self.seq = self.cfg["n_positions"]
        self.B = a["global_batch"]
        self.pool = make_pool(a["pool"], self.seq, self.cfg["vocab_size"], self.dev)
        self.sync = (lambda: torch.cuda.synchronize(self.dev)) if self.cuda else (lambda: None)

    # -- pieces -------------------------------------------------------------------------------
    def batch(self, step: int, offset: int, size: int):
        n = self.pool.shape[0]
        idx = [(step * self.B + offset + i) % n for i in range(size)]
        return self.pool[idx]

    def forward_backward(self, net, x, scale):
        import torch
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda \
            else contextlib.nullcontext()
        with ctx:
            out = net(input_ids=x, labels=x)
        (out.loss * scale).backward()
        return out.loss.detach()

    def fresh(self, factor: float, ddp: bool = True):
        """Model, optimizer, DDP wrapper (ddp=False: none); this rank slowed by ``factor``."""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hetccl.balance.emulate import slow_down_module
        self._free()                  # what the previous phase left (its model, optimizer)
        model = build_model(self.cfg, self.dev)
        handles = slow_down_module(model, factor) if factor > 1 else []
        wrapped = DDP(model, device_ids=[self.dev.index] if self.cuda else None,
                      bucket_cap_mb=25, gradient_as_bucket_view=True) if ddp else None
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        return model, wrapped, opt, handles

    # -- phases -------------------------------------------------------------------------------
    def solo(self, factor: float, cap: int) -> list[float]:
        """Every rank's throughput computing the global batch alone (samples/s)."""
        import torch.distributed as dist

        from hetccl.balance import equal_plan, micro_loss_scales
        model, _, opt, handles = self.fresh(factor, ddp=False)
        thr = 0.0
        for r in range(self.W):
            dist.barrier()
            if r == self.rank:
                plan = equal_plan(self.B, 1, cap)
                sc = micro_loss_scales(plan, 0)
                best = math.inf
                for rep in range(1 + self.a["alone_reps"]):
                    self.sync()
                    t0 = time.perf_counter()
                    off = 0
                    for b, s in zip(plan.per_rank[0], sc):
                        self.forward_backward(model, self.batch(0, off, b), s)
                        off += b
                    self.sync()
                    if rep:                       # the first one warms up
                        best = min(best, time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
                thr = self.B / best
        dist.barrier()
        out = [None] * self.W
        dist.all_gather_object(out, thr)
        for h in handles:
            h.remove()
        del model, opt
        self._free()
        return out

    def train(self, factor: float, balanced: bool, caps) -> dict:
        import torch
        import torch.distributed as dist

        from hetccl.balance import Balancer, ForwardTimer, equal_plan, micro_loss_scales
        model, ddp, opt, handles = self.fresh(factor)
        W, B = self.W, self.B
        bal = None
        if balanced:
            bal = Balancer(B, caps, timer=ForwardTimer(model), min_gain=self.a["min_gain"])
        plan = equal_plan(B, W, caps)
        times, losses, plans = [], [], []
        dist.barrier()
        self.sync()
        t_prev = time.perf_counter()
        for step in range(self.a["warmup"] + self.a["steps"]):
            if bal is not None:
                plan = bal.plan
                bal.begin_step()
            plans.append(plan.counts())
            mbs = plan.per_rank[self.rank]
            off = plan.offsets()[self.rank]
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.dev)
            if not mbs:          # no samples: DDP's hooks must still fire (loss x 0)
                self.forward_backward(ddp, self.batch(step, 0, 1), 0.0)
            for j, (b, s) in enumerate(zip(mbs, micro_loss_scales(plan, self.rank))):
                ctx = ddp.no_sync() if j < len(mbs) - 1 else contextlib.nullcontext()
                with ctx:
                    loss = self.forward_backward(ddp, self.batch(step, off, b), s)
                loss_sum += loss.double() * b
                off += b
            if bal is not None:
                bal.end_step(plan.samples(self.rank))     # after the gradient all-reduce
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum = loss_sum.cpu()
            dist.all_reduce(loss_sum)
            losses.append(float(loss_sum) / B)           # mean loss over the global batch
            self.sync()
            t = time.perf_counter()
            if step >= self.a["warmup"]:
                times.append(t - t_prev)
            t_prev = t
        models = None
        if bal is not None:
            models = [None if m is None else {"fixed_ms": 1e3 * m.fixed,
                                              "per_sample_ms": 1e3 * m.per_sample,
                                              "count": m.count} for m in bal.models]
        peak = torch.cuda.max_memory_allocated(self.dev) / 2**30 if self.cuda else None
        peaks = [None] * W
        dist.all_gather_object(peaks, peak)
        replans = bal.replans if bal else 0
        for h in handles:
            h.remove()
        if bal is not None:
            bal.timer.detach()
        del model, ddp, opt, bal
        self._free()
        return {"step_ms": 1e3 * statistics.mean(times),
                "step_median_ms": 1e3 * statistics.median(times), "losses": losses,
                "plans": plans, "micro": plan.per_rank, "models": models,
                "replans": replans, "peak_mem_gib": peaks}

    def probe_cap(self) -> int:
        import torch

        from hetccl.balance import probe_max_micro
        model = build_model(self.cfg, self.dev)
        # allocate what training holds besides activations (gradients, AdamW's two moments)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        self.forward_backward(model, self.batch(0, 0, 1), 1.0)
        opt.step()
        limit = self.a["probe_limit"]

        def step(b):
            try:
                if not self.cuda and self.rank == 1 and self.a.get("smoke_cap") and \
                        b > self.a["smoke_cap"]:
                    raise torch.OutOfMemoryError(f"emulated: {b} samples > smoke cap")
                self.forward_backward(model, self.batch(0, 0, b), 1.0)
                self.sync()
            finally:
                model.zero_grad(set_to_none=True)

        cap = probe_max_micro(step, limit, start=min(8, limit), device=self.dev, margin=0.15)
        model = opt = None      # noqa: F841 - frees the probe's model before training
        self._free()
        return cap

    def _free(self):
        import gc

        import torch
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.dev)


def _entry(ctx, a, what):
    import torch.distributed as dist
    job = Job(ctx, a)
    try:
        cap = a["max_micro"]
        out = {"rows": []}
        if what == "gaps":
            ref = job.train(1.0, False, cap)
            out["rows"].append({"mode": "reference", "gap": 1.0, **ref})
            for gap in a["gaps"]:
                f = gap if job.rank == 1 else 1.0
                alone = job.solo(f, cap)
                for balanced in (False, True):
                    res = job.train(f, balanced, cap)
                    out["rows"].append({"mode": "balanced" if balanced else "unbalanced",
                                        "gap": gap, "alone_throughput": alone, **res})
        else:   # memcap
            from hetccl.balance import gather_max_micro
            caps = gather_max_micro(job.probe_cap())
            alone = job.solo(1.0, caps[job.rank])       # each rank alone, with its own cap
            out["caps"] = caps
            for mode, balanced in (("unbalanced-capped", False), ("balanced-capped", True)):
                res = job.train(1.0, balanced, caps)
                out["rows"].append({"mode": mode, "gap": 1.0, "alone_throughput": alone,
                                    **res})
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("gaps", "memcap"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny model (CPU check of the script)")
    p.add_argument("--gaps", default="2,3")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default 192; --smoke 16)")
    p.add_argument("--max-micro", type=int, default=None, help="micro-batch cap (16; smoke 4)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--alone-reps", type=int, default=2)
    p.add_argument("--min-gain", type=float, default=0.03)
    p.add_argument("--mem-fraction", type=float, default=0.25,
                   help="memcap: rank 1's torch.cuda.set_per_process_memory_fraction")
    p.add_argument("--probe-limit", type=int, default=None, help="memcap: probe up to (64)")
    p.add_argument("--smoke-cap", type=int, default=3, help="memcap on CPU: emulated cap")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            p.error("needs 2 CUDA GPUs (use --device cpu --smoke for a CPU check)")
    smoke = args.smoke
    a = {"device": args.device, "smoke": smoke,
         "global_batch": args.global_batch or (16 if smoke else 192),
         "max_micro": args.max_micro or (4 if smoke else 16),
         "steps": args.steps, "warmup": args.warmup, "alone_reps": args.alone_reps,
         "min_gain": args.min_gain, "gaps": [float(g) for g in args.gaps.split(",") if g],
         "pool": 512 if smoke else 4096,
         "mem_fraction": args.mem_fraction if args.what == "memcap" else None,
         "probe_limit": args.probe_limit or (8 if smoke else 64), "smoke_cap": args.smoke_cap}
    from hetccl.launch import spawn
    t0 = time.time()
    res = spawn(_entry, 2, args=(a, args.what), vendors="1+1", timeout=args.timeout)[0]
    rows = res["rows"]
    ref = next((r for r in rows if r["mode"].startswith("reference")), None)
    meta = {"bench": "gpt2_balance", "what": args.what, "device": args.device, "smoke": smoke,
            "model": model_config(smoke), "global_batch": a["global_batch"],
            "max_micro": a["max_micro"], "date": time.strftime("%Y-%m-%d"),
            "command": "python recipes/balance/gpt2_bench.py " + " ".join(argv or sys.argv[1:])}
    if args.device == "cuda":
        import torch
        meta["gpu"] = torch.cuda.get_device_name(0)
    out_rows = []
    for r in rows:
        row = {**meta, **r}
        if "caps" in res:
            row["caps"] = res["caps"]
            row["mem_fraction_rank1"] = a["mem_fraction"]
        thr = a["global_batch"] / (r["step_ms"] / 1e3)
        row["throughput"] = thr
        if r.get("alone_throughput"):
            row["sum_alone_throughput"] = sum(r["alone_throughput"])
            row["efficiency"] = thr / row["sum_alone_throughput"]
        if ref is not None and r is not ref:
            d = [abs(x - y) for x, y in zip(r["losses"], ref["losses"])]
            row["max_abs_loss_diff_vs_reference"] = max(d)
            row["max_rel_loss_diff_vs_reference"] = max(
                x / abs(y) for x, y in zip(d, ref["losses"]))
        out_rows.append(row)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for row in out_rows:
                f.write(json.dumps(row) + "\n")
    print(f"\n# GPT-2 balance bench ({args.what}, {args.device}{', smoke' if smoke else ''}): "
          f"B={a['global_batch']}, cap={res.get('caps', a['max_micro'])}, "
          f"{time.time() - t0:.0f} s")
    for row in out_rows:
        eff = f"{100 * row['efficiency']:5.1f}%" if "efficiency" in row else "   -  "
        dl = row.get("max_rel_loss_diff_vs_reference")
        print(f"  {row['mode']:17s} gap {row['gap']:g}: step {row['step_ms']:8.1f} ms  "
              f"plan {'/'.join(map(str, row['plans'][-1]))}  efficiency {eff}  "
              f"loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}"
              + (f"  max rel loss diff vs reference {dl:.2e}" if dl is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
