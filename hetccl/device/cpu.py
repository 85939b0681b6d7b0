"""Host tensors: no streams; inside a vendor group the native library is gloo."""
from __future__ import annotations

import torch.distributed as dist


class CpuSeam:
    type = "cpu"
    native_backend = "gloo"
    asynchronous = False

    @staticmethod
    def available() -> bool:
        return True

    def new_native(self, store, rank: int, size: int, timeout, group_name: str = "",
                   global_ranks=None):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def runtime(self):
        return None
