"""The GPU suite (issue 23): every path a user takes, on CUDA tensors, against references.

    python3 -m pytest -q tests/test_gpu_suite.py -m gpu                 # on the GPU box
    HETCCL_GPU_SUITE_DEVICE=cpu python3 -m pytest -q tests/test_gpu_suite.py -m gpu
                                            # the same rank-side cases on CPU tensors: proves
                                            # the test logic on a machine without a GPU

(`bash .ci/gpu-box.sh build tests` runs it with tests/test_gpu.py and writes the log and a
summary.) Without CUDA and without HETCCL_GPU_SUITE_DEVICE=cpu every test skips with a reason.
On CPU the CUDA-only check (wait() on another stream) skips with a reason, and the
set_default_device mode uses "meta" instead of the GPU.

Placement: rank r uses GPU r % device_count, so on a one-GPU box every emulated vendor's
process shares the GPU (a correctness run; speeds mean nothing). Splits whose vendor group has
two ranks (2+1) need two GPUs (NCCL refuses two ranks of one communicator on one GPU) and skip
with that reason on one GPU.

What runs (one spawn covers many cases; each case or family is reported as its own test):
  1. every c10d family (tests/collective_cases.py FAMILIES) for 1+1, 1+1+1 and 2+1, with and
     without torch.set_default_device(<the rank's GPU>) in effect (on CPU tensors: "meta", on
     which an allocation that does not name its device fails);
  2. bad input (size, dtype, op, root) after every order of earlier calls, for two and three
     vendor groups (tests/gpu_cases.py run_errors); a peer SIGKILLed during large all-reduces;
  3. DDP and FSDP2 against the float64 single-process reference; DeepSpeed ZeRO-1/2/3 in bf16
     through `hetccl deepspeed` against a single-process DeepSpeed run; the HF Trainer recipe;
     megatron-core pp=2 (even and planned split) against pp=1, and checkpoint resume;
     `hetccl bench train --tiny`.
Figures (loss differences, ms per step) go to the JSON lines file named by
HETCCL_GPU_FIGURES when it is set (.ci/gpu-box.sh summarises them).
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from hetccl.launch import RankError, spawn

import collective_cases
import gpu_cases

DEVICE = os.environ.get("HETCCL_GPU_SUITE_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE not in ("cuda", "cpu"),
                       reason=f"HETCCL_GPU_SUITE_DEVICE={DEVICE!r}: cuda (default) or cpu"),
    pytest.mark.skipif(ON_GPU and NGPU < 1,
                       reason="needs a CUDA GPU (run .ci/gpu-box.sh on the GPU box), or "
                              "HETCCL_GPU_SUITE_DEVICE=cpu to run the same cases on CPU tensors"),
]

SPLITS = ["1+1", "1+1+1", "2+1"]
# face_capi: the torch face on the C API (HETCCL_FACE_ROUTE=capi, hetccl/face_capi.py);
# face_capi_route: the same with every CUDA call on the C API's device route
# (HETCCL_STREAM_DEVICE_BYTES=1), so every routed call's join is deferred to its work's wait()
# (HETCCL_FACE_DEFER_JOIN, default on)
MODES = ["plain", "default_device", "face_capi", "face_capi_route"]
_MODE_ENV = {"face_capi": {"HETCCL_FACE_ROUTE": "capi"},
             "face_capi_route": {"HETCCL_FACE_ROUTE": "capi", "HETCCL_STREAM_DEVICE_BYTES": "1"}}


def _world(split: str) -> int:
    return sum(int(x) for x in split.split("+"))


def _split_skip(split: str) -> str | None:
    """Why `split` cannot run here, or None."""
    if ON_GPU and max(int(x) for x in split.split("+")) > NGPU:
        return (f"vendor group of {max(int(x) for x in split.split('+'))} ranks needs as many "
                f"GPUs (NCCL: one rank per GPU in a communicator); this machine has {NGPU}")
    return None


def figure(name: str, **values) -> None:
    """Append one figure row to $HETCCL_GPU_FIGURES (if set)."""
    path = os.environ.get("HETCCL_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"figure": name, "device": DEVICE, **values}) + "\n")


def recorded(fn, split: str, kwargs: dict, env: dict | None = None, timeout: float = 300):
    """Run fn(ctx, record=..., **kwargs) on the ranks of `split`; every case's verdict is
    written by each rank as soon as it is known, so a rank that dies still leaves the cases it
    finished. Returns ({case: {rank: verdict}}, failure text or None). A case a rank started
    and never finished has the verdict "no verdict: ... still running it"; when the ranks did
    not finish, the failure text carries each late rank's Python stack taken a little before
    the timeout (what it was blocked in)."""
    world = _world(split)
    tmp = tempfile.mkdtemp(prefix="hetccl-gpu-suite-")
    failure = None
    try:
        spawn(gpu_cases.recorded_entry, world, args=(tmp, fn, kwargs, max(1.0, timeout - 15)),
              vendors=split, env=env, timeout=timeout)
    except RankError as e:
        failure = str(e) + late_stacks(tmp, world)
    merged: dict[str, dict[int, str]] = {}
    for r in range(world):
        path = os.path.join(tmp, f"rank{r}.jsonl")
        if os.path.exists(path):
            for line in open(path):
                case, verdict = json.loads(line)
                if verdict == collective_cases.RUNNING:
                    verdict = ("no verdict: the rank started this case and was still running it "
                               "when it died or the run timed out")
                merged.setdefault(case, {})[r] = verdict
    shutil.rmtree(tmp, ignore_errors=True)
    return merged, failure


def late_stacks(tmp: str, world: int, frames: int = 10) -> str:
    """The stacks recorded_entry wrote for ranks still running near the timeout: per rank,
    each thread that was in a test or hetccl frame, innermost `frames` frames first."""
    out = []
    for r in range(world):
        path = os.path.join(tmp, f"rank{r}.stacks")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        if not text.strip():
            continue
        # faulthandler: "Timeout (h:mm:ss)!", then one block per thread, blank-line separated
        text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("Timeout ("))
        blocks = [b for b in text.split("\n\n") if b.strip()]
        for b in blocks:
            lines = b.strip().splitlines()
            if not any(("tests/" in ln or "hetccl" in ln) for ln in lines[1:]):
                continue
            out.append(f"rank {r} {lines[0].strip()}\n" + "\n".join(lines[1:1 + frames]))
    return ("\nstacks of the ranks still running before the timeout:\n" + "\n".join(out)) if out else ""


def check_cases(cases: dict[str, dict[int, str]], world: int, failure: str | None,
                accept=("ok",)) -> None:
    """Every rank has an accepted verdict for every case; all "skip: ..." -> pytest.skip."""
    bad = {}
    skips = set()
    for case, per_rank in sorted(cases.items()):
        for r in range(world):
            v = per_rank.get(r)
            if v is None:
                bad[f"{case} rank {r}"] = "no verdict (the rank died or failed before it)"
            elif v.startswith("skip: "):
                skips.add(v[6:])
            elif v not in accept:
                bad[f"{case} rank {r}"] = v
    detail = "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:12])
    if failure and bad:
        detail += "\n--- the ranks failed:\n" + failure[-3000:]
    assert not bad, f"{len(bad)} failing (case, rank) of {len(cases)} cases:\n{detail}"
    if skips and all(all(v.startswith("skip: ") for v in pr.values()) for pr in cases.values()):
        pytest.skip("; ".join(sorted(skips)))


# ===================================================================== 1. every c10d family
@functools.lru_cache(maxsize=None)
def collectives(split: str, mode: str):
    return recorded(collective_cases.run_all, split,
                    {"device": DEVICE, "default_device": mode == "default_device"},
                    env=_MODE_ENV.get(mode),
                    timeout=240)


def _collectives_skip(split, mode):
    why = _split_skip(split)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("family", collective_cases.FAMILIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", SPLITS)
def test_collectives(split, mode, family):
    """Every case of `family` correct on every rank, against float64 / exact references
    (collective_cases.py: random data, zero-size and non-contiguous tensors)."""
    _collectives_skip(split, mode)
    res, failure = collectives(split, mode)
    mine = {c: v for c, v in res.items() if c.split("/")[0] == family}
    assert mine, f"no case of {family} ran" + (f"; the ranks failed:\n{failure[-3000:]}"
                                               if failure else "")
    check_cases(mine, _world(split), failure)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", SPLITS)
def test_collectives_ranks_exit_cleanly(split, mode):
    """The spawn of the matrix ended without a rank failing (destroy_process_group included),
    and covered every family with a few hundred cases."""
    _collectives_skip(split, mode)
    res, failure = collectives(split, mode)
    assert failure is None, failure[-4000:]
    assert {c.split("/")[0] for c in res} == set(collective_cases.FAMILIES)
    assert len(res) > 300, len(res)


@pytest.mark.parametrize("split,in_place,views", [("1+1", (0, 1), (0, 1)),
                                                   ("1+1+1", (0, 1, 2), (0, 2))])
def test_all_gather_reduce_scatter_between_hosts(split, in_place, views):
    """Each group its own host (message links) on device tensors: all_gather exact and
    reduce_scatter (sum, max) against a float64 reference, out of place and in place, several
    dtypes and sizes; a group of one receives another group's block straight into its place in
    the output and sends its reduce_scatter input as a view (the engine's stats say which ran,
    as tests/test_backend.py test_all_gather_host_paths on host tensors)."""
    why = _split_skip(split)
    if why:
        pytest.skip(why)
    per_rank = spawn(collective_cases.run_all_gather_paths, _world(split), args=(DEVICE,),
                     vendors=split, env={"HETCCL_EMULATE_HOSTS": "1"}, timeout=300)
    collective_cases.check_gather_paths(per_rank, in_place, views)


# ===================================================================== 2. bad input
ERROR_ENV = {"HETCCL_ASYNC_ERROR_HANDLING": "raise"}
ERROR_SPLITS = ["1+1", "1+1+1"]
# two spawns per split: a rank that dies in one batch of orders leaves the other batch reported
ERROR_BATCHES = [["fresh", "both_used"], ["r0_used", "rest_used"]]


@functools.lru_cache(maxsize=None)
def errors(split: str, batch: int, check: str = "on"):
    orders = ERROR_BATCHES[batch] if check == "on" else ["fresh", "both_used"]
    return recorded(gpu_cases.run_errors, split,
                    {"device": DEVICE, "orders": orders, "check": check},
                    env={**ERROR_ENV, "HETCCL_CHECK_ARGS": check}, timeout=240)


@pytest.mark.parametrize("order", gpu_cases.ERROR_ORDERS)
@pytest.mark.parametrize("kind", list(gpu_cases.ERROR_KINDS))
@pytest.mark.parametrize("split", ERROR_SPLITS)
def test_bad_input(split, kind, order):
    """rank 0 and the other ranks call with different sizes / dtypes / ops / roots after
    `order` of earlier successful calls (HETCCL_CHECK_ARGS=on, the default): every rank raises
    a ValueError at the call naming what differs, and the group is usable afterwards
    (docs/reliability.md, hetccl/checks.py) -- whatever each rank called before."""
    batch = next(i for i, b in enumerate(ERROR_BATCHES) if order in b)
    res, failure = errors(split, batch)
    name = f"{kind}/{order}"
    assert name in res, f"{name} not reached" + (f"; the ranks failed:\n{failure[-3000:]}"
                                                 if failure else "")
    check_cases({name: res[name]}, _world(split), failure)


@pytest.mark.parametrize("order", ["fresh", "both_used"])
@pytest.mark.parametrize("kind", list(gpu_cases.ERROR_KINDS))
@pytest.mark.parametrize("split", ERROR_SPLITS)
def test_bad_input_async_checks(split, kind, order):
    """HETCCL_CHECK_ARGS=async (device calls never wait for the peers' headers): the mismatch
    is still reported on every rank naming what differs, by the call or the next call, and the
    group then works or refuses at once -- never a hang or a wrong value. (On CPU tensors
    every call waits, so this is the "on" behaviour with a broken group allowed.)"""
    res, failure = errors(split, 0, "async")
    name = f"{kind}/{order}/async"
    assert name in res, f"{name} not reached" + (f"; the ranks failed:\n{failure[-3000:]}"
                                                 if failure else "")
    check_cases({name: res[name]}, _world(split), failure)


def _hetccl_shm():
    return set(glob.glob("/dev/shm/hetccl*"))


@pytest.mark.parametrize("nelem", [16 << 20])
def test_peer_killed_during_large_all_reduce(nelem):
    """1+1+1: rank 2 SIGKILLs itself while 64 MiB all-reduces of device tensors are in flight;
    both survivors raise within the timeout (+ slack), the rank that talks to it names it,
    later calls fail at once, and no shared-memory segment is left behind."""
    timeout_s = 10
    before = _hetccl_shm()
    t0 = time.monotonic()
    res = spawn(gpu_cases.peer_dies_device, 3, args=(DEVICE, 2, nelem, timeout_s),
                vendors="1+1+1", env=ERROR_ENV, timeout=120, may_die=[2])
    wall = time.monotonic() - t0
    for r in (0, 1):
        got = res[r]
        assert got["error"], f"rank {r} saw no error in {got['iters']} all-reduces"
        msg = got["error"].lower()
        assert any(w in msg for w in ("rank 2", "timed out", "unusable", "peer")), msg
        assert got["elapsed"] < timeout_s + 8, f"rank {r} took {got['elapsed']:.1f} s: {msg}"
        assert got["again_s"] < 2, f"a later operation took {got['again_s']:.1f} s to fail"
        assert "succeeded" not in got["again"]
    assert any("rank 2" in res[r]["error"] for r in (0, 1)), [res[0], res[1]]
    time.sleep(0.5)
    assert _hetccl_shm() <= before, f"leaked: {sorted(_hetccl_shm() - before)}"
    figure("peer_kill", survivors_s=[res[0]["elapsed"], res[1]["elapsed"]], wall_s=wall)


# ===================================================================== 3. training
TRAIN = {"1+1": ["ddp", "fsdp2", "fsdp2_bf16"], "1+1+1": ["ddp", "fsdp2"]}
# fp32: summation order and fp32 rounding only (tests/test_training.py); bf16 parameters in
# the forward/backward (FSDP2 MixedPrecisionPolicy, fp32 gradient reduction): bf16 rounding
# of the activations, ~1e-4 on these parameters after 5 steps (7.5e-5 measured on CPU)
TRAIN_TOL = {"ddp": 1e-4, "fsdp2": 1e-4, "fsdp2_bf16": 5e-3}


@functools.lru_cache(maxsize=None)
def training(split):
    return spawn(gpu_cases.run_training, _world(split), args=(DEVICE, TRAIN[split]),
                 vendors=split, timeout=200)


@pytest.mark.parametrize("split,which", [(s, w) for s, ws in TRAIN.items() for w in ws])
def test_training_matches_single_process_reference(split, which):
    """DDP / FSDP2 over hetccl on the device, each rank its slice of the global batch: final
    parameters and per-step losses equal the float64 single-process full-batch run's."""
    import training_cases as tc

    per_rank = training(split)
    ref = tc.reference_params()
    ref_losses = gpu_cases.reference_losses()
    init = [p.detach() for p in tc.make_model().parameters()]
    tol = TRAIN_TOL[which]
    worst = max((p - want).abs().max().item() for out in per_rank
                for p, want in zip(out[which]["params"], ref))
    figure(f"training/{which}/{split}", max_param_diff=worst,
           max_loss_diff=max(abs(a - b) for a, b in zip(per_rank[0][which]["losses"],
                                                          ref_losses)))
    for r, out in enumerate(per_rank):
        got = out[which]
        assert len(got["params"]) == len(ref)
        for p, want, p0 in zip(got["params"], ref, init):
            assert not torch.allclose(want, p0), "reference did not train"
            torch.testing.assert_close(p, want, atol=tol, rtol=tol,
                                       msg=lambda m, r=r: f"rank {r} {which}: {m}")
        dl = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
        assert dl <= tol * max(1.0, max(ref_losses)), (r, got["losses"], ref_losses)


# ----------------------------------------------------------------------------- DeepSpeed
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="deepspeed not importable (pip install "
                                                  "hetccl[deepspeed]; on the GPU box: .whl/)")
