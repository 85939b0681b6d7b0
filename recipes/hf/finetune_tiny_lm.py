"""Fine-tune a tiny causal LM with the HuggingFace Trainer over hetccl, mixed vendors emulated.

    python recipes/hf/finetune_tiny_lm.py                      # 2 ranks (1+1 vendors) + reference
    python recipes/hf/finetune_tiny_lm.py --slowdown 1,3       # vendor v1 3x slower: rebalances
    torchrun --nproc-per-node 2 recipes/hf/finetune_tiny_lm.py --vendors 1+1

Everything is built in code, nothing is downloaded: the text comes from a small generator
(template sentences), the tokenizer is character-level over a fixed alphabet, the model is a
2-layer Llama made from a LlamaConfig. The Trainer script is ordinary except for two calls from
hetccl.integrations.transformers: init_distributed() before TrainingArguments and balance(trainer).

Without torchrun, the script launches the ranks itself (hetccl.launch.spawn, HETCCL_VENDOR set
per rank) and, unless --no-reference, a single-vendor reference run on the same global batch.
It writes to --out: metrics.json (per-step losses of both runs, per-rank samples per step) and
loss.png (both loss curves, their difference, and the per-rank split). See README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
try:
    import hetccl  # noqa: F401
except ModuleNotFoundError:      # running from a source checkout without installing hetccl
    sys.path.insert(0, str(REPO))


def import_integration():
    """hetccl.integrations.transformers; in a source checkout integrations/ is not yet mapped
    under hetccl (the wheel does that, see pyproject), so map it the same way."""
    try:
        from hetccl.integrations import transformers as hhf
    except ModuleNotFoundError as e:
        if e.name not in ("hetccl.integrations", "hetccl"):
            raise
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        import hetccl
        import integrations
        sys.modules.setdefault("hetccl.integrations", integrations)
        hetccl.integrations = integrations
        from hetccl.integrations import transformers as hhf
    return hhf


# ------------------------------------------------------------------------------------------
# Data: generated text, character-level tokenizer
# ------------------------------------------------------------------------------------------
SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the robot",
            "our teacher", "the farmer", "a young girl", "the captain"]
VERBS = ["sees", "likes", "finds", "follows", "paints", "builds", "carries", "watches"]
OBJECTS = ["a red ball", "the blue house", "some green apples", "a long road", "the tall tree",
           "two white boats", "a quiet lake", "the yellow kite"]
PLACES = ["in the park", "near the river", "at home", "on the hill", "by the sea",
          "after dinner", "every morning", "in the rain"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def make_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 3)
        out.append(" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                            f"{rng.choice(PLACES)}." for _ in range(k)))
    return out


class CharTokenizer:
    def __init__(self):
        self.itos = SPECIALS + list(ALPHABET)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self):
        return len(self.itos)

    def encode(self, text: str, max_len: int) -> list[int]:
        ids = [self.bos_id] + [self.stoi[c] for c in text] + [self.eos_id]
        return ids[:max_len]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(SPECIALS))


class TextDataset:
    """Variable-length samples: token counts differ per sample, so exact normalisation must
    count tokens, not samples."""

    def __init__(self, texts, tok: CharTokenizer, max_len: int):
        self.items = [tok.encode(t, max_len) for t in texts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def collate(features, pad_id: int = 0):
    import torch
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(features), n), dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def make_model(vocab: int, max_len: int, seed: int, layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def emulate_slow_vendor(model):
    """TEST ONLY: HETCCL_SLOWDOWN=f makes this rank's forward and backward f times slower
    (hetccl.balance.emulate.slow_down_module: extra GPU kernels on CUDA, a sleep on CPU),
    standing in for a slower GPU vendor."""
    from hetccl.balance.emulate import slow_down_module
    slow_down_module(model)


def StepTimes():
    """A TrainerCallback recording the wall time of every optimizer step (seconds; the device
    is synchronised at each step end, so the time covers the step's kernels)."""
    import time

    import torch
    from transformers import TrainerCallback

    class _StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._t = None

        def _now(self):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            if self._t is None:
                self._t = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            t = self._now()
            self.times.append(t - self._t)
            self._t = t

    return _StepTimes()


# ------------------------------------------------------------------------------------------
# One rank (or the single process of the reference run)
# ------------------------------------------------------------------------------------------
def train(cfg: dict, store=None) -> dict:
    hhf = import_integration()
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import Trainer, TrainingArguments

    transformers.logging.set_verbosity_warning()
    torch.set_num_threads(max(1, cfg["threads"]))
    hhf.init_distributed(cfg.get("backend"), store=store)  # the one call, before TrainingArguments
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    tok = CharTokenizer()
    ds = TextDataset(make_corpus(cfg["samples"], cfg["seed"]), tok, cfg["seq"])
    model = make_model(len(tok), cfg["seq"], cfg["seed"], cfg["layers"], cfg["hidden"])
    emulate_slow_vendor(model)

    G = cfg["grad_accum"]
    args = TrainingArguments(
        output_dir=cfg["out"] + f"/trainer-{cfg['tag']}",
        max_steps=cfg["steps"],
        per_device_train_batch_size=max(1, cfg["global_batch"] // (world * G)),
        gradient_accumulation_steps=G,
        learning_rate=cfg["lr"], lr_scheduler_type="cosine", warmup_steps=cfg["steps"] // 10,
        weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(),
        average_tokens_across_devices=True,
        dataloader_num_workers=0, seed=cfg["seed"], ddp_find_unused_parameters=False,
        disable_tqdm=not cfg["progress"] or rank != 0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    if not cfg["progress"]:
        from transformers.trainer_callback import PrinterCallback
        trainer.remove_callback(PrinterCallback)     # no per-step log lines either
    cb = hhf.balance(trainer, global_batch=cfg["global_batch"], max_micro=cfg["max_micro"],
                     replan=cfg["replan"], speeds=cfg.get("speeds"))
    timer = StepTimes()
    trainer.add_callback(timer)
    if cfg.get("unsafe_per_rank_mean"):
        # NEGATIVE CONTROL only: each rank averages its own tokens; unequal batches are then
        # mis-weighted and the loss no longer matches the reference.
        args.average_tokens_across_devices = False
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    sample = None
    if rank == 0 and cfg.get("generate"):
        model.eval()
        prompt = torch.tensor([tok.encode("the cat", cfg["seq"])[:-1]])
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=40, do_sample=False,
                                 pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
        sample = tok.decode(gen[0].tolist())
    return {"rank": rank, "world": world, "losses": losses,
            "counts": [c for _, c in cb.history], "step_times": timer.times,
            "backend": str(dist.get_backend()) if dist.is_initialized() else None,
            "vendor": os.environ.get("HETCCL_VENDOR", ""), "sample": sample}


def _rank_entry(ctx, cfgs):
    store = ctx.store()
    return [train(c, store=store) for c in cfgs]   # several runs share one process group


def launch(cfgs: list[dict], vendors: str, slowdown: list[float] | None,
           timeout: float, threads: int | None = None) -> list[dict]:
    """Run ``train`` for each config in turn on len(vendors) local ranks (hetccl.launch.spawn,
    HETCCL_VENDOR per rank); rank 0's results."""
    from hetccl.launch import spawn, vendor_labels
    labels = vendor_labels(vendors)
    groups = sorted(set(labels))
    rank_env = None
    if slowdown:
        f = {g: (slowdown[i] if i < len(slowdown) else 1.0) for i, g in enumerate(groups)}
        rank_env = [{"HETCCL_SLOWDOWN": str(f[v])} for v in labels]
    threads = threads or max(1, (os.cpu_count() or 1) // len(labels))
    cfgs = [{**c, "threads": threads} for c in cfgs]
    res = spawn(_rank_entry, len(labels), args=(cfgs,), vendors=labels, rank_env=rank_env,
                timeout=timeout)
    return res[0]


def launch_many(jobs: dict[str, tuple], timeout: float) -> dict[str, list[dict]]:
    """Start several launch() jobs at once (threads; each owns its processes and store) and
    wait for all: the reference and the mixed run overlap their start-up (imports)."""
    import concurrent.futures as cf

    from hetccl.launch import vendor_labels
    ranks = sum(len(vendor_labels(job[1])) for job in jobs.values())
    threads = max(1, (os.cpu_count() or 1) // ranks)     # do not oversubscribe the cores
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futs = {name: ex.submit(launch, *job, timeout, threads) for name, job in jobs.items()}
        return {name: f.result() for name, f in futs.items()}


def plot(path: Path, runs: dict[str, dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in names:
        ls = runs[name]["losses"]
        axes[0].plot(range(1, len(ls) + 1), ls, label=name, lw=1.6,
                     ls="-" if name == names[0] else "--")
    axes[0].set_xlabel("optimizer step"), axes[0].set_ylabel("training loss (per token)")
    axes[0].set_title("loss"), axes[0].legend()
    if len(names) == 2:
        a, b = (runs[n]["losses"] for n in names)
        d = [abs(x - y) / abs(y) for x, y in zip(a, b)]
        axes[1].semilogy(range(1, len(d) + 1), [max(v, 1e-12) for v in d])
        axes[1].set_title(f"|{names[0]} - {names[1]}| / {names[1]}\n(exactly 0 drawn at 1e-12)",
                          fontsize=9)
        axes[1].set_xlabel("optimizer step")
    else:
        axes[1].axis("off")
    counts = runs[names[0]]["counts"]
    if counts:
        for r in range(len(counts[0])):
            axes[2].step(range(1, len(counts) + 1), [c[r] for c in counts], where="mid",
                         label=f"rank {r}")
        axes[2].set_ylim(0, max(max(c) for c in counts) + 1)
    axes[2].set_title(f"samples per rank per step ({names[0]})")
    axes[2].set_xlabel("optimizer step"), axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vendors", default="1+1", help="ranks per emulated vendor, e.g. 1+1, 2+1")
    p.add_argument("--slowdown", default="",
                   help="per-vendor slow-down factors, e.g. 1,3 (TEST ONLY emulation)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-replan", action="store_true", help="keep the initial (equal) split")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the single-vendor reference run")
    p.add_argument("--reference-vendors", default="1",
                   help="ranks of the reference run, all one vendor (default: 1 process)")
    p.add_argument("--backend", default=None, help="override the backend (default: hetccl)")
    p.add_argument("--unsafe-per-rank-mean", action="store_true",
                   help="NEGATIVE CONTROL: turn off global token normalisation")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="out/hf")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(steps=a.steps, global_batch=a.global_batch, grad_accum=a.grad_accum,
               max_micro=a.max_micro, seq=a.seq, samples=a.samples, layers=a.layers,
               hidden=a.hidden, lr=a.lr, seed=a.seed, replan=not a.no_replan,
               backend=a.backend, unsafe_per_rank_mean=a.unsafe_per_rank_mean,
               progress=not a.no_progress, out=str(out), threads=1, generate=True)

    if "RANK" in os.environ:          # under torchrun: this process is one rank
        from hetccl.launch import vendor_labels
        labels = vendor_labels(a.vendors)
        rank = int(os.environ["RANK"])
        if not os.environ.get("HETCCL_VENDOR") and len(labels) == int(os.environ["WORLD_SIZE"]):
            os.environ["HETCCL_VENDOR"] = labels[rank]
        cfg["threads"] = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                            "1")))
        res = train({**cfg, "tag": "torchrun"})
        if res["rank"] == 0:
            (out / "metrics.json").write_text(json.dumps({"mixed": res}, indent=1))
            plot(out / "loss.png", {f"{a.vendors} vendors": res}, "hetccl + HF Trainer")
            print(f"wrote {out / 'metrics.json'} and {out / 'loss.png'}")
        return 0

    slowdown = [float(x) for x in a.slowdown.split(",") if x] or None
    mixed, ref = f"mixed {a.vendors}", "single-vendor reference"
    jobs = {mixed: ([{**cfg, "tag": "mixed"}], a.vendors, slowdown)}
    print(f"== mixed-vendor run: vendors {a.vendors}, slowdown {slowdown or 'none'}", flush=True)
    if not a.no_reference:
        n_ref = sum(int(x) for x in a.reference_vendors.split("+"))
        jobs[ref] = ([{**cfg, "tag": "reference", "replan": False, "progress": False}],
                     str(n_ref), None)
        print(f"== single-vendor reference (at the same time): {n_ref} rank(s), one vendor",
              flush=True)
    runs = {name: r[0] for name, r in launch_many(jobs, a.timeout).items()}
    metrics = {"config": cfg, "vendors": a.vendors, "slowdown": slowdown, "runs": runs}
    names = list(runs)
    if len(names) == 2:
        x, y = runs[names[0]]["losses"], runs[names[1]]["losses"]
        metrics["max_rel_diff"] = max(abs(u - v) / abs(v) for u, v in zip(x, y))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(out / "loss.png", runs, f"tiny Llama, Trainer over {runs[names[0]]['backend']}: "
                                 f"vendors {a.vendors} vs single vendor")
    first = runs[names[0]]
    print(f"backend {first['backend']}; loss {first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}"
          f"; samples per rank: first step {first['counts'][0]}, last {first['counts'][-1]}")
    times = first.get("step_times") or []
    if len(times) > 5:
        import statistics
        med = statistics.median(times[5:])
        print(f"median step time (steps 6..): {1e3 * med:.1f} ms; "
              f"{cfg['global_batch'] / med:.1f} samples/s")
    if "max_rel_diff" in metrics:
        print(f"max relative loss difference vs reference: {metrics['max_rel_diff']:.3g}")
    if first.get("sample"):
        print(f"sample: {first['sample']!r}")
    print(f"wrote {out / 'metrics.json'} and {out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
