"""Megatron-core integration on CPU (integrations/megatron.py).

Default tests (about a minute on 2 busy cores; the cost is four processes importing
megatron-core): the missing-extra message, our group enumeration against Megatron's own
RankGenerator, and one 2+2 emulated-vendor job with launch ranks interleaved across vendors
that checks every parallel_state group against the vendor map and the backend, then trains a
tp=2 x dp=2 GPT with unequal micro-batch counts (3 vs 1) and compares its losses with a
1-process reference run. A naively normalised run in the same job must NOT match (so the
comparison can fail).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hetccl.integrations.layout import ParallelSizes, megatron_groups, plan_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
RECIPES = os.path.join(REPO, "recipes", "megatron")


def test_missing_megatron_gives_install_hint():
    code = (
        "import sys; sys.modules['megatron'] = None\n"          # make the import fail
        "from hetccl.integrations import megatron as m\n"               # lazy: must still import
        "try:\n    m.initialize(tp=1)\nexcept ImportError as e:\n    print('MSG', e)\n"
        "print('RC', m.main(['--config', 'recipes/megatron/cpu_2p2.yaml']))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert "MSG" in out and "pip install hetccl[megatron]" in out, out
    assert "RC 2" in out, out


def test_recipes_load_and_place():
    from hetccl.integrations import megatron as m
    names = sorted(f for f in os.listdir(RECIPES) if f.endswith(".yaml"))
    assert {"cpu_1p1_pp2.yaml", "cpu_2p2.yaml", "cpu_2p2_auto.yaml",
            "gpu_1p1_350m.yaml"} <= set(names)
    for n in names:
        rec = m.load_recipe(os.path.join(RECIPES, n))
        L = plan_layout(m.recipe_labels(rec), m._sizes(rec))
        # pp=1 recipes keep whole replicas on a vendor; the pp=2 one puts a stage on each
        assert L.placement == ("stage" if rec["pipeline_model_parallel_size"] > 1
                               else "replica"), n
    gpu = m.load_recipe(os.path.join(RECIPES, "gpu_1p1_350m.yaml"))
    from hetccl.integrations.megatron_recipe import param_count
    assert 300e6 <= param_count(gpu) <= 1e9          # "realistic": 350M-1B parameters


def _minimal(**over):
    rec = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
               micro_batch_size=2, train_iters=2, lr=0.01,
               hetccl={"device": "cpu", "vendors": [{"name": "a", "gpus": 1}]})
    rec.update(over)
    return rec


def test_recipe_keys_are_megatron_lm_arguments_and_unknown_keys_are_named():
    from hetccl.integrations.megatron_recipe import RecipeError, load_recipe, pipeline_layers
    rec = load_recipe(_minimal(**{"pipeline-model-parallel-size": 2}))   # dashes read as _
    assert rec["pipeline_model_parallel_size"] == 2 and rec["use_distributed_optimizer"]
    assert pipeline_layers(rec) == [2, 2]
    with pytest.raises(RecipeError, match=r"unknown key 'num_layer'; did you mean num_layers"):
        load_recipe(_minimal(num_layer=4))
    with pytest.raises(RecipeError, match=r"hetccl: unknown key 'stage'; did you mean stages"):
        load_recipe(_minimal(hetccl={"vendors": [{"name": "a", "gpus": 1}], "stage": "plan"}))
    with pytest.raises(RecipeError, match=r"hetccl.vendors\[0\]: unknown key 'gpu'"):
        load_recipe(_minimal(hetccl={"vendors": [{"name": "a", "gpu": 1}]}))
    with pytest.raises(RecipeError, match="missing required key 'hidden_size'"):
        load_recipe({k: v for k, v in _minimal().items() if k != "hidden_size"})
    with pytest.raises(RecipeError, match="micro_batch_size must be int, got '2'"):
        load_recipe(_minimal(micro_batch_size="2"))
    with pytest.raises(RecipeError, match="missing the 'hetccl:' block"):
        load_recipe({k: v for k, v in _minimal().items() if k != "hetccl"})
    with pytest.raises(RecipeError, match=r"hetccl.stages \[3, 2\] sums to 5, num_layers is 4"):
        load_recipe(_minimal(pipeline_model_parallel_size=2,
                             hetccl={"vendors": [{"name": "a", "gpus": 2}], "stages": [3, 2]}))
    with pytest.raises(RecipeError, match="pipeline_model_parallel_layout and hetccl.stages"):
        load_recipe(_minimal(pipeline_model_parallel_layout="Et|ttL",
                             hetccl={"vendors": [{"name": "a", "gpus": 2}], "stages": "plan"}))
    rec = load_recipe(_minimal(num_layers=7, pipeline_model_parallel_size=3,
                               decoder_first_pipeline_num_layers=1))
    assert pipeline_layers(rec) == [1, 3, 3]
    with pytest.raises(RecipeError, match="not divisible by pipeline_model_parallel_size 3"):
        pipeline_layers(load_recipe(_minimal(num_layers=4, pipeline_model_parallel_size=3)))
    rec = load_recipe(_minimal(pipeline_model_parallel_size=2,
                               num_layers_per_virtual_pipeline_stage=1,
                               hetccl={"vendors": [{"name": "a", "gpus": 2}]}))
    assert rec["num_virtual_stages_per_pipeline_rank"] == 2 and rec["overlap_p2p_comm"]
    with pytest.raises(RecipeError, match="interleaved 1F1B with pipeline_model_parallel_size=2 "
                                          "needs overlap_p2p_comm"):
        load_recipe(_minimal(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2,
                             overlap_p2p_comm=False,
                             hetccl={"vendors": [{"name": "a", "gpus": 2}]}))
    # the CLI names the bad key too, before starting anything
    from hetccl.integrations import megatron as m
    assert m.main(["--config", os.path.join(RECIPES, "cpu_2p2.yaml"), "--set", "lrr=1",
                   "--layout-only"]) == 2


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,order", [
    (8, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, 1, None, "tp-cp-ep-dp-pp"),
    (8, 1, 2, 1, 2, None, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, None, "tp-cp-ep-pp-dp"),
    (12, 2, 3, 1, 1, None, "tp-cp-ep-dp-pp"),
])
def test_groups_equal_megatron_rank_generator(world, tp, pp, cp, ep, etp, order):
    ps = pytest.importorskip("megatron.core.parallel_state")
    ours = megatron_groups(world, ParallelSizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp), order)
    dense = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    etp_ = tp if etp is None else etp
    expert = ps.RankGenerator(tp=etp_, ep=ep, dp=world // (etp_ * ep * pp), pp=pp, cp=1,
                              order=order)
    for key, gen, tok in [("tp", dense, "tp"), ("cp", dense, "cp"), ("pp", dense, "pp"),
                          ("dp", dense, "dp"), ("dp_cp", dense, "dp-cp"), ("mp", dense, "tp-pp"),
                          ("tp_cp", dense, "tp-cp"), ("ep", expert, "ep"), ("etp", expert, "tp"),
                          ("edp", expert, "dp"), ("tp_ep", expert, "tp-ep")]:
        assert ours[key] == gen.get_ranks(tok), key


# ------------------------------------------------------------------ training through megatron-core
def _tiny(vendors, *, pp=1, tp=1, stages="even", **over):
    rec = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
           "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
           "vocab_size": 128, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 4,
           "lr": 0.01, "seed": 7, "log_interval": 100,
           "hetccl": {"device": "cpu", "vendors": vendors, "stages": stages,
                      "probe_iters": 3}}
    rec.update(over)
    return rec


def _train_job(ctx, runs):
    """Runs in each spawned process: one session, several trainings (run: recipe dict, env)."""
    from hetccl.integrations import megatron as m
    out = []
    rec0 = m.load_recipe(runs[0][0])
    sess = m.initialize(tp=rec0["tensor_model_parallel_size"],
                        pp=rec0["pipeline_model_parallel_size"], store=ctx.store(),
                        launch_rank=ctx.rank, world_size=ctx.world_size, device="cpu",
                        seed=rec0["seed"])
    for raw, env in runs:
        os.environ.update(env.get(ctx.rank, {}))
        rec = m.load_recipe(raw)
        out.append(m.train(rec, sess, quiet=True))
        for k in env.get(ctx.rank, {}):
            os.environ.pop(k, None)
    cross = sorted(sess.layout.cross_vendor)
    sess.destroy()
    return {"rank": ctx.rank, "runs": out, "cross": cross}


def test_pp2_across_vendors_uneven_split_matches_pp1_and_resume_reproduces(tmp_path):
    """pp=2 with one stage per emulated vendor (activations and gradients cross the bridge) and
    the uneven split [3, 1], through megatron-core's 1F1B schedule, Megatron DDP and the
    distributed optimizer: losses and grad norms equal a 1-process pp=1 run's to fp32
    tolerance. A run saved at iteration 2 (dist_checkpointing) and resumed reproduces the
    uninterrupted run's iterations 3-4. stages: plan with the second vendor emulated 3x slower
    gives the fast stage more layers."""
    pytest.importorskip("megatron.core")
    from hetccl.launch import spawn
    two = [{"name": "v0", "gpus": 1}, {"name": "v1", "gpus": 1}]
    ck = str(tmp_path / "ckpt")
    runs = [(_tiny(two, pp=2, stages=[3, 1]), {}),
            (_tiny(two, pp=2, stages=[3, 1], save=ck, exit_interval=2), {}),
            (_tiny(two, pp=2, stages=[3, 1], load=ck), {}),
            (_tiny(two, pp=2, stages="plan", train_iters=1), {1: {"HETCCL_SLOWDOWN": "3"}})]
    res = spawn(_train_job, 2, args=(runs,), vendors=["v0", "v1"],
                env={"OMP_NUM_THREADS": "1"}, timeout=400)
    ref = spawn(_train_job, 1, args=([(_tiny([{"name": "v0", "gpus": 1}]), {})],),
                vendors=["v0"], env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]["runs"][0]
    assert res[0]["cross"] == ["mp", "pp"]                  # the pipeline crosses vendors
    full, first, resumed, planned = res[0]["runs"]
    loss = lambda rows: [(r["lm_loss"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert loss(res[1]["runs"][0]) == loss(full)           # both stages report the same losses
    assert [r["stages"] for r in full] == [[3, 1]] * 4 and ref[0]["stages"] == [4]
    assert [r["iteration"] for r in full] == [1, 2, 3, 4]
    for a, b in zip(full, ref):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(b["lm_loss"]), (full, ref)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (full, ref)
        assert a["consumed_samples"] == b["consumed_samples"]
    assert full[-1]["lm_loss"] < full[0]["lm_loss"]
    assert [r["iteration"] for r in first] == [1, 2]
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, full[2:]):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-6 * abs(b["lm_loss"]), (resumed, full)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]
        assert a["consumed_samples"] == b["consumed_samples"]
    # iteration 4 depends on the optimizer state restored at 2 (Adam moments and step count):
    # a fresh optimizer would give a different loss there, so the comparison above is sharp
    plan = planned[0]["stage_plan"]
    assert sum(plan["planned"]) == 4 and plan["planned"][0] > plan["planned"][1], plan
    assert plan["stage_layer_ms"][1] > 1.5 * plan["stage_layer_ms"][0], plan


def test_bf16_pp2_across_vendors_trains_like_pp1_and_resumes_exactly(tmp_path):
    """bf16 recipes (the GPU recipe's precision) through Megatron-LM's Float16Module: the local
    spec's norms were left in fp32 and every bf16 run failed at the first linear layer
    ("expected mat1 and mat2 to have the same dtype"). pp=2 across vendors against a one-process
    pp=1 run within bf16 tolerance, and a save at iteration 2 resumed bit-exactly."""
    pytest.importorskip("megatron.core")
    from hetccl.launch import spawn
    two = [{"name": "v0", "gpus": 1}, {"name": "v1", "gpus": 1}]
    ck = str(tmp_path / "ckpt")
    runs = [(_tiny(two, pp=2, bf16=True), {}),
            (_tiny(two, pp=2, bf16=True, save=ck, exit_interval=2), {}),
            (_tiny(two, pp=2, bf16=True, load=ck), {})]
    res = spawn(_train_job, 2, args=(runs,), vendors=["v0", "v1"],
                env={"OMP_NUM_THREADS": "1"}, timeout=400)
    ref = spawn(_train_job, 1, args=([(_tiny([{"name": "v0", "gpus": 1}], bf16=True), {})],),
                vendors=["v0"], env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]["runs"][0]
    full, first, resumed = res[0]["runs"]
    assert [r["iteration"] for r in full] == [1, 2, 3, 4]
    for a, b in zip(full, ref):
        # bf16 keeps 8 bits of mantissa: pipeline and single-process sums round differently
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 2e-2 * abs(b["lm_loss"]), (full, ref)
    assert full[-1]["lm_loss"] < full[0]["lm_loss"], full
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, full[2:]):
        assert a["lm_loss"] == b["lm_loss"] and a["grad_norm"] == b["grad_norm"], (resumed, full)


def _train_vpp_job(ctx, runs):
    """Like _train_job, for a session with interleaving (virtual stages are fixed per
    session in megatron-core's parallel_state)."""
    from hetccl.integrations import megatron as m
    rec0 = m.load_recipe(runs[0])
    sess = m.initialize(tp=1, pp=rec0["pipeline_model_parallel_size"], store=ctx.store(),
                        launch_rank=ctx.rank, world_size=ctx.world_size, device="cpu",
                        seed=rec0["seed"], virtual_pipeline_model_parallel_size=rec0[
                            "num_virtual_stages_per_pipeline_rank"])
    out = [m.train(m.load_recipe(raw), sess, quiet=True) for raw in runs]
    sess.destroy()
    return out


def test_interleaved_pp2_across_vendors_matches_pp1_and_resumes(tmp_path):
    """Interleaved 1F1B (2 virtual stages per rank, uneven [3, 1] split: chunks of 2+1 and 1+0
    layers), one pipeline rank per emulated vendor: losses and grad norms equal a 1-process
    pp=1 run's to fp32 tolerance, and a checkpoint saved at iteration 2 resumes to the same
    iterations 3-4. Megatron-LM's p2p choice for interleaving (overlap_p2p_comm, separate
    isend/irecv) is what makes pp=2 right: with one batch_isend_irecv per exchange the two
    directions to the one other stage share a batch and the losses differ from iteration 1,
    so that combination is refused naming the key."""
    pytest.importorskip("megatron.core")
    from hetccl.integrations import megatron as m
    from hetccl.launch import spawn
    two = [{"name": "v0", "gpus": 1}, {"name": "v1", "gpus": 1}]
    ck = str(tmp_path / "ckpt")
    vpp = dict(num_virtual_stages_per_pipeline_rank=2)
    runs = [_tiny(two, pp=2, stages=[3, 1], **vpp),
            _tiny(two, pp=2, stages=[3, 1], save=ck, exit_interval=2, **vpp),
            _tiny(two, pp=2, stages=[3, 1], load=ck, **vpp)]
    res = spawn(_train_vpp_job, 2, args=(runs,), vendors=["v0", "v1"],
                env={"OMP_NUM_THREADS": "1"}, timeout=400)
    ref = spawn(_train_job, 1, args=([(_tiny([{"name": "v0", "gpus": 1}]), {})],),
                vendors=["v0"], env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]["runs"][0]
    full, first, resumed = res[0]
    assert [r["vpp"] for r in full] == [2] * 4 and [r["stages"] for r in full] == [[3, 1]] * 4
    assert [(r["lm_loss"], r["grad_norm"]) for r in res[1][0]] == \
        [(r["lm_loss"], r["grad_norm"]) for r in full]
    for a, b in zip(full, ref):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(b["lm_loss"]), (full, ref)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (full, ref)
    assert [r["iteration"] for r in first] == [1, 2]
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, full[2:]):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-6 * abs(b["lm_loss"]), (resumed, full)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]
    with pytest.raises(m.RecipeError, match="overlap_p2p_comm"):
        m.load_recipe(_tiny(two, pp=2, overlap_p2p_comm=False, **vpp))
    m.load_recipe(_tiny([{"name": "v0", "gpus": 2}, {"name": "v1", "gpus": 2}], pp=4,
                        num_layers=8, overlap_p2p_comm=False, **vpp))  # pp > 2: allowed


