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
    that module on a (simulated) ROCm build;
  * the device route's calls over the same stand-in and tests/cpp/fake_hiprtc.cc (hiprtc: its
    own library as in ROCm 7, built into libamdhip64 as before 7.0, or absent): the embedded
    kernel source compiled by hiprtc, the module loaded and every kernel looked up, one warm-up
    launch each (grid, block, argument block), non-blocking streams, stream-ordered memory, the
    launches of reduce / scale_div / scale_mul, and the failures that leave the route off.

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


def _build(sources: list[str], out: Path, *extra: str) -> subprocess.Popen:
    inc = _include_dir()
    cxx = shutil.which("g++") or shutil.which("c++")
    flags = [] if inc == Path("/usr/include") else ["-isystem", str(inc)]
    return subprocess.Popen([cxx, "-std=c++17", "-D__HIP_PLATFORM_AMD__", "-shared", "-fPIC", *flags, *extra,
                             *[str(ROOT / "tests" / "cpp" / s) for s in sources], "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    """The stand-ins, built against the HIP headers (in parallel), one folder per simulated ROCm:
    hip-only (libamdhip64 without hiprtc), rocm7 (libhiprtc.so beside it), rocm5 (hiprtc inside
    libamdhip64), no-alloc-async (a HIP runtime without hipMallocAsync / hipFreeAsync), and
    loaded-rtc/libhiprtc.so.7 (a hiprtc with that soname, for a process that loaded it first)."""
    base = tmp_path_factory.mktemp("fakehip")
    layout = {
        "hip-only/libamdhip64.so": (["fake_hip.cc"], ()),
        "rocm7/libamdhip64.so": (["fake_hip.cc"], ()),
        "rocm7/libhiprtc.so": (["fake_hiprtc.cc"], ()),
        "rocm5/libamdhip64.so": (["fake_hip.cc", "fake_hiprtc.cc"], ()),
        "no-alloc-async/libamdhip64.so": (["fake_hip.cc"], ("-DFAKE_HIP_NO_MALLOC_ASYNC",)),
        "loaded-rtc/libhiprtc.so.7": (["fake_hiprtc.cc"], ("-Wl,-soname,libhiprtc.so.7",)),
    }
    jobs = []
    for rel, (sources, extra) in layout.items():
        (base / rel).parent.mkdir(exist_ok=True)
        jobs.append(_build(sources, base / rel, *extra))
    for job in jobs:
        _, err = job.communicate()
        assert job.returncode == 0, err[-3000:]
    return base


def _open_fake(path: Path):
    import ctypes

    lib = ctypes.CDLL(str(path))
    for fn in ("fake_hip_log", "fake_hiprtc_log", "fake_hiprtc_source"):
        if hasattr(lib, fn):
            getattr(lib, fn).restype = ctypes.c_char_p
    if hasattr(lib, "fake_hip_reset"):
        lib.fake_hip_reset.argtypes = [ctypes.c_int]
    if hasattr(lib, "fake_hiprtc_fail"):
        lib.fake_hiprtc_fail.argtypes = [ctypes.c_char_p]
    return lib


@pytest.fixture(scope="module")
def fake_hip(fakes):
    """tests/cpp/fake_hip.cc alone: a libamdhip64 stand-in that logs (no hiprtc beside or in it)."""
    path = fakes / "hip-only" / "libamdhip64.so"
    return str(path), _open_fake(path)


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


# ---- the device route over the stand-ins (device_ops.h; hip_ops.cc states what ROCm documents)

KERNEL_SRC = ROOT / "csrc" / "device" / "kernels" / "reduce_kernels.cu"
_LAUNCH = re.compile(r"hipModuleLaunchKernel (\w+) grid=(\d+),(\d+),(\d+) block=(\d+),(\d+),(\d+) shared=(\d+) "
                     r"stream=(\S+) args=(\d+):(.*)$")


def _kernel_names() -> set[str]:
    """Every kernel reduce_kernels.cu defines (HETCCL_KERNELS(dtype, D) stamps six; the device
    programs' hetccl_program)."""
    dtypes = re.findall(r"^HETCCL_KERNELS\((\w+), \w+\)$", KERNEL_SRC.read_text(), re.M)
    assert len(dtypes) == 8, dtypes
    return {f"hetccl_{k}_{d}" for d in dtypes for k in ("div", "mul")} | \
           {f"hetccl_reduce_{d}_{op}" for d in dtypes for op in ("sum", "prod", "min", "max")} | {"hetccl_program"}


def _launches(log: list[str]) -> list[tuple]:
    """(kernel, grid, block, shared, stream, arg bytes, [argument words]) of each logged launch."""
    out = []
    for line in log:
        if line.startswith("hipModuleLaunchKernel"):
            m = _LAUNCH.match(line)
            assert m, line
            out.append((m[1], tuple(map(int, m.group(2, 3, 4))), tuple(map(int, m.group(5, 6, 7))), int(m[8]),
                        int(m[9], 16), int(m[10]), [int(w, 16) for w in m[11].split()]))
    return out


def _hex(p: int) -> str:
    return f"{p:#x}"  # as %p prints a non-null pointer


@pytest.mark.parametrize("rocm,device", [("rocm7", 21), ("rocm5", 22)])
def test_hip_device_route_prepares_kernels_with_hiprtc(fakes, rocm, device):
    """prepare_kernels: hiprtc compiles the embedded kernel source (no architecture option: hiprtc
    takes the current device's) from its own library (ROCm 7) or from libamdhip64 (before 7.0);
    the code object is loaded, every kernel looked up, and each launched once with n = 0 on a
    non-blocking stream of its own, synchronized and destroyed -- once per device and process."""
    hip = _open_fake(fakes / rocm / "libamdhip64.so")
    rtc = _open_fake(fakes / rocm / ("libhiprtc.so" if rocm == "rocm7" else "libamdhip64.so"))
    ops = _C.device_ops("hip", str(fakes / rocm / "libamdhip64.so"))
    assert ops.device_route() is True
    ops.set_device(device)
    assert ops.current_device() == device
    hip.fake_hip_reset(1)
    rtc.fake_hiprtc_reset()
    ops.prepare_kernels()

    # hiprtc: the source reduce_kernels_gen.h embeds (reduce_kernels.cu, test_device_kernels.py)
    assert rtc.fake_hiprtc_source().decode() == KERNEL_SRC.read_text()
    rlog = rtc.fake_hiprtc_log().decode().splitlines()
    nbytes = len(KERNEL_SRC.read_bytes())
    assert rlog[:2] == [f"hiprtcCreateProgram name=reduce_kernels.cu headers=0 bytes={nbytes}",
                        "hiprtcCompileProgram options=0"], rlog
    assert [line.split(" ")[0] for line in rlog[2:]] == \
        ["hiprtcGetCodeSize", "hiprtcGetCode", "hiprtcDestroyProgram"]

    log = _log(hip)
    names = _kernel_names()
    assert log[0] == f"hipDeviceGetAttribute 88 {device}"  # hipDeviceAttributeMemoryPoolsSupported
    assert log[1] == f"hipModuleLoadData {len(names)} kernels"  # hiprtc's code object
    looked_up = [line.split(" ")[1] for line in log if line.startswith("hipModuleGetFunction")]
    assert sorted(looked_up) == sorted(names)  # each once
    created = [line for line in log if line.startswith("hipStreamCreateWithFlags")]
    assert len(created) == 1 and created[0].startswith("hipStreamCreateWithFlags flags=1 -> ")  # NonBlocking
    stream = int(created[0].rsplit(" ", 1)[1], 16)
    launches = _launches(log)
    assert sorted(k for k, *_ in launches) == sorted(names)  # one warm-up launch each
    for kernel, grid, block, shared, s, nbytes, words in launches:
        if kernel == "hetccl_program":
            # (slot, bar, blocks): one block a group, on an aborted slot that ends at once
            assert (grid, block, shared, s) == ((2, 1, 1), (512, 1, 1), 0, stream), kernel
            assert nbytes == 24 and words[0] != 0 and words[1:] == [0, 1], words
            continue
        assert (grid, block, shared, s) == ((1, 1, 1), (256, 1, 1), 0, stream), kernel
        # the kernels' parameter lists (reduce_kernels.cu), n = 0; div by 1
        want = {"reduce": (24, [0, 0, 0]), "div": (24, [0, 0, 1]), "mul": (32, [0, 0, 0, 0])}[kernel.split("_")[1]]
        assert (nbytes, words) == want, kernel
    first = log.index(created[0])
    assert all(first < log.index(line) for line in log if line.startswith("hipModuleLaunchKernel"))
    last = max(i for i, line in enumerate(log) if line.startswith("hipModuleLaunchKernel"))
    assert f"hipStreamSynchronize {_hex(stream)}" in log[last:]  # every warm-up launch waited for
    assert log[-1] == f"hipStreamDestroy {_hex(stream)}", log[last:]

    # once per device and process: a second call, or another module instance, compiles nothing
    hip.fake_hip_reset(1)
    rtc.fake_hiprtc_reset()
    ops.prepare_kernels()
    _C.device_ops("hip", str(fakes / rocm / "libamdhip64.so")).prepare_kernels()
    assert _log(hip) == [] and rtc.fake_hiprtc_log() == b""


def test_hip_device_route_calls(fakes):
    """The route's calls after prepare_kernels: non-blocking streams, stream-ordered memory (never
    0 bytes, never a free of NULL), and the kernels' launches -- grid as cuda_ops.cc (256 threads,
    one block per 1024 elements, at most 4096), arguments as the kernels declare them."""
    import struct

    path = fakes / "rocm7" / "libamdhip64.so"
    hip = _open_fake(path)
    ops = _C.device_ops("hip", str(path))
    ops.set_device(21)
    ops.prepare_kernels()  # done by the test above, or now
    hip.fake_hip_reset(1)

    s = ops.stream_create()
    assert _log(hip) == [f"hipStreamCreateWithFlags flags=1 -> {_hex(s)}"]
    p = ops.mem_alloc_async(1 << 20, s)
    q = ops.mem_alloc_async(0, s)
    assert _log(hip)[-2:] == [f"hipMallocAsync {1 << 20} stream={_hex(s)} -> {_hex(p)}",
                              f"hipMallocAsync 1 stream={_hex(s)} -> {_hex(q)}"]

    hip.fake_hip_reset(1)
    ops.reduce(p, q, 1 << 18, "float32", "sum", s)
    ops.reduce(p, q, 1 << 18, "bfloat16", "avg", s)  # AVG reduces as SUM
    ops.reduce(p, q, 10 ** 8, "int64", "max", s)     # at most 4096 blocks
    ops.reduce(p, q, 1, "uint8", "prod", s)
    ops.reduce(p, q, 0, "float32", "sum", s)         # nothing to do: no launch
    ops.scale_div(p, 1000, "int32", 3, s)
    ops.scale_div(p, 1000, "int32", 1, s)            # dividing by 1: no launch
    ops.scale_mul(p, 5000, "float32", 0, struct.pack("<f", 2.5), s)   # the scalar's bits, now
    ops.scale_mul(p, 5000, "float16", q, b"", s)                       # read by the stream
    expect = [("hetccl_reduce_float32_sum", 256, 24, [p, q, 1 << 18]),
              ("hetccl_reduce_bfloat16_sum", 256, 24, [p, q, 1 << 18]),
              ("hetccl_reduce_int64_max", 4096, 24, [p, q, 10 ** 8]),
              ("hetccl_reduce_uint8_prod", 1, 24, [p, q, 1]),
              ("hetccl_div_int32", 1, 24, [p, 1000, 3]),
              ("hetccl_mul_float32", 5, 32, [p, 5000, 0, struct.unpack("<I", struct.pack("<f", 2.5))[0]]),
              ("hetccl_mul_float16", 5, 32, [p, 5000, q, 0])]
    got = _launches(_log(hip))
    assert [(k, g[0], n, w) for k, g, b, sh, st, n, w in got] == expect
    assert all(g[1:] == (1, 1) and b == (256, 1, 1) and sh == 0 and st == s for k, g, b, sh, st, n, w in got)

    hip.fake_hip_reset(1)
    ops.mem_free_async(p, s)
    ops.mem_free_async(q, s)
    ops.mem_free_async(0, s)  # not passed on: hipFreeAsync(NULL) is an error before ROCm 7.0
    ops.stream_destroy(s)
    assert _log(hip) == [f"hipFreeAsync {_hex(p)} stream={_hex(s)}", f"hipFreeAsync {_hex(q)} stream={_hex(s)}",
                         f"hipStreamDestroy {_hex(s)}"]

    ops.set_device(99)  # a device whose kernels were never prepared
    with pytest.raises(_C.CommError, match="not loaded on HIP device 99"):
        ops.reduce(p, q, 10, "float32", "sum", 0)


def test_hip_device_route_refusals(fakes):
    """What leaves the route off (the C API then stages through host memory): a compile error
    (CommError with hiprtc's log, the program destroyed, nothing cached), a device without memory
    pools, a HIP runtime without stream-ordered allocation."""
    path = fakes / "rocm7" / "libamdhip64.so"
    hip = _open_fake(path)
    rtc = _open_fake(fakes / "rocm7" / "libhiprtc.so")
    ops = _C.device_ops("hip", str(path))
    ops.set_device(23)
    hip.fake_hip_reset(1)
    rtc.fake_hiprtc_reset()
    rtc.fake_hiprtc_fail(b"reduce_kernels.cu:42:7: error: use of undeclared identifier '__fake'")
    try:
        with pytest.raises(_C.CommError, match=r"(?s)hiprtc could not compile hetccl's reduction kernels "
                                               r"\(reduce_kernels.cu\) for HIP device 23: hiprtc error 6 .*"
                                               r"reduce_kernels.cu:42:7: error: use of undeclared identifier"):
            ops.prepare_kernels()
    finally:
        rtc.fake_hiprtc_fail(None)
    assert rtc.fake_hiprtc_log().decode().splitlines()[-1] == "hiprtcDestroyProgram"
    assert not any(line.startswith("hipModuleLoadData") for line in _log(hip))
    ops.prepare_kernels()  # the failure cached nothing: compiled now
    assert any(line.startswith("hipModuleLoadData") for line in _log(hip))

    hip.fake_hip_set_pools(0)
    try:
        ops.set_device(24)
        rtc.fake_hiprtc_reset()
        with pytest.raises(_C.CommError, match="HIP device 24 has no stream-ordered memory pools"):
            ops.prepare_kernels()
        assert rtc.fake_hiprtc_log() == b""  # refused before compiling
    finally:
        hip.fake_hip_set_pools(1)

    old = _C.device_ops("hip", str(fakes / "no-alloc-async" / "libamdhip64.so"))
    assert old.device_route() is False  # the module still opens: the rest of it works
    with pytest.raises(_C.CommError, match="has no device route"):
        old.prepare_kernels()


def test_hip_device_route_without_hiprtc(fake_hip):
    """A ROCm without hiprtc (none loaded, none beside libamdhip64 or in it, none on the loader's
    path): the module opens and answers device_route() from HIP's calls; prepare_kernels throws
    CommError naming hiprtc (the C API catches it and stays staged)."""
    import ctypes.util

    if ctypes.util.find_library("hiprtc"):
        pytest.skip("this machine has a hiprtc on the loader's path")
    path, lib = fake_hip
    ops = _C.device_ops("hip", path)
    assert ops.device_route() is True
    ops.set_device(25)
    with pytest.raises(_C.CommError, match=r"HIP's runtime compiler \(hiprtc\).* was not found"):
        ops.prepare_kernels()


_LOADED_RTC = r"""
import ctypes, sys
rtc = ctypes.CDLL(sys.argv[1])  # as the framework would have loaded it (soname libhiprtc.so.7)
rtc.fake_hiprtc_log.restype = ctypes.c_char_p
from hetccl._core import _C
ops = _C.device_ops("hip", sys.argv[2])  # nothing beside it, nothing in it
ops.set_device(5)
ops.prepare_kernels()
print(rtc.fake_hiprtc_log().decode())
"""


def test_hip_device_route_uses_the_loaded_hiprtc(fakes):
    """A hiprtc the process already loaded (found by soname, RTLD_NOLOAD) is the one used."""
    r = subprocess.run([sys.executable, "-c", _LOADED_RTC, str(fakes / "loaded-rtc" / "libhiprtc.so.7"),
                        str(fakes / "hip-only" / "libamdhip64.so")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hiprtcCompileProgram options=0" in r.stdout, r.stdout