DS_STAGES = (1, 2, 3)
DS_STEPS = 8 if ON_GPU else 4     # CPU: the fp32 check needs fewer steps (see DS_TOL)
# bf16 (GPU): parameters and gradients in bf16, fp32 master weights; the two runs differ in
# reduction order and in how the batch is cut (2 ranks x 2 micro-batches vs 1 rank x 4):
# ~1e-2 on a loss of ~4.2. fp32 (CPU validation): order of sums only.
# Measured on CPU, one process: bf16 against fp32 differs by <= 2e-3 over these 8 steps, in
# which the loss falls by ~0.46.
DS_TOL = 2e-2 if ON_GPU else 2e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ds_runs(tmp, world: int) -> str:
    """A runs file for tests/gpu_ds_driver.py: recipes/deepspeed/train.py for ZeRO-1/2/3 with
    the global batch of 2 ranks x 4 x 2 micro-batches (gradient accumulation scaled by 2/world),
    bf16 on the GPU."""
    runs = []
    for stage in DS_STAGES:
        with open(os.path.join(REPO, "recipes", "deepspeed", f"zero{stage}.json")) as f:
            cfg = json.load(f)
        cfg["gradient_accumulation_steps"] = cfg.get("gradient_accumulation_steps", 1) * 2 // world
        path = os.path.join(tmp, f"zero{stage}_w{world}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        argv = ["--deepspeed_config", path, "--steps", str(DS_STEPS), "--tag", f"zero{stage}",
                "--out", os.path.join(tmp, f"steps_w{world}.jsonl")]
        runs.append(argv + (["--bf16"] if ON_GPU else []))
    p = os.path.join(tmp, f"runs_w{world}.json")
    with open(p, "w") as f:
        json.dump(runs, f)
    return p