def test_2p2_tp2_unequal_micro_batches_exact_vs_single_process():
    """2+2 emulated vendors, launch ranks interleaved (v0 v1 v0 v1): the layout keeps tp=2
    inside a vendor and puts dp across; v0's replica runs 3 micro-batches, v1's 1
    (hetccl.balance: static). With calculate_per_token_loss Megatron's finalize_model_grads
    normalises by the global token count, so losses equal a 1-process run on the same 8 samples
    (4 micro-batches); Megatron's per-micro-batch mean (calculate_per_token_loss: false) in the
    same job does not (so the comparison can fail)."""
    pytest.importorskip("megatron.core")
    from hetccl.launch import spawn
    vend = [{"name": "v0", "gpus": 2, "micro_batches": 3},
            {"name": "v1", "gpus": 2, "micro_batches": 1}]
    base = dict(tp=2, global_batch_size=None, train_iters=3)
    exact = _tiny(vend, **base)
    exact["hetccl"]["balance"] = "static"
    naive = _tiny(vend, calculate_per_token_loss=False, **base)
    naive["hetccl"]["balance"] = "static"
    res = spawn(_train_job, 4, args=([(exact, {}), (naive, {})],),
                vendors=["v0", "v1", "v0", "v1"], env={"OMP_NUM_THREADS": "1"}, timeout=400)
    ref = spawn(_train_job, 1, args=([(_tiny([{"name": "v0", "gpus": 1}], train_iters=3), {})],),
                vendors=["v0"], env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]["runs"][0]
    tok, mean = res[0]["runs"]
    assert all([x["lm_loss"] for x in r["runs"][0]] == [x["lm_loss"] for x in tok] for r in res)
    assert tok[0]["micro_batches"] == [3, 1] and tok[0]["global_batch"] == 8
    assert res[0]["cross"] == ["dp", "dp_cp", "edp"]
    for a, b in zip(tok, ref):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 2e-5 * abs(b["lm_loss"]), (tok, ref)
    assert abs(mean[0]["lm_loss"] - ref[0]["lm_loss"]) <= 2e-5 * abs(ref[0]["lm_loss"])
    assert max(abs(a["lm_loss"] - b["lm_loss"]) for a, b in zip(mean[1:], ref[1:])) > 1e-4, mean


