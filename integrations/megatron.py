"""Megatron-core over hetccl: a vendor-aware layout, one-call initialisation and a recipe runner.

    from hetccl.integrations import megatron as hm
    sess = hm.initialize(tp=2, pp=1)      # under torchrun (or pass store/launch_rank/world_size)
    ...build a megatron-core model; every parallel_state group runs over hetccl...
    sess.destroy()

`initialize` (1) reads each process's vendor label (hetccl.detect_vendor: HETCCL_VENDOR, else
detection), (2) exchanges the labels through the launcher's TCPStore *before* any process group
exists, (3) computes the placement (integrations/layout.py: TP/CP/EP groups and pipeline stages
inside one vendor group, data-parallel groups across vendors), (4) calls
torch.distributed.init_process_group with the *layout rank* of this process, and (5) builds
Megatron's parallel_state on top with create_gloo_process_groups=False, so every group Megatron
creates inherits the default backend.

Ranks under torchrun: torchrun's RANK is the *launch rank*. After initialize,
torch.distributed.get_rank() (and everything Megatron derives from it) is the *layout rank*;
LOCAL_RANK still picks the device. Logs that print RANK name the launch rank; the session object
holds both and `sess.layout.describe()` prints the mapping.

The recipe runner (`hetccl megatron --config recipes/megatron/<name>.yaml`) trains a small
megatron-core GPT. Under torchrun it uses the processes it is given; without torchrun it spawns
the recipe's vendor groups as local processes (CPU emulation). Data-parallel replicas may run
different numbers of micro-batches (per-vendor counts or hetccl.balance); the loss is normalised
per token over the whole global batch, so gradients equal a single-process run's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import operator
import os
import sys
import time
from datetime import timedelta
from typing import Any, Sequence

from .layout import DEFAULT_ORDER, Layout, LayoutError, ParallelSizes, plan_layout

__all__ = ["initialize", "Session", "LayoutError", "plan_layout", "ParallelSizes",
           "load_recipe", "train", "main", "cli_main", "BACKEND", "install_cpu_shims",
           "seed_model_parallel_rng"]

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
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
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
_MODEL_DEFAULTS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                       seq_length=32)
_TRAIN_DEFAULTS = dict(steps=20, micro_batch=2, global_batch=None, lr=1e-3, optimizer="adam",
                       seed=1234, weight_decay=0.0, max_micro=64)


def load_recipe(path_or_dict) -> dict:
    """Read and check a recipe (see docs/integrations/megatron.md for the format)."""
    if isinstance(path_or_dict, dict):
        rec = dict(path_or_dict)
    else:
        import yaml
        with open(path_or_dict) as f:
            rec = yaml.safe_load(f)
    if not isinstance(rec, dict) or "cluster" not in rec:
        raise ValueError(f"{path_or_dict}: a recipe needs a 'cluster' section")
    vendors = rec["cluster"].get("vendors")
    if not vendors:
        raise ValueError("recipe cluster.vendors: list the vendor groups "
                         "({name, gpus, micro_batches | speed})")
    names = [v["name"] for v in vendors]
    if len(set(names)) != len(names):
        raise ValueError(f"recipe cluster.vendors: duplicate names {names}")
    for v in vendors:
        if int(v.get("gpus", 0)) < 1:
            raise ValueError(f"recipe vendor {v['name']}: gpus must be >= 1")
    balance = rec["cluster"].get("balance", "static")
    if balance not in ("static", "auto"):
        raise ValueError(f"recipe cluster.balance must be static or auto, got {balance!r}")
    if balance == "static" and not all("micro_batches" in v for v in vendors):
        raise ValueError("recipe with balance: static needs micro_batches for every vendor")
    rec["model"] = {**_MODEL_DEFAULTS, **(rec.get("model") or {})}
    rec["parallel"] = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": None,
                       **(rec.get("parallel") or {})}
    rec["train"] = {**_TRAIN_DEFAULTS, **(rec.get("train") or {})}
    rec["cluster"]["balance"] = balance
    rec.setdefault("device", "cpu")
    return rec


def recipe_labels(rec: dict) -> list[str]:
    """Vendor labels by launch rank for a local emulation of the recipe's cluster."""
    return [v["name"] for v in rec["cluster"]["vendors"] for _ in range(int(v["gpus"]))]


