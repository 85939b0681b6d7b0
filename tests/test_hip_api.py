"""The HIP runtime module's declarations (csrc/device/hip_api.h) checked against ROCm's own
definitions, without an AMD GPU:

  * compiled against ROCm's HIP headers (Debian's libamdhip64-dev, ROCm 5.2; or a ROCm install):
    tests/cpp/hip_api_check.cc static_asserts every constant and opaque type and redeclares every
    function (HIP's from hip_runtime_api.h, hiprtc's from hiprtc.h) with the table's type; a
    deliberately wrong constant, prototype or type must fail that compile (so the check can fail);
  * compared with the generated bindings of a current ROCm (rocm-bindings-hip, ROCm 7.x): the
    table as the compiled module exports it (hetccl._C.runtime_api("hip")) against the bindings'
    enum and constant values and the prototypes of their cyhip.pxd (HIP) and cyhiprtc.pxd
    (hiprtc);
  * the HIP runtime module's own code run over tests/cpp/fake_hip.cc, a libamdhip64 stand-in
    built from the same headers that logs each call: the attribute it queries (10013), signal
    memory for wait words (8 bytes, hipMallocSignalMemory), 64-bit Gte waits with every mask bit
    on counters past 2^32, registration / event / copy flags, error text; and RocmSeam opening
    that module on a (simulated) ROCm build.

.ci/setup installs both (apt: libamdhip64-dev; pip download: rocm-bindings-hip and -core into
build/rocm-bindings). Where one is missing the test skips saying what to install -- except under
CI (CI=true), where a missing definition fails, so a wrong constant can never pass CI unchecked.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetccl._core import _C

ROOT = Path(__file__).resolve().parent.parent
HEADER_DIRS = [Path(os.environ.get("HETCCL_HIP_INCLUDE", "/usr/include")), Path("/opt/rocm/include")]
BINDINGS = Path(os.environ.get("HETCCL_ROCM_BINDINGS", ROOT / "build" / "rocm-bindings" / "site"))


def _missing(what: str):
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{what} (CI must check the HIP declarations: .ci/setup installs it)")
    pytest.skip(what)


def _include_dir() -> Path:
    for d in HEADER_DIRS:
        if (d / "hip" / "hip_runtime_api.h").is_file():
            return d
    _missing("no HIP headers (apt-get install libamdhip64-dev, or HETCCL_HIP_INCLUDE)")


def _compile(tmp_path: Path, header_override: str | None = None):
    inc = _include_dir()
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        _missing("no C++ compiler")
    flags = ["-I", str(ROOT / "csrc")]
    if header_override is not None:
        (tmp_path / "device").mkdir(exist_ok=True)
        (tmp_path / "device" / "hip_api.h").write_text(header_override)
        flags = ["-I", str(tmp_path)] + flags
    exe = tmp_path / "hip_api_check"
    if inc != Path("/usr/include"):  # the compiler's own include path already has it
        flags += ["-isystem", str(inc)]
    r = subprocess.run([cxx, "-std=c++17", "-D__HIP_PLATFORM_AMD__", *flags,
                        str(ROOT / "tests" / "cpp" / "hip_api_check.cc"), "-o", str(exe)],
                       capture_output=True, text=True)
    return r, exe


def test_declarations_compile_against_the_hip_headers(tmp_path):
    r, exe = _compile(tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    consts, funcs = _C.runtime_api("hip")
    m = re.match(r"checked (\d+) constants (\d+) types (\d+) functions against HIP (\d+)\.(\d+)", out)
    assert m, out
    assert (int(m[1]), int(m[3])) == (len(consts), len(funcs)), out  # all of the tables
    assert int(m[2]) >= 11, out  # every opaque type, hiprtc's included


@pytest.mark.parametrize("mutation", [
    ("X(hipDeviceAttributeCanUseStreamWaitValue, kAttrCanUseStreamWaitValue, 10013)",
     "X(hipDeviceAttributeCanUseStreamWaitValue, kAttrCanUseStreamWaitValue, 10)",
     "kAttrCanUseStreamWaitValue"),
    ("using StreamWaitValue64 = Error(Stream, void*, uint64_t, unsigned int, uint64_t);",
     "using StreamWaitValue64 = Error(Stream, void*, uint32_t, unsigned int, uint32_t);",
     "hipStreamWaitValue64"),
    ("using Event = void*;      // hipEvent_t", "using Event = int;      // hipEvent_t", "hipEvent_t"),
    # hiprtc's: a prototype (from hiprtc.h) and an opaque type
    ("using RtcCompileProgram = RtcResult(RtcProgram, int, Strings);",
     "using RtcCompileProgram = RtcResult(RtcProgram, unsigned int, Strings);", "hiprtcCompileProgram"),
    ("using RtcProgram = void*; // hiprtcProgram", "using RtcProgram = long; // hiprtcProgram",
     "hiprtcProgram"),
    # a function the C++ headers overload (template <class T> hipMallocAsync(T**, ...) would take
    # int**): the C redeclaration still refuses it
    ("using MallocAsync = Error(void**, Size, Stream);", "using MallocAsync = Error(int**, Size, Stream);",
     "hipMallocAsync"),
    # a pointer-valued macro's value
    ("X(HIP_LAUNCH_PARAM_END, kLaunchParamEnd, 0x3)", "X(HIP_LAUNCH_PARAM_END, kLaunchParamEnd, 0x2)",
     "kLaunchParamEnd"),
])
def test_a_wrong_declaration_fails_the_compile(tmp_path, mutation):
    old, new, named = mutation
    text = (ROOT / "csrc" / "device" / "hip_api.h").read_text()
    assert old in text, "the mutation no longer applies: update the test"
    r, _ = _compile(tmp_path, text.replace(old, new))
    assert r.returncode != 0, "a wrong declaration compiled"
    assert named in r.stderr, r.stderr[-3000:]


_TYPES = {"hipError_t": "Error", "hipStream_t": "Stream", "hipEvent_t": "Event",
          "hipMemcpyKind": "MemcpyKind", "hipDeviceAttribute_t": "DeviceAttr",
          "hipStreamCaptureStatus": "CaptureStatus", "hipModule_t": "Module",
          "hipFunction_t": "Function", "hiprtcResult": "RtcResult", "hiprtcProgram": "RtcProgram",
          "unsigned": "unsigned int"}


def _spell(decl: str, has_name: bool) -> str:
    """'hipEvent_t * event' -> 'Event*', 'const char *const * options' -> 'const char* const*'
    (hetccl's spelling, hip_api_table.cc)."""
    t = decl.strip()
    if has_name:
        t = re.sub(r"\s*\b\w+$", "", t)  # drop the parameter name
    tokens = re.findall(r"\*|\w+", t)
    first = tokens.index("*") if "*" in tokens else len(tokens)
    base = " ".join(tokens[:first])
    out = _TYPES.get(base, base)
    for tok in tokens[first:]:  # '*', or a qualifier of the pointer before it
        out += "*" if tok == "*" else " " + tok
    return out


def _pxd_prototypes(text: str) -> dict[str, list[str]]:
    protos = {}
    for ret, name, params in re.findall(r"^cdef\s+([\w\s\*]+?)\s*\b(\w+)\(([^)]*)\)\s*(?:except|noexcept)",
                                        text, re.M):
        protos[name] = [_spell(ret, False)] + [_spell(p, True) for p in params.split(",") if p.strip()]
    return protos


_VALUES = r"""
import json, sys, enum
sys.path.insert(0, sys.argv[1])
from rocm.bindings import hip, hiprtc
names = json.loads(sys.argv[2])
out = {"version": [hip.HIP_VERSION_MAJOR, hip.HIP_VERSION_MINOR]}
for n in names:
    mod = hiprtc if n.lower().startswith("hiprtc") else hip
    enums = [v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    if hasattr(mod, n) and isinstance(getattr(mod, n), int):
        out[n] = int(getattr(mod, n))
        continue
    for e in enums:
        if n in e.__members__:
            out[n] = int(e.__members__[n].value)
            break
print(json.dumps(out))
"""


def test_declarations_match_current_rocm_bindings():
    """HIP's declarations against cyhip.pxd and the hip module's values, hiprtc's (named
    hiprtc* / HIPRTC_*, as ROCm names them) against cyhiprtc.pxd and the hiprtc module's."""
    import json

    pxd = BINDINGS / "rocm" / "bindings" / "cyhip.pxd"
    rtc_pxd = BINDINGS / "rocm" / "bindings" / "cyhiprtc.pxd"
    if not pxd.is_file() or not rtc_pxd.is_file():
        _missing(f"no ROCm bindings at {BINDINGS} (.ci/setup downloads rocm-bindings-hip)")
    consts, funcs = _C.runtime_api("hip")
    r = subprocess.run([sys.executable, "-c", _VALUES, str(BINDINGS), json.dumps(sorted(consts))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    values = json.loads(r.stdout)
    major, minor = values.pop("version")
    assert major >= 6, f"bindings of ROCm {major}.{minor} are not a current generation"
    wrong = {n: (v, values.get(n)) for n, v in consts.items() if values.get(n) != v}
    assert not wrong, f"constants differing from ROCm {major}.{minor} (ours, theirs): {wrong}"
    assert any(n.startswith("HIPRTC") for n in consts), "no hiprtc constant was compared"
    protos = _pxd_prototypes(pxd.read_text())
    rtc_protos = _pxd_prototypes(rtc_pxd.read_text())
    assert len(protos) > 300, "the prototype parser found too few functions in cyhip.pxd"
    assert len(rtc_protos) >= 10, "the prototype parser found too few functions in cyhiprtc.pxd"
    theirs = {n: (rtc_protos if n.startswith("hiprtc") else protos).get(n) for n in funcs}
    assert sum(n.startswith("hiprtc") for n in funcs) >= 8, "no hiprtc function was compared"
    bad = {n: (sig, theirs[n]) for n, sig in funcs.items() if theirs[n] != sig}
    assert not bad, f"prototypes differing from ROCm {major}.{minor} (ours, theirs): {bad}"


@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory):
    """tests/cpp/fake_hip.cc built against the HIP headers: a libamdhip64 stand-in that logs."""
    import ctypes

    inc = _include_dir()
    out = tmp_path_factory.mktemp("fakehip") / "libamdhip64.so"
    cxx = shutil.which("g++") or shutil.which("c++")
    flags = [] if inc == Path("/usr/include") else ["-isystem", str(inc)]
    r = subprocess.run([cxx, "-std=c++17", "-D__HIP_PLATFORM_AMD__", "-shared", "-fPIC", *flags,
                        str(ROOT / "tests" / "cpp" / "fake_hip.cc"), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lib = ctypes.CDLL(str(out))
    lib.fake_hip_log.restype = ctypes.c_char_p
    lib.fake_hip_reset.argtypes = [ctypes.c_int]
    return str(out), lib


def _log(lib) -> list[str]:
    return lib.fake_hip_log().decode().splitlines()


def test_hip_module_calls_what_hip_documents(fake_hip):
    """The HIP runtime module itself (csrc/device/hip_ops.cc), run over a HIP stand-in built from
    ROCm's headers: the attribute it queries, the flags, sizes and widths it passes."""
    import torch

    path, lib = fake_hip
    lib.fake_hip_reset(1)
    ops = _C.device_ops("hip", path)
    assert (ops.name, ops.memory_type) == ("hip", "rocm")
    assert ops.stream_mem_ops(3) is True
    assert _log(lib)[-1] == "hipDeviceGetAttribute 10013 3"  # CanUseStreamWaitValue, not 10
    lib.fake_hip_reset(0)
    assert ops.stream_mem_ops(0) is False
    # the words streams wait on: 8 bytes of signal memory, addressed by HIP's own pointer
    w = ops.wait_word_alloc()
    assert w and _log(lib)[-1] == "hipExtMallocWithFlags 8 flags=2"
    assert ops.wait_word_address(w) == w
    # 64-bit waits and writes on counters past 2^32 (no wrap: the counter does not)
    stream = 0x1234
    ops.write(stream, w, (1 << 32) + 5)
    ops.wait_geq(stream, w, (1 << 32) + 5)
    ops.wait_geq(stream, w, (1 << 32) + 6)
    ops.wait_geq(stream, w, 7)  # position 7 of an earlier epoch: reached (unsigned 64-bit)
    log = _log(lib)[-4:]
    assert log[0] == f"hipStreamWriteValue64 {w:#x} {(1 << 32) + 5}"
    full = "flags=0 mask=ffffffffffffffff"  # hipStreamWaitValueGte, every bit
    assert log[1:] == [f"hipStreamWaitValue64 {w:#x} {(1 << 32) + 5} {full} held=1",
                       f"hipStreamWaitValue64 {w:#x} {(1 << 32) + 6} {full} held=0",
                       f"hipStreamWaitValue64 {w:#x} 7 {full} held=1"]
    ops.wait_word_free(w)
    assert _log(lib)[-1] == "hipFree"
    # registration portable | mapped; events without timing; copies of kind hipMemcpyDefault
    buf = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    assert ops.host_register(buf.data_ptr(), 16) is True
    assert _log(lib)[-1] == "hipHostRegister 16 flags=3"
    assert ops.device_address(buf.data_ptr()) == buf.data_ptr()
    ev = ops.event_create()
    assert _log(lib)[-1] == "hipEventCreateWithFlags flags=2"
    ops.event_destroy(ev)
    ops.memcpy_async(dst.data_ptr(), buf.data_ptr(), 16, stream)
    assert _log(lib)[-1] == "hipMemcpyAsync 16 kind=4" and torch.equal(dst, buf)
    # a failing call names the call and HIP's error string
    with pytest.raises(_C.CommError, match=r"hipSetDevice failed: error 101 \(invalid device "
                                           r"ordinal \(fake\)\)"):
        ops.set_device(-1)


def test_hip_module_refuses_a_library_without_hip(tmp_path):
    with pytest.raises(_C.CommError, match="cannot open the device runtime"):
        _C.device_ops("hip", str(tmp_path / "libamdhip64.so"))
    libc = "libc.so.6"
    with pytest.raises(_C.CommError, match="libc.so.6 lacks hipSetDevice"):
        _C.device_ops("hip", libc)


def test_rocm_seam_opens_the_hip_module(fake_hip, monkeypatch):
    """On a ROCm build the "cuda" device type is served by RocmSeam, whose runtime is the HIP
    module over the libamdhip64 the process loaded (here the stand-in, as if torch had loaded
    it)."""
    import torch

    import hetccl.device as devices
    from hetccl.device import cuda as cuda_mod
    from hetccl.device.rocm import RocmSeam

    path, lib = fake_hip
    monkeypatch.setattr(torch.version, "hip", "7.15.0", raising=False)
    chosen = {t: next(c for c in cs if c.build_matches()) for t, cs in devices._CANDIDATES.items()}
    assert chosen["cuda"] is RocmSeam
    seen = []
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cuda_mod, "_loaded_library",
                        lambda stems: seen.append(stems) or path)
    ops = RocmSeam().runtime()
    assert seen == [("libamdhip64.so",)]
    assert (ops.name, ops.memory_type) == ("hip", RocmSeam.memory_type)

