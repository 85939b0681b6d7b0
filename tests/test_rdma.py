"""RDMA readiness in `hetccl doctor` (hetccl/rdma.py): no pyverbs, no device, a kernel without RDMA
(ENOSYS), a listing through a fake pyverbs module, GPU memory registration, and the per-vendor
UCX build check."""
from __future__ import annotations

import errno
import sys
import types

import pytest

from hetccl import rdma


class _FakeError(Exception):
    def __init__(self, msg, code):
        super().__init__(msg)
        self.error_code = code


class _Gid:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def _fake_pyverbs(devices=None, list_error=None):
    """A stand-in for pyverbs.device: `devices` maps a name to its ports, each a dict with
    state, link_layer and gids {index: (gid text, gid type)}; missing indices raise like sparse
    GID tables do."""
    m = types.ModuleType("pyverbs.device")

    class Device:
        def __init__(self, name):
            self.name = name.encode()

    class Context:
        def __init__(self, name):
            self.ports = devices[name]
            self.closed = False

        def query_device(self):
            return types.SimpleNamespace(fw_version="28.39.1002", phys_port_cnt=len(self.ports))

        def query_port(self, port):
            p = self.ports[port - 1]
            return types.SimpleNamespace(state=p["state"], link_layer=p["link_layer"],
                                         gid_tbl_len=16)

        def query_gid(self, port, idx):
            gids = self.ports[port - 1]["gids"]
            if idx not in gids:
                raise _FakeError("Failed to query gid", -1)
            return _Gid(gids[idx][0])

        def query_gid_type(self, port, idx):
            return self.ports[port - 1]["gids"][idx][1]

        def close(self):
            self.closed = True

    def get_device_list():
        if list_error is not None:
            raise list_error
        return [Device(n) for n in (devices or {})]

    m.Context, m.get_device_list = Context, get_device_list
    return m


def test_no_pyverbs_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    lines = rdma.rdma_lines()
    assert len(lines) == 1
    assert "pyverbs not importable" in lines[0] and "python3-pyverbs" in lines[0], lines


def test_kernel_without_rdma_names_enosys():
    err = _FakeError("Failed to get devices list", errno.ENOSYS)
    lines = rdma.rdma_lines(_fake_pyverbs(list_error=err))
    assert len(lines) == 1
    assert "ENOSYS" in lines[0] and "kernel without InfiniBand" in lines[0], lines


def test_no_device_is_one_line():
    lines = rdma.rdma_lines(_fake_pyverbs(devices={}))
    assert lines == ["RDMA devices      : none (rdma-core sees no RDMA device)"]


def test_listing_devices_ports_and_gids():
    devices = {
        "mlx5_0": [
            {"state": 4, "link_layer": 2, "gids": {
                0: ("fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f", 0),
                1: ("0000:0000:0000:0000:0000:ffff:0a00:0001", 1),
                2: ("0000:0000:0000:0000:0000:0000:0000:0000", 1)}},  # empty entry: skipped
            {"state": 1, "link_layer": 1, "gids": {}},
        ],
        "mlx5_1": [{"state": 4, "link_layer": 1, "gids": {5: ("fe80:0000:0000:0000:0002:c903:0001:0002", 0)}}],
    }
    lines = rdma.rdma_lines(_fake_pyverbs(devices))
    text = "\n".join(lines)
    assert lines[0] == "RDMA devices      : 2"
    assert "mlx5_0: fw 28.39.1002, 2 port(s)" in text
    port1 = next(ln for ln in lines if "port 1: ACTIVE, link layer Ethernet" in ln)
    assert "[0] fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f (IB/RoCE v1)" in port1
    assert "[1] 0000:0000:0000:0000:0000:ffff:0a00:0001 (RoCE v2)" in port1
    assert "[2]" not in port1  # the all-zero GID is not listed
    assert "port 2: DOWN, link layer InfiniBand, GIDs none" in text
    assert "[5] fe80:0000:0000:0000:0002:c903:0001:0002" in text  # a GID after holes


def test_a_device_that_cannot_be_opened_is_reported():
    m = _fake_pyverbs({"mlx5_0": []})

    def refuse(name):
        raise _FakeError("Failed to open device", errno.EACCES)
    m.Context = refuse
    lines = rdma.rdma_lines(m)
    assert lines[0] == "RDMA devices      : 1"
    assert "mlx5_0: cannot open (EACCES" in lines[1], lines


@pytest.mark.parametrize("kind,mods,dmabuf,want", [
    ("cpu", set(), None, "no GPU in this process"),
    ("cuda", {"nvidia_peermem", "nvidia"}, False, "nvidia_peermem loaded -> GPUDirect RDMA possible"),
    ("cuda", {"nvidia"}, True, "dma-buf yes; peer-memory modules: none loaded"),
    ("cuda", {"nvidia"}, False, "cannot be registered for RDMA"),
    ("rocm", {"amdgpu"}, None, "dma-buf via amdgpu"),
])
def test_gpu_memory_registration(kind, mods, dmabuf, want):
    lines = rdma.gpu_rdma_lines(kind, modules=mods, dmabuf=dmabuf)
    assert len(lines) == 1 and want in lines[0], lines


def test_loaded_modules_reads_proc_modules(tmp_path):
    p = tmp_path / "modules"
    p.write_text("nvidia_peermem 16384 0 - Live 0x0\nib_core 458752 1 nvidia_peermem, Live 0x0\n")
    assert rdma.loaded_modules(str(p), str(tmp_path / "none")) == {"nvidia_peermem", "ib_core"}


def test_loaded_library_and_modules(tmp_path):
    lib = tmp_path / "lib"
    (lib / "ucx").mkdir(parents=True)
    for m in ("libuct_cuda.so.0", "libuct_ib.so.0", "libucx_perftest_cuda.so.0"):
        (lib / "ucx" / m).write_text("")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 0 08:01 1 {lib}/libucs.so.0\n7f01-7f02 r-xp 0 08:01 2 {lib}/libucp.so.0\n")
    path = rdma.loaded_library("libucp.", str(maps))
    assert path == f"{lib}/libucp.so.0"
    assert rdma.ucx_module_names(path) == ["cuda", "ib"]


def _table(memory):
    return [{"name": "ucx", "memory": memory, "detail": "UCX 1.22.0; transports self,tcp"}]


def test_ucx_per_vendor_build():
    ok = rdma.ucx_lines("cuda", _table(["host", "cuda"]), "/x/libucp.so", ["cuda", "cma"])
    assert "matches this process's cuda device" in ok[1], ok
    wrong = rdma.ucx_lines("rocm", _table(["host", "cuda"]), "/x/libucp.so", ["cuda", "cma"])
    assert "MISMATCH" in wrong[1] and "built for cuda" in wrong[1] and "8764" in wrong[1], wrong
    no_driver = rdma.ucx_lines("cuda", _table(["host"]), "/x/libucp.so", ["cuda"])
    assert "MISMATCH" in no_driver[1] and "found no cuda driver" in no_driver[1], no_driver
    host = rdma.ucx_lines("cpu", _table(["host"]), "/x/libucp.so", ["cma"])
    assert "host process" in host[1]
    assert rdma.ucx_lines("cuda", [], "", []) == [
        "UCX library      : not built into hetccl._C (no ucx transport)"]


def test_doctor_prints_the_readiness_lines(capsys):
    from hetccl import doctor
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    for key in ("RDMA devices      :", "GPU memory RDMA   :"):
        assert key in out, out
