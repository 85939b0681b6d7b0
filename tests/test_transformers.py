"""HuggingFace Trainer over hetccl (hetccl.integrations.transformers, recipes/hf).

The recipe's training runs on 2 CPU ranks of two emulated vendors with an uneven per-rank split
of the global batch and is compared step by step with a single-process reference on the same
global batch. Tolerance (relative, per logged step loss): 1e-4. Both runs are fp32 and see the
same samples per step; they differ only in the order of floating-point sums (per-rank partial
gradients summed by the all-reduce, other micro-batch padding shapes), measured at ~1e-7 over
12 AdamW steps. A normalisation error is orders of magnitude larger: the negative control below
(each rank averaging its own tokens, the Trainer's default without
average_tokens_across_devices) must deviate by more than 1e-3, which shows the check can fail.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "recipes" / "hf"
HAVE_TRANSFORMERS = (importlib.util.find_spec("transformers") is not None
                     and importlib.util.find_spec("accelerate") is not None)
needs_tf = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                              reason="transformers/accelerate not installed "
                                     "(pip install hetccl[transformers])")
RTOL = 1e-4


def _recipe():
    # Importable by name (not from a file spec): spawned ranks unpickle its functions by module
    # name, and they inherit this sys.path.
    if str(RECIPE_DIR) not in sys.path:
        sys.path.insert(0, str(RECIPE_DIR))
    import finetune_tiny_lm
    return finetune_tiny_lm


def _hhf():
    return _recipe().import_integration()


def _rel(a, b):
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


SMALL = dict(steps=12, global_batch=16, grad_accum=2, max_micro=8, seq=64, samples=512,
             layers=2, hidden=64, lr=3e-3, seed=0, replan=False, backend=None,
             progress=False, threads=1, generate=False)


@needs_tf
def test_recipe_uneven_split_matches_single_vendor(tmp_path):
    rec = _recipe()
    cfg = {**SMALL, "out": str(tmp_path), "backend": _hhf().BACKEND}
    uneven = {**cfg, "tag": "mixed", "speeds": [3.0, 1.0]}          # plan 12:4 of 16
    control = {**uneven, "tag": "control", "unsafe_per_rank_mean": True}
    ref = {**cfg, "tag": "ref"}
    out = rec.launch_many({"mixed": ([uneven, control], "1+1", None),
                           "ref": ([ref], "1", None)}, timeout=240)
    good, bad = out["mixed"]
    (reference,) = out["ref"]
    assert good["world"] == 2 and reference["world"] == 1
    assert good["backend"] == cfg["backend"]
    assert all(c == [12, 4] for c in good["counts"]), good["counts"]
    assert len(good["losses"]) == cfg["steps"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.3    # it does learn
    assert _rel(good["losses"], reference["losses"]) < RTOL
    assert _rel(bad["losses"], reference["losses"]) > 10 * RTOL      # the check can fail


@pytest.mark.slow
@needs_tf
def test_recipe_cli_rebalances_and_plots(tmp_path):
    """The script as a user runs it: vendor v1 emulated 4x slower (forward), re-planning on;
    loss still equals the reference, the split moved towards rank 0, PNG + metrics written."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + sys.path)}
    p = subprocess.run(
        [sys.executable, str(RECIPE_DIR / "finetune_tiny_lm.py"), "--steps", "14",
         "--samples", "512", "--seq", "64", "--slowdown", "1,4", "--no-progress",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["max_rel_diff"] < RTOL
    counts = m["runs"]["mixed 1+1"]["counts"]
    assert counts[0] == [8, 8] and counts[-1][0] > counts[-1][1], counts
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@needs_tf
def test_sampler_covers_global_batch():
    from hetccl.balance import plan_microbatches, step_indices
    hhf = _hhf()
    Sampler = hhf.HetcclBalancedSampler
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    n, B, G, W = 100, 12, 3, 3
    plan = plan_microbatches(B, [5.0, 1.0, 0.01], 8)          # rank 2 would get 0 samples
    samplers = [Sampler(n, plan, r, G, seed=7) for r in range(W)]
    assert isinstance(samplers[0], BatchRebalanceSampler)    # Trainer: rank-aware batch sampler
    later = plan_microbatches(B, [1.0, 1.0, 1.0], 8)
    for s in samplers:
        s.schedule(later, at_step=5)
    its = [list(s) for s in samplers]
    spe = n // B
    assert all(len(x) == spe * G == len(s) for x, s in zip(its, samplers))
    for k in range(spe):
        mbs = [x[k * G:(k + 1) * G] for x in its]
        assert all(len(mb) > 0 for r in mbs for mb in r)      # G non-empty micro-batches each
        got = sorted(i for r in mbs for mb in r for i in mb)
        assert got == sorted(step_indices(n, B, k, epoch=0, seed=7))
        sizes = [sum(len(mb) for mb in r) for r in mbs]
        if k >= 5:
            assert sizes == [4, 4, 4]                             # the scheduled plan
        else:
            assert plan.samples(2) == 0 and sizes[2] == G         # floor of G samples
            assert sizes[0] > sizes[1] >= G, sizes
    with pytest.raises(RuntimeError, match="already produced"):
        samplers[0].schedule(plan, at_step=3)


def test_missing_transformers_message():
    code = ("import sys; sys.modules['transformers'] = None; sys.path.insert(0, %r)\n"
            "import finetune_tiny_lm as r; hhf = r.import_integration()\n"
            "try:\n    hhf.init_distributed()\nexcept ImportError as e:\n    print('MSG', e)\n"
            "try:\n    hhf.HetcclBalanceCallback\nexcept ImportError as e:\n    print('MSG', e)\n"
            % str(RECIPE_DIR))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    msgs = [ln for ln in p.stdout.splitlines() if ln.startswith("MSG")]
    assert len(msgs) == 2 and all("pip install hetccl[transformers]" in m for m in msgs), p.stdout


TRAINER_SCRIPT = r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
import torch.distributed as dist
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, max_position_embeddings=32))
data = [{"input_ids": torch.arange(i, i + 16) % 64, "labels": torch.arange(i, i + 16) % 64}
        for i in range(16)]
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=2, max_steps=2,
                         report_to=[], save_strategy="no", logging_steps=1,
                         dataloader_num_workers=0)          # no --use_cpu
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print(f"rank {dist.get_rank()} world {args.world_size} mode {args.parallel_mode} "
      f"backend {dist.get_backend()} ddp {type(trainer.model_wrapped).__name__}", flush=True)
