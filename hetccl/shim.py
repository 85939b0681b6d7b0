"""Run an unchanged training script over hetccl (used by `hetccl run`).

`python -m hetccl.shim script.py args...` imports hetccl, redirects
torch.distributed.init_process_group to the "hetccl" backend whatever backend the script asks
for (nccl, gloo, "cpu:gloo,cuda:nccl", or none), then runs the script as __main__ the way
`python script.py` would: sys.argv is the script and its arguments, and the script's folder is
sys.path[0] (so a script importing a sibling module works from any working directory).
device_id= is turned into torch.cuda.set_device(): torch's eager init calls
ProcessGroup._get_backend(device), which a multi-vendor (Python) group does not have.

Framework fixes the shim applies when the framework is imported (post-import hooks, so a script
that never imports them pays nothing):

* HuggingFace Trainer on a machine without CUDA: accelerate runs multi-process training only
  when told to use the CPU, otherwise every rank silently trains its own copy. The shim sets
  ACCELERATE_USE_CPU=true when CUDA is absent and the job has several ranks (unless the variable
  is set); if a TrainingArguments still ends up not distributed in a multi-rank job, building it
  raises, naming --use_cpu.
* Megatron-core: after parallel_state.initialize_model_parallel, rank 0 warns once if
  tensor-parallel groups span vendors (correct but the slowest placement), with the layout that
  keeps them inside one vendor. On a machine without CUDA, model_parallel_cuda_manual_seed uses
  hetccl.integrations.megatron's CPU RNG tracker and memory buffer instead of failing.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import runpy
import sys
import threading

import torch
import torch.distributed as dist

import hetccl  # noqa: F401 - registers the backend
from hetccl import backend as _backend, config

log = logging.getLogger("hetccl")


def install() -> None:
    original = dist.init_process_group
    if getattr(original, "_hetccl", False):
        return

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if backend != "hetccl":
            log.info("hetccl run: backend %r replaced by 'hetccl'", backend)
            _backend.replaced_backend = "torch's default" if backend is None else str(backend)
        device_id = kwargs.pop("device_id", None)
        if device_id is not None and torch.cuda.is_available():
            torch.cuda.set_device(device_id)
        return original("hetccl", *args, **kwargs)

    init_process_group._hetccl = True
    dist.init_process_group = init_process_group
    # modules that did `from torch.distributed import init_process_group` before us
    import torch.distributed.distributed_c10d as c10d
    c10d.init_process_group = init_process_group


# ------------------------------------------------------------------------- post-import hooks
class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls fn(module) right after `name` has been imported (before the importer sees it)."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, fn = spec.loader, self.fn

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                fn(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, fn) -> None:
    """Run fn(module) once `name` is imported (at once if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None:
        fn(mod)
        return
    sys.meta_path.insert(0, _AfterImport(name, fn))


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


# ------------------------------------------------------------------------- HuggingFace Trainer
def prepare_transformers_env() -> None:
    """On a machine without CUDA, multi-rank: tell accelerate to run distributed on the CPU."""
    if not torch.cuda.is_available() and _world_size() > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def _patch_training_args(module) -> None:
    cls = getattr(module, "TrainingArguments", None)
    if cls is None or getattr(cls.__post_init__, "_hetccl", False):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *a, **kw):
        original(self, *a, **kw)
        world = _world_size()
        if world > 1 and self.world_size != world:
            raise RuntimeError(
                f"hetccl run: this job has {world} ranks, but the HF Trainer would train "
                f"{self.parallel_mode} with world size {self.world_size}, i.e. every rank alone. "
                f"On a machine without CUDA pass --use_cpu (TrainingArguments(use_cpu=True)) or "
                f"leave ACCELERATE_USE_CPU unset (hetccl run then sets it to true).")

    __post_init__._hetccl = True
    cls.__post_init__ = __post_init__


# ------------------------------------------------------------------------- Megatron-core
_tp_warned = False


