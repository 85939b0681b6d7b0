"""The one place that knows how torch versions differ (2.11 on the GPU box, 2.13 on CI).

C++ callers (DDP's reducer, functional collectives, FSDP2) reach a Python ProcessGroup only
through the PyProcessGroup trampoline, whose method names changed between releases:

    role                           torch 2.13                        torch 2.11
    all-gather into one tensor     all_gather_single                 _allgather_base
    reduce-scatter from one tensor reduce_scatter_single             _reduce_scatter_base
    all-to-all of one tensor       all_to_all_single                 alltoall_base
    coalesced all-gather           all_gather_single_coalesced       allgather_into_tensor_coalesced
    coalesced reduce-scatter       reduce_scatter_single_coalesced   reduce_scatter_tensor_coalesced

``install_aliases(cls)`` gives a ProcessGroup subclass both spellings from one implementation
(named by role), so no other module carries version checks.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# role -> every trampoline name that torch versions use for it
METHOD_ALIASES = {
    "_hc_all_gather_single": ("all_gather_single", "_allgather_base"),
    "_hc_reduce_scatter_single": ("reduce_scatter_single", "_reduce_scatter_base"),
    "_hc_all_to_all_single": ("all_to_all_single", "alltoall_base"),
    "_hc_all_gather_single_coalesced": ("all_gather_single_coalesced",
                                        "allgather_into_tensor_coalesced"),
    "_hc_reduce_scatter_single_coalesced": ("reduce_scatter_single_coalesced",
                                            "reduce_scatter_tensor_coalesced"),
}


def install_aliases(cls: type) -> type:
    for impl, names in METHOD_ALIASES.items():
        fn = getattr(cls, impl)
        for name in names:
            setattr(cls, name, fn)
    return cls


def work_from_future(fut: torch.futures.Future) -> dist.Work:
    """A c10d Work whose wait() waits on (and re-raises the error of) `fut`."""
    return _create_work_from_future(fut)


def register_backend(name: str, creator, devices: list[str]) -> None:
    # `devices` must be a list: a string would be iterated character by character.
    dist.Backend.register_backend(name, creator, extended_api=True, devices=list(devices))


def backend_opts(dist_backend_opts: Any) -> tuple[Any, int, int, Any, list[int], str]:
    """(store, rank, size, timeout, global_ranks, group_id) from the extended-API options.
    global_ranks_in_group is [] for the default group on every supported version."""
    o = dist_backend_opts
    return (o.store, o.group_rank, o.group_size, o.timeout,
            list(getattr(o, "global_ranks_in_group", []) or []),
            str(getattr(o, "group_id", "") or ""))


def passthrough_group(store, rank: int, size: int, backends: dict[str, Any]) -> dist.ProcessGroup:
    """A plain c10d ProcessGroup with native backends registered per device type: torch then
    dispatches straight to them, so a single-vendor group runs at native speed with no Python
    in the data path.

    It must be the C++ class itself, not a Python subclass (e.g. one overriding
    getBackendName): C++ callers would then go through pybind's trampoline, which holds the GIL
    while gloo enqueues work, while a gloo worker that drops a finished work's tensors needs the
    GIL under gloo's queue lock: a deadlock (seen with Megatron's async tensor-parallel
    all-reduce in backward). Its backend name for C++ callers is therefore the native one; see
    install_ddp_logging_name for what DDP reports."""
    pg = dist.ProcessGroup(store, rank, size)
    # backends: {device type: (native backend name, backend)}, from the device seams; the
    # default is an accelerator's native backend where there is one (as torch's own default)
    def btype(kind):
        return getattr(dist.ProcessGroup.BackendType, kind.upper())
    default = next((kind for d, (kind, _) in backends.items() if d != "cpu"),
                   backends["cpu"][0] if "cpu" in backends else "gloo")
    for device, (kind, backend) in backends.items():
        pg._register_backend(torch.device(device), btype(kind), backend)
    pg._set_default_backend(btype(default))
    return pg


def install_ddp_logging_name(backend_name: str) -> None:
    """DistributedDataParallel._get_ddp_logging_data() reports "backend_name" from the C++
    group's getBackendName(), which for hetccl's single-vendor pass-through group (a plain
    c10d ProcessGroup, see passthrough_group) is the native backend ("gloo", "nccl"). Make it
    report what dist.get_backend(group) says for hetccl groups, and keep the native name under
    "hetccl_native_backend". Only the Python accessor changes; C++ DDP usage logs (c10's
    LogPyTorchDDPUsage, TORCH_DISTRIBUTED_DEBUG=INFO) keep the native name. Idempotent."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP._get_ddp_logging_data
    if getattr(original, "_hetccl", False):
        return

    def _get_ddp_logging_data(self):
        data = original(self)
        try:
            name = str(dist.get_backend(self.process_group))
        except Exception:  # noqa: BLE001 - never break DDP's own accessor
            return data
        if name == backend_name and data.get("backend_name") not in (None, backend_name):
            data["hetccl_native_backend"] = data["backend_name"]
            data["backend_name"] = backend_name
        return data

    _get_ddp_logging_data._hetccl = True
    _get_ddp_logging_data.__doc__ = original.__doc__
    DDP._get_ddp_logging_data = _get_ddp_logging_data


# --------------------------------------------------------------------------- megatron-core
# megatron-core 0.16 (Python 3.11, CPU CI) and 0.19 (the GPU box) differ in ways hetccl's
# runner meets; each difference is handled here and nowhere else:
#
#   what                                   0.16                      0.19
#   get_megatron_optimizer gloo groups     asserted unless           same (argument kept)
#                                          use_gloo_process_groups=False
#   dist_checkpointing.save/load kwargs    common_strategy=...       no common_strategy;
#                                                                    process_group, verify_integrity
#   get_forward_backward_func              (pp_size, vp_size)        + schedule_pg_collection
#
# The runner passes only arguments both accept (use_gloo_process_groups=False, positional
# state dict and directory), so the table is documentation until a call needs a branch;
# `megatron_core_version()` is what rows record.
def megatron_core_version() -> str:
    try:
        import megatron.core as mc
        return str(getattr(mc, "__version__", "unknown"))
    except ImportError:
        return "absent"


def megatron_core_tuple() -> tuple[int, int]:
    v = megatron_core_version()
    try:
        return tuple(int(x) for x in v.split(".")[:2])  # type: ignore[return-value]
    except ValueError:
        return (0, 0)


@functools.lru_cache(maxsize=None)
def premul_sum_factor_visible() -> bool:
    """(Decided once per process: a property of the torch build.) Whether this torch hands a backend the factor of ReduceOp.PREMUL_SUM
    (dist._make_nccl_premul_sum(f).factor; torch 2.13 has it, 2.11 does not): without it a
    Python backend cannot apply the op, and hetccl refuses it naming the op."""
    make = getattr(dist, "_make_nccl_premul_sum", None)
    if make is None:
        return False
    try:
        return getattr(make(1.0), "factor", None) is not None
    except Exception:  # noqa: BLE001 - a build without the NCCL op bindings
        return False
