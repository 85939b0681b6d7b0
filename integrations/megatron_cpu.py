"""Megatron-core's training machinery on a machine without CUDA (CPU emulation of vendors).

Megatron-core's model code runs on CPU with two shims (`megatron.install_cpu_shims`: the global
memory buffer and the RNG tracker). Its *training machinery* -- the pipeline schedules
(``total_num_tokens = torch.zeros(..., device="cuda")``), p2p shape exchange
(``torch.cuda.current_device()``, ``torch.cuda.synchronize()``), DDP's grad buffers
(``device=torch.cuda.current_device()``), the optimizers (``device='cuda'`` scalars,
``.cuda()``), gradient clipping -- names CUDA unconditionally. `cuda_on_cpu()` makes those names
mean the CPU for the duration of a block, without editing Megatron:

* a ``TorchFunctionMode`` that rewrites a CUDA ``device=`` argument (``"cuda"``, ``"cuda:N"``,
  an int, a ``torch.device``) of any torch call to ``"cpu"``, turns ``Tensor.cuda()`` into a
  no-op and ``Tensor.to(<cuda>)`` into ``Tensor.to("cpu")``, and drops ``pin_memory=True``;
* ``torch.cuda.current_device`` returns 0 (the mode then maps device 0 to the CPU), and
  ``synchronize``, ``Stream``, ``stream``, ``current_stream``, ``default_stream``, ``Event`` are
  host no-ops (CPU work is synchronous, so a stream or event that orders nothing is exact).

``torch.cuda.is_available()`` keeps saying False, so code that *chooses* a device still picks the
CPU. The patches are process-wide while the block runs and are undone on exit; the mode is
thread-local (torch's mode stack), which covers Megatron: it allocates on the thread that calls
it, and autograd runs CPU backward on the calling thread.

Trade-off: this is emulation for CPU tests and CPU figures only; on a CUDA machine nothing here is
used (`cuda_on_cpu` refuses to run when CUDA is available, so it can never hide a real device).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_on_cpu", "CudaOnCpuMode"]


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True  # an integer device index means a CUDA device in torch
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class CudaOnCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            # Megatron's optimizers accept parameters by their type string
            # ("torch.cuda.FloatTensor"): report CPU tensors under the CUDA name they stand for
            out = out.replace("torch.", "torch.cuda.", 1)
        return out


class _Stream:
    """A CUDA stream stand-in on the host: CPU work is synchronous, so ordering is a no-op."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    def __init__(self, *a, **k):
        import time
        self._t = time.perf_counter()

    def record(self, stream=None):
        import time
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end._t - self._t) * 1e3


def _current_device() -> int:
    return 0


_current_device._hetccl_cpu = True

_PATCHES = {
    "current_device": _current_device,
    "synchronize": lambda *a, **k: None,
    "Stream": _Stream,
    "Event": _Event,
    "stream": lambda s=None: contextlib.nullcontext(),
    "current_stream": lambda *a, **k: _Stream(),
    "default_stream": lambda *a, **k: _Stream(),
}


@contextlib.contextmanager
def cuda_on_cpu():
    """Run the block with Megatron's CUDA names mapped to the CPU (module docstring).
    Nestable; refuses to run where CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("cuda_on_cpu() is CPU emulation only; CUDA is available here")
    saved = {k: getattr(torch.cuda, k) for k in _PATCHES}
    nested = getattr(torch.cuda.current_device, "_hetccl_cpu", False)
    if not nested:
        for k, v in _PATCHES.items():
            setattr(torch.cuda, k, v)
    try:
        with CudaOnCpuMode():
            yield
    finally:
        if not nested:
            for k, v in saved.items():
                setattr(torch.cuda, k, v)
