"""DeepSpeed over hetccl: ZeRO-1/2/3 losses against a plain DeepSpeed reference run.

The reference is the recipe (recipes/deepspeed/train.py) run the ordinary DeepSpeed way: gloo,
equal batch slices, engine-managed gradient accumulation. The runs under test use hetccl with
emulated vendors (HETCCL_VENDOR per rank), plain and balanced (hetccl.balance plans unequal
micro-batch counts: the faster emulated vendor runs 3 micro-batches, the slower 1). All runs see
the same global batches from the same initial weights, so the per-step global mean loss must
agree up to floating-point reduction order.

Tolerance: LOSS_TOL = 2e-4 absolute on losses of ~4.2. The runs differ only in the order in
which fp32 partial sums are added (gloo vs hetccl's hierarchical all-reduce; 12+4 vs 8+8 samples
per rank), i.e. ~1e-7 relative per step; observed differences are <= 3e-7. The optimizer is plain
SGD (not Adam, which is invariant to a constant gradient scale) and clipping is set too high to
act, so a wrongly scaled or wrongly weighted gradient moves the loss: the test checks that the
reference loss changes by more than 50 x LOSS_TOL over the run, and a factor-2 gradient error
shifts the step-1 loss by about half of that change.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="optional extra: pip install hetccl[deepspeed]")

from hetccl.launch import spawn  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "recipes", "deepspeed")

# The backend under test, in ONE place (was "gloo" while the hetccl backend was being written).
BACKEND = "hetccl"
VENDORS = "1+1"
STAGES = (1, 2, 3)
STEPS = 3
LOSS_TOL = 2e-4
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
       # env:// rendezvous as under torchrun: every rank is a client of the store spawn() owns.
       "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONPATH": REPO}

try:
    from hetccl.integrations import deepspeed as hds
except ModuleNotFoundError as e:  # source checkout, not installed: integrations/ at the top
    if not (e.name or "").startswith("hetccl"):
        raise
    sys.path.insert(0, REPO)
    from integrations import deepspeed as hds

# The module name the launcher wrapper starts its workers with.
WRAPPER_MODULE = "hetccl.cli" if hds.__name__.startswith("hetccl.") else hds.__name__


def _load_recipe():
    spec = importlib.util.spec_from_file_location("hetccl_ds_recipe", os.path.join(RECIPE, "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sgd_config(tmp_dir: str, stage: int) -> str:
    """The recipe's config for `stage` with SGD and inactive clipping (see module docstring)."""
    with open(os.path.join(RECIPE, f"zero{stage}.json")) as f:
        cfg = json.load(f)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["gradient_clipping"] = 100.0  # computed (norm all-reduce runs) but never binding
    path = os.path.join(tmp_dir, f"sgd_zero{stage}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _train_ranks(ctx, runs):
    """Per rank: train each (key, argv) of `runs` in turn in this process; {key: records}."""
    import torch.distributed as dist

    recipe = _load_recipe()
    out = {key: recipe.run(argv) for key, argv in runs}
    out["_vendor"] = os.environ.get("HETCCL_VENDOR")
    out["_backend"] = str(dist.get_backend())
    return out


def _runs(tmp_dir, backend, cases, world=2):
    """argv of each (stage, mode) case; mode "plain" (the DeepSpeed idiom) or "balanced"."""
    speeds = {2: "3,1", 4: "3,1,2,1"}[world]
    runs = []
    for stage, mode in cases:
        argv = ["--comm_backend", backend, "--deepspeed_config", _sgd_config(tmp_dir, stage),
                "--steps", str(STEPS)]
        if mode == "balanced":
            argv += ["--balance", "static", "--speeds", speeds]
        runs.append(((stage, mode), argv))
    return runs


# Default suite: every stage balanced over hetccl, plus the plain idiom on ZeRO-2 (the plain
# idiom on ZeRO-1/3 is in the slow suite; every run costs ~10 s of CPU on 2 ranks).
CASES = [(1, "balanced"), (2, "balanced"), (3, "balanced"), (2, "plain")]
SLOW_CASES = [(1, "plain"), (3, "plain")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ds_ref"))
    cases = [(stage, "plain") for stage in STAGES]
    return spawn(_train_ranks, 2, args=(_runs(tmp, "gloo", cases),), env=ENV, timeout=300)[0]


def _losses(records):
    return [r["loss"] for r in records]


def _check(reference, results, stage, mode):
    ref = _losses(reference[(stage, "plain")])
    # Non-vacuous: training moves the loss far more than the tolerance.
    assert max(abs(x - ref[0]) for x in ref) > 50 * LOSS_TOL, ref
    for rank, res in enumerate(results):
        assert res["_backend"] == BACKEND
        if BACKEND == "hetccl":
            assert res["_vendor"] == f"v{rank}"
        got = _losses(res[(stage, mode)])
        assert all(math.isfinite(x) for x in got)
        diff = max(abs(a - b) for a, b in zip(got, ref))
        assert diff <= LOSS_TOL, f"ZeRO-{stage} {mode} over {BACKEND}: {got} vs reference {ref}"
    recs = results[0][(stage, mode)]
    assert all(r["zero_stage"] == stage and r["backend"] == BACKEND for r in recs)
    if mode == "balanced":
        # The fast emulated vendor takes 12 samples (3 micro-batches of 4), the slow one 4: in
        # 1 micro-batch on ZeRO-1, in as many passes as the fast one on ZeRO-2/3 (every pass
        # reduces gradients, so ranks run in lockstep: hds.balanced_plan).
        assert all(r["samples_per_rank"] == [12, 4] for r in recs), recs
        micro = [3, 1] if stage < 2 else [3, 3]
        assert all(r["micro_per_rank"] == micro for r in recs), recs
    else:
        assert all(r["micro_per_rank"] == [2, 2] for r in recs), recs


@pytest.fixture(scope="module")
def under_test(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ds_het"))
    return spawn(_train_ranks, 2, args=(_runs(tmp, BACKEND, CASES),), vendors=VENDORS, env=ENV,
                 timeout=300)


@pytest.mark.parametrize("stage,mode", CASES)
def test_zero_losses_match_reference(reference, under_test, stage, mode):
    _check(reference, under_test, stage, mode)


@pytest.mark.slow
def test_zero_plain_idiom_stages_1_3_match_reference(reference, tmp_path):
    got = spawn(_train_ranks, 2, args=(_runs(str(tmp_path), BACKEND, SLOW_CASES),),
                vendors=VENDORS, env=ENV, timeout=300)
    for stage, mode in SLOW_CASES:
        _check(reference, got, stage, mode)


@pytest.mark.slow
def test_zero_four_ranks_balanced_matches_reference(tmp_path):
    """4 ranks, vendors 2+1+1, balanced (3,1,2,1 speeds) against a 4-rank gloo reference."""
    ref = spawn(_train_ranks, 4, args=(_runs(str(tmp_path), "gloo",
                                             [(s, "plain") for s in STAGES], 4),),
                env=ENV, timeout=600)[0]
    got = spawn(_train_ranks, 4, args=(_runs(str(tmp_path), BACKEND,
                                             [(s, "balanced") for s in STAGES], 4),),
                vendors="2+1+1", env=ENV, timeout=600)[0]
    for stage in STAGES:
        a, b = _losses(got[(stage, "balanced")]), _losses(ref[(stage, "plain")])
        assert max(abs(x - y) for x, y in zip(a, b)) <= LOSS_TOL, (stage, a, b)
        samples = got[(stage, "balanced")][0]["samples_per_rank"]
        assert len(set(samples)) > 1, samples  # ranks really ran different shares


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_recipe_through_launcher_wrapper(tmp_path):
    """`hetccl deepspeed --comm_backend hetccl --vendors 1+1 ...`: the deepspeed launcher starts
    two workers that run the recipe script unchanged over hetccl (ZeRO-2 config as shipped)."""
    out = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", WRAPPER_MODULE] + (["deepspeed"] if WRAPPER_MODULE == "hetccl.cli" else [])
    cmd += ["--comm_backend", BACKEND, "--vendors", VENDORS, "--num_gpus", "2",
            "--master_port", str(_free_port()),
            os.path.join(RECIPE, "train.py"), "--deepspeed_config", os.path.join(RECIPE, "zero2.json"),
            "--steps", "3", "--out", str(out)]
    env = dict(os.environ, **{k: v for k, v in ENV.items() if k != "TORCHELASTIC_USE_AGENT_STORE"})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["backend"] == BACKEND and r["world_size"] == 2 and r["zero_stage"] == 2
               for r in recs)
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]


# ------------------------------------------------------------------ no processes below

def test_launcher_argv_rewrite():
    mod = hds._worker_module()
    got = hds.launcher_argv(["--comm_backend", "hetccl", "--vendors=1+1", "--num_gpus", "2",
                             "train.py", "--lr", "1", "--comm_backend", "mine"])
    assert got == ["--num_gpus", "2", "--module", mod, "--hetccl_worker", "--comm_backend",
                   "hetccl", "--vendors", "1+1", "--", "train.py", "--lr", "1", "--comm_backend",
                   "mine"]
    # An option value that looks like a script is not taken for the script.
    got = hds.launcher_argv(["--hostfile", "hosts", "--comm_backend=hetccl", "--module", "pkg.train"])
    assert got == ["--hostfile", "hosts", "--module", mod, "--hetccl_worker", "--comm_backend",
                   "hetccl", "--module", "--", "pkg.train"]
    # Without --comm_backend the workers run over hetccl, as under `hetccl run`; a --vendors
    # after the script is the script's.
    got = hds.launcher_argv(["--num_gpus", "2", "--vendors", "1+1", "train.py", "--vendors", "x"])
    assert got == ["--num_gpus", "2", "--module", mod, "--hetccl_worker", "--comm_backend",
                   "hetccl", "--vendors", "1+1", "--", "train.py", "--vendors", "x"]
    with pytest.raises(SystemExit, match="--vendors '1x1'"):
        hds.launcher_argv(["--vendors=1x1", "train.py"])
    with pytest.raises(SystemExit, match="cannot be combined with --comm_backend nccl"):
        hds.launcher_argv(["--comm_backend", "nccl", "--vendors", "1+1", "train.py"])
    with pytest.raises(SystemExit, match="no_python"):
        hds.launcher_argv(["--comm_backend", "hetccl", "--no_python", "run.sh"])
    with pytest.raises(SystemExit, match="expected one of"):
        hds.launcher_argv(["--comm_backend", "hetcl", "train.py"])


def test_launcher_dropin():
    """`hetccl deepspeed --dropin`: DeepSpeed's own nccl backend in the workers (--vendors keeps
    its emulated labels), the drop-in NCCL preloaded in front of them; contradictions refused."""
    from hetccl import nccl_dropin

    mod = hds._worker_module()
    argv = ["--dropin", "--vendors", "1+1", "--num_gpus", "2", "train.py", "--dropin"]
    got = hds.launcher_argv(argv)
    assert got == ["--num_gpus", "2", "--module", mod, "--hetccl_worker", "--comm_backend",
                   "nccl", "--vendors", "1+1", "--dropin", "--", "train.py", "--dropin"]
    env = hds.launcher_env(argv)
    assert env["LD_PRELOAD"].split(":")[0] == nccl_dropin.library_path("nccl"), env
    assert env["HETCCL_DROPIN"] == "1" and env.get(nccl_dropin.REAL_ENV["nccl"]), env
    assert hds.launcher_env(["--num_gpus", "2", "train.py", "--dropin"]) == {}  # the script's flag
    with pytest.raises(SystemExit, match="cannot be combined with --comm_backend hetccl"):
        hds.launcher_argv(["--dropin", "--comm_backend", "hetccl", "train.py"])


def test_help_shows_working_forms_first(capsys):
    """`hetccl deepspeed --help`: hetccl's usage with --vendors, the working forms, and the
    literal `deepspeed --comm_backend hetccl` named as not working; then deepspeed's options."""
    with pytest.raises(SystemExit):
        hds.cli_main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: hetccl deepspeed [--vendors SPLIT]"), out[:200]
    working = out.index("Working forms:")
    broken = out.index("Does NOT work: `deepspeed --comm_backend hetccl train.py`")
    assert working < broken
    assert "hetccl deepspeed --vendors 1+1 --num_gpus 2 train.py" in out
    assert "--vendors=1+1" in out and "unrecognized arguments" in out
    assert "--num_gpus" in out  # the deepspeed launcher's own help follows


def test_add_config_arguments():
    import argparse

    p = hds.add_config_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--deepspeed_config", "c.json", "--comm_backend", "hetccl",
                      "--hetccl_vendors", "1+1"])
    assert (a.deepspeed_config, a.comm_backend, a.hetccl_vendors) == ("c.json", "hetccl", "1+1")
    assert hds.add_config_arguments(p) is p  # idempotent, no duplicate-option error


