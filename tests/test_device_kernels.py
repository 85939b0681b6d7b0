"""hetccl's device kernels (csrc/device/kernels/reduce_kernels.cu), without a GPU:

  * the generated header embeds the source as it is, and (where this machine's nvcc is the one
    that made it) the PTX nvcc makes of it now (gen_kernels.py --check);
  * ptxas accepts the embedded PTX (ISA 6.4) for the oldest and a current architecture;
  * the PTX has every kernel the CUDA module asks for (csrc/device/cuda_ops.cc);
  * the device-program kernel (hetccl_program, csrc/device/program.h) compiled for the host,
    each group's block on a host thread: a program of every instruction against numpy, the
    slot's words after it, and an aborted slot ending at once;
  * the kernels' arithmetic is reduce.cc's, bit for bit: the source compiled for the host (a
    prelude stands in for the CUDA built-ins; one thread walks the grid-stride loop) against
    hetccl._C.reduce_into / scale_div and numpy on random data with NaN, infinities,
    subnormals and overflow, for every dtype and op. The GPU box runs the real kernels through
    the C API (tests/test_gpu_capi.py)."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import compiler
from hetccl import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "csrc", "device", "kernels")
SRC = os.path.join(KDIR, "reduce_kernels.cu")
GEN = os.path.join(KDIR, "reduce_kernels_gen.h")
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max"]
NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
      "int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int64": np.int64}


def _embedded(which: str) -> str:
    text = open(GEN).read()
    delim = {"ptx": "HETCCL_PTX", "source": "HETCCL_SRC"}[which]
    return re.search(r'R"' + delim + r"\((.*?)\)" + delim + '"', text, re.S).group(1)


def test_header_embeds_the_source():
    assert _embedded("source") == open(SRC).read(), \
        "reduce_kernels_gen.h is stale: run python3 csrc/device/kernels/gen_kernels.py"


def test_header_is_what_nvcc_makes_now():
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc on this machine (the header was made with the one its PTX names)")
    made_with = re.search(r"Cuda compilation tools, release [\d.]+, V[\d.]+", _embedded("ptx")).group(0)
    here = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    if made_with not in here:
        pytest.skip(f"this nvcc is not the one that made the header ({made_with}): its PTX may differ")
    out = subprocess.run(["python3", os.path.join(KDIR, "gen_kernels.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_ptxas_accepts_the_ptx(tmp_path, arch):
    ptxas = shutil.which("ptxas")
    if not ptxas:
        pytest.skip("no ptxas on this machine")
    p = tmp_path / "k.ptx"
    p.write_text(_embedded("ptx"))
    assert ".version 6.4" in p.read_text()
    out = subprocess.run([ptxas, f"-arch={arch}", str(p), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_kernel_the_module_loads_is_in_the_ptx():
    entries = set(re.findall(r"\.entry\s+(\w+)\(", _embedded("ptx")))
    want = {f"hetccl_reduce_{d}_{o}" for d in DTYPES for o in OPS}
    want |= {f"hetccl_div_{d}" for d in DTYPES} | {f"hetccl_mul_{d}" for d in DTYPES} | {"hetccl_program"}
    assert want <= entries, sorted(want - entries)
    cuda = open(os.path.join(ROOT, "csrc", "device", "cuda_ops.cc")).read()
    for pattern in ('"hetccl_reduce_" + dn + "_" + ops[o]', '"hetccl_div_" + dn', '"hetccl_mul_" + dn',
                    'fn("hetccl_program")'):
        assert pattern in cuda, pattern


PRELUDE = r"""
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
struct HetcclDim { unsigned x; };
static thread_local HetcclDim blockIdx = {0};
static HetcclDim threadIdx = {0}, blockDim = {1}, gridDim = {1};
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline void __syncthreads() {}
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
"""
# after the source: one block of the program kernel on the calling host thread
POSTLUDE = r"""
extern "C" void hetccl_test_program_block(u64* slot, u32* bar, unsigned block, unsigned blocks) {
  blockIdx.x = block;
  hetccl_program(slot, bar, blocks);
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    cxx = compiler("c++", "the kernels for the host")
    d = tmp_path_factory.mktemp("kernels")
    src = d / "k.cc"
    src.write_text(PRELUDE + open(SRC).read() + POSTLUDE)
    lib = d / "k.so"
    out = subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", str(src), "-o", str(lib)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def _data(dt: str, n: int, seed: int, special: bool) -> np.ndarray:
    g = np.random.default_rng(seed)
    if dt in ("int8", "uint8", "int32", "int64"):
        info = np.iinfo(NP[dt])
        return g.integers(info.min, info.max, n, dtype=NP[dt], endpoint=True)
    if dt == "bfloat16":
        bits = g.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)  # every bit pattern
        return bits
    x = g.uniform(-3, 3, n) * 10.0 ** g.integers(-8 if dt != "float16" else -7, 6, n)
    if special and n >= 8:
        x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 6e-8, 3e-5]
    with np.errstate(over="ignore"):
        a = x.astype(NP[dt])
    if dt == "float16" and n >= 40:
        a.view(np.uint16)[8:40] = g.integers(0, 1 << 16, 32).astype(np.uint16)  # subnormals, NaN payloads
    return a