@pytest.mark.slow
def test_recipe_runner_auto_balance(tmp_path):
    """`hetccl megatron --config cpu_2p2_auto.yaml`: v1 is emulated 3x slower; the Balancer
    must move micro-batches to v0 while training proceeds through Megatron's schedule."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "hetccl.integrations.megatron", "--config",
                        os.path.join(RECIPES, "cpu_2p2_auto.yaml"), "--iters", "8",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["micro_batches"] == [8, 8]
    assert rows[-1]["micro_batches"][0] > rows[-1]["micro_batches"][1], rows[-1]
    assert all(r["global_batch"] == 32 for r in rows)
    assert " iteration        8/       8 | consumed samples:          256" in p.stdout


def _pp_job(ctx):
    import torch.distributed as dist
    from hetccl.integrations import megatron as m
    from megatron.core import parallel_state as ps
    sess = m.initialize(pp=2, store=ctx.store(), launch_rank=ctx.rank,
                        world_size=ctx.world_size, device="cpu")
    got = sorted(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    vend = sess.layout.vendor_of_rank
    sess.destroy()
    return got, vend


@pytest.mark.slow
def test_pipeline_layout_parallel_state():
    """tp=1 pp=2 on 2+2 interleaved vendors: parallel_state's pp groups stay inside a vendor."""
    pytest.importorskip("megatron.core")
    from hetccl.launch import spawn

    for got, vend in spawn(_pp_job, 4, vendors=["a", "b", "a", "b"], timeout=400):
        assert len({vend[r] for r in got}) == 1


