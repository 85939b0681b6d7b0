"""UCX transport options of issue 28 (CPU): the copy thread, prepared device handles, the device
copy transports removed where no device memory goes to UCX, and the thread stack dump the GPU
probe uses. (Stashed copies and irecv_reduce on the copy thread, its default, are exercised by
tests/test_transport.py -k ucx; device handles need a GPU: tests/gpu_ucx_probe.py.)"""
from __future__ import annotations

import threading

import pytest
import torch

from hetccl import transports
from hetccl._core import _C

pytestmark = pytest.mark.skipif("ucx" not in _C.transport_names(), reason="built without UCX")


def test_copy_exclusions():
    assert transports.ucx_copy_exclusions(True) == []
    assert sorted(transports.ucx_copy_exclusions(False)) == ["cuda_copy", "rocm_copy"]


@pytest.mark.parametrize("key", ["copy_thread", "device_prepare"])
def test_bad_option_values_are_refused(key):
    with pytest.raises(_C.CommError, match=key):
        _C.Transport("ucx", 0, 1, {key: "maybe"})


@pytest.mark.parametrize("copy", ["on", "off"])
def test_copy_thread_option_in_info(copy):
    t = _C.Transport("ucx", 0, 1, {"copy_thread": copy})
    try:
        assert t.info()["copy_thread"] == copy
    finally:
        t.close()


def test_prepare_device_without_device_memory_is_a_no_op():
    t = _C.Transport("ucx", 0, 1, {})
    try:
        buf = torch.zeros(1024, dtype=torch.uint8)
        t.prepare_device(buf.data_ptr(), buf.numel(), "cuda")  # this UCX handles no cuda memory
        t.prepare_device(buf.data_ptr(), buf.numel(), "host")  # not a device type: ignored
        info = t.info()
        assert info["device_prepare"] == "on"
        assert info["device_handles"].startswith("0 cached"), info["device_handles"]
    finally:
        t.close()
    t = _C.Transport("ucx", 0, 1, {"device_prepare": "off"})
    try:
        assert t.info()["device_prepare"] == "off"
    finally:
        t.close()


def test_thread_stack_dump_names_the_ucx_threads(capfd):
    t = _C.Transport("ucx", 0, 1, {})
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        answered = _C.dump_thread_stacks()
    finally:
        stop.set()
        t.close()
    err = capfd.readouterr().err
    names = [ln.split()[2] for ln in err.splitlines() if ln.startswith("hetccl-stack ")]
    assert answered == len(names) >= 3, (answered, names)
    assert "hetccl-ucx" in names and "hetccl-ucx-cp" in names, names
    assert "hetccl-frame " in err
