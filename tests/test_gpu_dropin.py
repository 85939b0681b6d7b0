"""The drop-in NCCL on CUDA tensors (GPU box): unchanged torch code that calls
init_process_group("nccl"), with hetccl/dropin/libnccl.so.2 preloaded in front of torch and the
real NCCL (the nvidia-nccl wheel) behind it.

  * every c10d family of tests/collective_cases.py for 1+1 and 1+1+1 emulated vendors on the
    one GPU (hetccl's stream path serves the calls: csrc/api/stream_path.h) and for one vendor
    (world size 1: the real NCCL serves them), with get_backend() == "nccl";
  * DDP and FSDP2 against the float64 single-process reference, 1+1;
  * DeepSpeed ZeRO-1/2/3 through `hetccl deepspeed --dropin --vendors 1+1` (DeepSpeed's own
    nccl backend) against one plain DeepSpeed process on the same global batches;
  * the drop-in's start-up line, and which library served each communicator.
Rank r uses GPU r % device_count (all vendors share the one GPU)."""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch

from hetccl import nccl_dropin
from hetccl.launch import spawn

import collective_cases
import gpu_cases
from test_gpu_suite import recorded
import test_gpu_suite as suite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU box)"),
]


def _dropin_env(monkeypatch):
    """LD_PRELOAD and the real library for the ranks (spawned processes inherit os.environ)."""
    real = nccl_dropin.real_library("nccl")
    if not real:
        pytest.fail("no real libnccl.so.2 found (torch's nvidia-nccl wheel): the drop-in has nothing to forward to")
    for k, v in nccl_dropin.launch_env("nccl", {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HETCCL_NCCL_LIBRARY", real)
    monkeypatch.setenv("HETCCL_LOG_LEVEL", "INFO")
    # hetccl's own waits (bootstrap, peers, the stream path's executor) fail naming what they
    # waited for well inside the spawn's bound, as torch's watchdog does for its works (60 s)
    monkeypatch.setenv("HETCCL_TIMEOUT_S", "60")
    return real


@pytest.fixture
def dropin_env(monkeypatch):
    return _dropin_env(monkeypatch)


def _families(ctx, record=None):
    collective_cases.run_all(ctx, device="cuda", backend="nccl", timeout_s=60, record=record)


@functools.lru_cache(maxsize=None)
def _plain_nccl() -> dict:
    """Every case on plain NCCL (nothing preloaded), world size 1: what NCCL itself accepts
    and refuses (torch refuses some ops and dtypes for NCCL before any NCCL call)."""
    assert "libnccl.so.2" not in os.environ.get("LD_PRELOAD", "")
    cases, failure = recorded(_families, "1", {}, timeout=200)
    assert not failure, failure
    return {k: v[0] for k, v in cases.items()}


def _refusal(verdict: str) -> str:
    """The exception type of a case's traceback verdict (the first line that names an error:
    torch's own, before any text the library adds), or the verdict's first line."""
    lines = [ln.strip() for ln in verdict.strip().splitlines() if ln.strip()]
    errs = [ln.split(":")[0] for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b:", ln)]
    return errs[0] if errs else (lines[0] if lines else "")


@pytest.mark.parametrize("split", ["1", "1+1", "1+1+1"])
def test_every_family_under_the_dropin(split, monkeypatch, capfd):
    """Each case's verdict is recorded by every rank as soon as it is known (a hang names the
    last case that finished). A case passes when it is ok or skipped, or when it fails as it
    does on plain NCCL (the same refusal); world size 1 must equal plain NCCL case for case."""
    plain = _plain_nccl()
    _dropin_env(monkeypatch)
    world = sum(int(x) for x in split.split("+"))
    cases, failure = recorded(_families, split, {}, timeout=240)
    bad = {}
    for case, per_rank in cases.items():  # in the order the first rank ran them
        # plain NCCL ran at world size 1: a case of another root is judged by root 0's verdict
        # (torch refuses e.g. a non-contiguous broadcast for NCCL whatever the root)
        was = plain.get(case, plain.get(re.sub(r"/root\d+/", "/root0/", case), "ok"))
        plain_refused = was != "ok" and not was.startswith("skip")
        for r in range(world):
            v = per_rank.get(r)
            if v is None:
                bad[f"{case} rank {r}"] = "no verdict (the rank died or hung before it)"
            elif v == "ok" or v.startswith("skip"):
                continue
            elif not plain_refused:
                bad[f"{case} rank {r}"] = v
            elif _refusal(v) != _refusal(was):
                bad[f"{case} rank {r}"] = f"refused otherwise than plain NCCL ({_refusal(was)}): {v}"
    if world == 1:
        for case, v in plain.items():
            got = cases.get(case, {}).get(0)
            if (got == "ok") != (v == "ok"):
                bad[f"{case} (plain NCCL: {v[:60]})"] = got
    # the first failing cases first (later ones are often their consequence), each cut short
    detail = "\n".join(f"{k}: {v[-700:]}" for k, v in list(bad.items())[:12])
    assert not bad and not failure, (f"{len(bad)} failing (case, rank), in the order run:\n"
                                     f"{detail}\n--- the ranks failed:\n{(failure or '')[-2500:]}")
    assert len(cases) > 50 and all(cases["backend/get_backend"][r] == "ok" for r in range(world))
    err = capfd.readouterr().err
    assert "hetccl: serving NCCL calls (drop-in libnccl.so.2)" in err, err[-3000:]
    want = "one vendor: the real NCCL serves" if world == 1 else "vendor group(s): hetccl serves"
    assert want in err, err[-3000:]


def test_training_under_the_dropin(dropin_env):
    import training_cases as tc

    per_rank = spawn(gpu_cases.run_training, 2, args=("cuda", ["ddp", "fsdp2"], "nccl"), vendors="1+1",
                     timeout=300)
    ref = tc.reference_params()
    for which in ("ddp", "fsdp2"):
        for r, out in enumerate(per_rank):
            for p, want in zip(out[which]["params"], ref):
                torch.testing.assert_close(p, want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, r=r, w=which: f"rank {r} {w}: {m}")


@suite.needs_ds
@pytest.mark.timeout(600)
def test_deepspeed_under_the_dropin(tmp_path):
    """ZeRO-1/2/3 (bf16) through `hetccl deepspeed --dropin --vendors 1+1 --num_gpus 2`: every
    worker runs DeepSpeed's own nccl backend (get_backend() "nccl") with the drop-in serving it
    across the two emulated vendors; per-step losses within the GPU suite's DS_TOL of one plain
    DeepSpeed process (torchrun, nccl) on the same global batches, and the loss falls
    (test_gpu_suite.check_deepspeed_stage)."""
    runs = suite.deepspeed_pair(str(tmp_path), ["--dropin"], het_timeout=300, ref_timeout=200)
    het = runs["het"]
    assert het.returncode == 0, runs["cmd"] + " failed:\n" + het.stdout[-3000:] + het.stderr[-6000:]
    assert "hetccl: serving NCCL calls (drop-in libnccl.so.2)" in het.stderr, het.stderr[-3000:]
    for stage in suite.DS_STAGES:
        suite.check_deepspeed_stage(runs, stage, "nccl", f"dropin/deepspeed/zero{stage}")


@pytest.mark.skipif(not suite.HAVE_HF, reason="transformers/accelerate not installed")
@pytest.mark.timeout(900)
def test_hf_trainer_recipe_under_the_dropin(tmp_path):
    """recipes/hf/finetune_tiny_lm.py, unchanged, as a user runs an NCCL script across vendors:
    `hetccl run --dropin --vendors 1+1 --nproc-per-node 2 finetune_tiny_lm.py --backend nccl`
    (the Trainer's own "nccl" group, served by the drop-in), against the recipe's single-vendor
    run of one rank on the same global batch: per-step losses within the GPU suite's HF_RTOL,
    get_backend() "nccl" on the mixed run, the drop-in's start-up line, and the loss falls."""
    import json
    import subprocess
    import sys

    common = ["--steps", "16", "--samples", "512", "--seq", "48", "--no-progress",
              "--no-replan", "--timeout", "400"]
    recipe = os.path.join(suite.REPO, "recipes", "hf", "finetune_tiny_lm.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([suite.REPO] + sys.path),
               HETCCL_TIMEOUT_S="120")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    mixed_out, ref_out = tmp_path / "mixed", tmp_path / "ref"
    cmd = [sys.executable, "-m", "hetccl.cli", "run", "--dropin", "--vendors", "1+1",
           "--nproc-per-node", "2", "--master-port", str(suite._free_port()), recipe,
           "--vendors", "1+1", "--backend", "nccl", *common, "--out", str(mixed_out)]
    p = subprocess.run(cmd, cwd=suite.REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stdout[-3000:] + p.stderr[-6000:]
    assert "hetccl: serving NCCL calls (drop-in libnccl.so.2)" in p.stderr, p.stderr[-3000:]
    ref_cmd = [sys.executable, recipe, "--vendors", "1", "--no-reference", *common,
               "--out", str(ref_out)]
    r = subprocess.run(ref_cmd, cwd=suite.REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, " ".join(ref_cmd) + "\n" + r.stdout[-3000:] + r.stderr[-6000:]
    mixed = json.loads((mixed_out / "metrics.json").read_text())["mixed"]
    ref = list(json.loads((ref_out / "metrics.json").read_text())["runs"].values())[0]
    assert mixed["world"] == 2 and ref["world"] == 1, (mixed["world"], ref["world"])
    assert mixed["backend"] == "nccl", mixed["backend"]
    assert len(mixed["losses"]) == len(ref["losses"]) == 16
    diff = max(abs(u - v) / abs(v) for u, v in zip(mixed["losses"], ref["losses"]))
    t = mixed["step_times"][5:] or mixed["step_times"]
    suite.figure("dropin/hf_trainer", max_rel_loss_diff=diff,
                 ms_per_step=1e3 * sorted(t)[len(t) // 2], vendors="1+1")
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]
    assert diff <= suite.HF_RTOL, (diff, mixed["losses"], ref["losses"])
