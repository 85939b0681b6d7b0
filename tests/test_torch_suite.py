"""PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py)
against hetccl, through tests/torch_suite.py (how it runs the suite, and how it treats hetccl
like gloo where the suite gates tests on the name gloo: docs/torch-suite.md).

Default: a representative selection (one test of each issue-15 item plus DDP, p2p, collectives
and a gloo-gated timeout test) on 2+1 emulated vendors; every one must pass (they all pass on
gloo: docs/torch-suite.md). `-m slow`: the whole suite for gloo and for hetccl with 1+1, 2+1 and
1+1+1 vendors (env:// and file:// init), and no test may pass on gloo but not on hetccl.
Skips with the reason when the suite's dependencies are missing.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "torch_suite.py")
sys.path.insert(0, HERE)
import torch_suite  # noqa: E402

WHY_NOT = torch_suite.missing_dependencies()
needs_suite = pytest.mark.skipif(WHY_NOT is not None, reason=f"PyTorch's suite cannot run: {WHY_NOT}")

# One per item of issue 15 that the suite covers, plus a cross-section of the rest.
SELECTION = [
    "test_all_gather_coalesced_simple",      # [rank][tensor] layout
    "test_sparse_all_reduce_sum",            # sparse all-reduce (gloo-gated)
    "test_send_recv_any_source",             # recv from any source
    "test_barrier_timeout_full_group",       # "Timed out" wording (gloo-gated)
    "test_monitored_barrier_gloo",           # hetccl.monitored_barrier (gloo-gated)
    "test_ddp_logging_data_cpu",             # backend name in DDP's logging data
    "test_all_reduce_complex_unsupported_ops",  # BAND/BOR/BXOR rejected for complex
    "test_batch_isend_irecv_gloo",           # gloo-gated p2p batch
    "test_accumulate_gradients_no_sync",     # runtime `BACKEND == "gloo"` branch
    "test_DistributedDataParallelCPU",
    "test_all_reduce_sum",
    "test_reduce_sum",
    "test_scatter",
    "test_all_gather_object_subgroup",
    "test_get_backend",
]


def run(backend: str, vendors: str | None, tests: list[str] | None, tmp: str,
        world: int | None = None, init: str = "env", timeout_s: int = 900) -> dict:
    out = os.path.join(tmp, f"{backend}-{vendors or world}-{init}.json")
    cmd = [sys.executable, RUNNER, "--backend", backend, "--init-method", init, "--json", out,
           "--timeout", "120"]
    cmd += ["--vendors", vendors] if vendors else ["--world-size", str(world)]
    if tests:
        cmd += ["--tests", ",".join(tests)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETCCL_")}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if not os.path.exists(out):
        raise AssertionError(f"runner wrote no results (rc {p.returncode}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _failures(d: dict, names) -> str:
    return "\n".join(f"{t}: {d['results'][t]['outcome']}: {d['results'][t]['detail'][-1500:]}"
                     for t in names)


@needs_suite
def test_selection_passes_on_hetccl_2p1(tmp_path):
    d = run("hetccl", "2+1", SELECTION, str(tmp_path))
    assert sorted(d["results"]) == sorted(SELECTION)
    bad = [t for t in SELECTION if d["results"][t]["outcome"] != "PASS"]
    assert not bad, _failures(d, bad)


def test_gloo_gate_treats_hetccl_like_gloo_only_for_the_name():
    g = torch_suite.GlooGate("hetccl")
    assert g == "gloo" and g == "hetccl" and not (g != "gloo")
    assert g != "nccl" and str(g) == "hetccl" and g.lower() == "hetccl"
    assert g in ["gloo", "nccl"] and g in {"hetccl"}


def test_report_names_regressions(tmp_path):
    def write(name, backend, vendors, world, res):
        p = tmp_path / name
        p.write_text(json.dumps({"backend": backend, "vendors": vendors, "world_size": world,
                                 "init_method": "env", "seconds": 1, "results": {
                                     t: {"outcome": o, "detail": ""} for t, o in res.items()}}))
        return str(p)

    a = write("g.json", "gloo", None, 2, {"t1": "PASS", "t2": "PASS", "t3": "SKIP"})
    b = write("h.json", "hetccl", "1+1", 2, {"t1": "PASS", "t2": "FAIL", "t3": "SKIP"})
    table = torch_suite.report([a, b])
    assert "| hetccl | 1+1 | 2 | env | 3 | 1 | 1 | 0 | 1 | t2 |" in table, table
    assert torch_suite.regressions(torch_suite.outcomes(a), torch_suite.outcomes(b)) == ["t2"]


@functools.lru_cache(maxsize=None)
def _gloo(world: int, init: str, tmp: str) -> dict:
    return run("gloo", None, None, tmp, world=world, init=init, timeout_s=3000)


@needs_suite
@pytest.mark.slow
@pytest.mark.parametrize("init", ["env", "file"])
@pytest.mark.parametrize("vendors", ["1+1", "2+1", "1+1+1"])
def test_full_suite_no_test_passes_on_gloo_only(vendors, init, tmp_path_factory):
    world = sum(int(x) for x in vendors.split("+"))
    tmp = str(tmp_path_factory.mktemp("torch_suite"))
    gloo = _gloo(world, init, str(tmp_path_factory.getbasetemp()))
    het = run("hetccl", vendors, None, tmp, init=init, timeout_s=3000)
    g = {t: r["outcome"] for t, r in gloo["results"].items()}
    h = {t: r["outcome"] for t, r in het["results"].items()}
    assert set(g) == set(h), "the two runs selected different tests"
    assert sum(o == "PASS" for o in g.values()) >= 80, "gloo itself passes too few tests"
    reg = torch_suite.regressions(g, h)
    assert not reg, _failures(het, reg)