def _ds_env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")] +
                                                       sys.path))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if not ON_GPU:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def _records(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        out.setdefault(r["tag"], []).append(r)
    return out


def deepspeed_pair(tmp: str, launcher_flags=(), het_timeout: float = 240,
                   ref_timeout: float = 150) -> dict:
    """ZeRO-1/2/3 through `hetccl deepspeed [launcher_flags] --vendors 1+1 --num_gpus 2` (on one
    GPU the launcher maps both ranks onto it: each rank sees GPU local_rank % n as its device 0),
    and the same through one plain DeepSpeed process (torchrun, nccl / gloo) as the reference."""
    env = _ds_env()
    driver = os.path.join(REPO, "tests", "gpu_ds_driver.py")
    cmd = [sys.executable, "-m", "hetccl.cli", "deepspeed", *launcher_flags, "--vendors", "1+1",
           "--num_gpus", "2", "--master_port", str(_free_port()), driver, _ds_runs(tmp, 2)]
    het = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=het_timeout)
    ref_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "1", driver, _ds_runs(tmp, 1), "--comm_backend", "nccl" if ON_GPU else "gloo"]
    ref = subprocess.run(ref_cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=ref_timeout)
    return {"het": het, "ref": ref, "tmp": tmp, "cmd": " ".join(cmd)}


