"""Megatron-core over hetccl: a vendor-aware layout, one-call initialisation and a recipe runner.

    from hetccl.integrations import megatron as hm
    sess = hm.initialize(tp=2, pp=1)      # under torchrun (or pass store/launch_rank/world_size)
    ...build a megatron-core model; every parallel_state group runs over hetccl...
    sess.destroy()

`initialize` (1) reads each process's vendor label (hetccl.detect_vendor: HETCCL_VENDOR, else
detection), (2) exchanges the labels through the launcher's TCPStore *before* any process group
exists, (3) computes the placement (integrations/layout.py: TP/CP/EP groups inside one vendor
group, data-parallel groups across vendors, and pipeline stages across vendors only when a
vendor group is smaller than a model replica), (4) calls
torch.distributed.init_process_group with the *layout rank* of this process, and (5) builds
Megatron's parallel_state on top with create_gloo_process_groups=False, so every group Megatron
creates inherits the default backend.

Ranks under torchrun: torchrun's RANK is the *launch rank*. After initialize,
torch.distributed.get_rank() (and everything Megatron derives from it) is the *layout rank*;
LOCAL_RANK still picks the device. Logs that print RANK name the launch rank; the session object
holds both and `sess.layout.describe()` prints the mapping.

The recipe runner (`hetccl megatron --config recipes/megatron/<name>.yaml`; recipes are
Megatron-LM arguments plus a hetccl: block, integrations/megatron_recipe.py) trains a
megatron-core GPT through megatron-core's own schedules, DDP, distributed optimizer and
dist_checkpointing (integrations/megatron_train.py; on CPU under megatron_cpu.cuda_on_cpu()).
Under torchrun it uses the processes it is given; without torchrun it spawns the recipe's vendor
groups as local processes (CPU emulation). Pipeline stages may be sized by
hetccl.balance.plan_stages; data-parallel replicas may run different numbers of micro-batches
(per-vendor counts or hetccl.balance) with the loss normalised per token over the whole global
batch, so gradients equal a single-process run's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import math
import operator
import os
import sys
from datetime import timedelta
from typing import Any, Sequence

from .layout import DEFAULT_ORDER, Layout, LayoutError, ParallelSizes, plan_layout

__all__ = ["initialize", "Session", "LayoutError", "plan_layout", "ParallelSizes",
           "load_recipe", "RecipeError", "train", "main", "cli_main", "BACKEND",
           "install_cpu_shims", "seed_model_parallel_rng"]

# The one place that names the communication backend used by default.
BACKEND = "hetccl"

_INSTALL_HINT = ("hetccl.integrations.megatron needs megatron-core, which is an optional extra: "
                 "pip install hetccl[megatron]")
_STORE_PREFIX = "hetccl/megatron"


def require_megatron():
    """Import megatron.core.parallel_state or raise ImportError naming the extra to install."""
    try:
        from megatron.core import parallel_state  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
    import megatron.core as mc
    return mc


def vendor_label(launch_rank: int | None = None) -> str:
    """This process's vendor label, as the hetccl backend will see it (HETCCL_VENDOR_SPLIT
    labels by RANK, else by `launch_rank`)."""
    import hetccl
    return hetccl.detect_vendor(rank=launch_rank)


# --------------------------------------------------------------------------- launch plumbing
def _launch_env() -> tuple[int, int, int]:
    """(launch rank, world size, local rank) from torchrun / hetccl.launch environment."""
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ.get("LOCAL_RANK", "0")))
    except KeyError as e:
        raise RuntimeError(f"hetccl.integrations.megatron.initialize: {e.args[0]} is not set; "
                           "run under torchrun (or hetccl.launch.spawn), or pass store=, "
                           "launch_rank= and world_size=") from None


def _launcher_store(launch_rank: int, world: int, timeout: timedelta):
    """The launcher's TCPStore, opened the way torch's env:// rendezvous does: a client of
    torchrun's agent store, else rank 0 hosts it at MASTER_ADDR:MASTER_PORT."""
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, port, world, (not agent) and launch_rank == 0, timeout=timeout,
                         wait_for_workers=False)


