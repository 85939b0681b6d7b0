"""Train a tiny GPT-style model with DeepSpeed ZeRO over hetccl (or any other backend).

CPU, emulated 1+1 vendors (tests/test_deepspeed.py runs this briefly):
    DS_ACCELERATOR=cpu hetccl deepspeed --vendors 1+1 --num_gpus 2 \\
        recipes/deepspeed/train.py --deepspeed_config recipes/deepspeed/zero2.json --steps 20
torchrun (what recipes/deepspeed/gpu_bench.sh does; the script-level form of --comm_backend):
    torchrun --nproc_per_node 2 recipes/deepspeed/train.py --comm_backend hetccl \\
        --hetccl_vendors 1+1 --deepspeed_config recipes/deepspeed/zero2.json
Balanced (ranks run different numbers of micro-batches, hetccl.balance plans them):
    ... --balance static --speeds 3,1      (fixed relative speeds: deterministic)
    ... --balance auto                     (measured throughput, re-planned when it drifts)

Data is generated here: sequences from a fixed random first-order Markov chain (seeded), so the
loss has something to learn and every run sees the same global batches. Sample i of step s is the
same whatever the rank layout, which is what lets a balanced run be compared with a plain one.
Rank 0 writes one JSON line per step (global mean loss, step time, micro-batches per rank) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from hetccl.integrations import deepspeed as hds
except ModuleNotFoundError as e:  # a source checkout that is not installed: integrations/ at top
    if not (e.name or "").startswith("hetccl"):
        raise
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from integrations import deepspeed as hds


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                 mlp_ratio: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

class MarkovData:
    """Global batch `step` of `global_batch` sequences of seq_len+1 tokens, same on every rank.

    A first-order chain that is cheap for any vocabulary: the successor of token t is perm[t]
    with probability 3/4, else uniform. A model can learn it (loss floor ~1.5 nats + 1/4 of
    ln(vocab)), and nothing of vocab^2 size is ever built."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=g)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def global_batch(self, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (n,), generator=g)
        follow = torch.rand(n, self.seq_len, generator=g) < 0.75
        noise = torch.randint(self.vocab, (n, self.seq_len), generator=g)
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.where(follow[:, t], self.perm[seq[:, t]], noise[:, t])
        return seq


def sample_loss_sum(engine, batch: torch.Tensor) -> torch.Tensor:
    """Sum over the batch's sequences of each sequence's mean next-token loss."""
    x, y = batch[:, :-1], batch[:, 1:]
    logits = engine(x)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                reduction="none")
    return per_token.view(y.shape).mean(dim=1).sum()


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--model_config", default=os.path.join(HERE, "model_tiny.json"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the timing summary")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="enable bf16 in the DeepSpeed config")
    p.add_argument("--balance", choices=("off", "static", "auto"), default="off",
                   help="static: plan from --speeds; auto: hetccl.balance.Balancer (measured)")
    p.add_argument("--speeds", default=None, help="static plan: relative rank speeds, e.g. 3,1")
    p.add_argument("--max_micro", type=int, default=None,
                   help="largest micro-batch (default: the config's micro-batch size)")
    p.add_argument("--hetccl_slowdown", default=None, metavar="F0,F1,...",
                   help="TEST ONLY: per-rank slow-down factors (sets HETCCL_SLOWDOWN on each "
                        "rank; under torchrun every rank gets the same environment)")
    p.add_argument("--out", default=None, help="JSONL file; rank 0 writes one line per step")
    p.add_argument("--tag", default="", help="free text copied into every JSONL line")
    # The one-line difference from a plain DeepSpeed script: hds.add_config_arguments adds
    # DeepSpeed's arguments plus --comm_backend (and --hetccl_vendors for emulation).
    p = hds.add_config_arguments(p)
    return p.parse_args(argv)


def _plan(engine, args, global_batch: int, world: int, max_micro: int):
    """Static plan from --speeds, in the form the ZeRO stage needs (hds.balanced_plan)."""
    if args.balance == "static":
        speeds = [float(s) for s in (args.speeds or ",".join(["1"] * world)).split(",")]
        if len(speeds) != world:
            raise SystemExit(f"--speeds has {len(speeds)} values for {world} ranks")
        return hds.balanced_plan(engine, global_batch, speeds, max_micro)
    return None


