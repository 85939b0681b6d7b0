"""HuggingFace Trainer over hetccl (installed as ``hetccl.integrations.transformers``).

Two calls, both optional extras on top of an unchanged Trainer script:

    from hetccl.integrations import transformers as hhf

    hhf.init_distributed()              # BEFORE TrainingArguments(...): the one call
    args = TrainingArguments(...)       # leave ddp_backend unset
    trainer = Trainer(model, args, ...)
    hhf.balance(trainer)                # optional: per-rank batch sizes from hetccl.balance
    trainer.train()

How it hooks in (transformers 5.x / accelerate 1.15, read from their sources):

* ``TrainingArguments.__post_init__`` builds accelerate's ``PartialState``, which calls
  ``torch.distributed.init_process_group`` only when no group exists yet. init_distributed()
  registers the backend (``import hetccl``) and initialises the default group from the torchrun
  environment first, so the Trainer's DDP model, its gathers and barriers all run over hetccl.
  ``ddp_backend`` must stay unset: its argparse choices exclude third-party names and, on CPU,
  accelerate rejects every backend but gloo/mpi ("Your assigned backend ... is not available").
* On a machine without CUDA, accelerate only runs multi-process training when told to use the
  CPU (``use_cpu=True`` or ACCELERATE_USE_CPU); otherwise every rank would silently train alone.
  init_distributed() sets ACCELERATE_USE_CPU=true there (unless already set).
* balance() gives every rank its share of a fixed global batch from a ``hetccl.balance.Balancer``
  plan. It installs a rank-aware batch sampler (a subclass of transformers'
  ``BatchRebalanceSampler``, which the Trainer hands to the DataLoader as ``batch_sampler`` and
  exempts from accelerate's re-sharding) and a callback that measures this rank's compute speed
  and re-plans. Exactness: with ``average_tokens_across_devices=True`` the Trainer divides the
  summed token loss by the global token count of the step and multiplies by the world size, so
  after DDP's average every token has weight 1/global_tokens whatever the split (the same rule as
  hetccl.balance.token_loss_scale).

transformers is an optional dependency: nothing here imports it at module import time; every
entry point raises ImportError naming ``pip install hetccl[transformers]`` when it is missing.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

# The backend the integration initialises. The one place it is named (tests and the recipe
# import it from here).
BACKEND = "hetccl"

_INSTALL_HINT = ("hetccl.integrations.transformers needs HuggingFace transformers and accelerate: "
                 "pip install hetccl[transformers]")

logger = logging.getLogger("hetccl.integrations.transformers")

# HetcclBalancedSampler and HetcclBalanceCallback subclass transformers classes and are created
# on first access (module __getattr__), so they are not in __all__.
__all__ = ["BACKEND", "init_distributed", "balance", "probe_trainer_max_micro",
           "check_trainer_distributed", "require_transformers"]


def require_transformers():
    """Import transformers (and accelerate, which its Trainer needs) or raise a clear ImportError."""
    try:
        import accelerate  # noqa: F401
        import transformers
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return transformers


# --------------------------------------------------------------------------------------------
# The one call
# --------------------------------------------------------------------------------------------
def init_distributed(backend: str | None = None, *, store=None,
                     timeout_s: float | None = None) -> bool:
    """Initialise torch.distributed over hetccl so that a Trainer built afterwards uses it.

    Call it before constructing ``TrainingArguments`` (their __post_init__ sets up the device and
    would otherwise initialise a gloo/nccl group). Reads the torchrun environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; HETCCL_VENDOR names this rank's vendor).
    Returns True when a distributed group is in place, False for a plain single-process run
    (no RANK in the environment: nothing to do). Idempotent; raises RuntimeError if a group with
    a different backend already exists. ``store``: a torch.distributed Store to rendezvous on
    instead of env:// (e.g. hetccl.launch's ctx.store(), whose server the launcher owns).
    """
    require_transformers()
    import torch
    import torch.distributed as dist

    backend = backend or BACKEND
    if backend == "hetccl":
        import hetccl  # noqa: F401 - registers the "hetccl" backend
    if dist.is_initialized():
        current = str(dist.get_backend()).lower()
        if current != backend.lower():
            raise RuntimeError(
                f"torch.distributed is already initialised with backend {current!r}, not "
                f"{backend!r}. Call init_distributed() before TrainingArguments(...) is built and "
                f"leave ddp_backend unset.")
        _prefer_cpu_if_no_cuda()
        return True
    if "RANK" not in os.environ:
        return False
    rank = int(os.environ["RANK"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    _prefer_cpu_if_no_cuda()
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        from datetime import timedelta
        kwargs["timeout"] = timedelta(seconds=float(timeout_s))
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    return True


def _prefer_cpu_if_no_cuda() -> None:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def check_trainer_distributed(trainer) -> None:
    """Raise if the Trainer does not run data-parallel over the initialised process group."""
    import torch.distributed as dist
    from transformers.training_args import ParallelMode

    if not dist.is_initialized():
        return
    if trainer.args.parallel_mode != ParallelMode.DISTRIBUTED or \
            trainer.args.world_size != dist.get_world_size():
        raise RuntimeError(
            f"torch.distributed is initialised ({dist.get_backend()}, world "
            f"{dist.get_world_size()}) but the Trainer runs {trainer.args.parallel_mode} with world "
            f"{trainer.args.world_size}: on a CPU-only machine pass use_cpu=True (or call "
            f"init_distributed() before building TrainingArguments).")


# --------------------------------------------------------------------------------------------
# Compute timing: the Balancer must not time waits on other ranks
# --------------------------------------------------------------------------------------------
def _forward_timer():
    """hetccl.balance.ForwardTimer: sums the model's forward passes of one optimizer step.

    Wall time of a DDP step includes waiting for the slowest rank in the gradient all-reduce
    (inside the last micro-batch's backward), which would make every rank measure the same
    speed. The forward pass of the unwrapped model contains no communication, so its duration
    is this rank's compute up to a constant factor (backward costs about twice the forward),
    which is what the planner compares. On CUDA it is timed with device events, without
    synchronising the device (host timing of asynchronous kernels measures launches only)."""
    from hetccl.balance import ForwardTimer
    return ForwardTimer()


# --------------------------------------------------------------------------------------------
# Sampler and callback (need transformers: created on first use, see __getattr__)
# --------------------------------------------------------------------------------------------
def _even_split(n: int, k: int) -> list[int]:
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def _trainer_counts(plan, grad_accum: int) -> list[int]:
    """Samples per rank for one step: the plan's allocation, except that every rank gets at
    least ``grad_accum`` samples. The Trainer runs the same number of micro-batches
    (gradient_accumulation_steps) on every rank and a micro-batch cannot be empty, so a rank the
    planner gives fewer samples (even 0) takes them from the ranks with the most (ties: the
    highest rank) - deterministic, so every rank derives the same counts."""
    counts = [plan.samples(r) for r in range(plan.world_size)]
    need = grad_accum * len(counts)
    if sum(counts) < need:
        raise ValueError(f"global batch {sum(counts)} < world_size * gradient_accumulation_steps "
                         f"= {need}")
    for r in range(len(counts)):
        while counts[r] < grad_accum:
            donor = max(range(len(counts)), key=lambda i: (counts[i], i))
            counts[donor] -= 1
            counts[r] += 1
    return counts


def _make_sampler_class():
    require_transformers()
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    from hetccl.balance import step_indices

    class HetcclBalancedSampler(BatchRebalanceSampler):
        """Batch sampler yielding this rank's ``grad_accum`` micro-batches per optimizer step.

        Step k of epoch e covers the global batch of hetccl.balance.step_indices (one permutation
        of the dataset seeded with seed + e, cut into blocks of global_batch, trailing partial
        batch dropped): rank r takes its slice at the plan's offset and cuts it into grad_accum
        micro-batches of near-equal size. The union over the ranks is the global batch, each
        sample once, as in a homogeneous run with the same global batch and seed.

        Plans change only at announced steps (``schedule(plan, at_step)``): the Trainer and
        accelerate prefetch batches ahead of the training step, so "the plan of now" would be
        read at different moments on different ranks; an explicit step number is read
        identically everywhere. It subclasses BatchRebalanceSampler only so the Trainer passes
        it as a rank-aware batch_sampler (not re-sharded by accelerate); it shares no logic.
        """

        def __init__(self, num_samples: int, plan, rank: int, grad_accum: int,
                     seed: int = 0, shuffle: bool = True):
            # BatchRebalanceSampler.__init__ is deliberately not called (it wants lengths).
            self.n = int(num_samples)
            self.rank = int(rank)
            self.dp_size = plan.world_size
            self.grad_accum = int(grad_accum)
            self.global_batch = plan.global_batch
            self.seed, self.shuffle = int(seed), bool(shuffle)
            self.epoch = 0
            if self.global_batch < self.dp_size * self.grad_accum:
                raise ValueError(
                    f"global batch {self.global_batch} is smaller than world_size x "
                    f"gradient_accumulation_steps = {self.dp_size * self.grad_accum}")
            if self.steps_per_epoch == 0:
                raise ValueError(f"dataset of {self.n} samples holds no global batch of "
                                 f"{self.global_batch}")
            self._plans: list[tuple[int, Any]] = [(0, plan)]   # (first absolute step, plan)
            self._generated = -1          # highest absolute step whose indices were generated
            self.counts_by_step: dict[int, list[int]] = {}

        # -- plan schedule --------------------------------------------------------------------
        @property
        def steps_per_epoch(self) -> int:
            return self.n // self.global_batch

        def plan_at(self, abs_step: int):
            plan = self._plans[0][1]
            for first, p in self._plans:
                if first <= abs_step:
                    plan = p
            return plan

        def schedule(self, plan, at_step: int) -> None:
            """Use ``plan`` from absolute optimizer step ``at_step`` (0-based) on."""
            if plan.world_size != self.dp_size or plan.global_batch != self.global_batch:
                raise ValueError("a new plan must keep the world size and the global batch")
            if at_step <= self._generated:
                raise RuntimeError(
                    f"plan scheduled for step {at_step} but the sampler already produced step "
                    f"{self._generated}: the prefetch lag is larger than assumed")
            self._plans = [(f, p) for f, p in self._plans if f < at_step] + [(at_step, plan)]

        # -- iteration ------------------------------------------------------------------------
        def set_epoch(self, epoch: int) -> None:
            self.epoch = int(epoch)

        def __len__(self) -> int:
            return self.steps_per_epoch * self.grad_accum

        def micro_batches(self, abs_step: int, perm: list[int] | None = None) -> list[list[int]]:
            spe, B = self.steps_per_epoch, self.global_batch
            epoch, k = divmod(abs_step, spe)
            if perm is None:
                perm = step_indices(self.n, self.n, 0, epoch=epoch, seed=self.seed,
                                    shuffle=self.shuffle)
            idx = perm[k * B:(k + 1) * B]
            counts = _trainer_counts(self.plan_at(abs_step), self.grad_accum)
            self.counts_by_step[abs_step] = counts
            start = sum(counts[:self.rank])
            mine = idx[start:start + counts[self.rank]]
            out, off = [], 0
            for size in _even_split(len(mine), self.grad_accum):
                out.append(mine[off:off + size])
                off += size
            return out

        def __iter__(self):
            # One permutation per epoch: the same as hetccl.balance.step_indices(n, B, k, ...)
            perm = step_indices(self.n, self.n, 0, epoch=self.epoch, seed=self.seed,
                                shuffle=self.shuffle)
            for k in range(self.steps_per_epoch):
                abs_step = self.epoch * self.steps_per_epoch + k
                self._generated = max(self._generated, abs_step)
                # keep the bookkeeping small
                for old in [s for s in self.counts_by_step if s < abs_step - 64]:
                    del self.counts_by_step[old]
                yield from self.micro_batches(abs_step, perm)

    return HetcclBalancedSampler


def _make_callback_class():
    require_transformers()
    from transformers import TrainerCallback

    class HetcclBalanceCallback(TrainerCallback):
        """Times this rank's forward passes per optimizer step (hetccl.balance.ForwardTimer,
        the Balancer's timer), feeds the Balancer (collective end_step on every rank) and
        schedules each new plan on the sampler ``lag`` steps ahead. Records (step, per-rank
        sample counts) in ``history``."""

        def __init__(self, balancer, sampler, timer, lag: int, replan: bool = True):
            self.balancer, self.sampler, self.timer = balancer, sampler, timer
            self.lag, self.replan = int(lag), bool(replan)
            self.history: list[tuple[int, list[int]]] = []

        @property
        def clock(self):          # old name
            return self.timer

        def on_train_begin(self, args, state, control, **kwargs):
            trainer_model = kwargs.get("model")
            if trainer_model is not None and not self.timer.attached:
                self.timer.attach(trainer_model)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.replan:
                self.balancer.begin_step()

        def on_step_end(self, args, state, control, **kwargs):
            done = state.global_step - 1          # absolute index of the step just finished
            counts = self.sampler.counts_by_step.get(done)
            if counts is not None:
                self.history.append((done, counts))
            if not self.replan:
                return
            n = counts[self.balancer.rank] if counts is not None else None
            if self.balancer.end_step(n):       # collective over the balancer's group
                at = state.global_step + self.lag
                self.sampler.schedule(self.balancer.plan, at)
                logger.info("hetccl: new plan from step %d: %s", at, self.balancer.plan)

        def on_train_end(self, args, state, control, **kwargs):
            self.timer.detach()

    return HetcclBalanceCallback


def _compute_clock_class():
    from hetccl.balance import ForwardTimer
    return ForwardTimer


_LAZY = {"HetcclBalancedSampler": _make_sampler_class,
         "HetcclBalanceCallback": _make_callback_class,
         "ComputeClock": _compute_clock_class}      # old name of hetccl.balance.ForwardTimer
_CACHE: dict[str, type] = {}


def __getattr__(name: str):
    if name in _LAZY:
        if name not in _CACHE:
            _CACHE[name] = _LAZY[name]()
        return _CACHE[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# balance(trainer)
# --------------------------------------------------------------------------------------------
def probe_trainer_max_micro(trainer, limit: int, *, margin: float = 0.1, scan: int = 4096) -> int:
    """This rank's largest micro-batch that fits in memory for ``trainer``'s model, measured
    (hetccl.balance.probe_max_micro): forward + backward of the longest samples among the
    first ``scan`` of the training set (collated by the Trainer's data collator), doubling then
    bisecting up to ``limit`` until the device runs out of memory. Keeps ``margin`` free.
    Call before trainer.train() (the model is not yet wrapped; nothing is communicated)."""
    require_transformers()
    import torch

    from hetccl.balance import probe_max_micro

    model = trainer.model
    ds = trainer.train_dataset
    collate = trainer.data_collator
    n = min(len(ds), int(scan))

    def length(i):
        item = ds[i]
        ids = item.get("input_ids") if isinstance(item, dict) else None
        return len(ids) if ids is not None else 0

    longest = sorted(range(n), key=length, reverse=True)
    device = next(model.parameters()).device
    was_training = model.training
    model.train()

    def step(b: int) -> None:
        try:
            batch = collate([ds[i] for i in longest[:b]])
            batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            out = model(**batch)
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    try:
        return probe_max_micro(step, min(int(limit), n), device=device, margin=margin)
    finally:
        model.train(was_training)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def balance(trainer, *, global_batch: int | None = None, max_micro=None, balancer=None,
            speeds=None, min_gain: float = 0.03, threshold: float | None = None,
            replan: bool = True, group=None, seed: int | None = None,
            probe_limit: int | None = None):
    """Give every data-parallel rank of ``trainer`` its share of a fixed global batch.

    global_batch  samples per optimizer step over all ranks (default: per_device_train_batch_size
                  x gradient_accumulation_steps x world_size, what the unbalanced Trainer uses).
    max_micro     memory cap per micro-batch: an int, one per rank, or "probe" (each rank
                  measures its own with probe_trainer_max_micro up to ``probe_limit``, default
                  4 x per_device_train_batch_size, and the caps are exchanged). Default:
                  per_device_train_batch_size. The Trainer runs gradient_accumulation_steps (G)
                  micro-batches per step on every rank, so the plan gives rank r between G and
                  G x max_micro[r] samples (hetccl.balance.plan_microbatches with
                  micro_steps=G, min_samples=G: the fastest such plan); a global batch that
                  cannot fit raises ValueError saying which G would.
    balancer      a hetccl.balance.Balancer to use (default: a new one over ``group``);
    speeds        initial speeds (skips the equal-split warm-up);
    min_gain      re-plan only when the predicted step time improves by more than this
                  (relative; ``threshold`` is its old name) and by more than the noise;
    replan        False: keep the initial plan (fixed per-rank batch sizes);
    seed          permutation seed (default: args.data_seed or args.seed).

    Timing: the forwards of the model in each optimizer step (hetccl.balance.ForwardTimer;
    device events on CUDA, no synchronisation), fitted per rank as fixed + per-sample cost.

    Requires ``average_tokens_across_devices=True`` (turned on here, with a warning, if off) and
    a model that takes ``num_items_in_batch`` (all transformers causal LMs) or a
    compute_loss_func: that is what makes unequal batches give the global per-token mean.
    Returns the callback (``.balancer``, ``.sampler``, ``.history``).
    """
    require_transformers()
    import torch.distributed as dist

    from hetccl.balance import Balancer, gather_max_micro

    args = trainer.args
    check_trainer_distributed(trainer)
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        raise ValueError(
            "balance() needs the loss normalised by the global token count, but this model's "
            "forward takes no num_items_in_batch and no compute_loss_func is set: each rank "
            "would average its own batch and unequal batches would be mis-weighted.")
    if not args.average_tokens_across_devices:
        logger.warning("hetccl balance(): setting average_tokens_across_devices=True "
                       "(needed for exact loss normalisation with unequal per-rank batches)")
        args.average_tokens_across_devices = True
    if trainer.train_dataset is None or not hasattr(trainer.train_dataset, "__len__"):
        raise ValueError("balance() needs a map-style train_dataset with a length")
    if threshold is not None:
        min_gain = threshold

    init = dist.is_initialized()
    world = dist.get_world_size(group) if init else 1
    rank = dist.get_rank(group) if init else 0
    G = int(args.gradient_accumulation_steps)
    if global_batch is None:
        global_batch = args.per_device_train_batch_size * G * world
    if max_micro is None:
        max_micro = args.per_device_train_batch_size
    elif isinstance(max_micro, str):
        if max_micro != "probe":
            raise ValueError(f"max_micro must be an int, a list or 'probe', not {max_micro!r}")
        limit = probe_limit or 4 * args.per_device_train_batch_size
        mine = probe_trainer_max_micro(trainer, limit)
        max_micro = gather_max_micro(mine, group)
        logger.info("hetccl balance(): measured micro-batch caps %s", max_micro)
    timer = _forward_timer()
    try:
        if balancer is None:
            balancer = Balancer(global_batch, max_micro, group=group, min_gain=min_gain,
                                initial_speeds=speeds, micro_steps=G, min_samples=G,
                                timer=timer)
        else:
            balancer.timer = timer
            if balancer.global_batch != global_batch:
                raise ValueError(f"balancer.global_batch={balancer.global_batch} != "
                                 f"{global_batch}")
            if balancer.micro_steps != G or balancer.min_samples < G:
                logger.warning("hetccl balance(): the given Balancer should be built with "
                               "micro_steps=%d, min_samples=%d (the Trainer's "
                               "gradient_accumulation_steps)", G, G)
    except ValueError as e:
        raise ValueError(f"hetccl balance(): {e} (the Trainer runs gradient_accumulation_steps="
                         f"{G} non-empty micro-batches on every rank)") from None
    plan = balancer.plan
    caps = max_micro if isinstance(max_micro, int) else None
    caps = [caps] * world if caps is not None else list(max_micro)
    worst = max(math.ceil(plan.samples(r) / G) - caps[r] for r in range(world))
    if worst > 0:
        logger.warning("hetccl balance(): a rank's share needs micro-batches above max_micro with "
                       "gradient_accumulation_steps=%d; raise it to >= %d", G,
                       max(math.ceil(plan.samples(r) / caps[r]) for r in range(world)))

    Sampler = __getattr__("HetcclBalancedSampler")
    Callback = __getattr__("HetcclBalanceCallback")
    if seed is None:
        seed = args.data_seed if args.data_seed is not None else args.seed
    sampler = Sampler(len(trainer.train_dataset), plan, rank, G, seed=seed)
    # How far ahead of the training step the sampler runs: accelerate's DataLoaderShard keeps one
    # micro-batch ahead; DataLoader workers add num_workers x prefetch_factor.
    workers = int(args.dataloader_num_workers or 0)
    ahead = 1 + workers * int(args.dataloader_prefetch_factor or 2) if workers else 1
    lag = 1 + math.ceil(ahead / G)
    callback = Callback(balancer, sampler, timer, lag, replan=replan)
    trainer._get_train_sampler = lambda train_dataset=None: sampler  # noqa: E731
    trainer.add_callback(callback)
    return callback