def micro_plan(rec: dict, layout: Layout):
    """The first step's hetccl.balance.Plan over data-parallel ranks (micro-batch sizes per rank).

    static: the recipe's per-vendor micro-batch count, micro_batch samples each (a replica that
    spans vendors takes the smallest count). auto: hetccl.balance.plan_microbatches for
    train.global_batch from the vendors' `speed` hints (default equal); the runner then lets a
    hetccl.balance.Balancer re-plan from measured throughput."""
    from hetccl.balance import Plan, plan_microbatches
    by_name = {v["name"]: v for v in rec["cluster"]["vendors"]}
    reps = layout.replica_vendors()
    mb = int(rec["train"]["micro_batch"])
    if rec["cluster"]["balance"] == "static":
        per = [[mb] * min(int(by_name[v]["micro_batches"]) for v in vs) for vs in reps]
        return Plan(per_rank=per, global_batch=sum(map(sum, per)), micro_batch=mb)
    gb = rec["train"]["global_batch"]
    if not gb:
        raise ValueError("recipe with balance: auto needs train.global_batch")
    return plan_microbatches(int(gb), replica_speeds(rec, layout), int(rec["train"]["max_micro"]),
                             micro_batch=mb)


def replica_speeds(rec: dict, layout: Layout) -> list[float]:
    """Relative speed hint of each data-parallel replica: its slowest vendor's `speed`."""
    by_name = {v["name"]: v for v in rec["cluster"]["vendors"]}
    return [min(float(by_name[v].get("speed", 1.0)) for v in vs)
            for vs in layout.replica_vendors()]


# --------------------------------------------------------------------------- synthetic data
def synthetic_sample(index: int, seq: int, vocab: int, seed: int):
    """Deterministic sample `index`: an arithmetic sequence mod vocab (learnable), and a loss
    mask of random length in [seq/2, seq] so that samples carry different token counts."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(0, vocab, (1,), generator=g))
    step = int(torch.randint(1, 8, (1,), generator=g))
    toks = (start + step * torch.arange(seq + 1)) % vocab
    n = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
    mask = (torch.arange(seq) < n).float()
    return toks[:-1], toks[1:], mask


def _batch(indices: Sequence[int], seq: int, vocab: int, seed: int):
    import torch
    xs, ys, ms = zip(*(synthetic_sample(i, seq, vocab, seed) for i in indices))
    return torch.stack(xs), torch.stack(ys), torch.stack(ms)


# --------------------------------------------------------------------------- training
def build_gpt(rec: dict, device: str):
    """A small megatron-core GPTModel with the local (Transformer-Engine-free) layer spec,
    initialised on CPU from the recipe seed so that any tp split starts from the same weights."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core import parallel_state as ps
    m = rec["model"]
    cfg = TransformerConfig(
        num_layers=int(m["num_layers"]), hidden_size=int(m["hidden_size"]),
        num_attention_heads=int(m["num_attention_heads"]),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    torch.manual_seed(int(rec["train"]["seed"]))
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=int(m["vocab_size"]), max_sequence_length=int(m["seq_length"]))
    return model.to(device)