def test_balanced_config():
    cfg = {"zero_optimization": {"stage": 1, "overlap_comm": True}, "train_batch_size": 8}
    out = hds.balanced_config(cfg)
    assert out["managed_gradient_accumulation"] is False
    assert out["zero_optimization"]["overlap_comm"] is False
    assert cfg["zero_optimization"]["overlap_comm"] is True  # input untouched


def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ImportError, match=r"pip install hetccl\[deepspeed\]"):
        hds.init_distributed(comm_backend="hetccl")
    with pytest.raises(ImportError, match=r"pip install hetccl\[deepspeed\]"):
        hds.cli_main(["--comm_backend", "hetccl", "train.py"])


def _ds_init_ranks(ctx, backend):
    """Per rank: DeepSpeed's initialisation through the integration, then the DeepSpeed
    segments of this job (named after MASTER_ADDR/MASTER_PORT) left in /dev/shm, and whether
    DeepSpeed built its shm op."""
    import glob

    import torch
    import torch.distributed as dist
    import deepspeed.comm as dcomm

    if backend == "direct":  # the control: DeepSpeed's own initialisation, no integration
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        hds.init_distributed(comm_backend=backend)
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
            f"{os.environ['MASTER_PORT']}_*")
    x = torch.ones(1000) * (ctx.rank + 1)
    # over gloo: DeepSpeed's shm all-reduce, on segments already unlinked (the mappings stay);
    # over hetccl: no shm op, torch.distributed's all_reduce, i.e. hetccl
    dcomm.inference_all_reduce(x)
    dist.barrier()
    left = sorted(glob.glob(name))
    dist.barrier()
    if backend == "direct" and ctx.rank == 0:
        for path in left:  # the control leaves them: remove what this job made
            os.unlink(path)
    dist.destroy_process_group()
    return {"left": left, "sum": float(x.sum())}


