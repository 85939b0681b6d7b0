"""DeepSpeed over hetccl (ships as ``hetccl.integrations.deepspeed``).

DeepSpeed has no ``--comm_backend`` option: ``deepspeed.initialize`` asks the accelerator for a
backend name (nccl, gloo, ccl, ...) and ``deepspeed.comm.init_distributed`` only *wraps* a
torch.distributed default group that is already initialised. So the one thing hetccl has to do
is initialise the default group with backend "hetccl" before the user script reaches
``deepspeed.initialize``; DeepSpeed then runs every ZeRO collective through it.

Three entry points, from least to most code in the user's script (docs/integrations/deepspeed.md):

1. ``hetccl deepspeed [--vendors SPLIT] [deepspeed launcher args] train.py [args]``:
   a wrapper around the deepspeed launcher (backend hetccl unless ``--comm_backend`` names
   another). Each worker starts in this module (launcher ``--module``), initialises the group,
   then runs the unchanged script. The literal ``deepspeed --comm_backend hetccl ...`` does NOT
   work: the deepspeed launcher has no such option ("unrecognized arguments").
2. ``add_config_arguments(parser)`` + ``init_distributed(args)``: a script-level
   ``--comm_backend`` argument for scripts started by torchrun, srun or mpirun.
3. ``balanced_step(...)``: one optimizer step in which ranks run different numbers of
   micro-batches (ZeRO-0/1) or micro-batches of different sizes (ZeRO-2/3), planned by
   ``hetccl.balance`` (what a mixed-vendor job needs to keep its fast ranks busy);
   ``make_balancer(engine, ...)`` re-plans from measured step times.

DeepSpeed is an optional extra: it is imported only inside the functions that need it, and its
absence raises an ImportError that names ``pip install hetccl[deepspeed]``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from datetime import timedelta
from typing import Any, Callable, Sequence

EXTRA_HINT = "pip install hetccl[deepspeed]"
# Backends --comm_backend accepts. "hetccl" is ours; the others are passed to DeepSpeed as they are.
COMM_BACKENDS = ("hetccl", "nccl", "gloo", "ccl", "mpi", "hccl", "xccl")
# First argument of a worker started by the launcher wrapper (see cli_main / _worker_main).
_WORKER_FLAG = "--hetccl_worker"


def require_deepspeed():
    """Import and return the deepspeed module, or raise an ImportError saying how to get it."""
    try:
        import deepspeed
    except ImportError as e:  # ModuleNotFoundError, or a broken install raising ImportError
        raise ImportError(
            f"hetccl's DeepSpeed integration needs DeepSpeed, which could not be imported ({e}). "
            f"Install it with: {EXTRA_HINT}") from e
    return deepspeed


# --------------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------------

def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """deepspeed.add_config_arguments(parser) plus ``--comm_backend`` and ``--hetccl_vendors``.

    A drop-in for ``parser = deepspeed.add_config_arguments(parser)``; pass the parsed args to
    ``init_distributed(args)`` before ``deepspeed.initialize``. Safe to call on a parser that
    already has the DeepSpeed arguments.
    """
    ds = require_deepspeed()
    if not any("--deepspeed_config" in a.option_strings for a in parser._actions):
        parser = ds.add_config_arguments(parser)
    group = parser.add_argument_group("hetccl", "communication backend (hetccl integration)")
    if not any("--comm_backend" in a.option_strings for a in parser._actions):
        group.add_argument("--comm_backend", default=None, choices=COMM_BACKENDS,
                           help="torch.distributed backend for DeepSpeed; default: the "
                           "accelerator's own (nccl on CUDA, gloo on CPU)")
    if not any("--hetccl_vendors" in a.option_strings for a in parser._actions):
        group.add_argument("--hetccl_vendors", default=None, metavar="SPLIT",
                           help="EMULATION ONLY: vendor split such as 1+1 or 2+2; rank r gets "
                           "label v<i> of the split (sets HETCCL_VENDOR). Real mixed clusters "
                           "detect the vendor and need no flag.")
    return parser


def emulate_vendors(split: str | Sequence[int], rank: int | None = None) -> str:
    """Set this process's HETCCL_VENDOR from a split ('1+1': rank 0 -> v0, rank 1 -> v1).

    For emulating a mixed-vendor job on one kind of hardware. ``rank`` defaults to the RANK
    environment variable (the global rank; on one node it equals LOCAL_RANK)."""
    from hetccl.launch import vendor_labels

    labels = vendor_labels(split)
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    if rank >= len(labels):
        raise ValueError(f"vendor split {split!r} has {len(labels)} ranks, but this is rank {rank}")
    os.environ["HETCCL_VENDOR"] = labels[rank]
    return labels[rank]


def init_distributed(args: argparse.Namespace | None = None, *, comm_backend: str | None = None,
                     vendors: str | None = None, timeout: timedelta | None = None,
                     init_method: str | None = None, rank: int = -1,
                     world_size: int = -1) -> str:
    """Initialise torch.distributed and deepspeed.comm; return the backend in use.

    Backend choice: ``comm_backend`` > ``args.comm_backend`` > env HETCCL_DS_COMM_BACKEND
    (hetccl/config.py) > the accelerator's default. For "hetccl" the default group is created
    here, before DeepSpeed sees it: DeepSpeed would otherwise pass ``device_id`` on CUDA, which a
    Python process group cannot take. DeepSpeed then wraps the group (deepspeed.comm keeps
    using torch.distributed for every training collective). Idempotent: a second call returns
    the backend of the existing group.
    """
    ds = require_deepspeed()
    import torch
    import torch.distributed as dist

    if comm_backend is None and args is not None:
        comm_backend = getattr(args, "comm_backend", None)
    if comm_backend is None:
        from hetccl import config
        comm_backend = config.get("HETCCL_DS_COMM_BACKEND") or None
    if vendors is None and args is not None:
        vendors = getattr(args, "hetccl_vendors", None)
    if comm_backend is not None and comm_backend not in COMM_BACKENDS:
        raise ValueError(f"--comm_backend {comm_backend!r}: expected one of {COMM_BACKENDS}")
    if timeout is None:
        # DeepSpeed's own default (DEEPSPEED_TIMEOUT minutes, else 30 min).
        from deepspeed.constants import default_pg_timeout as timeout

    if dist.is_initialized():
        ds.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        return str(dist.get_backend())

    if comm_backend == "hetccl":
        if vendors:
            emulate_vendors(vendors, rank if rank >= 0 else None)
        import hetccl  # noqa: F401  registers the "hetccl" torch.distributed backend

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        # No device_id: hetccl's group is a Python ProcessGroup, and init_process_group(device_id)
        # calls pg._get_backend(device), which it does not have (integration-facts.md).
        dist.init_process_group("hetccl", init_method=init_method or "env://", timeout=timeout,
                                rank=rank, world_size=world_size)
        # cdb is None and the group exists: DeepSpeed wraps it (comm.py init_distributed).
        with _without_ds_shm_op():
            ds.init_distributed(dist_backend="hetccl", dist_init_required=False, timeout=timeout)
        return "hetccl"

    # Any other backend: DeepSpeed's own initialisation, with the backend forced if one was named.
    ds.init_distributed(dist_backend=comm_backend, timeout=timeout, init_method=init_method,
                        rank=rank, world_size=world_size)
    _unlink_ds_shm_segment()
    return str(dist.get_backend())


# DeepSpeed's CPU backend (deepspeed/comm/torch.py TorchBackend) builds its shared-memory
# all-reduce op (csrc/cpu/comm/shm.cpp) whenever all ranks are on one node, and each rank creates
# /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (69 MB) that
# nothing ever unlinks: every CPU run left one per rank behind (661 MB after a few test runs).
@contextlib.contextmanager
def _without_ds_shm_op():
    """Over hetccl, DeepSpeed's shm op is not built at all: it serves only
    deepspeed.comm.inference_all_reduce (training collectives go through torch.distributed),
    which then falls back to torch.distributed.all_reduce, i.e. to hetccl; built, it would move
    data between vendor groups through one host's memory, bypassing the bridge (between
    emulated vendors: memory a real vendor pair would not share), and leak its segments."""
    try:
        import deepspeed.comm.torch  # noqa: F401
    except ImportError:  # another DeepSpeed layout: nothing to switch off
        yield
        return
    # from sys.modules: the attribute deepspeed.comm.torch is the torch package (comm/__init__
    # star-imports comm.py, which imports torch), not DeepSpeed's module of that name
    ds_torch = sys.modules["deepspeed.comm.torch"]
    build = getattr(ds_torch, "build_shm_op", None)
    if build is None:
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _ds_shm_path(rank: int) -> str | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        return None
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def _unlink_ds_shm_segment() -> None:
    """Other backends keep DeepSpeed's shm op, but its segment is unlinked once every rank has
    mapped every other rank's (DeepSpeed's initialisation returns only then; the barrier makes
    sure all ranks are past it): the mappings stay valid, and the memory goes back to the system
    when the processes end, also when they crash."""
    import torch.distributed as dist

    path = _ds_shm_path(dist.get_rank()) if dist.is_initialized() else None
    if path is None or not os.path.exists(path):
        # no shm op in this run (ranks on several nodes, no CPU accelerator): every rank takes
        # this branch alike (DeepSpeed builds it on all ranks or on none)
        return
    dist.barrier()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------------------------
# Balanced steps: ranks run different numbers of micro-batches
# --------------------------------------------------------------------------------------------

def balanced_config(config: dict) -> dict:
    """Copy of a DeepSpeed config dict set up for ``balanced_step``.

    ``managed_gradient_accumulation: false`` makes ``engine.step()`` (not a micro-step counter)
    the accumulation boundary, so a rank may run any number of backward passes per step.
    overlap_comm is turned off for ZeRO-1 (DeepSpeed allows it with unmanaged accumulation only
    for stage 2)."""
    cfg = dict(config)
    cfg["managed_gradient_accumulation"] = False
    zero = dict(cfg.get("zero_optimization") or {})
    if int(zero.get("stage", 0)) < 2 and zero.get("overlap_comm"):
        zero["overlap_comm"] = False
        cfg["zero_optimization"] = zero
    return cfg


def lockstep_micro_steps(engine, plan) -> int | None:
    """How many backward passes every rank must run in one balanced step, or None if ranks may
    each run their own number.

    ZeRO-0/1 reduce gradients only in ``engine.step()``. ZeRO-2 reduces gradient buckets during
    every backward and ZeRO-3 also all-gathers parameters in every forward, so their ranks must
    run the same number of forward/backward passes: a rank with fewer planned micro-batches
    pads with empty ones (0 samples, no compute, only the collectives). Plans from
    balanced_plan()/make_balancer() give every rank the same count on ZeRO-2/3 (the planner's
    "lockstep" mode), so nothing is padded and every pass is balanced."""
    if engine.zero_optimization_stage() >= 2:
        return max(len(p) for p in plan.per_rank)
    return None


def _plan_mode(engine) -> str | None:
    """micro_steps for hetccl.balance.plan_microbatches: "lockstep" on ZeRO-2/3 (every pass
    is a collective, so every rank runs the same number and each pass is balanced), free on
    ZeRO-0/1."""
    return "lockstep" if engine.zero_optimization_stage() >= 2 else None


def balanced_plan(engine, global_batch: int, speeds, max_micro):
    """Optimal plan of ``global_batch`` samples for relative rank ``speeds`` (samples/s) and
    micro-batch caps ``max_micro`` (int or per rank), in the form the engine's ZeRO stage
    needs (same micro-batch count on every rank for ZeRO-2/3)."""
    from hetccl.balance import plan_microbatches
    return plan_microbatches(global_batch, speeds, max_micro, micro_steps=_plan_mode(engine))


def make_balancer(engine, global_batch: int, max_micro, **kwargs):
    """A hetccl.balance.Balancer for balanced_step(..., balancer=...): the same planner and
    step-time model as plain loops, timing the forward passes of ``engine.module`` (device
    events on CUDA; ZeRO-2's backward waits for the other ranks in its gradient reductions, the
    forward does not), with the ZeRO stage's micro-batch constraint. ``kwargs`` go to Balancer
    (min_gain, initial_speeds, group, ...). ZeRO-3 all-gathers parameters inside the forward,
    so its timings include waits: give it initial_speeds (or replan rarely) there. On ZeRO-2/3
    every pass also reduces the gradients, which the step-time model does not see: leave
    ``max_micro`` room for the fast rank's share in as many passes as the homogeneous run uses,
    or pass the per-pass reduction time as ``overhead``."""
    from hetccl.balance import Balancer, ForwardTimer
    kwargs.setdefault("micro_steps", _plan_mode(engine))
    return Balancer(global_batch, max_micro, timer=ForwardTimer(engine.module), **kwargs)


def balanced_step(engine, plan, rank: int, make_batch: Callable[[int, int], Any],
                  loss_sum: Callable[[Any, Any], Any], *, world_size: int | None = None,
                  empty_batch: Callable[[], Any] | None = None, balancer=None):
    """One optimizer step over this rank's share of the global batch, as planned by ``plan``.

    make_batch(offset, size) -> batch holding samples [offset, offset+size) of the global batch;
    loss_sum(engine, batch) -> the SUM over the batch's samples of the per-sample loss (a scalar
    tensor). Every micro-batch is back-propagated with weight loss_scale(plan, rank) /
    samples(rank), so after DeepSpeed averages over ranks the gradient is that of the mean loss
    over the whole global batch, whatever the split (hetccl.balance.loss_scale's contract).
    ``engine`` must be built from ``balanced_config(...)``. Returns the detached sum of this
    rank's per-sample losses (before scaling).

    balancer: a Balancer from make_balancer(); the step then follows balancer.plan (``plan``
    may be None), times its forwards, and ends with balancer.end_step() (a collective: every
    rank calls balanced_step); a new plan applies from the next call.
    """
    import torch
    from hetccl.balance import micro_loss_scales

    if engine.managed_gradient_accumulation():
        raise ValueError("balanced_step needs a DeepSpeed config made by balanced_config(): "
                         "'managed_gradient_accumulation' must be false")
    if balancer is not None:
        plan = balancer.plan
        balancer.begin_step()
    if plan is None:
        raise ValueError("balanced_step needs a plan or a balancer")
    sizes = list(plan.per_rank[rank])
    # Weight of micro-batch j's loss SUM: micro_loss_scales (b_j * W / B, for its mean) / b_j.
    # scale_wrt_gas=False below: DeepSpeed must not also divide by gradient_accumulation_steps.
    weights = [s / b for s, b in zip(micro_loss_scales(plan, rank, world_size), sizes)]
    steps = lockstep_micro_steps(engine, plan)
    if steps is None and not sizes:
        steps = 1  # a rank without samples still runs one empty pass (no compute)
    if steps is not None:
        weights += [0.0] * (steps - len(sizes))
        sizes += [0] * (steps - len(sizes))
    offset = plan.offsets()[rank]
    total = torch.zeros((), dtype=torch.float64, device="cpu")
    for size, weight in zip(sizes, weights):
        batch = empty_batch() if size == 0 and empty_batch is not None else make_batch(offset, size)
        offset += size
        loss = loss_sum(engine, batch)
        engine.backward(loss * weight, scale_wrt_gas=False)
        total += loss.detach().double().cpu()
    engine.step()
    if balancer is not None:
        balancer.end_step(plan.samples(rank))
    return total


# --------------------------------------------------------------------------------------------
# Launcher wrapper: `hetccl deepspeed --comm_backend hetccl ...`
# --------------------------------------------------------------------------------------------

_WRAPPER_USAGE = """\
usage: hetccl deepspeed [--vendors SPLIT] [--comm_backend {backends}]
                        [deepspeed launcher options] user_script [user_args ...]

The deepspeed launcher, with every worker over hetccl: each worker initialises torch.distributed
with backend hetccl (and DeepSpeed wraps that group) before running the unchanged user script.

Working forms:
  hetccl deepspeed --num_gpus 8 train.py --deepspeed_config ds.json
  hetccl deepspeed --vendors 1+1 --num_gpus 2 train.py ...    (emulate two vendors)
  hetccl deepspeed --dropin --vendors 1+1 --num_gpus 2 train.py ...  (the drop-in NCCL)
  any launcher, with hetccl.integrations.deepspeed.init_distributed(comm_backend="hetccl")
  called in the script before deepspeed.initialize (docs/integrations/deepspeed.md)
Does NOT work: `deepspeed --comm_backend hetccl train.py`: the deepspeed launcher has no
--comm_backend option and stops with "unrecognized arguments".

hetccl options (read before user_script only; after it they belong to the script):
  --vendors SPLIT       EMULATION ONLY: vendor split such as 1+1 or 2+2; blocks of consecutive
                        ranks get labels v0, v1, ... (HETCCL_VENDOR). `--vendors=1+1` works too.
  --comm_backend NAME   backend for the workers (default: nccl under the drop-in on a machine with
                        a CUDA GPU, else hetccl; others: DeepSpeed initialises them itself)
  --dropin              the drop-in NCCL (libnccl.so.2) in front of every worker, and DeepSpeed's
                        own nccl backend (default with it) served across vendors by hetccl; with
                        --vendors the ranks carry emulated vendor labels. The default on a
                        machine with a CUDA GPU (and the real NCCL found)
  --torch-face          the torch face (backend hetccl) even on a machine with a CUDA GPU
All other options are the deepspeed launcher's (listed below, from `deepspeed --help`).
"""


def _script_index(tokens: list[str]) -> int | None:
    """Index of the user script in deepspeed launcher arguments, found exactly as the launcher's
    own parser finds it; None if ``tokens`` do not parse (yet)."""
    import contextlib
    import io

    from deepspeed.launcher.runner import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            ds_args = parse_args(list(tokens))
    except SystemExit:
        return None
    return len(tokens) - len(ds_args.user_args) - 1  # user_args: every token after the script


def _split_wrapper_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Take --comm_backend / --vendors ('--X V' or '--X=V') out of the launcher options, i.e.
    the tokens before the user script (the same flags after it belong to the user script).
    Returns (options, remaining argv)."""
    opts: dict[str, str] = {}
    kept: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if tok in ("--dropin", "--torch-face"):
            opts[tok[2:]] = "1"
            i += 1
            continue
        if name in ("--comm_backend", "--vendors"):
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"hetccl deepspeed: {name} needs a value")
                i += 1
                val = argv[i]
            opts[name[2:]] = val
            i += 1
            continue
        if not tok.startswith("-") and _script_index(kept + argv[i:]) == len(kept):
            return opts, kept + argv[i:]  # tok is the user script
        kept.append(tok)
        i += 1
    return opts, kept


