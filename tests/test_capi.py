"""The C API (csrc/hetccl.h, libhetccl.so) through ctypes, ranks as processes without torch
(tests/capi_worker.py): every collective and dtype against float64 / exact references, in
place and out of place, zero-size, point to point, argument errors on every rank, a killed peer;
its settings and tables against hetccl/config.py and hetccl/tuning.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from hetccl import capi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPLITS = {"1": ["a"], "1+1": ["a", "b"], "2+1": ["a", "a", "b"], "1+1+1": ["a", "b", "c"],
          "2+2": ["a", "a", "b", "b"], "3+3": ["a", "a", "a", "b", "b", "b"],
          "3+2+2": ["a", "a", "a", "b", "b", "c", "c"],
          # groups not contiguous in rank order (the group rings are not the global ring's)
          "2+1+2 mixed": ["a", "b", "a", "c", "c"]}


def launch(tmp_path, split: str, mode: str, env=None, timeout=240, worker="capi_worker.py", **extra):
    """Every rank of `split` as a process running `worker` (tests/<worker> <job.json>), vendor
    labels by HETCCL_VENDOR; returns ({rank: its JSON result}, processes, logs)."""
    labels = SPLITS[split]
    n = len(labels)
    uid = capi.unique_id().hex()
    procs, outs = [], []
    for r, lab in enumerate(labels):
        out = str(tmp_path / f"{mode}-r{r}.json")
        cfg = str(tmp_path / f"{mode}-r{r}.cfg")
        with open(cfg, "w") as f:
            json.dump({"uid": uid, "rank": r, "n": n, "mode": mode, "out": out, "labels": labels,
                       **extra}, f)
        e = {**os.environ, "HETCCL_VENDOR": lab, **(env or {})}
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, worker), cfg],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out)
    end = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1, end - time.monotonic()))[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{split} {mode}: ranks did not finish within {timeout} s")
    res = {}
    for r, o in enumerate(outs):
        if os.path.exists(o):
            res[r] = json.load(open(o))
    return res, procs, logs


@pytest.mark.parametrize("split,algo", [("1", "auto"), ("1+1", "auto"), ("2+1", "auto"),
                                        ("1+1+1", "auto"), ("2+2", "auto"), ("2+2", "ring"),
                                        ("1+1", "rd"), ("3+3", "rd"),
                                        ("3+2+2", "auto"), ("2+1", "hier"), ("2+2", "hier"),
                                        ("3+2+2", "hier"), ("1+1+1", "hier"),
                                        ("2+1+2 mixed", "hier")])
def test_collectives_against_references(tmp_path, split, algo):
    """auto: recursive doubling for small all_reduces (folded when n is not a power of two),
    rings for large ones; the check's all-gather recursive doubling where n is a power of two,
    Bruck's otherwise; broadcast's binomial tree, Bruck's all_gather and the recursive-doubling
    reduce_scatter for small messages, the chain and rings for large ones (csrc/api/select.cc);
    ring / rd force one (HETCCL_CAPI_ALGO); hier: every all_reduce hierarchical across the
    vendor groups (coll_allreduce_hier.cc; 3+2+2: 6 blocks, runs of two and three owners;
    "2+1+2 mixed": groups interleaved in rank order). 3+3 and 3+2+2: the fold with two and
    three ranks beyond the power of two."""
    res, procs, logs = launch(tmp_path, split, "cases",
                              env={"HETCCL_CAPI_ALGO": algo,
                                   # a stream's runtime that cannot be opened (error/stream_one_rank)
                                   "HETCCL_CAPI_DEVICE_LIBRARY": "/nonexistent/libcuda.so.1"})
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    cases = res[0]["cases"]
    assert len(cases) > 200, len(cases)
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    # the algorithms the table chose ran (counted by the communicator)
    info = res[0]["info"]
    rd, ring = int(info.get("algo_all_reduce_rd", 0)), int(info.get("algo_all_reduce_ring", 0))
    hier = int(info.get("algo_all_reduce_hier", 0))
    if n == 1:
        pass
    elif algo == "hier":
        assert hier > 0 and rd == 0 and ring == 0, info
    elif algo == "ring":
        assert rd == 0 and ring > 0, info
    elif algo == "rd":
        assert ring == 0 and rd > 0, info
    else:
        assert rd > 0 and ring > 0, info  # small ones recursive doubling, the large ones rings
    if n > 1:  # broadcast, all_gather, reduce_scatter: latency algorithms for small messages,
        # rings (the chain) for large ones
        for latency, ring in (("broadcast_binomial", "broadcast_chain"),
                              ("all_gather_bruck", "all_gather_ring"),
                              ("reduce_scatter_rd", "reduce_scatter_ring")):
            lt, rg = int(info.get("algo_" + latency, 0)), int(info.get("algo_" + ring, 0))
            assert (lt > 0) == (algo != "ring") and (rg > 0) == (algo != "rd"), (latency, info)
    if n > 1:  # the check: a summary all_reduce on every call, the headers' all-gather on the
        # failing ones (recursive doubling where n is 2^m, else Bruck's); forced ring: the ring
        checks = {k: int(v) for k, v in info.items() if k.startswith("algo_check_")}
        if algo == "ring":
            assert list(checks) == ["algo_check_ring"] and checks["algo_check_ring"] > 0, info
        else:
            gather = "algo_check_headers_" + ("rd" if n & (n - 1) == 0 else "bruck")
            assert sorted(checks) == sorted(["algo_check_summary", gather]), info
            # the headers only for the refused / mismatched cases: far fewer than the calls
            assert 0 < checks[gather] < checks["algo_check_summary"] // 4, info
    # every rank has the same bits of every all_reduce, and the same text of every error
    for key in res[0]["digests"]:
        vals = {r: res[r]["digests"].get(key) for r in res}
        assert len(set(vals.values())) == 1, (key, vals)


STREAM_SPLITS = [("1", "emulated"), ("1+1", "emulated"), ("2+1", "emulated"), ("1+1+1", "emulated-hip"),
                 ("2+2", "emulated"), ("3+2+2", "emulated")]


@pytest.mark.parametrize("route,split,runtime",
                         [(r, s, rt) for r in ("auto", "device") for s, rt in STREAM_SPLITS] +
                         [("kernel", s, rt) for s, rt in STREAM_SPLITS if s in ("1+1", "2+1", "1+1+1")] +
                         [("kernel-ring", "1+1", "emulated")])
def test_stream_path(tmp_path, split, runtime, route):
    """Calls with a stream (csrc/api/stream_path.h) on the emulated device runtime, CUDA's and
    HIP's comparison rules: every collective case of the host test, on a stream, against the
    same references and with the same bits as the host path; 40 calls in flight; the default
    stream; host and stream ranks mixed; a group over two streams; a refusal reaching every
    rank as its async error. auto: calls of 1 MiB and more take the device route
    (csrc/api/device_route.h), the others are staged; device: every stream call with data takes
    the device route (HETCCL_STREAM_DEVICE_BYTES=1): engine device plans and the runtime's
    kernels for every collective, dtype and op, the PreMulSum scalars, and a count mismatch
    refused before any plan; kernel: the same with each device-route call one program kernel
    on the caller's stream (HETCCL_CAPI_ROUTE_LAUNCH=kernel, csrc/api/device_program.h; the
    emulated runtime's kernel is program_host.cc's interpreter); kernel-ring: the same with
    4 KiB chunks, so the larger calls' programs pass their instruction rings' 256 entries and
    the executor waits for the kernel to read on (program.h's flow control)."""
    env = {"HETCCL_CAPI_DEVICE": runtime}
    if route in ("device", "kernel", "kernel-ring"):
        env["HETCCL_STREAM_DEVICE_BYTES"] = "1"
    if route.startswith("kernel"):
        env["HETCCL_CAPI_ROUTE_LAUNCH"] = "kernel"
    if route == "kernel-ring":
        env["HETCCL_CAPI_DEVICE_CHUNK_BYTES"] = "4096"
        route = "kernel"  # the same assertions
    res, procs, logs = launch(tmp_path, split, "stream", env=env)
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    cases = res[0]["cases"]
    assert len(cases) > 200 and "stream/burst40" in cases, len(cases)
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    info = res[0]["info"]
    assert int(info["stream_jobs"]) > 200, info  # the calls took the stream path
    # the issuing thread's time in the stream path is counted on every call (gpu_dropin_bench)
    assert int(info["stream_issue_calls"]) >= int(info["stream_jobs"]) and int(info["stream_issue_ns"]) > 0, info
    for r in res:
        assert res[r]["digests"] == res[0]["digests"] or n == 1, f"rank {r} has other bits"
        info = res[r]["info"]
        assert info["stream_device_route"] == "1", info
        device_jobs = int(info["stream_device_jobs"])
        # every device call was a program in kernel mode, none elsewhere
        assert (int(info["stream_program_jobs"]) == device_jobs) == (route == "kernel" or device_jobs == 0), info
        if route == "kernel":  # scratch of ended programs is reused (device_program.h's cache)
            assert 0 < int(info["stream_program_scratch_reuses"]), info
            assert int(info["stream_program_scratch_allocs"]) < int(info["stream_program_jobs"]) // 2, info
        if route in ("device", "kernel"):
            assert device_jobs > 200, info
            # the route's issue cost by phase (stream_path.h), counted on every device call (a
            # program's issuing thread does not wait for the executor)
            for phase in ("check", "enqueue") + (("issue_wait",) if route == "device" else ()):
                assert int(info[f"stream_route_{phase}_ns"]) > 0 or n == 1, (phase, info)
            for coll in ("all_reduce_ring", "reduce_scatter_ring", "all_gather_ring", "broadcast_chain"):
                assert int(info.get(f"algo_{coll}_device", 0)) > 0 or n == 1, (coll, info)
            # stream/mixed_host_and_stream: where the other ranks made host calls, the odd
            # (stream) ranks ran the call staged on the route's stream
            assert (int(info["stream_staged_fallbacks"]) > 0) == (r % 2 == 1 and n > 1), (r, info)
        else:
            assert 0 < device_jobs < 30 or n == 1, info  # the large cases only
    if route in ("device", "kernel") and n > 1:
        assert "stream/device_mismatch_breaks_every_rank" in res[0]["cases"]


@pytest.mark.parametrize("split,device_bytes", [("1+1", "1"), ("2+1", "1"), ("1+1+1", "4096")])
def test_stream_path_deferred_joins(tmp_path, split, device_bytes):
    """hetcclCommDeferJoin / hetcclCommJoin (stream_path.h; the torch face's works): every case
    of the stream test with device-route calls returning before their stream is ordered after
    them, each joined only when its stream is next synchronized (tests/capi_worker.py
    DeferredComm), against the same references with the same bits on every rank: 40 calls in
    flight unjoined, staged calls after unjoined device ones (device_bytes 4096: small calls
    staged, larger ones deferred; the C API joins the staged call's stream first), a group over
    two streams, refusals and a broken communicator still joining."""
    res, procs, logs = launch(tmp_path, split, "stream", defer=True,
                              env={"HETCCL_CAPI_DEVICE": "emulated", "HETCCL_STREAM_DEVICE_BYTES": device_bytes})
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    assert "stream/burst40" in res[0]["cases"]
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    for r in res:
        assert res[r]["digests"] == res[0]["digests"], f"rank {r} has other bits"
        info = res[r]["info_end"]
        deferred = int(info["stream_deferred_jobs"])
        assert deferred > 100 and res[r]["deferred_calls"] == deferred, (res[r]["deferred_calls"], info)
        assert int(info["stream_joins"]) > 0, info
        if device_bytes != "1":  # staged calls were issued behind unjoined device-route ones
            assert int(info["stream_implicit_joins"]) > 0, info


def test_stream_path_staged_calls_take_the_hierarchical_all_reduce(tmp_path):
    """HETCCL_CAPI_ALGO=hier with stream calls (emulated runtime, 3+2+2): the staged calls' host
    all_reduces are hierarchical (the device route keeps its ring), every case against its
    reference with the same bits on every rank."""
    res, procs, logs = launch(tmp_path, "3+2+2", "stream",
                              env={"HETCCL_CAPI_DEVICE": "emulated", "HETCCL_CAPI_ALGO": "hier"})
    assert sorted(res) == list(range(7)), "\n".join(logs)[-4000:]
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    for r in res:
        assert res[r]["digests"] == res[0]["digests"], f"rank {r} has other bits"
        info = res[r]["info"]
        assert int(info.get("algo_all_reduce_hier", 0)) > 0 and "algo_all_reduce_ring" not in info, info


@pytest.mark.parametrize("split", ["1+1", "2+1", "1+1+1"])
def test_stream_path_chunked(tmp_path, split):
    """HETCCL_STREAM_CHUNK_BYTES (stream_path.h): every case of the stream test with every
    all_reduce above 4 KiB run chunk by chunk (1031 floats: 2 chunks; 300,000: past the 32-chunk
    bound, so the chunks grow), against the same float64 references, the same bits on every
    rank; a count mismatch spanning chunks leaves every buffer as it was and breaks every rank."""
    res, procs, logs = launch(tmp_path, split, "stream",
                              env={"HETCCL_CAPI_DEVICE": "emulated", "HETCCL_STREAM_CHUNK_BYTES": "4096"})
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    cases = res[0]["cases"]
    assert "stream/chunked_mismatch_breaks_every_rank" in cases, sorted(cases)[-5:]
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    for r in res:
        info = res[r]["info"]
        # every float and integer all_reduce of 1031 elements and the large ones went chunked
        assert int(info["stream_chunked_jobs"]) >= 40, info
        assert int(info["stream_chunks"]) >= 2 * int(info["stream_chunked_jobs"]), info
        assert res[r]["digests"] == res[0]["digests"], f"rank {r} has other bits"


def test_links_stay_constant_per_rank(tmp_path):
    """Four ranks on one host: each holds shared memory only to its two ring neighbours, and
    tcp only to the peers it exchanged messages with (p2p/far: rank 0 and rank 2)."""
    res, _, logs = launch(tmp_path, "2+2", "cases")
    assert sorted(res) == [0, 1, 2, 3], "\n".join(logs)[-4000:]
    for r, d in res.items():
        info = d["info"]
        assert info["links_shm"] == "2" and info["links_tcp"] == "1", (r, info)


@pytest.mark.parametrize("algo", ["auto", "hier"])
def test_killed_peer_is_a_clear_error(tmp_path, algo):
    """hier: the hierarchical all_reduce's concurrent plans (one per run of blocks) all end
    with the peer's failure, none left waiting."""
    res, procs, logs = launch(tmp_path, "2+1", "death", env={"HETCCL_TIMEOUT_S": "20",
                                                            "HETCCL_CAPI_ALGO": algo},
                              timeout=120, kill_at=3)
    assert procs[2].returncode == 17
    for r in (0, 1):
        d = res.get(r)
        assert d is not None, "\n".join(logs)[-3000:]
        assert d["code"] == capi.REMOTE_ERROR, d
        assert re.search(r"rank \d", d["text"]), d["text"]
        assert d["async"] == capi.REMOTE_ERROR, d
        assert d["again_code"] == capi.REMOTE_ERROR and "unusable after an earlier failure" in d["again"], d
        assert d["again_s"] < 1, d
        # a thread that made no failing call polls the async error, then asks for the last
        # error with no communicator (what torch's watchdog does through NCCL's ABI)
        assert d["watchdog_async"] == capi.REMOTE_ERROR and re.search(r"rank \d", d["watchdog_text"]), d


@pytest.mark.parametrize("route", ["device", "kernel", "staged", "deferred"])
def test_killed_peer_during_stream_calls(tmp_path, route):
    """A peer dies while stream calls are in flight (the device route's plans on its streams,
    or staged calls on the executor): no survivor's stream stays blocked, each survivor's
    communicator reports hetcclRemoteError as its async error, and a later call fails at once
    naming the failure. deferred: the device route with deferred joins (hetcclCommDeferJoin),
    each stream joined at its synchronization: the joins of a broken communicator pass too."""
    env = {"HETCCL_TIMEOUT_S": "20", "HETCCL_CAPI_DEVICE": "emulated",
           "HETCCL_STREAM_DEVICE_BYTES": "off" if route == "staged" else "1",
           "HETCCL_CAPI_ROUTE_LAUNCH": "kernel" if route == "kernel" else "streams"}
    res, procs, logs = launch(tmp_path, "2+1", "death_stream", env=env, timeout=150, kill_at=3,
                              defer=route == "deferred")
    assert procs[2].returncode == 17
    for r in (0, 1):
        d = res.get(r)
        assert d is not None, "\n".join(logs)[-3000:]
        assert d["async"] == capi.REMOTE_ERROR, d
        assert d.get("again_code") == capi.REMOTE_ERROR, d
        assert re.search(r"rank \d|peer", d["again"]), d["again"]
        assert d["again_s"] < 1, d
        assert (int(d["info"]["stream_device_jobs"]) > 0) == (route != "staged"), d["info"]
        assert (int(d["info"]["stream_program_jobs"]) > 0) == (route == "kernel"), d["info"]
        assert (int(d["info"]["stream_deferred_jobs"]) > 0) == (route == "deferred"), d["info"]


@pytest.mark.parametrize("call", ["host", "device_route"])
def test_abort_from_another_thread_ends_a_hung_call(tmp_path, call):
    """hetcclCommAbort on another thread while a call waits for a peer that never joins (alive,
    not dead: nothing fails on its own before the timeout): the call returns an error at once
    and the abort returns at once -- a host call waiting in the argument check, and a device
    route call whose issuing thread waits for the executor -- and the communicator is freed only
    after the call left it (the process exits cleanly)."""
    env = {"HETCCL_TIMEOUT_S": "60", "HETCCL_CAPI_DEVICE": "emulated", "HETCCL_STREAM_DEVICE_BYTES": "1"}
    res, procs, logs = launch(tmp_path, "1+1", "abort_hung", env=env, timeout=60,
                              stream=call == "device_route", sleep_s=8)
    assert procs[0].returncode == 0, "\n".join(logs)[-3000:]
    d = res.get(0)
    assert d is not None, "\n".join(logs)[-3000:]
    assert "abort" in d["call"] and d["code"] != capi.SUCCESS, d
    assert d["call_s"] < 4 and d["abort_s"] < 4, d


@pytest.mark.parametrize("route", ["staged", "device_route", "kernel", "deferred"])
def test_abort_keeps_memory_queued_stream_work_uses(tmp_path, route):
    """An abort with stream calls still queued on the caller's stream (the peer silent): the
    stream runs their copies and flag writes once released, and no operation may touch host
    memory the communicator unregistered or freed (the emulated device's lifetime check,
    strict: the process aborts on the first). The abort returns within a few seconds.
    deferred: device-route calls with deferred joins, none joined before the abort (their freed
    words come from the route, or from the executor for calls it never ran)."""
    env = {"HETCCL_TIMEOUT_S": "60", "HETCCL_CAPI_DEVICE": "emulated", "HETCCL_CHECK_ARGS": "off",
           "HETCCL_EMULATED_STRICT": "1",
           "HETCCL_STREAM_DEVICE_BYTES": "off" if route == "staged" else "1",
           "HETCCL_CAPI_ROUTE_LAUNCH": "kernel" if route == "kernel" else "streams"}
    res, procs, logs = launch(tmp_path, "1+1", "abort_queued", env=env, timeout=90, sleep_s=10,
                              defer=route == "deferred")
    out = "\n".join(logs)
    assert "use after unregister" not in out, out[-3000:]
    assert procs[0].returncode == 0 and 0 in res, out[-3000:]
    assert res[0]["abort_s"] < 8, res[0]


@pytest.mark.parametrize("shm", ["on", "off"])
def test_receive_given_up_is_withdrawn(tmp_path, shm):
    """A receive whose wait timed out is withdrawn: the message its peer sends afterwards does not
    land in the buffer of the call that returned (the caller may have freed it), over shared
    memory and over tcp."""
    env = {"HETCCL_TIMEOUT_S": "1", "HETCCL_CAPI_SHM": shm}
    res, procs, logs = launch(tmp_path, "1+1", "late_send", env=env, timeout=60)
    assert sorted(res) == [0, 1], "\n".join(logs)[-3000:]
    d = res[1]
    assert "Timed out" in d["recv"] and d["code"] == capi.REMOTE_ERROR, d
    assert d["landed"] == 0, f"{d['landed']} bytes of the late message landed in the given-up buffer"


@pytest.mark.parametrize("split", ["1+1+1", "2+2", "3+2+2"])
def test_shrink(tmp_path, split):
    """hetcclCommShrink on a healthy communicator: the last rank left out, then the first (the
    leader is not rank 0 then); each survivor's new rank and size and an all_reduce on the
    child; the parent usable after (every rank); bad lists refused on the calling rank alone."""
    res, procs, logs = launch(tmp_path, split, "shrink", timeout=120)
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    want = {f"shrink/{w}" for w in ("last", "first")} | {"bad/out_of_range", "bad/self", "bad/twice"}
    for r in range(n):
        cases = res[r]["cases"]
        bad = {k: v for k, v in cases.items() if v != "ok"}
        assert not bad, (r, bad)
        mine = want - ({"shrink/last"} if r == n - 1 else set()) - ({"shrink/first"} if r == 0 else set())
        assert mine <= set(cases), (r, sorted(cases))


def test_shrink_after_a_killed_peer(tmp_path):
    """2+1+1: the last rank (a vendor of its own) dies; the survivors' parent fails, and
    hetcclCommShrink with HETCCL_SHRINK_ABORT makes a working child of 3 ranks and 2 vendor
    groups without any collective over the broken parent; the parent stays refused."""
    SPLITS["2+1+1"] = ["a", "a", "b", "c"]
    res, procs, logs = launch(tmp_path, "2+1+1", "shrink_death", env={"HETCCL_TIMEOUT_S": "20"}, timeout=120)
    assert procs[3].returncode == 17
    for r in range(3):
        d = res.get(r)
        assert d is not None, "\n".join(logs)[-3000:]
        assert d["parent_error"] == capi.REMOTE_ERROR, d
        assert d["child"] == [r, 3] and d["child_sum"] == "ok", d
        assert d["child_groups"][0] == 2, d
        assert d["parent_after"] != "a call on the aborted parent succeeded", d
        assert d["shrink_s"] < 15, d


def _joining_rank(uid: bytes, n: int, rank: int, env: dict) -> subprocess.Popen:
    """A torch-free process that makes rank `rank` of an n-rank communicator from uid and prints
    'OK' or 'ERR <code> <text>'."""
    code = ("import sys, importlib.util as u; s=u.spec_from_file_location('c', sys.argv[1]); "
            "m=u.module_from_spec(s); s.loader.exec_module(m)\n"
            "try:\n    m.Comm(int(sys.argv[3]), bytes.fromhex(sys.argv[2]), int(sys.argv[4]))\n"
            "    print('OK')\nexcept m.HetcclError as e:\n    print('ERR', e.code, e.text)\n")
    path = os.path.join(ROOT, "hetccl", "capi.py")
    return subprocess.Popen([sys.executable, "-c", code, path, uid.hex(), str(n), str(rank)],
                            env=env, stdout=subprocess.PIPE, text=True)


def test_ranks_with_different_schedule_settings_are_refused_at_init():
    """HETCCL_CAPI_ALGO (or how calls are cut) set differently on two ranks: every rank's
    communicator creation fails with the same clear error naming both values, instead of the
    ranks running different steps until the timeout."""
    uid = capi.unique_id()
    base = {k: v for k, v in os.environ.items() if not k.startswith("HETCCL_CAPI_ALGO")}
    ps = [_joining_rank(uid, 2, r, {**base, "HETCCL_TIMEOUT_S": "20", "HETCCL_CAPI_ALGO": algo})
          for r, algo in enumerate(("ring", "hier"))]
    outs = [p.communicate(timeout=60)[0].strip() for p in ps]
    for o in outs:
        assert o.startswith(f"ERR {capi.INVALID_USAGE} "), outs
        assert "schedule settings differ" in o and "HETCCL_CAPI_ALGO=ring" in o and "HETCCL_CAPI_ALGO=hier" in o, outs
    assert outs[0].split(" ", 2)[2] == outs[1].split(" ", 2)[2], outs


def test_bootstrap_refuses_a_duplicate_rank(tmp_path, monkeypatch):
    """Two processes given rank 0: the second gets a clear error from the root; the other
    waits for the root's verdict, which names the ranks that never joined."""
    monkeypatch.setenv("HETCCL_TIMEOUT_S", "4")  # the root's (this process's) wait
    uid = capi.unique_id()
    env = {**os.environ, "HETCCL_TIMEOUT_S": "4"}
    ps = [_joining_rank(uid, 3, 0, env) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in ps]
    assert any("joined twice" in o for o in outs), outs
    assert any("did not join within" in o and "missing: 1, 2" in o for o in outs), outs


def _fake_joiner(uid: bytes, rank: int, nranks: int) -> dict:
    """Joins the bootstrap root through its wire (csrc/api/bootstrap.cc) as `rank`, with a tree
    listener, and never forwards the table to its children; returns the root's status, the
    body's size and the listener (kept open: the children can connect, nobody sends)."""
    import socket
    import struct

    secret, root = uid[8:24], uid[28:].split(b"\0")[0].decode()
    host, port = root.rsplit(":", 1)
    lis = socket.socket()
    lis.bind(("127.0.0.1", 0))
    lis.listen(4)
    me = f"127.0.0.1:{lis.getsockname()[1]}".encode()
    entry = b"\0\0\0\0"  # encode_kv of no pairs
    c = socket.create_connection((host, int(port)), timeout=30)
    c.sendall(b"hetcBOOT" + secret + struct.pack("<III", rank, nranks, len(entry)) + entry +
              struct.pack("<I", len(me)) + me)
    head = b""
    while len(head) < 12:
        head += c.recv(12 - len(head))
    status, blen = struct.unpack("<IQ", head)
    body = b""
    while len(body) < blen:
        body += c.recv(blen - len(body))
    return {"status": status, "body": len(body), "listener": lis}


def test_bootstrap_tree_names_a_parent_that_never_forwards(tmp_path):
    """The table reaches rank 0 from the root and every other rank from its parent in a
    binomial tree (bootstrap.cc). A rank 0 that joins and never forwards: its children (1 and
    2 of 3) fail with a timeout naming rank 0 as their parent, not a hang; the root sent the
    table to rank 0 only. The root (this process) keeps its default wait for the joins; the
    ranks' own timeout (5 s) bounds their wait for the parent."""
    uid = capi.unique_id()
    env = {**os.environ, "HETCCL_TIMEOUT_S": "5"}
    ps = [_joining_rank(uid, 3, r, env) for r in (1, 2)]
    got = _fake_joiner(uid, 0, 3)
    outs = [p.communicate(timeout=90)[0] for p in ps]
    got["listener"].close()
    assert got["status"] == 0 and got["body"] > 0, got  # rank 0 got the table itself
    for r, o in zip((1, 2), outs):
        assert "ERR" in o and "timed out waiting for the table from rank 0" in o, (r, o)
        assert f"rank {r}'s parent" in o, (r, o)


def test_settings_documented_and_tables_equal_tuning():
    """Every environment name the C faces read (csrc/api/settings.cc) is a setting of
    hetccl/config.py, and the C API's chunk tables are tuning.py's."""
    from hetccl import config, tuning

    src = open(os.path.join(ROOT, "csrc", "api", "settings.cc")).read()
    names = set(re.findall(r'"(HETCCL_[A-Z0-9_]+)"', src))
    assert names, "no settings found"
    declared = set(config.SETTINGS)
    assert names <= declared, names - declared
    rows = {k: re.search(k + r" = \{(.*?)\};", src, re.S).group(1)
            for k in ("host_chunks", "msg_chunks", "device_chunks")}

    def parse(text):
        val = {"KiB": 1 << 10, "MiB": 1 << 20, "INF": tuning.INF}
        out = []
        for a, b in re.findall(r"\{([^{}]+?),\s*([^{}]+?)\}", text):
            ev = [eval(x, {}, val) for x in (a.strip(), b.strip())]  # noqa: S307 - our own source
            out.append(tuple(ev))
        return out

    assert parse(rows["host_chunks"]) == [tuple(r) for r in tuning.HOST]
    assert parse(rows["msg_chunks"]) == [tuple(r) for r in tuning.MESSAGE]
    assert parse(rows["device_chunks"]) == [tuple(r) for r in tuning.DEVICE]


def test_torch_free():
    """The workers never import torch or the hetccl package (the C API's promise)."""
    code = ("import sys; sys.argv=['x']; import runpy\n"
            f"m = runpy.run_path({os.path.join(HERE, 'capi_worker.py')!r}, run_name='not_main')\n"
            "print(sorted(k for k in sys.modules if k.startswith(('torch', 'hetccl'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_scale_harness_runs(tmp_path):
    """`hetccl bench scale` (torch-free ranks on the C API): rows for each n, 0 wrong, jsonl."""
    rows = tmp_path / "rows.jsonl"
    out = subprocess.run([sys.executable, "-m", "hetccl.cli", "bench", "scale", "--ranks", "2,4",
                          "--iters", "3", "--no-progress", "--jsonl", str(rows)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["n"] for r in got] == [2, 4] and all(r["wrong"] == 0 for r in got), got
    assert all(r["links_shm"] >= 1 and r["sockets"] >= 1 for r in got), got
    assert "wrong elements: 0" in out.stdout


def test_peers_per_rank_log_n_for_any_n(tmp_path):
    """Issue 30: at n not a power of two (12, 24) a rank's tcp peers after small all_reduces are
    at most log2 of the largest power of two <= n (the folded recursive doubling's partners and
    the check's summary; the fold partner and the ring neighbours are on shm), its shared memory
    within HETCCL_SHM_BUDGET_BYTES, and every result right."""
    rows = tmp_path / "rows.jsonl"
    budget = 4 << 20
    out = subprocess.run([sys.executable, "-m", "hetccl.cli", "bench", "scale", "--ranks", "12,24",
                          "--iters", "3", "--no-progress", "--jsonl", str(rows)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HETCCL_SHM_BUDGET_BYTES": str(budget)})
    assert out.returncode == 0, out.stdout + out.stderr
    got = {r["n"]: r for r in map(json.loads, rows.read_text().splitlines())}
    for n, r in got.items():
        p = 1 << (n.bit_length() - 1)
        assert r["wrong"] == 0, r
        assert 1 <= r["tcp_peers"] <= p.bit_length() - 1, r  # log2(p): 3 at 12, 4 at 24
        # mapped: this rank's own segments (within the budget) and its two neighbours'
        assert 0 < r["shm_MB"] * 1e6 <= 2 * budget, r
        assert r["table_KB"] > 0, r
    assert set(got) == {12, 24}, got
