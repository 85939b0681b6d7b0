"""`hetccl bench ddp`: step time and losses of a small GPT-style model trained with
DistributedDataParallel, for one backend configuration per run, e.g.

  hetccl bench ddp --backend nccl   --device cuda --nranks 2
  hetccl bench ddp --backend hetccl --device cuda --vendors 1+1

Same seed, same global batches: the loss curves of two runs must match (up to reduction-order
rounding); --compare FILE.jsonl prints the comparison against an earlier run's rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from .report import hardware, today


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, d=256, layers=4, heads=4, ctx=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def batches(step: int, global_batch: int, ctx: int, vocab: int):
    g = torch.Generator().manual_seed(1234 + step)
    # a learnable stream: next token = (a * token + b) mod vocab with per-sequence a, b
    a = torch.randint(1, 7, (global_batch, 1), generator=g)
    b = torch.randint(0, vocab, (global_batch, 1), generator=g)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    seq = [start]
    for _ in range(ctx):
        seq.append((a * seq[-1] + b) % vocab)
    s = torch.cat(seq, 1)
    return s[:, :-1], s[:, 1:]


def _rank_main(lctx, cfg):
    import warnings

    import hetccl  # noqa: F401

    warnings.filterwarnings("ignore", category=FutureWarning)
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", lctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["backend"], init_method=lctx.init_method(), rank=lctx.rank,
                            world_size=lctx.world_size, timeout=timedelta(seconds=300))
    rank, world = lctx.rank, lctx.world_size
    torch.manual_seed(0)
    model = TinyGPT(ctx=cfg["seq"]).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    per = cfg["global_batch"] // world
    losses, times = [], []
    for step in range(cfg["steps"]):
        x, y = batches(step, cfg["global_batch"], cfg["seq"], 512)
        x, y = x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    nparams = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"losses": losses, "step_times": times, "params": nparams}


def main(argv=None) -> int:
    from ..launch import spawn

    p = argparse.ArgumentParser(prog="hetccl bench ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="hetccl")
    p.add_argument("--vendors", default=None, help="vendor split for hetccl (e.g. 1+1)")
    p.add_argument("--nranks", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--jsonl", default=None)
    p.add_argument("--compare", default=None, help="JSONL with an earlier run to compare with")
    args = p.parse_args(argv)
    world = sum(int(x) for x in args.vendors.split("+")) if args.vendors else args.nranks
    cfg = dict(backend=args.backend, device=args.device, steps=args.steps,
               global_batch=args.global_batch, seq=args.seq)
    res = spawn(_rank_main, world, args=(cfg,), vendors=args.vendors, timeout=1200)[0]
    warm = res["step_times"][3:] or res["step_times"]
    step_ms = 1e3 * sorted(warm)[len(warm) // 2]
    hw = hardware()
    if args.device == "cuda":
        hw = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {hw}"
    row = {"bench": "ddp", "backend": args.backend, "vendors": args.vendors or "-",
           "world_size": world, "device": args.device, "params": res["params"],
           "steps": args.steps, "global_batch": args.global_batch, "seq": args.seq,
           "median_step_ms": step_ms, "losses": res["losses"], "hardware": hw, "date": today()}
    print(f"ddp {args.backend} vendors={args.vendors or '-'} world={world} {args.device}: "
          f"{res['params'] / 1e6:.2f} M params, median step {step_ms:.2f} ms, loss "
          f"{res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    if args.compare:
        with open(args.compare) as f:
            other = [json.loads(line) for line in f if line.strip()]
        for o in other:
            if o.get("bench") != "ddp" or o is row:
                continue
            d = max(abs(a - b) for a, b in zip(o["losses"], res["losses"]))
            print(f"  vs {o['backend']} (vendors {o['vendors']}): max |loss diff| = {d:.2e} "
                  f"over {len(res['losses'])} steps; step time ratio "
                  f"{step_ms / o['median_step_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