def _c_ptr(a: np.ndarray):
    return ctypes.c_void_p(a.ctypes.data)


@pytest.mark.parametrize("dt", DTYPES)
def test_kernels_equal_the_host_kernels(host_kernels, dt):
    n = 4099
    for op in OPS + ["avg"]:
        a, b = _data(dt, n, 1, True), _data(dt, n, 2, False)
        if op == "avg":
            continue  # AVG reduces as SUM (reduce.h); its division is checked below
        want = a.copy()
        _core._C.reduce_into(op, dt, want.ctypes.data, b.ctypes.data, n)
        got = a.copy()
        getattr(host_kernels, f"hetccl_reduce_{dt}_{op}")(_c_ptr(got), _c_ptr(b), ctypes.c_uint64(n))
        diff = np.flatnonzero(got.view(f"u{got.itemsize}") != want.view(f"u{want.itemsize}"))
        if dt in ("float32", "float64", "float16"):  # a NaN may differ in payload only
            nan_both = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
            diff = np.array([i for i in diff if not nan_both[i]])
        assert diff.size == 0, (op, int(diff[0]), got[diff[0]], want[diff[0]], a[diff[0]], b[diff[0]])
    # AVG's last step: p /= n
    for by in (3, 7):
        a = _data(dt, n, 3, True)
        want = a.copy()
        _core._C.scale_div(dt, want.ctypes.data, n, by)
        got = a.copy()
        getattr(host_kernels, f"hetccl_div_{dt}")(_c_ptr(got), ctypes.c_uint64(n), ctypes.c_int64(by))
        ok = (got.view(f"u{got.itemsize}") == want.view(f"u{want.itemsize}"))
        if dt in ("float32", "float64", "float16"):
            ok |= np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
        assert ok.all(), (by, np.flatnonzero(~ok)[:3])


@pytest.mark.parametrize("dt", DTYPES)
def test_premul_kernel_is_a_product(host_kernels, dt):
    """hetccl_mul_<dt>: p[i] *= scalar, read from device memory (sp) or from the bits passed
    by value (imm), equal to reduce_into(prod) with a constant array."""
    n = 1031
    a = _data(dt, n, 4, False)
    sc = _data(dt, 1, 5, False)
    want, const = a.copy(), np.repeat(sc, n)
    _core._C.reduce_into("prod", dt, want.ctypes.data, const.ctypes.data, n)
    got_ptr, got_imm = a.copy(), a.copy()
    imm = int.from_bytes(sc.tobytes().ljust(8, b"\0"), "little")
    fn = getattr(host_kernels, f"hetccl_mul_{dt}")
    fn(_c_ptr(got_ptr), ctypes.c_uint64(n), _c_ptr(sc), ctypes.c_uint64(0))
    fn(_c_ptr(got_imm), ctypes.c_uint64(n), ctypes.c_void_p(0), ctypes.c_uint64(imm))
    for got in (got_ptr, got_imm):
        ok = got.view(f"u{got.itemsize}") == want.view(f"u{want.itemsize}")
        if dt in ("float32", "float64", "float16"):
            ok |= np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
        assert ok.all(), np.flatnonzero(~ok)[:3]


