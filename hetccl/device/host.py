"""Host tensors (torch device type "cpu"): no streams; inside a vendor group the native library
is gloo. Also the "vendor" of a process without a usable accelerator (label "host")."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import tuning


class HostSeam:
    type = "cpu"
    build = "cpu"               # what vendor.build_kind() reports for a process this seam serves
    vendor = "host"             # the vendor label of such a process
    native_backend = "gloo"
    native_library = None       # gloo is inside torch
    asynchronous = False

    graph_name = "graph"

    @staticmethod
    def capturing() -> bool:
        return False  # host memory has no graphs

    device_code = 1             # argument-check header code of the device type (checks.py)
    memory_type = "host"        # what a transport's capability table calls this memory
    ucx_device_paths: tuple[str, ...] = ()
    ucx_copy_paths: tuple[str, ...] = ()
    peer_memory_modules: tuple[str, ...] = ()
    # default shared-memory slot (bridge.py): host data only, so the host table's largest chunk
    staging_slot_bytes = tuning.max_chunk(tuning.HOST)
    shm_budget_bytes = 8 << 20  # default shared memory one rank creates (HETCCL_SHM_BUDGET_BYTES)
    # dtypes gloo reduces (checked before any communication, so an unsupported dtype is a clear
    # error on every rank); copy-type collectives move bytes and accept every dtype
    reduce_dtypes = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                               torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                               torch.complex64, torch.complex128})

    @staticmethod
    def available() -> bool:
        return True

    @staticmethod
    def build_matches() -> bool:
        return True

    def new_native(self, store, rank: int, size: int, timeout, group_name: str = "",
                   global_ranks=None):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def runtime(self):
        return None

    @staticmethod
    def is_device(t: torch.Tensor) -> bool:
        return False