MEGATRON_UNDER_RUN = r"""
import os, sys
rank = int(os.environ["RANK"])
os.environ["HETCCL_VENDOR"] = "ab"[rank % 2]          # launch ranks interleave two vendors
import torch, torch.distributed as dist
dist.init_process_group("nccl")                       # a Megatron-LM style script, unchanged
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
ps.initialize_model_parallel(tensor_model_parallel_size=2)
model_parallel_cuda_manual_seed(123)                  # CUDA-only in Megatron; CPU under hetccl run
with get_cuda_rng_tracker().fork():
    x = torch.rand(4)
draws = [None] * dist.get_world_size()
dist.all_gather_object(draws, (ps.get_tensor_model_parallel_rank(), x.tolist()))
if rank == 0:
    same_tp = all(a[1] == b[1] for a in draws for b in draws if a[0] == b[0])
    diff_tp = all(a[1] != b[1] for a in draws for b in draws if a[0] != b[0])
    print(f"RNG same-tp-rank-equal {same_tp} different-tp-rank-differ {diff_tp}", flush=True)
ps.destroy_model_parallel()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed "
                                                "(pip install hetccl[megatron])")
def test_megatron_under_hetccl_run_warns_on_cross_vendor_tp(tmp_path):
    """A Megatron-LM style script under `hetccl run` whose launch ranks interleave vendors:
    tensor-parallel groups span vendors (correct, slowest), so rank 0 warns once with the layout
    that fixes it; model_parallel_cuda_manual_seed works on CPU (hetccl's CPU RNG tracker:
    tensor-parallel peers draw different streams, data-parallel peers the same)."""
    script = tmp_path / "mcore.py"
    script.write_text(MEGATRON_UNDER_RUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETCCL_")}
    p = subprocess.run([sys.executable, "-m", "hetccl.cli", "run", "--standalone",
                        "--nproc_per_node", "4", str(script)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "RNG same-tp-rank-equal True different-tp-rank-differ True" in out, out[-4000:]
    warnings = [line for line in out.splitlines() if "tensor-parallel groups span vendors" in line]
    assert len(warnings) == 1, out[-4000:]
    assert ("2 of Megatron's 2 tensor-parallel groups span vendors (ranks [0, 1]: a+b; "
            "ranks [2, 3]: a+b)") in warnings[0], warnings
    assert "hetccl.integrations.megatron.initialize(tp=..., pp=...)" in warnings[0]
    # the suggested layout: tensor-parallel groups inside a vendor, only dp crosses
    assert "groups crossing vendors: dp" in out and "(launch ranks [0, 2])" in out, out[-4000:]


def test_vendors_option_is_checked_against_the_recipe(capsys):
    """`hetccl megatron --vendors SPLIT` (the launchers' shared option, = form too) must match
    the recipe's vendor groups; a mismatch is refused naming them."""
    from hetccl.integrations import megatron as hm

    cfg = os.path.join(RECIPES, "cpu_2p2.yaml")
    assert hm.main(["--config", cfg, "--vendors=2+2", "--layout-only"]) == 0
    assert "hetccl layout: world 4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        hm.main(["--config", cfg, "--vendors", "3+1", "--layout-only"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--vendors 3+1 does not match the recipe's vendor groups v0:2 + v1:2" in err, err
    with pytest.raises(SystemExit):
        hm.main(["--config", cfg, "--vendors", "2x2", "--layout-only"])
    assert "expected ranks per vendor joined by '+'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hm.main(["--help"])
    assert "--vendors SPLIT" in capsys.readouterr().out


def test_cpu_rng_helpers_are_public():
    from hetccl.integrations import megatron as hm

    assert {"install_cpu_shims", "seed_model_parallel_rng"} <= set(hm.__all__)
    assert hm._install_cpu_shims is hm.install_cpu_shims  # old private names still work
