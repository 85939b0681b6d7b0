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


# ------------------------------------------------------------------ workers sharing GPUs
def _share(env, argv=None):
    from hetccl.launch import share_gpus

    env = {k: str(v) for k, v in env.items()}
    note = share_gpus(env, argv)
    return env, note


@pytest.mark.parametrize("size_var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])
def test_emulated_workers_share_the_gpus_a_host_has(monkeypatch, size_var):
    """hetccl.launch.share_gpus: more emulated workers than GPUs -> each sees GPU local % n as
    its only GPU and LOCAL_RANK 0 (frameworks bind LOCAL_RANK to a GPU index). The GPU list
    comes from CUDA_VISIBLE_DEVICES here, so this runs without a GPU."""
    monkeypatch.delenv("HETCCL_SHARE_GPUS", raising=False)
    for local, want in [(0, "3"), (1, "5"), (2, "3")]:
        argv = ["--local_rank=%d" % local, "--lr", "1"]
        env, note = _share({"HETCCL_VENDOR_SPLIT": "2+1", "LOCAL_RANK": local, size_var: 3,
                            "CUDA_VISIBLE_DEVICES": "3,5"}, argv)
        assert env["CUDA_VISIBLE_DEVICES"] == want and env["LOCAL_RANK"] == "0", env
        assert env["HETCCL_LOCAL_RANK"] == str(local) and note and f"GPU {want}" in note
        assert argv == ["--local_rank=0", "--lr", "1"], argv
    argv = ["--local_rank", "1"]
    _share({"HETCCL_VENDOR": "v1", "LOCAL_RANK": 1, size_var: 2, "CUDA_VISIBLE_DEVICES": "0"},
           argv)
    assert argv == ["--local_rank", "0"]


def test_gpu_sharing_only_where_it_is_needed(monkeypatch):
    monkeypatch.delenv("HETCCL_SHARE_GPUS", raising=False)
    base = {"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "CUDA_VISIBLE_DEVICES": "0"}
    # no emulation: a real job is never rearranged
    env, note = _share(base)
    assert note is None and env["LOCAL_RANK"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0"
    # as many GPUs as workers: one GPU each already
    env, note = _share({**base, "HETCCL_VENDOR_SPLIT": "1+1", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert note is None and env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["LOCAL_RANK"] == "1"
    # no GPU at all
    env, note = _share({**base, "HETCCL_VENDOR_SPLIT": "1+1", "CUDA_VISIBLE_DEVICES": ""})
    assert note is None and env["LOCAL_RANK"] == "1"
    # already placed (a worker that re-enters): left alone
    env, note = _share({**base, "HETCCL_VENDOR_SPLIT": "1+1", "HETCCL_LOCAL_RANK": "1"})
    assert note is None and env["LOCAL_RANK"] == "1"
    monkeypatch.setenv("HETCCL_SHARE_GPUS", "off")
    env, note = _share({**base, "HETCCL_VENDOR_SPLIT": "1+1"})
    assert note is None and env["LOCAL_RANK"] == "1"
    monkeypatch.setenv("HETCCL_SHARE_GPUS", "on")
    env, note = _share(base)
    assert note and env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_hetccl_run_places_emulated_workers_on_one_gpu(tmp_path):
    """`hetccl run --vendors 1+1 --nproc_per_node 2` on a host that shows one GPU: every worker
    starts with that GPU as its only one and LOCAL_RANK 0, the script's --local_rank too."""
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print(f"rank {os.environ['RANK']} local {os.environ['LOCAL_RANK']} "
              f"real {os.environ.get('HETCCL_LOCAL_RANK')} cvd {os.environ['CUDA_VISIBLE_DEVICES']} "
              f"argv {sys.argv[1:]}", flush=True)
    """))
    r = _run(["--vendors", "1+1", "--standalone", "--nproc_per_node", "2", str(script),
              "--local_rank=7"], env={"CUDA_VISIBLE_DEVICES": "0"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank} local 0 real {rank} cvd 0 argv ['--local_rank=0']" in out, out


def test_listed_gpus_that_do_not_exist_are_dropped(monkeypatch):
    """The deepspeed launcher writes CUDA_VISIBLE_DEVICES=0,1 for --num_gpus 2 on a one-GPU
    host: the GPUs counted are the ones that exist (the host's count from the management
    library; faked here, where there is none)."""
    from hetccl import device as devices
    seam, _ = devices.visible_accelerators({})
    monkeypatch.setattr(seam, "count_devices", classmethod(lambda cls: 1))
    monkeypatch.delenv("HETCCL_SHARE_GPUS", raising=False)
    assert seam.visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["0"]
    assert seam.visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-abc,1"}) == ["GPU-abc"]
    assert seam.visible_devices({}) == ["0"]
    env, note = _share({"HETCCL_VENDOR": "v1", "LOCAL_RANK": 1, "LOCAL_SIZE": 2,
                        "CUDA_VISIBLE_DEVICES": "0,1"})
    assert note and env["CUDA_VISIBLE_DEVICES"] == "0" and env["LOCAL_RANK"] == "0", env
    monkeypatch.setattr(seam, "count_devices", classmethod(lambda cls: -1))  # cannot count
    assert seam.visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]


def test_default_face_follows_the_machine(monkeypatch, tmp_path):
    """nccl_dropin.default_launch: the drop-in only with a CUDA build, a GPU, the built drop-in
    and the real NCCL found, each missing piece named; `hetccl run` without --dropin /
    --torch-face follows it (here: no CUDA, so the torch face)."""
    from hetccl import nccl_dropin
    import hetccl.run as hrun

    real = tmp_path / "libnccl.so.2"
    real.write_bytes(b"")
    monkeypatch.setenv("HETCCL_NCCL_LIBRARY", str(real))
    assert nccl_dropin.default_launch(True, 1)[0] is True
    assert nccl_dropin.default_launch(False, 1) == (False, nccl_dropin.default_launch(True, 0)[1])
    assert "no CUDA GPU" in nccl_dropin.default_launch(False, 0)[1]
    monkeypatch.setenv("HETCCL_NCCL_LIBRARY", "none")
    dropin, why = nccl_dropin.default_launch(True, 1)
    assert not dropin and "no real libnccl.so.2" in why
    monkeypatch.delenv("HETCCL_NCCL_LIBRARY")
    import torch

    # worked out once per process (cached): cleared, so this test sees the environment it set
    hrun._machine_default.cache_clear()
    try:
        if not torch.cuda.is_available():
            assert hrun.default_dropin() is False  # no CUDA GPU: the torch face
    finally:
        hrun._machine_default.cache_clear()
    with pytest.raises(SystemExit):
        hrun.parser().parse_args(["--dropin", "--torch-face", "x.py"])