def train(rec: dict, sess: Session, steps: int | None = None, out: str | None = None,
          normalisation: str = "token") -> list[dict]:
    """Train the recipe's GPT for `steps` steps; returns (and on rank 0 appends to `out`) one row
    per step: loss (global per-token mean of the step's batch, before the update), step_time_s,
    tokens, the micro-batch plan.

    Each step: data-parallel rank d runs the micro-batches plan.per_rank[d] (the global batch's
    samples dealt out in dp-rank order, plan.offsets()). The SUM of its per-token losses is
    multiplied by hetccl.balance.token_loss_scale (dp_size / global tokens) and gradients are
    averaged over the data-parallel group (hetccl.balance.allreduce_gradients): every parameter
    gets sum over all tokens of d(loss_t) / global_tokens, what one process would compute,
    however unequal the replicas' micro-batch counts. normalisation="rank_mean" (each replica
    averages its own tokens, replicas averaged equally: the naive way) exists so that tests can
    show the difference. With balance: auto a Balancer re-plans from measured throughput; all
    ranks of one replica use the replica's slowest member's rate, so TP peers agree."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from hetccl.balance import Balancer, allreduce_gradients, token_loss_scale
    from hetccl.balance.emulate import slow_down

    if ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_context_parallel_world_size() > 1:
        raise NotImplementedError("the recipe runner trains with pp=1 and cp=1 (initialize() "
                                  "supports pp/cp layouts; see docs/integrations/megatron.md)")
    t, m = rec["train"], rec["model"]
    steps = int(t["steps"] if steps is None else steps)
    dev = sess.device
    model = build_gpt(rec, dev)
    params = [p for p in model.parameters() if p.requires_grad]
    if t["optimizer"] == "sgd":
        opt = torch.optim.SGD(params, lr=float(t["lr"]))
    else:
        opt = torch.optim.Adam(params, lr=float(t["lr"]), weight_decay=float(t["weight_decay"]))
    plan = micro_plan(rec, sess.layout)
    dp, d = sess.dp_size, sess.dp_rank
    bal = None
    if rec["cluster"]["balance"] == "auto":
        bal = Balancer(plan.global_batch, int(t["max_micro"]), micro_batch=int(t["micro_batch"]),
                       initial_speeds=replica_speeds(rec, sess.layout), rank=d, world_size=dp,
                       threshold=float(t.get("rebalance_threshold", 0.1)))
        plan = bal.plan
    seq, vocab, seed = int(m["seq_length"]), int(m["vocab_size"]), int(t["seed"])
    dp_group = sess.dp_group()
    cdev = torch.device(dev)
    pos = torch.arange(seq, device=dev).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=dev), diagonal=1)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    rows, consumed = [], 0
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        base = consumed + plan.offsets()[d]
        micro, k = [], base
        for size in plan.per_rank[d]:
            micro.append(_batch(range(k, k + size), seq, vocab, seed))
            k += size
        local_tokens = int(sum(float(msk.sum()) for _, _, msk in micro))
        if normalisation == "token":
            scale = token_loss_scale(local_tokens, group=dp_group, device=cdev)
        elif normalisation == "rank_mean":
            scale = 1.0 / max(local_tokens, 1)
        else:
            raise ValueError(normalisation)
        loss_sum = 0.0
        with slow_down() as sd:  # HETCCL_SLOWDOWN: emulated slower vendor (1.0: no effect)
            tc = time.perf_counter()
            for x, y, msk in micro:
                x, y, msk = x.to(dev), y.to(dev), msk.to(dev)
                per_tok = model(x, pos.expand(x.shape[0], -1), causal, labels=y)  # [b, s]
                tok_sum = (per_tok.float() * msk).sum()
                (tok_sum * scale).backward()
                loss_sum += float(tok_sum.detach())
            sync()
            compute_s = time.perf_counter() - tc
        compute_s += sd.slept if sd.slept > 0 else 0.0
        allreduce_gradients(params, group=dp_group)  # SUM / dp_size, one flat buffer
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = torch.tensor([loss_sum, float(local_tokens)], dtype=torch.float64, device=dev)
        dist.all_reduce(stats, group=dp_group)
        sync()
        dt = time.perf_counter() - t0
        row = dict(step=step, loss=float(stats[0] / stats[1]), tokens=int(stats[1]),
                   step_time_s=dt, micro_batches=[len(x) for x in plan.per_rank],
                   global_batch=plan.global_batch, backend=sess.backend, device=dev,
                   world=sess.world_size, tp=ps.get_tensor_model_parallel_world_size(), dp=dp,
                   vendors=sess.layout.vendors, placement=sess.layout.placement)
        consumed += plan.global_batch
        if bal is not None:
            # Every rank's samples/s, gathered world-wide; a replica runs at its slowest rank.
            rate = plan.samples(d) / compute_s if compute_s > 0 and plan.samples(d) else None
            rates: list = [None] * sess.world_size
            dist.all_gather_object(rates, rate)
            rep = [None] * dp
            for r, v in enumerate(rates):
                dr = sess.layout.dp_rank(r)
                if v is not None:
                    rep[dr] = v if rep[dr] is None else min(rep[dr], v)
            if bal.update(rep):
                plan = bal.plan
            row["rates"] = rep
        rows.append(row)
        if sess.rank == 0:
            print(f"step {step:4d}  loss {row['loss']:.5f}  {dt * 1e3:8.1f} ms  "
                  f"tokens {row['tokens']}  micro-batches per dp rank {row['micro_batches']}",
                  flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps({**row, "recipe": rec.get("name", "")}) + "\n")
    return rows


# --------------------------------------------------------------------------- runner
def _run_rank(rec: dict, args: argparse.Namespace, store=None, launch_rank=None,
              world_size=None) -> list[dict]:
    p = rec["parallel"]
    expect = {v["name"]: int(v["gpus"]) for v in rec["cluster"]["vendors"]}
    sess = initialize(tp=int(p["tp"]), pp=int(p["pp"]), cp=int(p["cp"]), ep=int(p["ep"]),
                      etp=p["etp"], backend=args.backend or rec.get("backend"),
                      device=args.device or rec["device"], store=store,
                      launch_rank=launch_rank, world_size=world_size,
                      expect_vendors=None if args.any_vendors else expect,
                      seed=int(rec["train"]["seed"]), verbose=True)
    try:
        return train(rec, sess, steps=args.steps, out=args.out)
    finally:
        sess.destroy()


def _spawned(ctx, rec, args):
    return _run_rank(rec, args, store=ctx.store(), launch_rank=ctx.rank,
                     world_size=ctx.world_size)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetccl megatron", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="recipe YAML (recipes/megatron/*.yaml)")
    ap.add_argument("--steps", type=int, default=None, help="override train.steps")
    ap.add_argument("--backend", default=None, help=f"process-group backend (default {BACKEND})")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="override device")
    ap.add_argument("--out", default=None, help="append one JSON row per step here (rank 0)")
    ap.add_argument("--any-vendors", action="store_true",
                    help="do not require the processes' vendor labels to match the recipe")
    ap.add_argument("--emulate-vendors", action="store_true",
                    help="under torchrun: set HETCCL_VENDOR of launch rank i to the i-th label "
                         "of the recipe's vendor groups (several vendors emulated on one kind "
                         "of hardware; the hetccl backend then bridges them like real ones)")
    ap.add_argument("--vendors", default=None, metavar="SPLIT",
                    help="EMULATION ONLY, the option `hetccl run` and `hetccl deepspeed` take: "
                         "vendor split such as 2+2. The recipe's cluster.vendors define the "
                         "vendor groups, so SPLIT must list their sizes in order; it then "
                         "emulates them (under torchrun: as --emulate-vendors; without: the "
                         "local processes the runner starts anyway)")
    ap.add_argument("--layout-only", action="store_true",
                    help="print the layout for the recipe's cluster and exit (no processes)")
    ap.add_argument("--timeout", type=float, default=900.0, help="local emulation timeout (s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    rec = load_recipe(args.config)
    if args.vendors is not None:
        from hetccl.run import parse_split
        try:
            split = parse_split(args.vendors)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
        groups = [(v["name"], int(v["gpus"])) for v in rec["cluster"]["vendors"]]
        if split != [n for _, n in groups]:
            ap.error(f"--vendors {args.vendors} does not match the recipe's vendor groups "
                     f"{' + '.join(f'{name}:{n}' for name, n in groups)}; the recipe's "
                     f"cluster.vendors define the groups: edit them, or drop --vendors")
        args.emulate_vendors = True
    p = rec["parallel"]
    sizes = ParallelSizes(tp=int(p["tp"]), pp=int(p["pp"]), cp=int(p["cp"]), ep=int(p["ep"]),
                          etp=p["etp"])
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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: one process per GPU
        if args.emulate_vendors:
            labels = recipe_labels(rec)
            if len(labels) != int(os.environ["WORLD_SIZE"]):
                print(f"hetccl megatron: the recipe has {len(labels)} GPUs, torchrun started "
                      f"{os.environ['WORLD_SIZE']} processes", file=sys.stderr)
                return 2
            os.environ["HETCCL_VENDOR"] = labels[int(os.environ["RANK"])]
        _run_rank(rec, args)
        return 0
    from hetccl.launch import spawn  # no launcher: emulate the recipe's cluster locally
    labels = recipe_labels(rec)
    try:
        plan_layout(labels, sizes)  # fail fast, before starting processes
    except LayoutError as e:
        print(f"hetccl megatron: {e}", file=sys.stderr)
        return 2
    slow = {v["name"]: str(float(v.get("slowdown", 1.0))) for v in rec["cluster"]["vendors"]}
    spawn(_spawned, len(labels), args=(rec, args), vendors=labels, timeout=args.timeout,
          env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
          rank_env=[{"HETCCL_SLOWDOWN": slow[v]} for v in labels])
    return 0


cli_main = main

if __name__ == "__main__":
    sys.exit(main())
