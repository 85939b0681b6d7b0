"""The drop-in NCCL/RCCL (csrc/nccl/dropin.cc) on the CPU machine: its exports and ABI, every
collective case of the C API test through NCCL's names across emulated vendors (host memory on
the emulated device's streams), the one-vendor path forwarding to a stand-in real library
(tests/cpp/fake_nccl.cc), a cross-vendor split whose children are one vendor each, a killed
peer, and what is refused across vendors. Ranks are torch-free processes (tests/capi_worker.py
with tests/nccl_shim.py)."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess

import pytest

from hetccl import nccl_dropin
from conftest import compiler
from test_capi import HERE, SPLITS, launch

DROPIN = nccl_dropin.library_path("nccl")


def nccl_env(**kw):
    return {"HETCCL_CAPI_LIB": DROPIN, "HETCCL_CAPI_DEVICE": "emulated", "HETCCL_NCCL_LIBRARY": "none", **kw}


@pytest.mark.parametrize("flavour", ["nccl", "rccl"])
def test_exports_and_soname(flavour):
    path = nccl_dropin.library_path(flavour)
    L = ctypes.CDLL(path)
    missing = [s for s in nccl_dropin.TORCH_IMPORTS + nccl_dropin.OTHER_USERS if not hasattr(L, s)]
    assert not missing, missing
    assert len(nccl_dropin.TORCH_IMPORTS) == 38
    out = subprocess.run(["readelf", "-d", "-W", path], capture_output=True, text=True, check=True).stdout
    assert f"[{nccl_dropin.SONAMES[flavour]}]" in out, out
    # only the C ABI is exported: no C++ symbol of the core to bind another hetccl library's
    syms = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    names = [ln.split()[-1] for ln in syms.splitlines() if ln.strip()]
    assert names and all(n.startswith(("nccl", "hetccl")) for n in names), [n for n in names if not n.startswith(("nccl", "hetccl"))][:5]


def test_destroy_and_abort_of_null_are_no_ops():
    """NCCL's ncclCommDestroy(NULL) and ncclCommAbort(NULL) return ncclSuccess (init.cc), and
    so do the drop-in's and the C API's: cleanup code calls them on a communicator that was never
    made."""
    from hetccl import capi

    for path, prefix in ((DROPIN, "nccl"), (capi.library_path(), "hetccl")):
        L = ctypes.CDLL(path)
        for fn in ("CommDestroy", "CommAbort"):
            f = getattr(L, prefix + fn)
            f.argtypes = [ctypes.c_void_p]
            assert f(None) == 0, f"{prefix}{fn}(NULL) returned {f(None)} in {path}"


def _protos(text: str) -> dict[str, str]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for m in re.finditer(r"(?:ncclResult_t|const char\*)\s+(nccl\w+)\s*\(([^)]*)\)\s*;", text):
        params = []
        for p in m.group(2).split(","):
            toks = re.findall(r"\w+|\*", p)
            if len(toks) > 1 and re.fullmatch(r"[A-Za-z_]\w*", toks[-1]):
                toks = toks[:-1]  # the parameter's name: only the types must agree
            params.append(" ".join(toks))
        out[m.group(1)] = "" if params == ["void"] else ", ".join(params)
    return out


def test_abi_matches_the_real_nccl_h():
    """Every prototype of nccl_abi.h against nccl.h of the real library (the nvidia-nccl wheel
    beside torch on the GPU box; HETCCL_NCCL_H elsewhere: passed against 2.28.9 and 2.32.6)."""
    h = nccl_dropin.nccl_header()
    if not h:
        pytest.skip("no nccl.h here (the nvidia-nccl wheel is on the GPU box; or set HETCCL_NCCL_H)")
    ours = _protos(open(os.path.join(HERE, "..", "csrc", "nccl", "nccl_abi.h")).read().replace("HETCCL_NCCL_API", ""))
    real_text = open(h).read()
    # the device API's host functions: nccl_device/core.h (2.28), nccl_device/host.h (2.32)
    for part in ("core.h", "host.h"):
        dev = os.path.join(os.path.dirname(h), "nccl_device", part)
        if os.path.exists(dev):
            real_text += re.sub(r"NCCL_EXTERN_C(\s+__host__)?", "", open(dev).read())
    real = _protos(real_text)
    assert len(ours) == 42 and set(nccl_dropin.TORCH_IMPORTS) <= set(ours), sorted(ours)
    bad = {k: (v, real.get(k)) for k, v in ours.items() if real.get(k) != v}
    assert not bad, bad
    for const in ("ncclFloat8e5m2 = 11", "ncclNumOps = 5", "ncclScalarHostImmediate = 1"):
        assert re.search(const.replace(" = ", r"\s*=\s*"), real_text), const


@pytest.mark.parametrize("split", ["1+1", "2+1", "1+1+1", "2+2"])
def test_every_collective_across_vendors(tmp_path, split):
    """The C API test's stream cases through NCCL's names: every dtype and op against float64 /
    exact references, in place, zero-size, reduce, all_to_all, PreMulSum, point to point, 40
    calls in flight, NCCL's NULL stream, a group over two streams, a refusal on every rank."""
    res, procs, logs = launch(tmp_path, split, "stream", env=nccl_env(), api="nccl")
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    cases = res[0]["cases"]
    assert len(cases) > 200 and "nccl/gather_scatter" in cases, len(cases)
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:30])
    assert int(res[0]["info"]["stream_jobs"]) > 200
    assert "hetccl: serving NCCL calls (drop-in libnccl.so.2)" in logs[0], logs[0][-2000:]


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    cxx = compiler("c++", "the stand-in NCCL")
    d = tmp_path_factory.mktemp("fake")
    out = d / "libnccl.so.2"
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", "-o", str(out), os.path.join(HERE, "cpp", "fake_nccl.cc")],
                   check=True)
    return str(out)