# LOCAL_SIZE (set by the deepspeed launcher) is what makes DeepSpeed create its segments
DS_SHM_ENV = dict(ENV, LOCAL_SIZE="2")


def test_deepspeed_alone_leaves_segments():
    """The control for the test below: DeepSpeed's own init_distributed on CPU leaves one
    segment per rank in /dev/shm (this test removes them)."""
    res = spawn(_ds_init_ranks, 2, args=("direct",), env=DS_SHM_ENV, timeout=240)
    assert len(res[0]["left"]) == 2, res


@pytest.mark.parametrize("backend", ["gloo", BACKEND])
def test_no_deepspeed_segments_left_in_dev_shm(backend):
    """DeepSpeed's CPU backend creates a 69 MB /dev/shm segment per rank that it never
    unlinks; through the integration none is left while the job still runs: over hetccl the
    op is not built (inference_all_reduce goes to hetccl and gives the right sum), over gloo
    each rank unlinks its own once all have mapped them."""
    kw = {"vendors": VENDORS} if backend == BACKEND else {}
    res = spawn(_ds_init_ranks, 2, args=(backend,), env=DS_SHM_ENV, timeout=240, **kw)
    for r in res:
        assert r["left"] == [], r
        assert r["sum"] == 1000 * 3, r


def test_launcher_default_face(monkeypatch):
    """Neither --dropin nor --torch-face: the drop-in on a machine with a CUDA GPU (as if
    --dropin), the torch face elsewhere; --torch-face and a named --comm_backend keep the face
    (or the named backend); --dropin with --torch-face is refused."""
    import hetccl.run as hrun

    mod = hds._worker_module()
    argv = ["--vendors", "1+1", "--num_gpus", "2", "train.py"]
    monkeypatch.setattr(hrun, "default_dropin", lambda announce=False: True)
    assert hds.launcher_argv(argv)[5:8] == ["--comm_backend", "nccl", "--vendors"]
    assert "--dropin" in hds.launcher_argv(argv) and hds.launcher_env(argv)["HETCCL_DROPIN"] == "1"
    face = ["--torch-face", *argv]
    assert hds.launcher_argv(face) == ["--num_gpus", "2", "--module", mod, "--hetccl_worker",
                                       "--comm_backend", "hetccl", "--vendors", "1+1", "--", "train.py"]
    assert hds.launcher_env(face) == {}
    assert hds.launcher_env(["--comm_backend", "nccl", "--num_gpus", "2", "train.py"]) == {}
    with pytest.raises(SystemExit, match="exclude each other"):
        hds.launcher_argv(["--dropin", "--torch-face", "train.py"])
    monkeypatch.setattr(hrun, "default_dropin", lambda announce=False: False)
    assert "--dropin" not in hds.launcher_argv(argv) and hds.launcher_env(argv) == {}