def _use_dropin(opts: dict) -> bool:
    """--dropin, or the launchers' default on this machine (hetccl.run.default_dropin: the drop-in
    on a machine with a CUDA GPU) when neither --torch-face nor a --comm_backend is given."""
    if "dropin" in opts and "torch-face" in opts:
        raise SystemExit("hetccl deepspeed: --dropin and --torch-face exclude each other")
    if "dropin" in opts:
        return True
    if "torch-face" in opts or "comm_backend" in opts:  # a backend named: as named
        return False
    from hetccl.run import default_dropin

    return default_dropin(announce=True)


def _worker_module() -> str:
    """The import name of this module, for the launcher's --module (hetccl.integrations.deepspeed
    when installed; integrations.deepspeed when run from a source checkout)."""
    spec = globals().get("__spec__")
    name = getattr(spec, "name", None) or __name__
    return "hetccl.integrations.deepspeed" if name == "__main__" else name


def launcher_argv(argv: list[str]) -> list[str]:
    """Rewrite `hetccl deepspeed` arguments into deepspeed launcher arguments (exposed for tests).

    The launcher starts this module on every rank (``--module``), which initialises the backend
    (--comm_backend, default hetccl) and then runs the user's script or module with the user's
    arguments.
    """
    if not argv:
        return argv
    # parse_args needs a user script; --help/--version go straight to the launcher.
    if not any(not a.startswith("-") for a in argv):
        return argv
    opts, rest = _split_wrapper_args(argv)
    dropin = _use_dropin(opts)
    if dropin and opts.get("comm_backend", "nccl") != "nccl":
        raise SystemExit(f"hetccl deepspeed: --dropin serves DeepSpeed's own nccl backend; it "
                         f"cannot be combined with --comm_backend {opts['comm_backend']}")
    opts.setdefault("comm_backend", "nccl" if dropin else "hetccl")
    if "vendors" in opts:
        if opts["comm_backend"] != "hetccl" and not dropin:
            raise SystemExit(f"hetccl deepspeed: --vendors emulates vendors for hetccl; it "
                             f"cannot be combined with --comm_backend {opts['comm_backend']}")
        from hetccl.run import parse_split
        try:
            parse_split(opts["vendors"])
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"hetccl deepspeed: {e}") from None
    if opts["comm_backend"] not in COMM_BACKENDS:
        raise SystemExit(f"hetccl deepspeed: --comm_backend {opts['comm_backend']!r}: expected one "
                         f"of {', '.join(COMM_BACKENDS)}")
    from deepspeed.launcher.runner import parse_args

    ds_args = parse_args(rest)
    if ds_args.no_python:
        raise SystemExit("hetccl deepspeed: --no_python is not supported (the workers must be "
                         "Python processes that initialise the backend first)")
    n_launcher = len(rest) - len(ds_args.user_args) - 1
    launcher_opts = [a for a in rest[:n_launcher] if a != "--module"]
    worker = [_WORKER_FLAG, "--comm_backend", opts["comm_backend"]]
    if "vendors" in opts:
        worker += ["--vendors", opts["vendors"]]
    if dropin:
        worker.append("--dropin")
    if ds_args.module:
        worker.append("--module")
    worker += ["--", ds_args.user_script] + list(ds_args.user_args)
    return launcher_opts + ["--module", _worker_module()] + worker