def test_one_vendor_forwards_to_the_real_library(tmp_path, fake_nccl):
    """Two ranks of one vendor: rank 0's real unique id reaches both, the real library makes
    the communicator, and the all_reduce is the real library's (its mark)."""
    logf = tmp_path / "fake.log"
    SPLITS["1v2"] = ["a", "a"]
    res, procs, logs = launch(tmp_path, "1v2", "forward",
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl, FAKE_NCCL_LOG=str(logf)), api="nccl")
    assert sorted(res) == [0, 1], "\n".join(logs)[-4000:]
    for r in (0, 1):
        assert res[r]["real"], res[r]
        assert res[r]["y"] == [1001.0 + r] * 8, res[r]
    calls = open(logf).read().split()
    assert calls.count("ncclGetUniqueId") == 1 and calls.count("ncclCommInitRank") == 2, calls
    assert calls.count("ncclAllReduce") == 2 and calls.count("ncclCommDestroy") == 2, calls
    assert f"real library: {os.path.realpath(fake_nccl)}" in logs[0], logs[0][-2000:]


def test_real_library_loaded_globally_first(tmp_path, fake_nccl):
    """As torch does (it preloads the nvidia-nccl wheel's libnccl.so.2 with RTLD_GLOBAL): the
    real library is already loaded when the drop-in opens it, and the drop-in is first in the
    global scope (LD_PRELOAD), so the real library's own call of ncclCommGetAsyncError reaches
    the drop-in, which must hand it back untouched (the stand-in fails the all_reduce otherwise)."""
    logf = tmp_path / "fake.log"
    SPLITS["1v2"] = ["a", "a"]
    res, procs, logs = launch(tmp_path, "1v2", "forward", api="nccl",
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl, FAKE_NCCL_LOG=str(logf),
                                           FAKE_NCCL_GLOBAL=fake_nccl, LD_PRELOAD=DROPIN))
    assert sorted(res) == [0, 1], "\n".join(logs)[-4000:]
    for r in (0, 1):
        assert res[r]["real"] and res[r]["y"] == [1001.0 + r] * 8, res[r]


