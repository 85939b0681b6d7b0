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
    assert {"cpu_2p2.yaml", "gpu_1p1.yaml"} <= set(names)
    for n in names:
        rec = m.load_recipe(os.path.join(RECIPES, n))
        p = rec["parallel"]
        L = plan_layout(m.recipe_labels(rec), ParallelSizes(tp=p["tp"], pp=p["pp"], cp=p["cp"],
                                                             ep=p["ep"], etp=p["etp"]))
        assert L.placement == "replica", n
    with pytest.raises(ValueError, match="micro_batches"):
        m.load_recipe({"cluster": {"vendors": [{"name": "a", "gpus": 1}]}})


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


# ------------------------------------------------------------------ one 2+2 job (+ reference)
def _job(ctx, rec, check_groups):
    """Runs in each spawned process."""
    import torch.distributed as dist
    from hetccl.integrations import megatron as m
    from megatron.core import parallel_state as ps

    p = rec["parallel"]
    sess = m.initialize(tp=p["tp"], store=ctx.store(), launch_rank=ctx.rank,
                        world_size=ctx.world_size, device="cpu", seed=rec["train"]["seed"])
    out = {"rank": sess.rank, "launch_rank": sess.launch_rank, "vendor": sess.vendor}
    if check_groups:
        L = sess.layout
        vend = [None] * ctx.world_size
        dist.all_gather_object(vend, m.vendor_label())  # what each torch rank really is
        out["vendor_of_rank"] = vend
        out["layout_vendor_of_rank"] = L.vendor_of_rank
        mine = {
            "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
            "cp": dist.get_process_group_ranks(ps.get_context_parallel_group()),
            "ep": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
            "mp": dist.get_process_group_ranks(ps.get_model_parallel_group()),
        }
        out["groups"] = {k: sorted(v) for k, v in mine.items()}
        out["expected"] = {k: next(sorted(g) for g in L.groups[k] if sess.rank in g)
                           for k in mine}
        backends = set()
        for g in ps._global_process_group_list or []:
            if g is not None and dist.get_rank(g) >= 0:
                backends.add(str(dist.get_backend(g)))
        out["backends"] = sorted(backends)
        out["n_groups"] = len(ps._global_process_group_list or [])
    out["token"] = [r["loss"] for r in m.train(rec, sess, steps=rec["train"]["steps"])]
    if check_groups:
        out["naive"] = [r["loss"] for r in m.train(rec, sess, steps=rec["train"]["steps"],
                                                   normalisation="rank_mean")]
    sess.destroy()
    return out


def _recipe(tp, vendors):
    return {"name": "test", "device": "cpu",
            "cluster": {"balance": "static", "vendors": vendors},
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                      "vocab_size": 128, "seq_length": 16},
            "parallel": {"tp": tp},
            "train": {"steps": 3, "micro_batch": 2, "lr": 0.05, "optimizer": "sgd", "seed": 7}}


def test_2p2_groups_and_exact_loss_vs_single_process():
    pytest.importorskip("megatron.core")
    from hetccl.launch import spawn
    from hetccl.integrations import megatron as m

    env = {"OMP_NUM_THREADS": "1"}
    rec = m.load_recipe(_recipe(2, [{"name": "v0", "gpus": 2, "micro_batches": 3},
                                    {"name": "v1", "gpus": 2, "micro_batches": 1}]))
    # launch ranks alternate vendors: v0 v1 v0 v1 -> the layout must permute them
    res = spawn(_job, 4, args=(rec, True), vendors=["v0", "v1", "v0", "v1"], env=env,
                timeout=400)
    ref_rec = m.load_recipe(_recipe(1, [{"name": "v0", "gpus": 1, "micro_batches": 4}]))
    ref = spawn(_job, 1, args=(ref_rec, False), vendors=["v0"], env=env, timeout=200)[0]

    by_launch = {r["launch_rank"]: r for r in res}
    assert [by_launch[l]["rank"] for l in range(4)] == [0, 2, 1, 3]
    for r in res:
        assert r["vendor_of_rank"] == ["v0", "v0", "v1", "v1"] == r["layout_vendor_of_rank"]
        assert r["groups"] == r["expected"], r
        vend = r["vendor_of_rank"]
        assert len({vend[x] for x in r["groups"]["tp"]}) == 1          # TP inside a vendor
        assert len({vend[x] for x in r["groups"]["dp"]}) == 2          # DP spans vendors
        assert r["backends"] == [m.BACKEND], r["backends"]            # no gloo side groups
        assert r["n_groups"] > 10
    losses = res[0]["token"]
    assert all(r["token"] == losses for r in res)  # every rank reports the same global loss
    # Same 8 samples per step: 3+1 micro-batches over 2 replicas of tp=2 vs 4 on one process.
    for a, b in zip(losses, ref["token"]):
        assert abs(a - b) <= 2e-5 * abs(b), (losses, ref["token"])
    assert losses[-1] < losses[0]
    # The naive normalisation (each replica's own mean, replicas averaged) differs after the
    # first update: the comparison above is sharp enough to notice a wrong gradient.
    naive = res[0]["naive"]
    assert abs(naive[0] - ref["token"][0]) <= 2e-5 * abs(ref["token"][0])
    assert max(abs(a - b) for a, b in zip(naive[1:], ref["token"][1:])) > 1e-3, naive


@pytest.mark.slow
def test_recipe_runner_auto_balance(tmp_path):
    """`hetccl megatron --config cpu_2p2_auto.yaml`: v1 is emulated 3x slower; the Balancer
    must move samples to v0 (more micro-batches on dp rank 0) while training proceeds."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "hetccl.integrations.megatron", "--config",
                        os.path.join(RECIPES, "cpu_2p2_auto.yaml"), "--steps", "8",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["micro_batches"] == [4, 4]
    assert rows[-1]["micro_batches"][0] > rows[-1]["micro_batches"][1], rows[-1]
    assert all(r["global_batch"] == 16 for r in rows)


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
