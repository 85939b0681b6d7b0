"""The defects issue 23 found on one H200, checked on CUDA tensors where they were found
(runs on the GPU box, `.ci/gpu-box.sh tests`; skipped with a reason without a GPU):

* point-to-point under torch.set_default_device("cuda") crashed the process (host staging
  buffers followed the default device; hetccl/hostmem.py);
* a size, dtype, op or root mismatch was not raised at the call when one rank had used its
  arguments before and its peer had not (a per-rank check cache: hetccl/checks.py); with three
  vendor groups the processes ended. Now every rank raises, in every order of earlier calls,
  and the group stays usable.
"""
from __future__ import annotations

import functools

import pytest
import torch

from hetccl.launch import spawn

import gpu_regression_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run .ci/gpu-box.sh on the GPU box)"),
]

CASES = ["p2p/default_cuda/cuda_tensors", "p2p/default_cuda/cpu_tensors",
         "collectives/default_cuda", "p2p/explicit_cuda", "mismatch/first_rank_cached",
         "mismatch/others_cached", "mismatch/both_cached", "mismatch/fresh",
         "mismatch/dtype_after_use", "mismatch/op_after_use", "mismatch/root_after_use",
         "usable_at_end"]


@functools.lru_cache(maxsize=None)
def _results(vendors: str):
    n = sum(int(v) for v in vendors.split("+"))
    return spawn(gpu_regression_cases.run, n, vendors=vendors, timeout=300)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("vendors", ["1+1", "1+1+1"])
def test_gpu_regression(vendors, case):
    for r, out in enumerate(_results(vendors)):
        assert out.get(case) == "ok", f"rank {r} {case}: {out.get(case)}"