def test_split_across_vendors_makes_native_children(tmp_path, fake_nccl):
    """2+2 (labels a a b b): the parent spans vendors (hetccl's all_reduce: 4.0); splitting by
    vendor makes two one-vendor children that the real library serves (its mark)."""
    logf = tmp_path / "fake.log"
    res, procs, logs = launch(tmp_path, "2+2", "forward",
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl, FAKE_NCCL_LOG=str(logf)), api="nccl")
    assert sorted(res) == [0, 1, 2, 3], "\n".join(logs)[-4000:]
    for r in range(4):
        d = res[r]
        assert not d["real"] and d["y"] == [4.0] * 8, d
        assert d["child_real"] and d["child_size"] == 2, d
        assert d["child_y"] == [1001.0 + r % 2] * 8, d


def test_killed_peer_reaches_the_async_error(tmp_path):
    res, procs, logs = launch(tmp_path, "2+1", "death", timeout=120, kill_at=3, api="nccl",
                              env=nccl_env(HETCCL_TIMEOUT_S="20"))
    assert sorted(res) == [0, 1], "\n".join(logs)[-4000:]
    for r in (0, 1):
        d = res[r]
        assert d["code"] in (2, 6) and d["async"] in (2, 6), d  # ncclSystemError / ncclRemoteError
        assert "rank 2" in d["text"] or "peer" in d["text"], d
        assert d["again_s"] < 2, d
        # torch's watchdog: ncclCommGetAsyncError then ncclGetLastError(NULL) on its own thread
        assert d["watchdog_async"] == d["async"], d
        assert "rank 2" in d["watchdog_text"] or "peer" in d["watchdog_text"], d


@pytest.mark.parametrize("split", ["1+1", "1+1+1"])
def test_one_rank_communicators_beside_a_cross_vendor_one(tmp_path, fake_nccl, split):
    """What torch's new_group([r]) on every rank does under the drop-in (the GPU suite's
    new_group family): with a stream all_reduce of the cross-vendor world in flight, every rank
    makes a one-rank communicator of its own at the same time (the real library serves each),
    then the world's call completes with the right values."""
    logf = tmp_path / "fake.log"
    res, procs, logs = launch(tmp_path, split, "forward", singletons=True, timeout=120,
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl, FAKE_NCCL_LOG=str(logf)), api="nccl")
    n = len(SPLITS[split])
    assert sorted(res) == list(range(n)), "\n".join(logs)[-4000:]
    for r in range(n):
        d = res[r]
        assert not d["real"] and d["single_real"], d
        assert d["single_y"] == [1001.0] * 8, d  # the stand-in's mark: send + 1000 + rank 0
        assert d["world_after"], d


@pytest.mark.parametrize("mode", ["shrink", "shrink_death"])
def test_shrink_through_nccl_names(tmp_path, fake_nccl, mode):
    """ncclCommShrink on a cross-vendor communicator (2+1+1): healthy (the last rank left out,
    then the first) and after the last rank died (NCCL_SHRINK_ABORT); the children are hetccl's
    (two or three vendors remain) and compute the right sums."""
    SPLITS["2+1+1"] = ["a", "a", "b", "c"]
    res, procs, logs = launch(tmp_path, "2+1+1", mode, api="nccl", timeout=120,
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl, HETCCL_TIMEOUT_S="20"))
    survivors = range(4) if mode == "shrink" else range(3)
    for r in survivors:
        d = res.get(r)
        assert d is not None, "\n".join(logs)[-3000:]
        if mode == "shrink":
            assert all(v == "ok" for v in d["cases"].values()), d["cases"]
            assert not any(d.get("child_real", {}).values()), d
        else:
            assert d["child"] == [r, 3] and d["child_sum"] == "ok", d


def test_shrink_to_one_vendor_is_the_real_library(tmp_path, fake_nccl):
    """2+2 shrunk to one vendor's ranks: the child is the real library's (its mark)."""
    res, procs, logs = launch(tmp_path, "2+2", "shrink_vendor", api="nccl", timeout=120,
                              env=nccl_env(HETCCL_NCCL_LIBRARY=fake_nccl))
    for r in (0, 1):
        d = res.get(r)
        assert d is not None, "\n".join(logs)[-3000:]
        assert d["child_real"] and d["child_y"] == [1001.0 + r] * 8, d