# device programs (csrc/device/program.h): the slot's layout in words
HDR, RING, ROPS = 64, 256, {"END": 0, "WAIT": 1, "WRITE": 2, "COPY": 3, "REDUCE": 4, "DIV": 5, "MUL": 6,
                           "SIGNAL": 7, "AWAIT": 8}


def _slot():
    return np.zeros(HDR + 2 * RING * 8, dtype=np.uint64)


def _put(slot, group, prog):
    for k, (op, *args) in enumerate(prog):
        w = HDR + (group * RING + k) * 8
        slot[w] = ROPS[op]
        slot[w + 1:w + 1 + len(args)] = args
    slot[8 + group] = len(prog)


def _run_program(host_kernels, slot, blocks=1, publish_late=None, null_bar=False):
    """Each block of the grid (groups x blocks) on a host thread of its own, one thread a
    block: the group barriers meet across the threads. publish_late=(group, first): only the
    group's first instructions are published at the start, the rest 0.2 s later (the blocks
    wait for them: block 0 on the slot, the others on its copy in `bar`). null_bar: `bar` is a
    null pointer (one block a group only), as prepare_kernels' warm-up launch passes it."""
    import threading
    import time
    bar = np.zeros(64, np.uint32)
    slot[6] = blocks
    late = None
    if publish_late:
        g, first = publish_late
        full = int(slot[8 + g])
        slot[8 + g] = first

        def publish():
            time.sleep(0.2)
            slot[8 + g] = full
        late = threading.Thread(target=publish)
        late.start()
    ts = [threading.Thread(target=host_kernels.hetccl_test_program_block,
                           args=(ctypes.c_void_p(slot.ctypes.data),
                                 ctypes.c_void_p(None if null_bar else bar.ctypes.data),
                                 ctypes.c_uint(k), ctypes.c_uint(blocks)))
          for k in reversed(range(2 * blocks))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if late:
        late.join()
    assert not any(t.is_alive() for t in ts), "the program did not end"
    # the barriers' counts and block 0's copies of len are left as found
    assert not bar[0] and not bar[32] and not bar[8:10].any() and not bar[40:42].any(), bar
    return bar


@pytest.mark.parametrize("blocks,late", [(1, False), (3, False), (3, True)])
def test_program_kernel_runs_every_instruction(host_kernels, blocks, late):
    """hetccl_program, one thread per block on the host: group 0 copies (aligned, then at an odd
    offset), reduces, divides and multiplies (host scalar bits and a scalar in memory), writes a
    32-bit word and signals; group 1 waits for the signal and the word, copies the result and
    reduces int8 MAX; both end and the kernel writes fin and ended, taken counts every read.
    With 3 blocks a group, the data instructions are spread over the blocks and their barriers
    run after each, waits polled by block 0 alone. late: group 0's program is published in
    two steps (its first 3 instructions, then the rest), so the other blocks read block 0's
    copy of the length more than once."""
    n = 1000
    g = np.random.default_rng(7)
    b, c = g.standard_normal(n).astype(np.float32), g.standard_normal(n).astype(np.float32)
    a, d = np.zeros(n, np.float32), np.zeros(n, np.float32)
    raw_src, raw_dst = g.integers(0, 255, 301, dtype=np.uint8), np.zeros(301, np.uint8)
    x8, y8 = g.integers(-128, 127, 77, dtype=np.int8), g.integers(-128, 127, 77, dtype=np.int8)
    words = np.zeros(4, np.uint64)
    scalar = np.array([0.5], np.float32)
    three = int(np.array([3.0], np.float32).view(np.uint32)[0])
    p = lambda arr, off=0: arr.ctypes.data + off  # noqa: E731
    slot = _slot()
    slot[0], slot[2], slot[3], slot[5] = 9, p(words, 8), 99, 0  # seq, fin_addr, fin_value, 32-bit words
    _put(slot, 0, [("COPY", p(a), p(b), 4 * n), ("COPY", p(raw_dst, 3), p(raw_src, 5), 290),
                   ("REDUCE", p(a), p(c), n, 0, 0), ("DIV", p(a), n, 0, 2), ("MUL", p(a), n, 0, 0, three),
                   ("MUL", p(a), n, 0, p(scalar), 0), ("WRITE", p(words), 7), ("SIGNAL", 3, 5), ("END",)])
    _put(slot, 1, [("AWAIT", 3, 5), ("WAIT", p(words), 7), ("COPY", p(d), p(a), 4 * n),
                   ("REDUCE", p(x8), p(y8), 77, 4, 3), ("END",)])
    x8_want = np.maximum(x8, y8)
    bar = _run_program(host_kernels, slot, blocks, publish_late=(0, 3) if late else None)
    want = (b + c) / np.float32(2) * np.float32(3) * np.float32(0.5)
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(d, want)
    np.testing.assert_array_equal(raw_dst[3:293], raw_src[5:295])
    assert not raw_dst[:3].any() and not raw_dst[293:].any()
    np.testing.assert_array_equal(x8, x8_want)
    assert words[0] == 7 and words[1] == 99, words  # the WRITE, then fin (32 bits, low half)
    assert slot[4] == 9 and list(slot[12:16]) == [9, 9, 9, 9], slot[:16]  # ended, gend, left
    # taken, per block: every instruction was read
    assert list(slot[32:32 + blocks]) == [9] * blocks and list(slot[48:48 + blocks]) == [5] * blocks, slot[32:64]
    assert slot[16 + 3] == 5
    if blocks > 1:  # group 0 met 9 times (6 data instructions, the write, the signal, the end),
        # group 1 5 times (2 waits, 2 data instructions, the end)
        assert bar[16] == 9 and bar[48] == 5, bar


def test_program_kernel_aborted_ends_at_once(host_kernels):
    """An aborted slot: a wait that would never pass passes, a group with nothing published
    ends, and the kernel still writes fin (64-bit words) and ended."""
    words = np.zeros(2, np.uint64)
    slot = _slot()
    slot[0], slot[1], slot[2], slot[3], slot[5] = 4, 1, words.ctypes.data + 8, 1 << 40, 1
    _put(slot, 0, [("WAIT", words.ctypes.data, 1 << 50)])  # never written; no END published
    _run_program(host_kernels, slot)
    assert words[1] == 1 << 40 and slot[4] == 4 and list(slot[14:16]) == [4, 4]


def test_program_kernel_warm_up_launch_touches_no_barrier_memory(host_kernels):
    """prepare_kernels (cuda_ops.cc, hip_ops.cc) launches the program kernel once on an aborted,
    empty slot with one block a group and a null `bar`: the kernel must end, write fin and never
    touch `bar` (a write through it is an illegal address on the GPU: every later call of the
    process fails with it; on the host a segfault)."""
    words = np.zeros(2, np.uint64)
    slot = _slot()
    slot[0], slot[1], slot[2], slot[3] = 6, 1, words.ctypes.data, 77
    _run_program(host_kernels, slot, null_bar=True)
    assert words[0] == 77 and slot[4] == 6 and list(slot[12:16]) == [6, 6, 6, 6], slot[:16]
