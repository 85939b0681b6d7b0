"""hetccl: collective communication for PyTorch jobs that mix GPU vendors.

``import hetccl`` registers the torch.distributed backend "hetccl" (cpu and cuda devices):

    import hetccl, torch.distributed as dist
    dist.init_process_group("hetccl")

Ranks with equal vendor labels (detected, or HETCCL_VENDOR) form a vendor group that runs on its
native library; the bridge connects the groups. See README.md and docs/.
"""
from __future__ import annotations

import logging as _logging

from . import compat as _compat
from . import config
from .vendor import detect_vendor

__version__ = "0.1.0"

# NOTICE (25): the one start line of a job (rank 0), shown at the default HETCCL_LOG_LEVEL.
_logging.addLevelName(25, "NOTICE")
_log = _logging.getLogger("hetccl")
if not _log.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(asctime)s hetccl %(levelname)s %(message)s"))
    _log.addHandler(_h)
    _log.propagate = False
_log.setLevel(str(config.get("HETCCL_LOG_LEVEL")).upper())

from .backend import BACKEND_NAME, HetcclProcessGroup, register  # noqa: E402

register()
_compat.install_ddp_logging_name(BACKEND_NAME)


def vendor_of_ranks(group=None) -> list[str]:
    """Vendor label of every rank of `group` (default: WORLD), in group rank order."""
    import torch.distributed as dist

    pg = group or dist.group.WORLD
    if isinstance(pg, HetcclProcessGroup):
        return [i.vendor for i in pg.topo.infos]
    labels = [None] * dist.get_world_size(pg)
    dist.all_gather_object(labels, detect_vendor(rank=dist.get_rank()), group=pg)
    return labels


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier for any group, hetccl's included (torch's refuses
    every backend not named gloo).

    Rank 0 of the group waits up to `timeout` (a timedelta or seconds; default: the group's
    timeout) for every other rank and raises RuntimeError naming the first rank that did not
    arrive ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms"), or all of them with
    wait_all_ranks=True ("Ranks 1, 2 failed ..."); the other ranks raise when rank 0's verdict is
    a failure or does not come in time. Wording as gloo's. gloo groups use torch's own; a
    single-vendor hetccl group uses its native gloo backend's; a multi-vendor group runs it over
    its store (HetcclProcessGroup.monitored_barrier), so it works while collectives are stuck."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if c10d._rank_not_in_group(group):
        return None
    pg = group if group is not None else c10d._get_default_group()
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if dist.get_backend(pg) == dist.Backend.GLOO:
        return dist.monitored_barrier(pg, timeout, wait_all_ranks=wait_all_ranks)
    if timeout is None:
        timeout = getattr(pg, "engine", None).timeout if isinstance(pg, HetcclProcessGroup) \
            else c10d._get_default_timeout(dist.get_backend(pg))
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


__all__ = ["BACKEND_NAME", "HetcclProcessGroup", "detect_vendor", "vendor_of_ranks", "config",
           "monitored_barrier"]
