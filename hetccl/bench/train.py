"""`hetccl bench train`: training efficiency of a GPT-2-small-shaped model with DDP.

    hetccl bench train --device cuda                      # single GPU, nccl, hetccl 1+1
    hetccl bench train --device cpu --tiny --steps 4      # a smoke run on any machine
    hetccl bench train --device cuda --tiny --steps 4     # a smoke run on one or more GPUs

One run measures, with the same model, data and per-GPU micro-batch:
  * single:  one process on one device (the throughput every other row is compared with);
  * nccl:    2 ranks over the native library (on 2+ GPUs; on one GPU, where NCCL cannot put
             two ranks, and on CPUs: gloo);
  * hetccl:  2 ranks over hetccl with emulated vendors 1+1 (the cross-vendor path);
each with 1 and 4 micro-batches per optimizer step (DDP's no_sync for all but the last).
Efficiency = throughput of the 2-rank run / (2 x throughput of the single run). Losses of the
2-rank runs are compared step by step with the nccl run's (same global batch; bf16 rounding).

Model (GPT-2 small shape): 12 layers, d=768, 12 heads, vocab 50257, 1024-token context, 124M
parameters, bf16 autocast on GPUs, DDP with default buckets, fused AdamW. Data: a learnable
synthetic token stream made in code (no download).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .report import hardware, today

GPT2_SMALL = dict(vocab=50257, d=768, layers=12, heads=12, ctx=1024)
TINY = dict(vocab=512, d=64, layers=2, heads=4, ctx=64)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def micro_batch(step: int, micro: int, index: int, batch: int, ctx: int, vocab: int):
    """Micro-batch `micro` of global step `step` for data-parallel slot `index` (same tokens
    whatever the number of ranks: slot index selects the rows)."""
    g = torch.Generator().manual_seed(((step * 64 + micro) * 64 + index) * 7919 + 17)
    a = torch.randint(1, 7, (batch, 1), generator=g)
    b = torch.randint(0, vocab, (batch, 1), generator=g)
    s = [torch.randint(0, vocab, (batch, 1), generator=g)]
    for _ in range(ctx):
        s.append((a * s[-1] + b) % vocab)
    s = torch.cat(s, 1)
    return s[:, :-1], s[:, 1:]


def _train(rank: int, world: int, device: torch.device, cfg: dict, ddp: bool) -> dict:
    shape = TINY if cfg["tiny"] else GPT2_SMALL
    torch.manual_seed(0)
    model = GPT(**shape).to(device)
    net = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=device.type == "cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)
    micro, batch = cfg["micro"], cfg["batch"]
    losses, times = [], []
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    steps = cfg["warmup"] + cfg["steps"]
    bar = None
    if rank == 0 and cfg["progress"]:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=f"{cfg['label']} x{micro}", leave=False)
    for step in range(steps):
        data = [micro_batch(step, m, rank, batch, shape["ctx"], shape["vocab"]) for m in range(micro)]
        data = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in data]
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for m, (x, y) in enumerate(data):
            ctxm = net.no_sync() if ddp and m < micro - 1 else _null()
            with ctxm, amp:
                logits = net(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            (loss / micro).backward()
            total += loss.detach() / micro
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        if ddp:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    warm = times[cfg["warmup"]:] or times
    med = sorted(warm)[len(warm) // 2]
    return {"median_step_s": med, "losses": losses[cfg["warmup"]:],
            "params": sum(p.numel() for p in model.parameters())}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _rank_main(lctx, cfg):
    import warnings

    import hetccl  # noqa: F401

    warnings.filterwarnings("ignore")
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", lctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["backend"], init_method=lctx.init_method(), rank=lctx.rank,
                            world_size=lctx.world_size, timeout=timedelta(seconds=600),
                            **({"device_id": device} if cfg["backend"] == "nccl" else {}))
    try:
        return _train(lctx.rank, lctx.world_size, device, cfg, ddp=True)
    finally:
        dist.destroy_process_group()


def _single(cfg):
    device = torch.device("cuda", 0) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _train(0, 1, device, cfg, ddp=False)


def _single_main(lctx, cfg):
    return _single(cfg)


def main(argv=None) -> int:
    from ..launch import spawn

    p = argparse.ArgumentParser(prog="hetccl bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--configs", default=None,
                   help="comma list of single, nccl, gloo, hetccl (default: single,nccl,hetccl "
                        "on 2+ GPUs; single,gloo,hetccl on one GPU and on cpu)")
    p.add_argument("--micro", default="1,4", help="micro-batches per step, comma list")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny model (smoke runs)")
    p.add_argument("--vendors", default="1+1")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    configs = args.configs
    if configs is None:
        # the 2-rank reference: NCCL needs one GPU per rank; with fewer GPUs (both ranks on GPU
        # rank % device_count) gloo is the reference (DDP over gloo takes CUDA tensors)
        two_gpus = args.device == "cuda" and torch.cuda.device_count() >= 2
        configs = "single,nccl,hetccl" if two_gpus else "single,gloo,hetccl"
    configs = configs.split(",")
    micros = [int(m) for m in args.micro.split(",")]
    shape = TINY if args.tiny else GPT2_SMALL
    hw = hardware()
    if args.device == "cuda":
        hw = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {hw}"
    print(f"# hetccl bench train: GPT shape {shape}, {args.batch} x {shape['ctx']} tokens per "
          f"rank per micro-batch, {args.device}, {today()}, {hw}")
    print(f"# {'config':>8} {'micro':>5} {'ranks':>5} {'step(ms)':>9} {'tokens/s':>10} "
          f"{'effic.':>7} {'max|dloss|':>10}")
    rows, single_tps, ref_losses = [], {}, {}
    for micro in micros:
        for c in configs:
            cfg = dict(device=args.device, micro=micro, batch=args.batch, steps=args.steps,
                       warmup=args.warmup, tiny=args.tiny, label=c,
                       progress=not args.no_progress, backend=c)
            if c == "single":
                res = spawn(_single_main, 1, args=(cfg,), timeout=1800)[0]
                world = 1
            else:
                world = 2
                if c == "hetccl":
                    cfg["backend"] = "hetccl"
                res = spawn(_rank_main, world, args=(cfg,), timeout=1800,
                            vendors=args.vendors if c == "hetccl" else None)[0]
            tps = world * micro * args.batch * shape["ctx"] / res["median_step_s"]
            if c == "single":
                single_tps[micro] = tps
            eff = tps / (world * single_tps[micro]) if micro in single_tps else float("nan")
            if c in ("nccl", "gloo") and micro not in ref_losses:
                ref_losses[micro] = res["losses"]
            dl = float("nan")
            if world > 1 and micro in ref_losses:
                dl = max(abs(a - b) for a, b in zip(res["losses"], ref_losses[micro]))
            row = {"bench": "train", "config": c, "vendors": args.vendors if c == "hetccl" else "-",
                   "micro": micro, "world_size": world, "median_step_ms": 1e3 * res["median_step_s"],
                   "tokens_per_s": tps, "efficiency": eff, "max_loss_diff_vs_ref": dl,
                   "losses": res["losses"], "params": res["params"], "device": args.device,
                   "batch": args.batch, "shape": shape, "hardware": hw, "date": today()}
            rows.append(row)
            print(f"  {c:>8} {micro:>5} {world:>5} {row['median_step_ms']:9.2f} {tps:10.0f} "
                  f"{eff:7.3f} {dl:10.2e}", flush=True)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print("# summary: efficiency = 2-rank tokens/s / (2 x single tokens/s)")
    for r in rows:
        if r["world_size"] > 1:
            print(f"#   {r['config']:>7} x{r['micro']}: {r['efficiency']:.3f}"
                  + ("" if math.isnan(r["max_loss_diff_vs_ref"]) else
                     f" (losses within {r['max_loss_diff_vs_ref']:.1e} of the reference)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
