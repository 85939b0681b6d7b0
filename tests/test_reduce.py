"""Host reductions (hetccl._C.reduce_into / scale_div) for every op x dtype x size against
references computed independently with torch.

Exactness: each output element is ONE operation on two representable inputs. For floats the
reference computes it exactly in float64 (sums and products of float32/float16/bfloat16 inputs of
the magnitudes drawn here are exact in float64) and rounds once to the dtype; the kernel must
return exactly that (float16/bfloat16 are computed in float32, where the exact result of these
inputs also fits, then rounded to nearest even once). So the comparison is bit-exact, NaNs
included. Integers wrap around on overflow like torch; the reference is torch's own integer
arithmetic on full-range random values.
"""
from __future__ import annotations

import re

import pytest
import torch

from hetccl import _core
from hetccl._core import _C

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8,
    "int32": torch.int32, "int64": torch.int64,
}
OPS = ["sum", "prod", "min", "max"]
SIZES = [0, 1, 1001, 3_000_003]  # the last one takes the multi-threaded path (> 1 MiB)


def _rand(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 4
        x = x.to(dtype)
        if n > 10:  # a few NaNs and infinities, and signed zeros
            x[3] = float("nan")
            x[7] = float("inf")
            x[8] = -0.0
        return x
    info = torch.iinfo(dtype)
    hi = info.max if dtype == torch.int64 else info.max + 1  # randint excludes hi
    return torch.randint(info.min, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reference(op, a, b):
    if a.dtype.is_floating_point:
        a64, b64 = a.double(), b.double()
        r = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum,
             "max": torch.maximum}[op](a64, b64)
        return r.to(a.dtype)
    return {"sum": torch.add, "prod": torch.mul, "min": torch.minimum,
            "max": torch.maximum}[op](a, b)  # wraps around like the kernel must


def _same(x, y):
    if x.dtype.is_floating_point:
        both_nan = torch.isnan(x) & torch.isnan(y)
        eq = (x == y) | both_nan
        return bool(eq.all())
    return torch.equal(x, y)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_reduce_into(op, dtype, n):
    t = DTYPES[dtype]
    a, b = _rand(t, n, 1), _rand(t, n, 2)
    ref = _reference(op, a, b)
    dst = a.clone()
    _C.reduce_into(op, dtype, dst.data_ptr(), b.data_ptr(), n)
    assert _same(b, _rand(t, n, 2)), "source modified"
    if not _same(dst, ref):
        bad = (dst != ref).nonzero()[:5].flatten().tolist()
        pytest.fail(f"{op} {dtype} n={n}: first mismatches at {bad}: "
                    f"a={a[bad].tolist()} b={b[bad].tolist()} got={dst[bad].tolist()} "
                    f"want={ref[bad].tolist()}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    n = 3_000_003
    a, b = _rand(torch.float32, n, 3), _rand(torch.float32, n, 4)
    dst = a.clone()
    _C.reduce_into("sum", "float32", dst.data_ptr(), b.data_ptr(), n, threads)
    assert _same(dst, _reference("sum", a, b))


def test_in_place_alias():
    x = torch.arange(-50, 50, dtype=torch.int32)
    _C.reduce_into("sum", "int32", x.data_ptr(), x.data_ptr(), x.numel())
    assert torch.equal(x, torch.arange(-50, 50, dtype=torch.int32) * 2)


def test_float_min_max_propagate_nan_both_sides():
    nan = float("nan")
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        t = DTYPES[dtype]
        for op in ("min", "max"):
            a = torch.tensor([nan, 1.0, nan, 2.0], dtype=t)
            b = torch.tensor([1.0, nan, nan, 3.0], dtype=t)
            _C.reduce_into(op, dtype, a.data_ptr(), b.data_ptr(), 4)
            assert torch.isnan(a[:3]).all() and a[3] == (2.0 if op == "min" else 3.0), (op, dtype, a)


def test_half_rounding_is_nearest_even():
    # 2048 + 1 is halfway between float16 2048 and 2050: ties to even -> 2048; 2050 + 1 -> 2052.
    a = torch.tensor([2048.0, 2050.0], dtype=torch.float16)
    b = torch.tensor([1.0, 1.0], dtype=torch.float16)
    _C.reduce_into("sum", "float16", a.data_ptr(), b.data_ptr(), 2)
    assert a.tolist() == [2048.0, 2052.0]
    # bfloat16: 256 + 1 is halfway between 256 and 258 -> 256; 258 + 1 -> 260.
    a = torch.tensor([256.0, 258.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    _C.reduce_into("sum", "bfloat16", a.data_ptr(), b.data_ptr(), 2)
    assert a.tolist() == [256.0, 260.0]


@pytest.mark.parametrize("n", [0, 1, 1001, 3_000_003])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scale_div(dtype, n):
    t = DTYPES[dtype]
    x = _rand(t, n, 5)
    for div in (3, 7):
        y = x.clone()
        _C.scale_div(dtype, y.data_ptr(), n, div)
        if t.is_floating_point:
            # computed as one float32 (float64 for float64) division, rounded once to the dtype
            work = torch.float64 if t == torch.float64 else torch.float32
            ref = (x.to(work) / div).to(t)
        else:
            ref = torch.div(x.to(torch.int64), div, rounding_mode="trunc").to(t)  # as torch
        assert _same(y, ref), (dtype, n, div)


def test_avg_is_sum_then_scale_div():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([3.0, 4.0, 6.0])
    _C.reduce_into("avg", "float32", a.data_ptr(), b.data_ptr(), 3)
    _C.scale_div("float32", a.data_ptr(), 3, 2)
    assert a.tolist() == [2.0, 3.0, 4.5]


def _known(err) -> list[str]:
    """The names a parse error lists ("... (known: a, b, c)")."""
    m = re.search(r"\(known: ([^)]*)\)", str(err.value))
    assert m, str(err.value)
    return m.group(1).split(", ")


def test_bad_names_are_named():
    """An unknown op or dtype is named, with every name the core knows: the ops in the C API's
    order, the dtypes exactly this file's and the torch face's (_core.HOST_REDUCE_DTYPES)."""
    x = torch.zeros(4)
    with pytest.raises(_C.CommError, match="median") as err:
        _C.reduce_into("median", "float32", x.data_ptr(), x.data_ptr(), 4)
    assert _known(err) == ["sum", "prod", "min", "max", "avg"]
    with pytest.raises(_C.CommError, match="complex64") as err:
        _C.reduce_into("sum", "complex64", x.data_ptr(), x.data_ptr(), 4)
    assert sorted(_known(err)) == sorted(DTYPES)
    assert set(_known(err)) == _core.HOST_REDUCE_DTYPES
    with pytest.raises(_C.CommError, match="complex64"):
        _C.scale_div("complex64", x.data_ptr(), 4, 2)
    with pytest.raises(_C.CommError, match="zero"):
        _C.scale_div("float32", x.data_ptr(), 4, 0)
