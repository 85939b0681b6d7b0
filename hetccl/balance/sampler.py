"""Per-step sampler following a micro-batch plan."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from .planner import Plan


def step_indices(n: int, global_batch: int, step: int, *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True) -> list[int]:
    """Dataset indices of the global batch of ``step`` in ``epoch`` (what every rank of a
    homogeneous run on the same global batch would see, split any way): a permutation of
    range(n) from torch.Generator seeded with seed + epoch, cut into consecutive blocks."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(int(seed) + int(epoch))
        perm = torch.randperm(n, generator=g).tolist()
    else:
        perm = list(range(n))
    return perm[step * global_batch:(step + 1) * global_batch]


class BalancedBatchSampler(Sampler[list[list[int]]]):
    """Yields, per optimizer step, this rank's micro-batches (lists of dataset indices).

    Step k of an epoch covers the global batch perm[k*B:(k+1)*B] of one permutation that
    every rank draws from the same seed (seed + epoch); rank r takes the slice
    [plan.offsets()[r], + plan.samples(r)) of it and cuts it into plan.per_rank[r]. Hence, for
    any plan, the union over the ranks of one step is exactly that global batch, each index
    once. A rank with 0 samples yields an empty list for the step (it must still join the
    gradient all-reduce).

    The plan is read when a step is generated, so set_plan() between two steps applies from
    the next step on. Iterate it in the training process, one step at a time (do not hand it
    to a DataLoader that prefetches across steps: ranks would switch plans at different
    steps). Load a micro-batch with ``collate([dataset[i] for i in mb])`` (see load()), or
    give a DataLoader a fixed list of indices per micro-batch.

    ``dataset`` may be a dataset or its length. ``rank`` defaults to this process's rank in
    ``group`` (the data-parallel group; default WORLD), ``world_size`` to the plan's.

    Steps per epoch: len(dataset) // global_batch (a trailing partial batch is dropped, as
    a homogeneous run with drop_last=True does).
    """

    def __init__(self, dataset, plan: Plan, rank: int | None = None,
                 world_size: int | None = None, shuffle: bool = True, seed: int = 0,
                 group=None):
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        if rank is None:    # this rank's index in the data-parallel group (default WORLD)
            import torch.distributed as dist
            init = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank(group) if init else 0
        if world_size is None:
            world_size = plan.world_size
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed = shuffle, int(seed)
        self.epoch = 0
        self.step = 0            # steps generated in the current epoch
        self.global_batch = plan.global_batch
        self._check(plan)
        self.plan = plan

    def _check(self, plan: Plan) -> None:
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, sampler for {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if plan.global_batch != self.global_batch:
            raise ValueError("set_plan: the global batch must not change "
                             f"({self.global_batch} -> {plan.global_batch})")

    def set_plan(self, plan: Plan) -> None:
        self._check(plan)
        self.plan = plan

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // self.global_batch if self.global_batch else 0

    def _perm(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.n, generator=g).tolist()
        return list(range(self.n))

    def _split(self, idx: list[int], plan: Plan) -> list[list[int]]:
        start = plan.offsets()[self.rank]
        out = []
        for size in plan.per_rank[self.rank]:
            out.append(idx[start:start + size])
            start += size
        return out

    def micro_batches(self, step: int, plan: Plan | None = None) -> list[list[int]]:
        """This rank's micro-batches of ``step`` in the current epoch under ``plan``."""
        B = self.global_batch
        return self._split(self._perm()[step * B:(step + 1) * B], plan or self.plan)

    def __iter__(self) -> Iterator[list[list[int]]]:
        perm, B = self._perm(), self.global_batch
        for step in range(len(self)):
            self.step = step
            # self.plan is read here, lazily: a set_plan() between steps applies from this one
            yield self._split(perm[step * B:(step + 1) * B], self.plan)
        self.step = len(self)


def load(dataset, indices: Sequence[int], collate: Callable[[list], Any] | None = None):
    """Collate one micro-batch: collate([dataset[i] for i in indices]) (default_collate)."""
    if collate is None:
        from torch.utils.data import default_collate
        collate = default_collate
    return collate([dataset[i] for i in indices])