def check_deepspeed_stage(runs: dict, stage: int, backend: str, name: str) -> None:
    """Per-step global mean loss of ZeRO-`stage` of the 2-rank run (every rank on `backend`)
    within DS_TOL of the single-process run on the same global batches, and the loss falls by
    far more than the tolerance (the comparison can fail); records figure `name`."""
    het, ref, tmp = runs["het"], runs["ref"], runs["tmp"]
    assert ref.returncode == 0, "reference run failed:\n" + ref.stdout[-3000:] + ref.stderr[-5000:]
    assert het.returncode == 0, f"{runs['cmd']} failed:\n" + het.stdout[-3000:] + het.stderr[-6000:]
    got = _records(os.path.join(tmp, "steps_w2.jsonl"))[f"zero{stage}"]
    want = _records(os.path.join(tmp, "steps_w1.jsonl"))[f"zero{stage}"]
    assert [r["step"] for r in got] == list(range(DS_STEPS))
    assert all(r["backend"] == backend and r["world_size"] == 2 and r["zero_stage"] == stage
               for r in got), got[0]
    a, b = [r["loss"] for r in got], [r["loss"] for r in want]
    diff = max(abs(x - y) for x, y in zip(a, b))
    ms = sorted(r["step_time_s"] for r in got[2:])[len(got[2:]) // 2] * 1e3
    figure(name, max_loss_diff=diff, loss_first=a[0], loss_last=a[-1], ms_per_step=ms,
           vendors="1+1")
    assert all(math.isfinite(x) for x in a)
    assert b[0] - b[-1] > 5 * DS_TOL, f"reference did not learn: {b}"
    assert diff <= DS_TOL, f"ZeRO-{stage} ({name}): {a} vs reference {b}"


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    return deepspeed_pair(str(tmp_path_factory.mktemp("ds")), ["--torch-face"])


@needs_ds
@pytest.mark.timeout(600)   # the fixture's two DeepSpeed launches (minutes on a busy 2-core CPU)
@pytest.mark.parametrize("stage", DS_STAGES)
def test_deepspeed_zero_bf16_through_launcher(deepspeed_runs, stage):
    """ZeRO-`stage` over hetccl 1+1 (2 ranks, `hetccl deepspeed`, the torch face) against the
    single-process DeepSpeed run (check_deepspeed_stage)."""
    check_deepspeed_stage(deepspeed_runs, stage, "hetccl", f"deepspeed/zero{stage}")


# ----------------------------------------------------------------------------- HF Trainer
HAVE_HF = (importlib.util.find_spec("transformers") is not None
           and importlib.util.find_spec("accelerate") is not None)
# fp32 on both devices: the runs differ in the order of sums (and, on the GPU, in atomics of
# the embedding backward): observed ~1e-7 relative on CPU (tests/test_transformers.py)
HF_RTOL = 1e-3 if ON_GPU else 1e-4


@pytest.mark.skipif(not HAVE_HF, reason="transformers/accelerate not installed")
def test_hf_trainer_recipe(tmp_path):
    """recipes/hf/finetune_tiny_lm.py as a user runs it (its own launcher: 1+1 emulated vendors
    and a single-vendor reference on the same global batch): losses within HF_RTOL, it learns."""
    out = tmp_path / "hf"
    cmd = [sys.executable, os.path.join(REPO, "recipes", "hf", "finetune_tiny_lm.py"),
           "--steps", "16", "--samples", "512", "--seq", "48", "--no-progress", "--no-replan",
           "--timeout", "400", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path))
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    m = json.loads((out / "metrics.json").read_text())
    runs = list(m["runs"].values())
    mixed, ref = runs[0], runs[1]
    assert mixed["world"] == 2 and ref["world"] == 1
    assert mixed["backend"] == "hetccl", mixed["backend"]
    assert len(mixed["losses"]) == 16
    t = mixed["step_times"][5:] or mixed["step_times"]
    figure("hf_trainer", max_rel_loss_diff=m["max_rel_diff"],
           ms_per_step=1e3 * sorted(t)[len(t) // 2], vendors="1+1")
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]
    assert m["max_rel_diff"] <= HF_RTOL, (m["max_rel_diff"], mixed["losses"], ref["losses"])


# ----------------------------------------------------------------------------- Megatron
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
# bf16 (GPU): pp=2 and pp=1 run the same bf16 kernels on the same micro-batches; the stage
# boundary and the gradient reduction order differ: ~1e-2 relative on the loss. fp32 (CPU):
# tests/test_megatron.py's 1e-5. Resume: the same process state restored, so only
# non-deterministic kernels (atomics) separate the runs.
MEG_TOL = 2e-2 if ON_GPU else 1e-5
MEG_RESUME_TOL = 1e-5 if ON_GPU else 1e-6


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    two = [{"name": "v0", "gpus": 1}, {"name": "v1", "gpus": 1}]
    ck = str(tmp_path_factory.mktemp("meg") / "ckpt")
    t = gpu_cases.megatron_tiny
    runs = [(t(two, DEVICE, pp=2), {}),
            (t(two, DEVICE, pp=2, stages="plan"), {1: {"HETCCL_SLOWDOWN": "3"}}),
            (t(two, DEVICE, pp=2, save=ck, exit_interval=2), {}),
            (t(two, DEVICE, pp=2, load=ck), {}),
            (t(two, DEVICE, pp=2, stages=[3, 1]), {})]
    pp2 = spawn(gpu_cases.run_megatron, 2, args=(DEVICE, runs), vendors=["v0", "v1"],
                env={"OMP_NUM_THREADS": "1"}, timeout=500)
    ref = spawn(gpu_cases.run_megatron, 1,
                args=(DEVICE, [(t([{"name": "v0", "gpus": 1}], DEVICE), {})]),
                vendors=["v0"], env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]["runs"][0]
    return pp2, ref


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not importable (pip install "
                                              "hetccl[megatron]; on the GPU box: .whl/)")
@pytest.mark.parametrize("split", ["even", "plan", "uneven"])
def test_megatron_pp2_matches_pp1(megatron_runs, split):
    """pp=2, one stage per emulated vendor (activations and gradients cross the bridge): the
    even split, the planner's split (second vendor emulated 3x slower; its measured per-layer
    time is slower) and a fixed uneven one [3, 1]: per-iteration losses within MEG_TOL of the
    pp=1 single-process run's (bf16 on the GPU)."""
    pp2, ref = megatron_runs
    rows = pp2[0]["runs"][{"even": 0, "plan": 1, "uneven": 4}[split]]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    if split == "plan":
        plan = rows[0]["stage_plan"]
        assert plan and sum(plan["planned"]) == 4, plan
        assert rows[0]["stages"] == plan["planned"], (rows[0]["stages"], plan)
        # no assertion on the measured per-layer times: on a one-GPU box both stages' processes
        # share the GPU (on a busy CPU the cores), so the split the planner picks from them is
        # not a property of hetccl; the figure row records them. The fixed [3, 1] split
        # ("uneven") is the non-even correctness check.
    else:
        assert rows[0]["stages"] == ([2, 2] if split == "even" else [3, 1]), rows[0]
    assert pp2[1]["runs"][{"even": 0, "plan": 1, "uneven": 4}[split]][0]["lm_loss"] == \
        rows[0]["lm_loss"], "the two stages report different losses"
    worst = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(b["lm_loss"]) for a, b in zip(rows, ref))
    ms = sorted(r["ms_per_iteration"] for r in rows[1:])[len(rows[1:]) // 2]
    figure(f"megatron/pp2_{split}", max_rel_loss_diff=worst, ms_per_iteration=ms,
           stages=rows[0]["stages"], **({"stage_layer_ms": [round(x, 3) for x in
                                                             rows[0]["stage_plan"]
                                                             ["stage_layer_ms"]]}
                                        if split == "plan" else {}))
    assert all(math.isfinite(a["lm_loss"]) for a in rows), rows
    assert worst <= MEG_TOL, (split, rows, ref)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"], ref


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not importable")
def test_megatron_checkpoint_resume_exact(megatron_runs):
    """pp=2 saved at iteration 2 (dist_checkpointing) and resumed: iterations 3-4 equal the
    uninterrupted run's (MEG_RESUME_TOL), which depends on the restored optimizer state."""
    pp2, _ = megatron_runs
    full, first, resumed = pp2[0]["runs"][0], pp2[0]["runs"][2], pp2[0]["runs"][3]
    assert [r["iteration"] for r in first] == [1, 2]
    assert [r["iteration"] for r in resumed] == [3, 4]
    worst = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(b["lm_loss"])
                for a, b in zip(resumed, full[2:]))
    figure("megatron/resume", max_rel_loss_diff=worst)
    assert worst <= MEG_RESUME_TOL, (resumed, full)
    for a, b in zip(resumed, full[2:]):
        assert a["consumed_samples"] == b["consumed_samples"]


