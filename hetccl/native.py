"""Collectives inside this rank's vendor group on the vendor's native library.

gloo for host tensors; nccl (NCCL on CUDA builds, RCCL on ROCm builds) for device tensors.
The native groups are built directly from a prefix of the hetccl group's store, one per vendor
group, so they never include a rank of another vendor. Every method returns the native Work.
A group of one rank needs no native communicator: callers skip the local stage then.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import device as devices

# dtypes each native library can reduce (checked before any communication starts, so an
# unsupported dtype is a clear error on every rank rather than a failure on some of them).
# Copy-type collectives move bytes and accept every dtype (see _bytes).
# The sets are the device seams' (hetccl/device/: reduce_dtypes).
REDUCE_DTYPES = {t: devices.reduce_dtypes(t) for t in devices.device_types()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Byte view for copy-type collectives: native libraries then move any dtype."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


RED = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX}


class NativeGroup:
    def __init__(self, store, label: str, rank: int, size: int, timeout: timedelta):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._store = dist.PrefixStore(f"hetccl/native/{label}/", store)
        self._backends: dict[str, object] = {}
        if size > 1:
            self.backend("cpu")  # always needed: barrier, object collectives, headers

    def backend(self, device_type: str):
        b = self._backends.get(device_type)
        if b is None:
            sub = dist.PrefixStore(device_type + "/", self._store)
            b = devices.seam(device_type).new_native(sub, self.rank, self.size, self.timeout)
            self._backends[device_type] = b
        return b

    def _b(self, t: torch.Tensor):
        return self.backend(t.device.type)

    def all_reduce(self, t: torch.Tensor, op: str):
        o = dist.AllreduceOptions()
        o.reduceOp = RED[op]
        return self._b(t).allreduce([t], o)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str):
        o = dist.ReduceScatterOptions()
        o.reduceOp = RED[op]
        return self._b(out)._reduce_scatter_base(out, inp, o)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        return self._b(inp)._allgather_base(_bytes(out), _bytes(inp))

    def broadcast(self, t: torch.Tensor, root: int):
        o = dist.BroadcastOptions()
        o.rootRank = root
        return self._b(t).broadcast([_bytes(t)], o)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]):
        es = inp.element_size()
        return self._b(inp).alltoall_base(_bytes(out), _bytes(inp), [c * es for c in out_splits],
                                          [c * es for c in in_splits], dist.AllToAllOptions())

    def gather(self, outs: list[torch.Tensor], t: torch.Tensor, root: int):
        o = dist.GatherOptions()
        o.rootRank = root
        outs = [_bytes(x) for x in outs]
        return self._b(t).gather([outs] if self.rank == root else [], [_bytes(t)], o)

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor], root: int):
        o = dist.ScatterOptions()
        o.rootRank = root
        ins = [_bytes(x) for x in ins]
        return self._b(out).scatter([_bytes(out)], [ins] if self.rank == root else [], o)

    def send(self, t: torch.Tensor, dst: int, tag: int):
        return self._b(t).send([_bytes(t)], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int):
        return self._b(t).recv([_bytes(t)], src, tag)

    def close(self):
        for b in self._backends.values():
            for name in ("shutdown", "abort"):
                fn = getattr(b, name, None)
                if fn is not None:
                    try:
                        fn()
                        break
                    except Exception:  # noqa: BLE001 - best effort at teardown
                        pass
        self._backends = {}