def _worker_main(argv: list[str]) -> int:
    """Runs on every rank: `[--local_rank=N] --hetccl_worker OPTS -- script args...`."""
    local_rank_arg = []
    if argv and argv[0].startswith("--local_rank"):
        local_rank_arg = [argv.pop(0)]
    assert argv and argv[0] == _WORKER_FLAG, argv
    sep = argv.index("--")
    p = argparse.ArgumentParser(prog="hetccl deepspeed worker")
    p.add_argument("--comm_backend", required=True, choices=COMM_BACKENDS)
    p.add_argument("--vendors", default=None)
    p.add_argument("--module", action="store_true")
    p.add_argument("--dropin", action="store_true")
    opts = p.parse_args(argv[1:sep])
    target, user_args = argv[sep + 1], argv[sep + 2:]
    if opts.comm_backend == "hetccl" or opts.dropin:
        # the torch face, or the drop-in NCCL (preloaded by the wrapper: launcher_env) serving
        # DeepSpeed's nccl backend across vendors; both place ranks on shared GPUs alike
        from hetccl.launch import share_gpus
        if opts.vendors:
            emulate_vendors(opts.vendors)
        # before DeepSpeed is imported: its accelerator probe initialises the GPU runtime
        note = share_gpus(argv=local_rank_arg)
        if note and os.environ.get("RANK", "0") == "0":
            print(note, file=sys.stderr, flush=True)
    init_distributed(comm_backend=opts.comm_backend, vendors=None if opts.dropin else opts.vendors)
    # The user script sees the argv the plain launcher would have given it.
    sys.argv = [target] + local_rank_arg + user_args
    if opts.module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    """`hetccl deepspeed ...` (and the per-rank worker the wrapper starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _WORKER_FLAG in argv[:2]:
        return _worker_main(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_WRAPPER_USAGE.format(backends="|".join(COMM_BACKENDS)))
        if not argv:
            return 2
    require_deepspeed()
    from deepspeed.launcher.runner import main as launcher_main

    new_argv = launcher_argv(argv)
    os.environ.update(launcher_env(argv))
    return int(launcher_main(new_argv) or 0)


def launcher_env(argv: list[str]) -> dict:
    """The variables the launcher's workers inherit for `hetccl deepspeed` arguments argv:
    with --dropin, the drop-in NCCL in front of every rank (LD_PRELOAD, the real library's
    path, HETCCL_DROPIN=1, which keeps hetccl.shim's hands off init_process_group). On other
    nodes of a multi-node launch DeepSpeed forwards only the variables of .deepspeed_env: put
    these there (`hetccl doctor` prints the LD_PRELOAD line)."""
    opts, _ = _split_wrapper_args(argv) if argv else ({}, [])
    if not _use_dropin(opts):
        return {}
    from hetccl import nccl_dropin

    env = nccl_dropin.launch_env("nccl", {})
    env["HETCCL_DROPIN"] = "1"
    return env


main = cli_main

if __name__ == "__main__":
    sys.exit(cli_main())