def exchange_labels(store, launch_rank: int, world: int, label: str) -> list[str]:
    """Every process publishes its vendor label; returns all labels in launch-rank order."""
    store.set(f"vendor/{launch_rank}", label)
    return [store.get(f"vendor/{r}").decode() for r in range(world)]


# --------------------------------------------------------------------------- CPU support
def install_cpu_shims() -> None:
    """Make megatron-core's model code run on CPU. Call it after
    parallel_state.initialize_model_parallel (which creates the buffer this replaces).

    Megatron-core hard-codes CUDA in two places a CPU forward/backward reaches: the global
    memory buffer (torch.cuda.current_device()) and the model-parallel RNG tracker
    (torch.cuda RNG states). This installs CPU equivalents through Megatron's own globals.
    Megatron's schedules, DDP and optimizers allocate on "cuda" unconditionally, which is why
    the runner here uses its own (small) data-parallel step. initialize(device="cpu") calls it;
    under `hetccl run` on a machine without CUDA, model_parallel_cuda_manual_seed does."""
    import torch
    import megatron.core.utils as mu
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mr

    class CpuMemoryBuffer(mu.GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = functools.reduce(operator.mul, tensor_shape, 1)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, device="cpu")
            return buf[:n].view(*tensor_shape)

    class CpuRNGTracker(mr.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} / seed {seed} already exists")
            self.seeds_.add(seed)
            g = torch.Generator()
            g.manual_seed(seed)
            self.states_[name] = g.get_state()

        @contextlib.contextmanager
        def fork(self, name=mr._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    ps._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    mr._CUDA_RNG_STATE_TRACKER = CpuRNGTracker()
    mr._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_model_parallel_rng(seed: int, device: str) -> None:
    """Megatron's model_parallel_cuda_manual_seed for `device` ("cuda": Megatron's own; "cpu":
    the CPU tracker of install_cpu_shims(), which must have run; same offsets: +2718 + tp_rank
    for the model-parallel state, +100*ep_rank + etp_rank for experts)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mr
    if device == "cuda":
        mr.model_parallel_cuda_manual_seed(seed)
        return
    t = mr.get_cuda_rng_tracker()
    t.reset()
    tp_seed = seed + 2718 + ps.get_tensor_model_parallel_rank()
    t.add(mr._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    t.add(mr._MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)
    t.add(mr._EXPERT_PARALLEL_RNG_TRACKER_NAME,
          seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
          + ps.get_expert_tensor_parallel_rank())


# the names these helpers had before they were public
_install_cpu_shims = install_cpu_shims
_seed_model_parallel_rng = seed_model_parallel_rng


# --------------------------------------------------------------------------- one-call init
@dataclasses.dataclass
class Session:
    """What initialize() set up. rank: torch.distributed/Megatron rank (layout rank);
    launch_rank: torchrun's RANK for this process."""
    layout: Layout
    rank: int
    launch_rank: int
    local_rank: int
    world_size: int
    vendor: str
    backend: str
    device: str

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_world_size()

    def dp_group(self):
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_group(with_context_parallel=True)

    def destroy(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def initialize(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, *,
               order: str = DEFAULT_ORDER, backend: str | None = None, device: str | None = None,
               store=None, launch_rank: int | None = None, world_size: int | None = None,
               local_rank: int | None = None, vendors: Sequence[str] | None = None,
               expect_vendors: dict[str, int] | None = None, seed: int = 1234,
               timeout_s: float = 600.0, verbose: bool = False, **megatron_kwargs) -> Session:
    """Initialise torch.distributed over `backend` (default hetccl) with a vendor-aware rank
    order and Megatron-core's parallel_state with tp/pp/cp/ep/etp on top of it.

    store/launch_rank/world_size: default to the launcher's (torchrun, hetccl.launch). vendors:
    labels by launch rank (default: exchanged through the store). expect_vendors: {label: count}
    the cluster must have (a recipe's vendor groups); a mismatch raises. Raises LayoutError with
    an explanation when the sizes cannot be placed. Extra keyword arguments go to
    parallel_state.initialize_model_parallel (only those the installed version accepts).
    """
    require_megatron()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    backend = backend or BACKEND
    if backend == "hetccl":
        import hetccl  # noqa: F401 - registers the backend
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; hetccl's layout has to "
                           "choose the ranks, so call initialize() before init_process_group")
    env_rank, env_world, env_local = (None, None, None)
    if launch_rank is None or world_size is None or local_rank is None:
        if "RANK" in os.environ or launch_rank is None or world_size is None:
            env_rank, env_world, env_local = _launch_env()
    launch_rank = env_rank if launch_rank is None else launch_rank
    world_size = env_world if world_size is None else world_size
    local_rank = (env_local if env_local is not None else launch_rank) if local_rank is None \
        else local_rank
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = _launcher_store(launch_rank, world_size, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.PrefixStore(f"{_STORE_PREFIX}/{attempt}", store)

    my_label = vendor_label(launch_rank)
    # The layout renumbers ranks: pin this process's label so that the backend (which labels a
    # HETCCL_VENDOR_SPLIT process by RANK, else by its new rank) sees the one planned with.
    os.environ.setdefault("HETCCL_VENDOR", my_label)
    labels = list(vendors) if vendors is not None else \
        exchange_labels(base, launch_rank, world_size, my_label)
    if expect_vendors is not None:
        have = {v: labels.count(v) for v in dict.fromkeys(labels)}
        if have != dict(expect_vendors):
            raise LayoutError(f"the recipe describes vendor groups {dict(expect_vendors)} but the "
                              f"processes report {have} (HETCCL_VENDOR or detection)")
    sizes = ParallelSizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    layout = plan_layout(labels, sizes, order)  # raises LayoutError, identically on every rank
    rank = layout.rank_of_launch[launch_rank]

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=dist.PrefixStore("pg", base), rank=rank,
                            world_size=world_size, timeout=timeout)

    accepted = inspect.signature(ps.initialize_model_parallel).parameters
    unknown = sorted(set(megatron_kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"this megatron-core's initialize_model_parallel does not accept {unknown}")
    kwargs: dict[str, Any] = dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, order=order,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    if "create_gloo_process_groups" in accepted:
        kwargs["create_gloo_process_groups"] = False  # every group over the default backend
    kwargs.update(megatron_kwargs)
    ps.initialize_model_parallel(**kwargs)
    if device == "cpu":
        install_cpu_shims()
    seed_model_parallel_rng(seed, device)

    sess = Session(layout=layout, rank=rank, launch_rank=launch_rank, local_rank=local_rank,
                   world_size=world_size, vendor=my_label, backend=backend, device=device)
    # Megatron's own view must be the layout's; a mismatch would be a bug here, not the user's.
    assert ps.get_data_parallel_rank() == layout.dp_rank(rank), "layout / parallel_state disagree"
    if verbose and rank == 0:
        print(layout.describe(), flush=True)
    return sess


# --------------------------------------------------------------------------- recipes
# Recipes are Megatron-LM arguments plus a hetccl: block (integrations/megatron_recipe.py).
from .megatron_recipe import RecipeError, load_recipe, recipe_labels  # noqa: E402


def _sizes(rec: dict) -> ParallelSizes:
    return ParallelSizes(tp=rec["tensor_model_parallel_size"],
                         pp=rec["pipeline_model_parallel_size"],
                         cp=rec["context_parallel_size"], ep=rec["expert_model_parallel_size"],
                         etp=rec["expert_tensor_parallel_size"])


# --------------------------------------------------------------------------- synthetic data
def synthetic_sample(index: int, seq: int, vocab: int, seed: int):
    """Deterministic sample `index`: an arithmetic sequence mod vocab (learnable), and a loss
    mask of random length in [seq/2, seq] so that samples carry different token counts."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(0, vocab, (1,), generator=g, device="cpu"))
    step = int(torch.randint(1, 8, (1,), generator=g, device="cpu"))
    toks = (start + step * torch.arange(seq + 1, device="cpu")) % vocab
    n = int(torch.randint(seq // 2, seq + 1, (1,), generator=g, device="cpu"))
    mask = (torch.arange(seq, device="cpu") < n).float()
    return toks[:-1], toks[1:], mask


def _batch(indices: Sequence[int], seq: int, vocab: int, seed: int):
    import torch
    xs, ys, ms = zip(*(synthetic_sample(i, seq, vocab, seed) for i in indices))
    return torch.stack(xs), torch.stack(ys), torch.stack(ms)


# --------------------------------------------------------------------------- training
def train(rec: dict, sess: Session, iters: int | None = None, out: str | None = None,
          quiet: bool = False, progress: bool = False) -> list[dict]:
    """Train recipe `rec` on an initialised session through megatron-core's machinery
    (integrations/megatron_train.py: GPTModel, get_forward_backward_func, Megatron DDP and
    optimizer, dist_checkpointing). On CPU the block runs under megatron_cpu.cuda_on_cpu()."""
    from . import megatron_train
    if sess.device == "cpu":
        from .megatron_cpu import cuda_on_cpu
        with cuda_on_cpu():
            return megatron_train.run(rec, sess, iters=iters, out=out, quiet=quiet,
                                      progress=progress)
    return megatron_train.run(rec, sess, iters=iters, out=out, quiet=quiet, progress=progress)


# --------------------------------------------------------------------------- runner
def _run_rank(rec: dict, args: argparse.Namespace, store=None, launch_rank=None,
              world_size=None) -> list[dict]:
    h = rec["hetccl"]
    expect = {v["name"]: int(v["gpus"]) for v in h["vendors"]}
    vpp = rec["num_virtual_stages_per_pipeline_rank"]
    extra = {"virtual_pipeline_model_parallel_size": vpp} if vpp else {}
    sz = _sizes(rec)
    sess = initialize(tp=sz.tp, pp=sz.pp, cp=sz.cp, ep=sz.ep, etp=sz.etp,
                      backend=args.backend, device=h["device"], store=store,
                      launch_rank=launch_rank, world_size=world_size,
                      expect_vendors=None if args.any_vendors else expect,
                      seed=rec["seed"], verbose=not args.quiet, **extra)
    try:
        return train(rec, sess, iters=args.iters, out=args.out, quiet=args.quiet,
                     progress=args.progress)
    finally:
        sess.destroy()


def _spawned(ctx, rec, args):
    return _run_rank(rec, args, store=ctx.store(), launch_rank=ctx.rank,
                     world_size=ctx.world_size)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetccl megatron", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True,
                    help="recipe YAML: Megatron-LM arguments + a hetccl: block "
                         "(recipes/megatron/*.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe key (YAML value), e.g. --set train_iters=5 "
                         "--set hetccl.stages=plan; repeatable")
    ap.add_argument("--iters", "--steps", dest="iters", type=int, default=None,
                    help="override train_iters")
    ap.add_argument("--backend", default=None, help=f"process-group backend (default {BACKEND})")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="override hetccl.device")
    ap.add_argument("--out", default=None, help="append one JSON row per iteration here "
                                                "(written by the last rank)")
    ap.add_argument("--tag", default=None, help="label written into every JSON row")
    ap.add_argument("--quiet", action="store_true", help="no iteration lines, no layout")
    ap.add_argument("--progress", action="store_true", help="a tqdm bar instead of lines")
    ap.add_argument("--any-vendors", action="store_true",
                    help="do not require the processes' vendor labels to match the recipe")
    ap.add_argument("--emulate-vendors", action="store_true",
                    help="under torchrun: set HETCCL_VENDOR (and HETCCL_SLOWDOWN) of launch "
                         "rank i from the recipe's vendor groups (several vendors emulated on "
                         "one kind of hardware; the hetccl backend then bridges them)")
    ap.add_argument("--vendors", default=None, metavar="SPLIT",
                    help="EMULATION ONLY, the option `hetccl run` and `hetccl deepspeed` take: "
                         "vendor split such as 2+2. The recipe's hetccl.vendors define the "
                         "vendor groups, so SPLIT must list their sizes in order; it then "
                         "emulates them (under torchrun: as --emulate-vendors; without: the "
                         "local processes the runner starts anyway)")
    ap.add_argument("--layout-only", action="store_true",
                    help="print the layout for the recipe's cluster and exit (no processes)")
    ap.add_argument("--timeout", type=float, default=900.0, help="local emulation timeout (s)")
    return ap


def apply_overrides(raw: dict, sets: Sequence[str]) -> dict:
    """--set KEY=VALUE on the raw recipe mapping (hetccl.KEY for the hetccl block; VALUE is
    YAML). The recipe check then names unknown keys as for the file."""
    import yaml
    raw = dict(raw)
    for item in sets:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE")
        key, val = item.split("=", 1)
        val = yaml.safe_load(val)
        if key.startswith("hetccl."):
            het = dict(raw.get("hetccl") or {})
            het[key[len("hetccl."):]] = val
            raw["hetccl"] = het
        else:
            raw[key] = val
    return raw


def _read(args) -> dict:
    import yaml
    with open(args.config) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise RecipeError(f"{args.config}: a recipe is a YAML mapping of Megatron-LM arguments")
    raw = apply_overrides(raw, args.set)
    if args.device:
        raw["hetccl"] = {**(raw.get("hetccl") or {}), "device": args.device}
    rec = load_recipe(raw)
    if rec["name"] == "recipe":
        rec["name"] = os.path.splitext(os.path.basename(args.config))[0]
    rec["tag"] = args.tag
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        rec = _read(args)
    except (RecipeError, OSError) as e:
        print(f"hetccl megatron: {e}", file=sys.stderr)
        return 2
    vendors = rec["hetccl"]["vendors"]
    if args.vendors is not None:
        from hetccl.run import parse_split
        try:
            split = parse_split(args.vendors)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
        groups = [(v["name"], int(v["gpus"])) for v in vendors]
        if split != [n for _, n in groups]:
            ap.error(f"--vendors {args.vendors} does not match the recipe's vendor groups "
                     f"{' + '.join(f'{name}:{n}' for name, n in groups)}; the recipe's "
                     f"hetccl.vendors define the groups: edit them, or drop --vendors")
        args.emulate_vendors = True
    sizes = _sizes(rec)
    if args.layout_only:
        try:
            print(plan_layout(recipe_labels(rec), sizes).describe())
        except LayoutError as e:
            print(f"hetccl megatron: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        require_megatron()
    except ImportError as e:
        print(f"hetccl megatron: {e}", file=sys.stderr)
        return 2
    labels = recipe_labels(rec)
    slow = {v["name"]: str(float(v["slowdown"])) for v in vendors}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: one process per GPU
        if args.emulate_vendors:
            if len(labels) != int(os.environ["WORLD_SIZE"]):
                print(f"hetccl megatron: the recipe has {len(labels)} GPUs, torchrun started "
                      f"{os.environ['WORLD_SIZE']} processes", file=sys.stderr)
                return 2
            me = labels[int(os.environ["RANK"])]
            os.environ["HETCCL_VENDOR"] = me
            os.environ.setdefault("HETCCL_SLOWDOWN", slow[me])
        _run_rank(rec, args)
        return 0
    from hetccl.launch import spawn  # no launcher: emulate the recipe's cluster locally
    try:
        plan_layout(labels, sizes)  # fail fast, before starting processes
    except LayoutError as e:
        print(f"hetccl megatron: {e}", file=sys.stderr)
        return 2
    spawn(_spawned, len(labels), args=(rec, args), vendors=labels, timeout=args.timeout,
          env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
          rank_env=[{"HETCCL_SLOWDOWN": slow[v]} for v in labels])
    return 0


cli_main = main

if __name__ == "__main__":
    sys.exit(main())