"""


@needs_tf
@pytest.mark.parametrize("accelerate_use_cpu", [None, "false"])
def test_trainer_under_hetccl_run_without_use_cpu(tmp_path, accelerate_use_cpu):
    """An HF Trainer script without --use_cpu under `hetccl run` on a machine without CUDA:
    hetccl run makes it train data-parallel over hetccl (instead of every rank alone); if
    ACCELERATE_USE_CPU=false forces the single-process path anyway, building TrainingArguments
    fails naming --use_cpu."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("the CPU-only case needs a machine without CUDA")
    script = tmp_path / "trainer.py"
    script.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + TRAINER_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HETCCL_") and k != "ACCELERATE_USE_CPU"}
    if accelerate_use_cpu is not None:
        env["ACCELERATE_USE_CPU"] = accelerate_use_cpu
    p = subprocess.run([sys.executable, "-m", "hetccl.cli", "run", "--vendors", "1+1",
                        "--standalone", "--nproc_per_node", "2", str(script)], env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if accelerate_use_cpu is None:
        assert p.returncode == 0, out[-6000:]
        for r in (0, 1):
            assert (f"rank {r} world 2 mode ParallelMode.DISTRIBUTED backend hetccl ddp "
                    f"DistributedDataParallel") in out, out[-4000:]
    else:
        assert p.returncode != 0, out[-4000:]
        assert "this job has 2 ranks, but the HF Trainer would train" in out, out[-4000:]
        assert "pass --use_cpu" in out, out[-4000:]