# ----------------------------------------------------------------------------- bench train
def test_bench_train_tiny(tmp_path):
    """`hetccl bench train --tiny`: a 2-layer GPT, a few steps, one process, a 2-rank reference
    (NCCL with 2 GPUs, gloo otherwise) and hetccl 1+1; hetccl's losses follow the reference's
    (bf16 autocast on the GPU)."""
    out = tmp_path / "train.jsonl"
    cmd = [sys.executable, "-m", "hetccl.cli", "bench", "train", "--device", DEVICE, "--tiny",
           "--steps", "4", "--warmup", "1", "--micro", "1", "--no-progress", "--jsonl", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path)))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rows = {r["config"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "hetccl" in rows and "single" in rows, rows.keys()
    h = rows["hetccl"]
    assert h["world_size"] == 2 and len(h["losses"]) == 4
    assert all(math.isfinite(x) for x in h["losses"])
    figure("bench_train_tiny", max_loss_diff=h["max_loss_diff_vs_ref"],
           ms_per_step=h["median_step_ms"], reference=[c for c in rows if c not in
                                                       ("single", "hetccl")])
    assert math.isfinite(h["max_loss_diff_vs_ref"]), h
    tol = 5e-2 if ON_GPU else 1e-4
    assert h["max_loss_diff_vs_ref"] <= tol, h
