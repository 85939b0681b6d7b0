"""The user-facing commands run and report what they claim: demo, doctor, the benchmarks
(short settings; their full runs are documented in docs/benchmarks.md)."""
from __future__ import annotations

import json

import pytest

from hetccl import cli


def test_demo_checks_and_trains(capsys):
    rc = cli.main(["demo", "--vendors", "1+1", "--steps", "5", "--global-batch", "8"])
    out = capsys.readouterr().out
    assert "all correct" in out and "-> match" in out and out.rstrip().endswith("OK"), out
    assert rc == 0


def test_doctor_reports_vendors_and_transports(capsys):
    rc = cli.main(["doctor", "--launch", "1+1"])
    out = capsys.readouterr().out
    assert rc == 0
    # the capability table (issue 18) and what a peer gets from it
    assert "bridge transports (capability table, most preferred first):" in out, out
    assert "shm  pref 10  reaches this host " in out and "tcp  pref 30" in out, out
    assert "peers on this host  -> shm" in out, out
    assert "peers on other hosts -> tcp" in out or "peers on other hosts -> ucx" in out, out
    assert "bridge peers 1:shm" in out and "bridge peers 0:shm" in out, out
    assert "HETCCL_TRANSPORT" in out
    assert "rank 0: vendor v0" in out and "rank 1: vendor v1" in out, out
    assert out.count("all_reduce check ok") == 2, out


def test_bench_collectives_rows_are_checked(tmp_path, capsys):
    jl = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "collectives", "--vendors", "1+1", "--backends", "hetccl,gloo",
                   "--colls", "all_reduce,all_gather,reduce_scatter", "--minbytes", "64K",
                   "--maxbytes", "256K", "--iters", "2", "--warmup", "1", "--no-progress",
                   "--jsonl", str(jl)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [json.loads(line) for line in jl.read_text().splitlines()]
    assert len(rows) == 2 * 3 * 2
    for r in rows:
        for key in ("collective", "size_bytes", "dtype", "backend", "vendors", "world_size",
                    "hardware", "busbw_gbs", "algbw_gbs", "time_us", "wrong", "date"):
            assert key in r
        assert r["wrong"] == 0 and r["busbw_gbs"] > 0
    assert "#    collective    backend" in out and "hetccl/gloo" in out


def test_bench_transport_runs(capsys):
    rc = cli.main(["bench", "transport", "--transports", "shm,tcp", "--sizes", "1M",
                   "--repeat", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "shm" in out and "tcp" in out and "memcpy" in out


def test_bench_transport_reduce_mode(capsys):
    """--modes reduce: bidirectional irecv_reduce, every message's sum checked (#wrong 0 on
    every transport of this build; ucx kept off shared memory as between emulated hosts)."""
    from hetccl._core import _C

    names = ",".join(_C.transport_names())
    rc = cli.main(["bench", "transport", "--transports", names, "--sizes", "256K", "--iters", "8",
                   "--repeat", "1", "--modes", "reduce", "--emulate-hosts"])
    out = capsys.readouterr().out  # the summary (rank 0's table is its own process's)
    assert rc == 0, out  # 1 if any reduced message was wrong
    line = next(ln for ln in out.splitlines() if ln.startswith("hetccl bench transport:"))
    assert "256 KiB reducing" in line and line.endswith("all rows verified"), line
    assert line.count("GB/s (median") == len(_C.transport_names()), line
    with pytest.raises(SystemExit):
        cli.main(["bench", "transport", "--modes", "sideways"])


def test_doctor_into_a_closed_pipe_ends_quietly():
    """`hetccl doctor | head`: the reader goes away before doctor is done. A filter then ends
    quietly (exit 0, no BrokenPipeError traceback); doctor did not. The pipe is closed before
    doctor writes anything, so its first write fails."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "hetccl.cli", "doctor"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.communicate(timeout=120)[1].decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert p.returncode == 0, err
