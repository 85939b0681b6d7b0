"""Host memory for hetccl's own buffers: the one place the library allocates it.

Contract: every tensor hetccl creates for host-side use -- staging of point-to-point data,
argument-check headers and tables, split and shape metadata, the barrier's token -- comes from
here and lives in ordinary CPU memory whatever `torch.set_default_device()` says. A factory
call without `device=` follows the default device, so under `torch.set_default_device("cuda")`
(model code and HF do this) it would return GPU memory, and a transport writing through that
pointer from the host crashes the process (tests/test_hostmem.py checks that no library file
calls a torch factory without naming the device).

Buffers that must be on the collective's device are made with `device=` from that tensor (or
with *_like), never from the default.
"""
from __future__ import annotations

from typing import Sequence

import torch

CPU = torch.device("cpu")


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=CPU)


def zeros(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=CPU)


def full(shape: int | Sequence[int], value, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=CPU)


def tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of Python values (headers, counts, shapes)."""
    return torch.tensor(values, dtype=dtype, device=CPU)


def staging_for(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host buffer of t's shape and dtype (for copying device data through)."""
    return torch.empty(t.shape, dtype=t.dtype, device=CPU)