@pytest.fixture(scope="module")
def group_init_program(tmp_path_factory):
    cc = compiler("c", "tests/cpp/dropin_group_init.c")
    d = tmp_path_factory.mktemp("group_init")
    out = d / "group_init"
    lib = os.path.dirname(DROPIN)
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-pthread", "-o", str(out), os.path.join(HERE, "cpp", "dropin_group_init.c"),
                    "-I", os.path.join(HERE, "..", "csrc"), "-L", lib, "-l:libnccl.so.2", f"-Wl,-rpath,{lib}"],
                   check=True)
    return str(out)


@pytest.mark.parametrize("layout", ["2+1", "2+2", "one vendor 2", "1+1+1 from one process",
                                    "2+2 device route", "2+2 device programs"])
def test_inits_inside_a_group_from_one_thread(tmp_path, group_init_program, layout):
    """NCCL's one-thread-several-devices pattern (nccl-tests -g N): each process makes several
    ranks inside one ncclGroupStart/End, whose inits the outermost ncclGroupEnd runs together,
    then all_reduces and a ring of sends and receives on all of them in one group, and a
    simulated group that must launch nothing (tests/cpp/dropin_group_init.c); a call or a
    split refused inside a group cancels it. Before the inits
    were deferred, the first init waited for ranks its thread had not made yet and timed out;
    before the group's calls were deferred, a call taking the device route ("2+2 device route")
    waited in its argument check for a rank whose call its thread had not made yet."""
    # (vendor label, how many ranks) per process
    procs_of = {"2+1": [("a", 2), ("b", 1)], "2+2": [("a", 2), ("b", 2)], "one vendor 2": [("a", 2)],
                "1+1+1 from one process": [("a", 1), ("b", 1), ("c", 1)],
                "2+2 device route": [("a", 2), ("b", 2)], "2+2 device programs": [("a", 2), ("b", 2)]}[layout]
    if layout == "1+1+1 from one process":  # one process, three vendors: HETCCL_VENDOR_SPLIT labels ranks
        procs_of = [(None, 3)]
    nranks = sum(k for _, k in procs_of)
    idfile = str(tmp_path / "id")
    procs, first = [], 0
    for label, k in procs_of:
        env = {**os.environ, **nccl_env(HETCCL_TIMEOUT_S="30")}
        if layout in ("2+2", "1+1+1 from one process"):  # every process makes several hetccl ranks
            env["HETCCL_TEST_SPLIT_ORDER"] = "1"
        if layout.endswith(("device route", "device programs")):
            env["HETCCL_STREAM_DEVICE_BYTES"] = "8192"
            env["HETCCL_EXPECT_DEVICE_ROUTE"] = "1"
        if layout.endswith("device programs"):  # each device-route call one program kernel
            env["HETCCL_CAPI_ROUTE_LAUNCH"] = "kernel"
        if label is None:
            env["HETCCL_VENDOR_SPLIT"] = "1+1+1"
        else:
            env["HETCCL_VENDOR"] = label
        procs.append(subprocess.Popen([group_init_program, idfile, str(nranks), str(first), str(k)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        first += k
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{layout}: the job did not finish within 120 s")
    for p, o in zip(procs, outs):
        assert p.returncode == 0 and o.strip().endswith("ok"), o[-3000:]


def test_abort_while_group_end_issues_the_group(tmp_path, group_init_program):
    """torch's watchdog pattern: another thread aborts a communicator while ncclGroupEnd issues
    that communicator's deferred calls (device-route all_reduces rank 1 never joins).
    ncclGroupEnd returns an error within seconds; the calls after the interrupted one are not
    issued on the freed communicator (the abort waits for the issuer to let go)."""
    idfile = str(tmp_path / "id")
    # MALLOC_PERTURB_: freed memory is overwritten, so a call on a freed communicator crashes
    env = {**os.environ, **nccl_env(HETCCL_TIMEOUT_S="60", HETCCL_STREAM_DEVICE_BYTES="8192"),
           "MALLOC_PERTURB_": "165"}
    procs = [subprocess.Popen([group_init_program, idfile, "2", str(r), "1", "abort"],
                              env={**env, "HETCCL_VENDOR": "ab"[r]},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the abort did not end the group within 90 s")
    assert procs[0].returncode == 0 and outs[0].strip().endswith("ok"), outs[0][-3000:]
