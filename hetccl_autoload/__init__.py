"""Notices HETCCL_* settings in a process that never uses hetccl.

torch calls every "torch.backends" entry point when it is imported (its device-backend autoload,
switched off with TORCH_DEVICE_BACKEND_AUTOLOAD=0); hetccl registers notice_unused_settings
there. It lives outside the hetccl package so that importing torch never imports hetccl (no C++
core, no backend registration): with no HETCCL_* variable set it only scans os.environ.

With HETCCL_* variables set (HETCCL_LOG_LEVEL aside), it wraps
torch.distributed.init_process_group: a default group created with another backend by a process
that never imported hetccl (plain torchrun or deepspeed with init_process_group("nccl"), say)
makes rank 0 print one line naming the variables that have no effect and how to use hetccl. `hetccl run` redirects the backend to
hetccl, so this never fires under it. It never raises: a failure here only loses the notice.
"""
from __future__ import annotations

import functools
import os
import sys

_IGNORED = {"HETCCL_LOG_LEVEL"}


def unused_settings() -> list[str]:
    return sorted(k for k in os.environ if k.startswith("HETCCL_") and k not in _IGNORED)


def message(backend, names: list[str]) -> str:
    shown = ", ".join(f"{n}={os.environ.get(n, '')}" for n in names)
    return (f"hetccl: {shown} {'is' if len(names) == 1 else 'are'} set, but this process "
            f"creates its default process group with backend {backend!r}, not hetccl, so "
            f"{'it has' if len(names) == 1 else 'they have'} no effect. Launch with `hetccl run` "
            f"(it redirects init_process_group to hetccl) or pass backend='hetccl'.")


def _rank_of(args, kwargs) -> int | None:
    rank = kwargs.get("rank", args[3] if len(args) > 3 else -1)  # (init_method, timeout,
    # world_size, rank, ...) follow backend
    if rank is not None and int(rank) >= 0:
        return int(rank)
    env = os.environ.get("RANK")
    return int(env) if env not in (None, "") else None


def notice_unused_settings() -> None:
    try:
        names = unused_settings()
        if not names:
            return
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        dist = sys.modules.get("torch.distributed")
        if c10d is None or dist is None or not hasattr(c10d, "init_process_group"):
            return
        original = c10d.init_process_group
        if getattr(original, "_hetccl_notice", False):
            return

        @functools.wraps(original)
        def init_process_group(backend=None, *args, **kwargs):
            try:
                name = "default (cpu:gloo,cuda:nccl)" if backend is None else str(backend)
                # a process that imported hetccl knows it is there (a gloo reference run
                # next to hetccl, say): only jobs that never load it are told
                if name.lower() != "hetccl" and "hetccl" not in sys.modules and \
                        _rank_of(args, kwargs) in (0, None):
                    sys.stderr.write(message(name, names) + "\n")
                    sys.stderr.flush()
            except Exception:  # noqa: BLE001 - the notice must never break the job
                pass
            return original(backend, *args, **kwargs)

        init_process_group._hetccl_notice = True
        c10d.init_process_group = init_process_group
        dist.init_process_group = init_process_group
    except Exception:  # noqa: BLE001 - torch's import must never fail because of this
        pass
