"""Vendor labels: which vendor group a rank belongs to, and which host it is on.

Device-specific code (streams, copies, native libraries) lives in the device seam
(hetccl/device/), and so does each build's vendor label ("nvidia", "amd", "host": the seam's
`vendor`); this module picks a process's label (emulation, splits, the build's) and its host
identity. On ROCm builds of torch, HIP is exposed as torch's "cuda" device type: the label is
what tells an AMD rank from an NVIDIA one.
"""
from __future__ import annotations

import functools
import os
import socket

from . import config

def build_kind() -> str:
    """What this torch build drives, from the device seams (hetccl/device/): 'cuda', 'rocm', or
    'cpu' where no accelerator with a seam is usable."""
    from . import device as devices

    return devices.build_seam().build


def detect_vendor(rank: int | None = None) -> str:
    """This process's vendor label: HETCCL_VENDOR if set (any non-empty label; this is how
    several vendors are emulated on one kind of hardware), else HETCCL_VENDOR_SPLIT's label for
    this process, else derived from the torch build.

    HETCCL_VENDOR_SPLIT labels a process by its launch rank: RANK when a launcher sets it
    (torchrun, hetccl run; a Megatron layout may renumber ranks later, the label stays with the
    process), else `rank` (the backend passes the default-group rank it was created with: the
    mp.spawn / init_process_group(rank=...) case). Neither known: ValueError, as a silent
    guess would put every process in one vendor group."""
    label = config.get("HETCCL_VENDOR")
    if label:
        return label
    split = config.get("HETCCL_VENDOR_SPLIT")
    if split:
        from .launch import vendor_labels

        labels = vendor_labels(split)
        env_rank = os.environ.get("RANK")
        if env_rank is not None and env_rank != "":
            rank = int(env_rank)
        elif rank is None:
            raise ValueError(f"hetccl: HETCCL_VENDOR_SPLIT={split!r} labels processes by rank, "
                             f"but this process's rank is unknown (no RANK variable, and no "
                             f"process group yet); set RANK or HETCCL_VENDOR")
        if not 0 <= rank < len(labels):
            raise ValueError(f"hetccl: HETCCL_VENDOR_SPLIT={split!r} covers {len(labels)} ranks,"
                             f" but this is rank {rank}")
        return labels[rank]
    from . import device as devices

    return devices.build_seam().vendor


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """Identifies this host's shared-memory domain: processes with equal identities can use the
    shm transport (same kernel boot, same /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        shm = os.stat("/dev/shm").st_ino
    except OSError:
        shm = 0
    return f"{socket.gethostname()}/{boot}/{shm}"
