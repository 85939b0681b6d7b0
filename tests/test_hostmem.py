"""hetccl's own host buffers never follow torch.set_default_device() (hetccl/hostmem.py).

Under `torch.set_default_device("cuda")` a torch factory call without `device=` returns GPU
memory; a transport that writes through that pointer from the host crashes the process (the
point-to-point path did, on the GPU box). Two checks:
  * every factory call in the library names its device (or takes it from a tensor: *_like);
  * on CPU, a default device that is not the CPU ("meta": no storage at all, so any buffer the
    library makes from it fails at once) leaves every collective family working.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

from hetccl.launch import spawn

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
             "empty_strided", "linspace", "eye"}
# library code where host buffers are made: the package and the framework adapters. The
# benchmarks, the demo and the doctor are programs of their own (they set their devices).
LIBRARY = [p for p in sorted((ROOT / "hetccl").rglob("*.py")) + sorted((ROOT / "integrations").rglob("*.py"))
           if not any(part in ("bench",) for part in p.parts)
           and p.name not in ("demo.py", "doctor.py", "hostmem.py")]


def _violations(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{f.attr}(...) without device=")
    return bad


def test_every_library_factory_call_names_its_device():
    assert LIBRARY, "no library files found"
    bad = [v for p in LIBRARY for v in _violations(p)]
    assert not bad, "use hetccl.hostmem (or device=) for:\n" + "\n".join(bad)


def test_the_scan_finds_a_factory_call_without_device(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch\nx = torch.empty(3)\ny = torch.zeros(2, device='cpu')\n")
    # paths are reported relative to the repository root
    p2 = ROOT / "tests" / "_hostmem_probe_tmp.py"
    p2.write_text(p.read_text())
    try:
        got = _violations(p2)
    finally:
        p2.unlink()
    assert len(got) == 1 and ":2: torch.empty" in got[0], got


def _rank_with_meta_default(ctx):
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import hetccl  # noqa: F401

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    cpu = torch.device("cpu")
    torch.set_default_device("meta")  # any buffer hetccl makes without naming a device fails
    try:
        r, w = ctx.rank, ctx.world_size
        out = {}
        x = torch.full((1000,), float(r + 1), device=cpu)
        dist.all_reduce(x)
        out["all_reduce"] = bool((x == sum(range(1, w + 1))).all())
        y = torch.full((5,), float(r), device=cpu)
        if r == 0:
            dist.send(y, 1)
            z = torch.empty(5, device=cpu)
            dist.recv(z, 1)
            out["p2p"] = bool((z == 1.0).all())
        elif r == 1:
            z = torch.empty(5, device=cpu)
            dist.recv(z, 0)
            dist.send(y, 0)
            out["p2p"] = bool((z == 0.0).all())
        else:
            out["p2p"] = True
        a = torch.arange(w * 2, dtype=torch.float32, device=cpu) + 10 * r
        b = torch.empty(w * 2, device=cpu)
        dist.all_to_all_single(b, a, [2] * w, [2] * w)
        out["all_to_all"] = bool(torch.equal(b, torch.cat(
            [torch.arange(2 * r, 2 * r + 2, dtype=torch.float32, device=cpu) + 10 * s
             for s in range(w)])))
        dist.barrier()
        g = torch.empty(w * 3, device=cpu)
        dist.all_gather_into_tensor(g, torch.full((3,), float(r), device=cpu))
        out["all_gather"] = bool(torch.equal(g, torch.arange(w, dtype=torch.float32, device=cpu)
                                             .repeat_interleave(3)))
        return out
    finally:
        torch.set_default_device(None)
        dist.destroy_process_group()


@pytest.mark.parametrize("vendors", ["1+1", "2+1"])
def test_collectives_ignore_the_default_device(vendors):
    world = sum(int(v) for v in vendors.split("+"))
    for r, out in enumerate(spawn(_rank_with_meta_default, world, vendors=vendors, timeout=120)):
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, f"rank {r}: wrong under set_default_device('meta'): {bad}"