def check_megatron_tp_layout(order: str | None = None) -> str | None:
    """After initialize_model_parallel: rank 0 logs (once per process) a warning if Megatron's
    tensor-parallel groups span vendors, with a layout that keeps them inside one vendor.
    Returns the warning text (None: nothing to say). No communication."""
    global _tp_warned
    from megatron.core import parallel_state as ps

    from hetccl.backend import HetcclProcessGroup
    world_pg = dist.group.WORLD
    if not isinstance(world_pg, HetcclProcessGroup):
        return None  # one vendor: nothing can span vendors
    labels = [i.vendor for i in world_pg.topo.infos]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp <= 1:
        return None
    from hetccl.integrations.layout import (DEFAULT_ORDER, LayoutError, ParallelSizes,
                                            megatron_groups, plan_layout)
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    sizes = ParallelSizes(tp=tp, pp=pp, cp=cp)
    try:
        groups = megatron_groups(len(labels), sizes, order or DEFAULT_ORDER)["tp"]
    except LayoutError:
        return None
    spanning = [g for g in groups if len({labels[r] for r in g}) > 1]
    if not spanning:
        return None
    shown = "; ".join(f"ranks {g}: {'+'.join(labels[r] for r in g)}" for g in spanning[:4])
    more = f" (and {len(spanning) - 4} more)" if len(spanning) > 4 else ""
    try:
        fix = plan_layout(labels, sizes, order or DEFAULT_ORDER)
        advice = ("hetccl.integrations.megatron.initialize(tp=..., pp=...) instead of "
                  "initialize_model_parallel places ranks so that no tensor-parallel group "
                  "crosses vendors:\n" + fix.describe())
    except LayoutError as e:
        advice = f"no placement keeps them inside one vendor: {e}"
    msg = (f"hetccl: {len(spanning)} of Megatron's {len(groups)} tensor-parallel groups span "
           f"vendors ({shown}{more}): every tensor-parallel collective crosses the bridge "
           f"(correct, but the slowest placement). {advice}")
    if dist.get_rank() == 0 and not _tp_warned:
        _tp_warned = True
        log.warning("%s", msg)
    return msg


def _patch_parallel_state(module) -> None:
    fn = getattr(module, "initialize_model_parallel", None)
    if fn is None or getattr(fn, "_hetccl", False):
        return

    @functools.wraps(fn)
    def initialize_model_parallel(*a, **kw):
        out = fn(*a, **kw)
        try:
            check_megatron_tp_layout(kw.get("order"))
        except Exception as e:  # noqa: BLE001 - advice only, never break the user's job
            log.info("hetccl: tensor-parallel layout check skipped: %s", e)
        return out

    initialize_model_parallel._hetccl = True
    module.initialize_model_parallel = initialize_model_parallel


def _patch_megatron_random(module) -> None:
    if torch.cuda.is_available():
        return
    fn = getattr(module, "model_parallel_cuda_manual_seed", None)
    if fn is None or getattr(fn, "_hetccl", False):
        return

    @functools.wraps(fn)
    def model_parallel_cuda_manual_seed(seed, *a, **kw):
        from hetccl.integrations.megatron import install_cpu_shims, seed_model_parallel_rng
        install_cpu_shims()
        seed_model_parallel_rng(int(seed), "cpu")

    model_parallel_cuda_manual_seed._hetccl = True
    module.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


def install_framework_hooks() -> None:
    prepare_transformers_env()
    when_imported("transformers.training_args", _patch_training_args)
    when_imported("megatron.core.parallel_state", _patch_parallel_state)
    when_imported("megatron.core.tensor_parallel.random", _patch_megatron_random)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m hetccl.shim script.py [args...]", file=sys.stderr)
        return 2
    from hetccl.launch import share_gpus
    note = share_gpus(argv=argv)  # before anything initialises the GPU runtime
    if note and os.environ.get("RANK", "0") == "0":
        log.warning("%s", note)
    if config.get("HETCCL_DROPIN"):
        # `hetccl run --dropin`: the preloaded libnccl.so.2 serves torch's own NCCL process
        # group, so init_process_group keeps the script's backend
        if os.environ.get("RANK", "0") == "0":
            log.warning("hetccl run: the drop-in NCCL serves NCCL calls (init_process_group is not redirected)")
    else:
        install()
    install_framework_hooks()
    script = argv[0]
    if not os.path.isfile(script):
        print(f"hetccl run: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = argv
    # `python script.py` puts the script's folder first on sys.path (not the working directory,
    # which `python -m hetccl.shim` put there).
    folder = os.path.dirname(os.path.abspath(script))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