def run(argv=None) -> list[dict]:
    """Train; return the per-step records (on every rank)."""
    import deepspeed
    import torch.distributed as dist

    args = parse_args(argv)
    backend = hds.init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.model_config) as f:
        mcfg = json.load(f)
    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    args.deepspeed_config = None  # passed as a dict below (possibly modified)
    if args.bf16:
        ds_cfg["bf16"] = {"enabled": True}
    micro = int(ds_cfg["train_micro_batch_size_per_gpu"])
    gas = int(ds_cfg.get("gradient_accumulation_steps", 1))
    global_batch = micro * gas * world
    ds_cfg["train_batch_size"] = global_batch
    if args.balance != "off":
        ds_cfg = hds.balanced_config(ds_cfg)

    torch.manual_seed(args.seed)
    model = TinyGPT(**mcfg)
    # TEST ONLY: HETCCL_SLOWDOWN=f stretches this rank's compute f times (a slower vendor):
    # extra GPU kernels on CUDA, a sleep on CPU; forward only (by 1 + 3 (f - 1): ZeRO-2/3
    # reduce gradients inside the backward, which must not be stretched)
    if args.hetccl_slowdown:
        factors = args.hetccl_slowdown.split(",")
        if len(factors) != world:
            raise SystemExit(f"--hetccl_slowdown has {len(factors)} factors for {world} ranks")
        os.environ["HETCCL_SLOWDOWN"] = factors[rank]
    from hetccl.balance.emulate import slow_down_module
    slow_down_module(model)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters(), config=ds_cfg)
    device = engine.device
    data = MarkovData(mcfg["vocab_size"], mcfg["seq_len"], args.seed)

    balancer = plan = None
    if args.balance != "off":
        max_micro = args.max_micro or micro
        plan = _plan(engine, args, global_batch, world, max_micro)
        if args.balance == "auto":
            # same planner and step-time model as plain loops; forwards timed (events on CUDA)
            balancer = hds.make_balancer(engine, global_batch, max_micro)
            plan = balancer.plan

    records = []
    for step in range(args.steps):
        batch = data.global_batch(step, global_batch).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if plan is None:
            # The plain DeepSpeed idiom: equal slices, `gas` micro-batches, engine-managed boundary.
            local = batch[rank * micro * gas:(rank + 1) * micro * gas]
            loss_sum = torch.zeros((), dtype=torch.float64)
            for j in range(gas):
                mb = local[j * micro:(j + 1) * micro]
                s = sample_loss_sum(engine, mb)
                engine.backward(s / micro)  # mean over the micro-batch; DeepSpeed divides by gas
                engine.step()
                loss_sum += s.detach().double().cpu()
            n_micro = gas
        else:
            if balancer is not None:
                plan = balancer.plan
            loss_sum = hds.balanced_step(
                engine, plan, rank,
                make_batch=lambda off, n: batch[off:off + n],
                loss_sum=sample_loss_sum,
                empty_batch=lambda: batch[:0], balancer=balancer)
            n_micro = plan.num_micro(rank)
            n_samples = plan.samples(rank)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if plan is None:
            n_samples = micro * gas
        # Global mean loss over the global batch: reduced over the same backend as training.
        stats = torch.tensor([loss_sum.item(), float(n_micro), dt, float(n_samples)],
                             dtype=torch.float64,
                             device=device)  # NCCL needs device tensors, inputs and outputs
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        gathered = [g.cpu() for g in gathered]
        rec = {"step": step, "loss": sum(g[0].item() for g in gathered) / global_batch,
               "step_time_s": max(g[2].item() for g in gathered),
               "micro_per_rank": [int(g[1].item()) for g in gathered],
               "samples_per_rank": [int(g[3].item()) for g in gathered],
               "backend": backend, "zero_stage": engine.zero_optimization_stage(),
               "world_size": world, "balance": args.balance, "tag": args.tag,
               "global_batch": global_batch}
        records.append(rec)
        if rank == 0 and args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    if rank == 0:
        timed = [r["step_time_s"] for r in records[args.warmup:]] or [math.nan]
        print(f"[hetccl-ds] backend={backend} zero={records[-1]['zero_stage']} world={world} "
              f"balance={args.balance} loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} "
              f"median step {sorted(timed)[len(timed) // 2] * 1e3:.1f} ms", flush=True)
    return records


if __name__ == "__main__":
    run()
