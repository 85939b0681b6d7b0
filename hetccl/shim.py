"""Run an unchanged training script over hetccl (used by `hetccl run`).

`python -m hetccl.shim script.py args...` imports hetccl, redirects
torch.distributed.init_process_group to the "hetccl" backend whatever backend the script asks
for (nccl, gloo, "cpu:gloo,cuda:nccl", or none), then runs the script as __main__.
device_id= is turned into torch.cuda.set_device(): torch's eager init calls
ProcessGroup._get_backend(device), which a multi-vendor (Python) group does not have.
"""
from __future__ import annotations

import functools
import logging
import runpy
import sys

import torch
import torch.distributed as dist

import hetccl  # noqa: F401 - registers the backend

log = logging.getLogger("hetccl")


def install() -> None:
    original = dist.init_process_group
    if getattr(original, "_hetccl", False):
        return

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if backend not in (None, "hetccl"):
            log.info("hetccl run: backend %r replaced by 'hetccl'", backend)
        device_id = kwargs.pop("device_id", None)
        if device_id is not None and torch.cuda.is_available():
            torch.cuda.set_device(device_id)
        return original("hetccl", *args, **kwargs)

    init_process_group._hetccl = True
    dist.init_process_group = init_process_group
    # modules that did `from torch.distributed import init_process_group` before us
    import torch.distributed.distributed_c10d as c10d
    c10d.init_process_group = init_process_group


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m hetccl.shim script.py [args...]", file=sys.stderr)
        return 2
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
