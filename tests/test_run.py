"""`hetccl run` (and the option set it shares with `hetccl deepspeed` / `hetccl megatron`): an
unchanged script that asks for NCCL runs over hetccl under torchrun; the script's folder is on
sys.path; --vendors works as `--vendors X` and `--vendors=X`, is checked, and a --vendors after
the script path stays the script's; help shows hetccl's usage; rank 0 prints one start line at
the default log level; HETCCL_* settings in a job that never loads hetccl are noticed."""
from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from hetccl import run as hrun


def _run(args, cwd=None, env=None, timeout=180):
    e = dict(os.environ)
    for k in [k for k in e if k.startswith("HETCCL_")]:
        del e[k]
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "hetccl.cli", "run", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_unchanged_nccl_script_runs_over_hetccl(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("nccl")          # unchanged user code
        import hetccl
        x = torch.full((1000,), float(dist.get_rank() + 1))
        dist.all_reduce(x)
        labels = hetccl.vendor_of_ranks()
        print(f"rank {dist.get_rank()} backend {type(dist.group.WORLD).__name__} "
              f"sum {x[0].item():.0f} vendors {'+'.join(labels)}", flush=True)
        dist.destroy_process_group()
    """))
    r = _run(["--vendors", "1+1", "--standalone", "--nproc_per_node", "2", str(script)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank} backend HetcclProcessGroup sum 3 vendors v0+v1" in out, out
    # one line at the default log level, on rank 0 only, saying what hetccl did
    starts = [line for line in out.splitlines() if "hetccl: started" in line]
    assert len(starts) == 1, out
    assert ("NOTICE hetccl: started, 2 ranks, 2 vendor groups (v0:1 + v1:1), bridge transport "
            "shm (as seen from rank 0); init_process_group('nccl') redirected to hetccl by "
            "`hetccl run`") in starts[0], starts


def test_script_folder_on_path_vendors_forms_and_script_args(tmp_path):
    """Launched from another directory, the script imports a sibling module; --vendors=1+1
    (the = form) is hetccl's, the --vendors after the script path is the script's own."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("VALUE = 41\n")
    (app / "train.py").write_text(textwrap.dedent("""
        import argparse, sys, torch.distributed as dist
        import helper                              # sibling module of the script
        p = argparse.ArgumentParser()
        p.add_argument("--vendors")
        a = p.parse_args()
        dist.init_process_group("gloo")
        import hetccl
        print(f"rank {dist.get_rank()} helper {helper.VALUE + 1} script-vendors {a.vendors} "
              f"hetccl-vendors {'+'.join(hetccl.vendor_of_ranks())} sys.path[0] {sys.path[0]}",
              flush=True)
        dist.destroy_process_group()
    """))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _run(["--vendors=1+1", "--standalone", "--nproc_per_node=2", str(app / "train.py"),
              "--vendors", "mine"], cwd=str(elsewhere), env={"HETCCL_LOG_LEVEL": "WARNING"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert (f"rank {rank} helper 42 script-vendors mine hetccl-vendors v0+v1 "
                f"sys.path[0] {app}") in out, out
    assert "hetccl: started" not in out  # HETCCL_LOG_LEVEL=WARNING silences the start line


def test_help_shows_hetccl_usage_and_vendors(capsys):
    with pytest.raises(SystemExit) as e:
        hrun.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hetccl run [--vendors SPLIT] [torchrun options] "
                          "training_script"), out[:200]
    assert "--vendors SPLIT" in out and "EMULATION ONLY" in out
    assert "--nproc-per-node" in out  # torchrun's own options follow


@pytest.mark.parametrize("argv, words", [
    (["--vendors", "2+2", "--nproc_per_node", "2", "x.py"],
     ["--vendors 2+2 covers 4 ranks, but torchrun starts 2"]),
    (["--vendors=2x2", "--nproc_per_node", "4", "x.py"], ["--vendors '2x2'", "e.g. 2+2"]),
    (["--vendors", "0+2", "--nproc_per_node", "2", "x.py"], ["--vendors '0+2'"]),
    (["-m", "pkg.train"], ["-m/--module"]),
])
def test_bad_options_are_refused_clearly(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        hrun.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hetccl run"), err
    for w in words:
        assert w in err, err


def test_split_parser_shared_by_the_launchers():
    assert hrun.parse_split("2+1+1") == [2, 1, 1]
    for bad in ("", "2+", "a+b", "2+-1"):
        with pytest.raises(Exception, match="--vendors"):
            hrun.parse_split(bad)


def test_no_torch_backends_entry_point():
    """torch imports every "torch.backends" entry point while it is itself imported and raises
    if one fails, so a broken hetccl installation would make `import torch` fail for every
    program (seen with an editable install whose source folder was gone). hetccl installs none
    (pyproject.toml says why); this guards against one coming back."""
    ours = [f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group="torch.backends")
            if ep.dist is not None and ep.dist.name.lower() == "hetccl"]
    assert not ours, f"hetccl registers torch.backends entry points: {ours}"
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'entry-points."torch.backends"' not in text


def test_script_that_ends_right_after_an_async_work_exits_cleanly(tmp_path):
    """A script that ends (no destroy_process_group) right after waiting on an async Work: the
    group's worker thread completed that Work's torch Future, which re-takes the GIL on its way
    out. Python 3.11 ends a thread that takes the GIL during finalization with pthread_exit,
    and that forced unwind through torch's noexcept frame aborted the process ("terminate
    called without an active exception") in 4 of 6 runs before hetccl closed its groups at
    exit. Several runs, since it is a race."""
    script = tmp_path / "ends_at_once.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("hetccl")
        x = torch.ones(1 << 12)
        for _ in range(3):
            dist.all_reduce(x, async_op=True).wait()
        print(f"rank {dist.get_rank()} sum {x[0].item():.0f}", flush=True)
    """))
    for attempt in range(4):
        r = _run(["--vendors", "1+1", "--standalone", "--nproc_per_node", "2", str(script)])
        out = r.stdout + r.stderr
        assert "terminate called" not in out, f"run {attempt}: {out[-4000:]}"
        assert r.returncode == 0, f"run {attempt}: {out[-4000:]}"
        for rank in (0, 1):
            assert f"rank {rank} sum 8" in out, out[-4000:]
