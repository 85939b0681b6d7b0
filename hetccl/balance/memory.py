"""Memory caps: the largest micro-batch each rank fits, measured or given.

A mixed cluster pairs cards of different memory (16 GB next to 80 GB): the planner bounds each
rank's micro-batch by its own cap (``max_micro[r]``) and gives it more micro-batches instead of
larger ones. probe_max_micro measures the cap on this rank by running real steps until one runs
out of memory; gather_max_micro shares the caps so every rank plans with the same list.
"""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable

logger = logging.getLogger("hetccl.balance")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of torch's allocators."""
    import torch
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    if oom and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _free(device) -> None:
    gc.collect()
    import torch
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def probe_max_micro(step: Callable[[int], Any], limit: int, *, start: int = 1, device=None,
                    margin: float = 0.0) -> int:
    """Largest micro-batch size b <= ``limit`` for which ``step(b)`` (one forward+backward of b
    samples, the caller's own, with the real model, sequence length and precision) runs
    without an out-of-memory error; 0 when not even one sample fits.

    Doubles from ``start`` until a size fails (or reaches ``limit``), then bisects between
    the last size that ran and the first that failed: about 2 log2(limit) calls. Assumes that
    a size that fits means every smaller one fits. After an out-of-memory error the
    references held by the exception are dropped and the CUDA cache of ``device`` is emptied,
    so the next try starts clean; step() should leave no gradients or activations behind
    (zero the gradients in it). ``margin`` keeps that fraction of the measured cap free
    (allocator fragmentation, longer sequences later): the result is floor(b * (1 - margin)),
    at least 1 if b >= 1. Other exceptions propagate."""
    limit = int(limit)
    if limit < 1:
        raise ValueError("limit must be >= 1")
    if not 0.0 <= margin < 1.0:
        raise ValueError("margin must be in [0, 1)")

    def fits(b: int) -> bool:
        failed = False
        try:
            step(b)
        except Exception as e:           # noqa: BLE001 - only OOM is swallowed
            if not is_oom(e):
                raise
            failed = True
        if failed:
            _free(device)
            logger.info("hetccl probe_max_micro: %d samples do not fit", b)
        return not failed

    good, bad = 0, None
    b = max(1, min(int(start), limit))
    while True:
        if fits(b):
            good = b
            if b == limit:
                break
            b = min(limit, 2 * b)
        else:
            bad = b
            break
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
    _free(device)
    if good >= 1 and margin > 0:
        good = max(1, int(good * (1.0 - margin)))
    return good


def gather_max_micro(local_cap: int, group=None) -> list[int]:
    """Every rank's cap, in group rank order (collective over ``group``); [local_cap] without
    torch.distributed. Pass the result to Balancer(max_micro=...) or set_max_micro()."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [int(local_cap)]
    from .scaling import _coll_device
    dev = _coll_device(group)
    t = torch.tensor([int(local_cap)], dtype=torch.int64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [int(o.item()) for o in out]
