"""hetccl: collective communication for PyTorch jobs that mix GPU vendors.

``import hetccl`` registers the torch.distributed backend "hetccl" (cpu and cuda devices):

    import hetccl, torch.distributed as dist
    dist.init_process_group("hetccl")

Ranks with equal vendor labels (detected, or HETCCL_VENDOR) form a vendor group that runs on its
native library; the bridge connects the groups. See README.md and docs/.
"""
from __future__ import annotations

import logging as _logging

from . import config
from .vendor import detect_vendor

__version__ = "0.1.0"

_log = _logging.getLogger("hetccl")
if not _log.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(asctime)s hetccl %(levelname)s %(message)s"))
    _log.addHandler(_h)
    _log.propagate = False
_log.setLevel(str(config.get("HETCCL_LOG_LEVEL")).upper())

from .backend import BACKEND_NAME, HetcclProcessGroup, register  # noqa: E402

register()


def vendor_of_ranks(group=None) -> list[str]:
    """Vendor label of every rank of `group` (default: WORLD), in group rank order."""
    import torch.distributed as dist

    pg = group or dist.group.WORLD
    if isinstance(pg, HetcclProcessGroup):
        return [i.vendor for i in pg.topo.infos]
    labels = [None] * dist.get_world_size(pg)
    dist.all_gather_object(labels, detect_vendor(), group=pg)
    return labels


__all__ = ["BACKEND_NAME", "HetcclProcessGroup", "detect_vendor", "vendor_of_ranks", "config"]
