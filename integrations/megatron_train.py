"""`hetccl megatron`: train a recipe through megatron-core's own training machinery.

What runs is megatron-core's, not a re-implementation: ``GPTModel`` (local layer spec, no
Transformer Engine), ``get_forward_backward_func`` (no pipelining, 1F1B; interleaving is wired
but refused by the recipe check: its losses do not match pp=1 yet, see the megatron doc),
``megatron.core.distributed.DistributedDataParallel`` with ``finalize_model_grads``, the
``DistributedOptimizer`` (or Megatron's float16/fp32 optimizer wrappers) from
``get_megatron_optimizer``, ``OptimizerParamScheduler``, and ``dist_checkpointing`` (torch_dist
format) for save / load / resume. hetccl supplies what sits around it:

* the vendor-aware rank layout and parallel_state over hetccl (megatron.initialize): TP/CP/EP
  inside a vendor group; pipeline neighbours on different vendors exchange activations and
  gradients through the bridge (p2p), neighbours on one vendor through the native library;
* the layers of each pipeline stage: even, a list, or planned by
  ``hetccl.balance.plan_stages`` from per-layer forward+backward time measured on every
  stage's device and from its memory, given to megatron-core as
  ``pipeline_model_parallel_layout`` (any split);
* data-parallel micro-batches per replica (balance: none | static | auto): replicas may run
  different numbers of micro-batches; with ``calculate_per_token_loss`` Megatron's
  finalize_model_grads divides by the global token count, so the update is exact whatever the
  split;
* deterministic initialisation by *global* parameter name (layer numbers counted over the
  whole model, tensor-parallel shards cut from the full tensor), so any tp / pp / vpp layout
  starts from the same weights and runs can be compared loss for loss;
* synthetic data made in code (``megatron.synthetic_sample``: learnable sequences with loss
  masks of random length), identical for any layout;
* Megatron-LM-style iteration lines and one JSON row per iteration.

On a machine without CUDA the same code runs on CPU under ``megatron_cpu.cuda_on_cpu()``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
import zlib
from datetime import datetime
from typing import Any

from .megatron_recipe import flops_per_iteration, param_count, pipeline_layers

__all__ = ["run", "build_layout", "stage_layout", "measure_stage_costs", "plan_pipeline"]


# --------------------------------------------------------------------------- layouts
def stage_layout(virtual_layers: list[int]) -> list[list[str]]:
    """megatron-core's pipeline_model_parallel_layout (list form) for layers per *virtual*
    stage in model order (k = chunk * pp + stage): the embedding opens the first, the loss
    closes the last."""
    out = []
    for k, n in enumerate(virtual_layers):
        row = (["embedding"] if k == 0 else []) + ["decoder"] * int(n)
        if k == len(virtual_layers) - 1:
            row.append("loss")
        out.append(row)
    return out


def virtual_layers(stage_layers: list[int], vpp: int) -> list[int]:
    """Layers per virtual stage (chunk c of stage s = virtual stage c * pp + s) when each stage's
    layers are split as evenly as possible over its vpp chunks."""
    from hetccl.balance.stages import chunk_split
    p = len(stage_layers)
    ch = [chunk_split(n, vpp) for n in stage_layers]
    return [ch[k % p][k // p] for k in range(p * vpp)]


# --------------------------------------------------------------------------- model
def transformer_config(rec: dict, *, num_layers: int | None = None, layout=None,
                       pp: int | None = None, vpp: int | None = None, device: str = "cpu"):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = torch.bfloat16 if rec["bf16"] else torch.float32
    kw: dict[str, Any] = dict(
        num_layers=num_layers or rec["num_layers"], hidden_size=rec["hidden_size"],
        num_attention_heads=rec["num_attention_heads"],
        ffn_hidden_size=rec["ffn_hidden_size"],
        num_query_groups=rec["num_query_groups"] if rec["group_query_attention"] else None,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size() if pp is None
        else pp,
        context_parallel_size=ps.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        # Megatron-LM's p2p choice: with interleaving, separate isend/irecv overlapped with
        # compute unless the recipe turns it off; without it, one batch_isend_irecv (Megatron-LM
        # forces overlap off for the non-interleaved schedule)
        overlap_p2p_comm=bool(vpp) and rec.get("overlap_p2p_comm", True),
        batch_p2p_comm=not (bool(vpp) and rec.get("overlap_p2p_comm", True)),
        pipeline_model_parallel_layout=layout,
        use_cpu_initialization=True, perform_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=rec["bf16"],
        hidden_dropout=rec["hidden_dropout"], attention_dropout=rec["attention_dropout"],
        init_method_std=rec["init_method_std"], normalization=rec["normalization"],
        gated_linear_unit=rec["swiglu"], calculate_per_token_loss=rec["calculate_per_token_loss"],
        masked_softmax_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    if rec["swiglu"]:
        import torch.nn.functional as F
        kw["activation_func"] = F.silu
        if rec["ffn_hidden_size"] is None:
            kw["ffn_hidden_size"] = int(8 * rec["hidden_size"] / 3 / 64 + 0.999) * 64 \
                if rec["hidden_size"] >= 64 else int(8 * rec["hidden_size"] / 3)
    kw = {k: v for k, v in kw.items() if v is not None or k in ("pipeline_model_parallel_layout",)}
    return TransformerConfig(**kw)


def _gpt(rec: dict, cfg, *, pre: bool, post: bool, vp_stage: int | None, tied: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    spec = get_gpt_layer_local_spec(normalization=rec["normalization"])
    kw = dict(config=cfg, transformer_layer_spec=spec, vocab_size=rec["vocab_size"],
              max_sequence_length=rec["max_position_embeddings"], pre_process=pre,
              post_process=post, share_embeddings_and_output_weights=tied,
              position_embedding_type=rec["position_embedding_type"])
    if vp_stage is not None:
        kw["vp_stage"] = vp_stage
    return GPTModel(**kw)


def deterministic_init(chunks, rec: dict, seed: int) -> int:
    """Re-initialise every matrix (dim >= 2) of the model chunks from a generator seeded by its
    *global* name, so that any tp / pp / vpp layout holds the same weights: decoder layers are
    renamed by their global layer number (``layer_number - 1``), a tied output layer takes the
    word embedding's name, and a tensor-parallel shard is cut from the full tensor drawn whole.
    Values: normal(0, init_method_std), output projections (linear_proj, linear_fc2) scaled by
    1 / sqrt(2 num_layers) as Megatron's scaled init; norms and biases keep Megatron's constant
    init. Returns the number of tensors set."""
    import torch
    from megatron.core import parallel_state as ps
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    std = rec["init_method_std"]
    scaled = std / math.sqrt(2.0 * rec["num_layers"])
    n = 0
    for chunk in chunks:
        rename = {}
        dec = getattr(chunk, "decoder", None)
        for i, layer in enumerate(getattr(dec, "layers", []) or []):
            rename[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
        for name, p in chunk.named_parameters():
            if p.dim() < 2:
                continue
            g = name
            for a, b in rename.items():
                if g.startswith(a):
                    g = b + g[len(a):]
                    break
            if g == "output_layer.weight" and not rec["untie_embeddings_and_output_weights"]:
                g = "embedding.word_embeddings.weight"
            s = scaled if g.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", -1)
            sharded = getattr(p, "tensor_model_parallel", False) and tp > 1 and dim >= 0
            if sharded:
                shape[dim] *= tp
            gen = torch.Generator(device=p.device).manual_seed(
                (int(seed) * 1_000_003 + zlib.crc32(g.encode())) % (2**63))
            full = torch.empty(shape, dtype=torch.float32, device=p.device)
            full.normal_(0.0, s, generator=gen)
            if sharded:
                full = full.chunk(tp, dim=dim)[tpr]
            with torch.no_grad():
                p.copy_(full.to(p.dtype))
            n += 1
    return n


def build_model(rec: dict, stage_layers: list[int] | None, device: str, layout=None):
    """The model chunks of this rank (megatron-core GPTModel, one per virtual stage), initialised
    deterministically (deterministic_init), on `device`, and their TransformerConfig."""
    from megatron.core import parallel_state as ps
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = rec["num_virtual_stages_per_pipeline_rank"]
    if layout is None and pp > 1:
        layout = stage_layout(virtual_layers(stage_layers, vpp or 1))
    cfg = transformer_config(rec, layout=layout, vpp=vpp, device=device)
    tied = not rec["untie_embeddings_and_output_weights"]
    chunks = []
    for c in range(vpp or 1):
        vs = c if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs)
        chunks.append(_gpt(rec, cfg, pre=pre, post=post, vp_stage=vs, tied=tied).to(device))
    # With tied embeddings and pp > 1 the last stage's output layer is a copy of stage 0's word
    # embedding (Megatron all-reduces it at construction and keeps the two in sync through the
    # embedding group); deterministic_init gives both the embedding's global name, so they
    # start equal, as Megatron's copy would make them.
    deterministic_init(chunks, rec, rec["seed"])
    return [half_precision(c, cfg, rec) for c in chunks], cfg


def half_precision(model, cfg, rec: dict):
    """bf16 as Megatron-LM's get_model does it: the chunk inside megatron-core's Float16Module,
    which casts every parameter to bf16 (params_dtype covers the linear layers but not the local
    spec's torch norms, whose fp32 output then met bf16 weights: "expected mat1 and mat2 to have
    the same dtype", the GPU recipe's failure), feeds the first stage bf16 and hands the last
    stage's output back in fp32 for the loss. fp32 recipes get the chunk unchanged."""
    if not rec["bf16"]:
        return model
    from megatron.core.transformer.module import Float16Module
    return Float16Module(cfg, model)


def gpt_of(chunk):
    """The GPTModel inside a chunk (through DDP and Float16Module)."""
    m = getattr(chunk, "module", chunk)
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    return m


# --------------------------------------------------------------------------- data
def _micro_batches(rec: dict, first_sample: int, counts: list[int], device: str):
    """This replica's micro-batches: samples first_sample, first_sample + 1, ... (counts: the
    sizes of its micro-batches)."""
    import torch
    from .megatron import _batch
    seq, vocab, seed = rec["seq_length"], rec["vocab_size"], rec["seed"]
    pos = torch.arange(seq, device="cpu").unsqueeze(0)
    out, k = [], first_sample
    for size in counts:
        x, y, m = _batch(range(k, k + size), seq, vocab, seed)
        out.append(dict(tokens=x.to(device), labels=y.to(device), loss_mask=m.to(device),
                        position_ids=pos.expand(size, -1).to(device)))
        k += size
    return out


def _loss_func(loss_mask, output_tensor):
    """Megatron-LM's GPT loss with calculate_per_token_loss: (sum of masked token losses,
    token count, {'lm loss': [sum, count]}) -- the schedule sums the counts, finalize_model_grads
    divides the gradients by the global count."""
    import torch
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses.view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.stack([total.detach().clone(), mask.sum().detach()])
    return total, tokens, {"lm loss": report}


def _loss_func_mean(loss_mask, output_tensor):
    """calculate_per_token_loss: false (Megatron's per-micro-batch mean; the schedule divides by
    the micro-batch count)."""
    import torch
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses.view(-1) * mask)
    report = torch.stack([total.detach().clone(), mask.sum().detach()])
    return total / mask.sum(), {"lm loss": report}


# --------------------------------------------------------------------------- stage planning
def _probe_once(rec: dict, k: int, device: str, iters: int) -> float:
    """Median seconds of forward + backward of one micro-batch through a GPT with k layers on
    this rank's device (embedding and output layer included; emulated slow-down applied as in
    training). Built with this rank's pipeline position but pre- and post-processing on, so
    it needs no other stage."""
    import torch
    from megatron.core import parallel_state as ps
    from hetccl.balance.emulate import slow_down_modules
    p, s = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    layout = None
    if p > 1:
        layout = [[] for _ in range(p * (vpp or 1))]
        layout[s] = ["decoder"] * k
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
    cfg = transformer_config(rec, num_layers=k, layout=layout, vpp=vpp, device=device)
    gpt = _gpt(rec, cfg, pre=True, post=True, vp_stage=0 if vpp else None,
               tied=False).to(device)
    model = half_precision(gpt, cfg, rec)
    slow = slow_down_modules(list(gpt.decoder.layers) + [gpt.output_layer],
                             device=device if device == "cuda" else None)
    mb = _micro_batches(rec, 0, [rec["micro_batch_size"]], device)[0]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(iters + 2):
        sync()
        t0 = time.perf_counter()
        out = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
        (out.float() * mb["loss_mask"]).sum().backward()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    slow.remove()
    del model
    # the fastest repetition: other work on the machine only ever adds to a timing, and the
    # per-layer time is a difference of two of these (a load spike in one skewed the plan)
    return min(times)


def _bytes_per(rec: dict, dp: int, tp: int) -> dict:
    """Memory model of one layer and of the embedding / output layer (LayerMemory fields,
    bytes): weights + fp32 gradients + Adam state (fp32 main weights too with bf16), the
    optimizer state divided over data-parallel ranks with the distributed optimizer; activations
    per micro-batch after Korthikanti et al. (s b h (34 + 5 a s / h) bytes in 16-bit, twice in
    fp32), divided by tp."""
    h, s, b, a = rec["hidden_size"], rec["seq_length"], rec["micro_batch_size"], \
        rec["num_attention_heads"]
    V = rec["vocab_size"]
    wbytes = 2 if rec["bf16"] else 4
    opt = (8 + (4 if rec["bf16"] else 0)) if rec["optimizer"] == "adam" else (
        4 if rec["bf16"] else 0)
    if rec["use_distributed_optimizer"]:
        opt = opt / dp
    per_param = wbytes + 4 + opt
    one = dict(rec, num_layers=1, vocab_size=0, max_position_embeddings=0)
    layer_params = param_count(one) - (2 * h if rec["normalization"] == "LayerNorm" else h)
    act = s * b * h * (34 + 5 * a * s / h) * (wbytes / 2) / tp
    return dict(static=layer_params * per_param / tp, activation=act,
                first_static=V * h * per_param / tp, first_activation=s * b * h * wbytes,
                last_static=(V * h * per_param / tp) if rec["untie_embeddings_and_output_weights"]
                else 0.0, last_activation=s * b * V * 4 * 2 / tp)


def measure_stage_costs(rec: dict, sess, device: str) -> dict:
    """Per-layer time and memory of this rank's device, for the stage planner: the fastest
    forward+backward time of a 1-layer and a 3-layer GPT (one micro-batch); layer time =
    (t3 - t1) / 2, and t1 - layer time is the embedding + output layer + loss (given to the
    last stage). Memory: the vendor's memory_gib, else the device's free memory (CUDA) or
    unlimited (CPU)."""
    import torch
    iters = rec["hetccl"]["probe_iters"]
    t1 = _probe_once(rec, 1, device, iters)
    t3 = _probe_once(rec, 3, device, iters)
    layer = max((t3 - t1) / 2.0, 1e-9)
    extra = max(t1 - layer, 0.0)
    by = {v["name"]: v for v in rec["hetccl"]["vendors"]}
    mem = by.get(sess.vendor, {}).get("memory_gib")
    if mem is not None:
        memory = mem * 2**30
    elif device == "cuda":
        memory = float(torch.cuda.mem_get_info()[0]) * 0.9
    else:
        memory = math.inf
    return dict(layer_time=layer, extra_time=extra, t1=t1, t3=t3, memory=memory)


def plan_pipeline(rec: dict, sess, device: str, num_micro: int) -> tuple[list[int], dict]:
    """Layers per pipeline stage from hetccl.balance.plan_stages: every rank measures its
    device (measure_stage_costs), the measurements are gathered world-wide, a stage's time is
    its slowest rank's and its memory its smallest; every rank then computes the same plan.
    Returns (layers per stage, report)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from hetccl.balance.stages import (LayerMemory, StageDevice, even_split, evaluate,
                                       plan_stages)
    mine = measure_stage_costs(rec, sess, device)
    mine["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    mine["vendor"] = sess.vendor
    allm: list = [None] * dist.get_world_size()
    dist.all_gather_object(allm, mine)
    p = ps.get_pipeline_model_parallel_world_size()
    vpp = rec["num_virtual_stages_per_pipeline_rank"] or 1
    devs = []
    for s in range(p):
        rows = [r for r in allm if r["pp_rank"] == s]
        vend = sorted({r["vendor"] for r in rows})
        devs.append(StageDevice(layer_time=max(r["layer_time"] for r in rows),
                                memory=min(r["memory"] for r in rows),
                                last_time=max(r["extra_time"] for r in rows) if s == p - 1 else 0,
                                name=f"stage {s} ({'+'.join(vend)})"))
    mem = LayerMemory(**_bytes_per(rec, ps.get_data_parallel_world_size(),
                                   ps.get_tensor_model_parallel_world_size()))
    plan = plan_stages(rec["num_layers"], devs, num_micro, memory=mem, vpp=vpp)
    report = dict(planned=list(plan.layers), planned_step_s=plan.est_step_time,
                  stage_layer_ms=[d.layer_time * 1e3 for d in devs],
                  head_ms=devs[-1].last_time * 1e3, describe=plan.describe())
    if rec["num_layers"] % p == 0:
        ev = evaluate(even_split(rec["num_layers"], p), devs, num_micro, memory=mem, vpp=vpp)
        report["even_step_s"] = ev.est_step_time
    return list(plan.layers), report


# --------------------------------------------------------------------------- checkpoints
def _ckpt_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _tracker(root: str) -> str:
    return os.path.join(root, "latest_checkpointed_iteration.txt")


def _state(chunks, optimizer, is_loading: bool) -> dict:
    model_sd = {}
    for i, c in enumerate(chunks):
        model_sd[f"model{i}" if len(chunks) > 1 else "model"] = c.module.sharded_state_dict()
    flat = {}
    for v in model_sd.values():
        flat.update(v)
    st = dict(model_sd)
    # dp_reshardable (Megatron-LM's default): each rank saves its own optimizer buckets, no
    # gathering; a checkpoint resumes on the same tp / pp layout (any dp). The model itself is
    # saved by global parameter names, so it would load into another layout too.
    st["optimizer"] = optimizer.sharded_state_dict(
        flat, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return st


@contextlib.contextmanager
def _children_allowed():
    """dist_checkpointing's torch_dist writer starts processes (a multiprocessing Manager for its
    results queue, forked writers). The local emulation (hetccl.launch.spawn) runs ranks as
    daemonic processes, which multiprocessing forbids to have children; for the duration of a
    save such a rank is marked non-daemonic: the forked writers are joined inside the save, and
    the Manager is shut down after it (a daemonic rank ends without running exit handlers, which
    would leave the Manager orphaned, holding the launcher's output pipes). Under torchrun
    nothing changes."""
    import multiprocessing as mp
    proc = mp.current_process()
    was = proc._config.get("daemon", False)
    if was:
        proc._config["daemon"] = False
    try:
        yield
    finally:
        if was:
            proc._config["daemon"] = True
            from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
            q = getattr(fa, "_results_queue", None)
            manager = getattr(q, "_manager", None)
            if manager is not None:
                manager.shutdown()
                fa._results_queue = None


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, extra: dict):
    """dist_checkpointing.save of model chunks, optimizer (sharded) and the common state
    (iteration, consumed samples, scheduler) into root/iter_NNNNNNN, then the tracker file
    (rank 0), as Megatron-LM lays them out."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    d = _ckpt_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    st = _state(chunks, optimizer, is_loading=False)
    st["opt_param_scheduler"] = scheduler.state_dict()
    st["iteration"] = iteration
    st["hetccl"] = extra
    with _children_allowed():
        dist_checkpointing.save(st, d)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(_tracker(root), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _init_state_for_load(optimizer) -> None:
    """Give a fresh optimizer the state tensors a checkpoint load fills in place. Megatron's
    DistributedOptimizer.state_dict() reads every state's "step" when neither Apex nor
    Transformer Engine is installed (megatron-core 0.16 and 0.19 alike), which a fresh torch
    optimizer does not have yet; Megatron's own init_state_fn makes exp_avg / exp_avg_sq and
    this adds step = 0 (all three are overwritten by the load)."""
    import torch
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, fn = getattr(sub, "optimizer", None), getattr(sub, "init_state_fn", None)
        if inner is None:
            continue
        if fn is not None:
            fn(inner, getattr(sub, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if st and "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device="cpu")


def _restore_steps(optimizer) -> None:
    """Without Apex / Transformer Engine, Megatron's DistributedOptimizer keeps the torch
    optimizer's step count in the checkpoint's param_groups ("step") but the dp_reshardable
    load copies only param / exp_avg / exp_avg_sq back into the states, leaving the step of
    _init_state_for_load (0): Adam's bias correction would restart. Put the saved count back
    into every state (megatron-core 0.16 and 0.19 alike)."""
    import torch
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                st = inner.state[p]
                if "step" in st:
                    st["step"] = torch.tensor(float(group["step"]), dtype=torch.float32, device="cpu")


def load_checkpoint(root: str, chunks, optimizer, scheduler) -> tuple[int, dict] | None:
    """Load the latest checkpoint under root (None if there is none)."""
    from megatron.core import dist_checkpointing
    try:
        with open(_tracker(root)) as f:
            iteration = int(f.read().strip())
    except FileNotFoundError:
        return None
    d = _ckpt_dir(root, iteration)
    _init_state_for_load(optimizer)
    st = _state(chunks, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(st, d)
    for i, c in enumerate(chunks):
        c.module.load_state_dict(loaded[f"model{i}" if len(chunks) > 1 else "model"])
    import torch
    with torch.no_grad():  # the dp_reshardable path copies into leaf parameters in place
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_steps(optimizer)
    common = dist_checkpointing.load_common_state_dict(d)
    scheduler.load_state_dict(common["opt_param_scheduler"])
    return iteration, common.get("hetccl", {})


# --------------------------------------------------------------------------- balance
def replica_micro_batches(rec: dict, layout, dp: int) -> list[int]:
    """Micro-batches of each data-parallel replica for the first iteration.
    none: global_batch_size / (micro_batch_size x dp) each (Megatron's); static: the vendors'
    micro_batches (a replica spanning vendors takes the smallest); auto: plan_microbatches from
    the vendors' speed hints."""
    h, mbs = rec["hetccl"], rec["micro_batch_size"]
    by = {v["name"]: v for v in h["vendors"]}
    reps = layout.replica_vendors()
    if h["balance"] == "static":
        per = [min(by[v]["micro_batches"] for v in vs) for vs in reps]
        gb = rec["global_batch_size"]
        if gb is not None and gb != sum(per) * mbs:
            from .megatron_recipe import RecipeError
            raise RecipeError(f"global_batch_size {gb} != the vendors' micro_batches {per} x "
                              f"micro_batch_size {mbs} = {sum(per) * mbs}")
        return per
    gb = rec["global_batch_size"] or mbs * dp
    if gb % mbs:
        from .megatron_recipe import RecipeError
        raise RecipeError(f"global_batch_size {gb} is not a multiple of micro_batch_size {mbs}")
    if h["balance"] == "none":
        if gb % (mbs * dp):
            from .megatron_recipe import RecipeError
            raise RecipeError(f"global_batch_size {gb} is not divisible by micro_batch_size "
                              f"{mbs} x data-parallel size {dp} (or use hetccl.balance: auto)")
        return [gb // (mbs * dp)] * dp
    from hetccl.balance import plan_microbatches
    speeds = [min(by[v]["speed"] for v in vs) for vs in reps]
    plan = plan_microbatches(gb // mbs, speeds, h["max_micro"], micro_batch=1)
    return plan.counts()


# --------------------------------------------------------------------------- training
def _log_line(it: int, iters: int, row: dict) -> str:
    """An iteration line in Megatron-LM's training_log format."""
    ts = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    s = (f" [{ts}] iteration {it:8d}/{iters:8d} | consumed samples: {row['consumed_samples']:12d}"
         f" | elapsed time per iteration (ms): {row['ms_per_iteration']:.1f}"
         f" | throughput per GPU (TFLOP/s/GPU): {row['tflops_per_gpu']:.3g}"
         f" | learning rate: {row['lr']:.6E} | global batch size: {row['global_batch']:5d}"
         f" | lm loss: {row['lm_loss']:.6E}")
    if row.get("grad_norm") is not None:
        s += f" | grad norm: {row['grad_norm']:.3f}"
    s += (f" | number of skipped iterations: {row['skipped']:3d}"
          f" | number of nan iterations: {row['nan']:3d} |")
    return s


def run(rec: dict, sess, *, iters: int | None = None, out: str | None = None,
        quiet: bool = False, progress: bool = False) -> list[dict]:
    """Train `rec` on the initialised session (megatron.initialize). Returns one row per
    iteration on every rank (the loss is sent from the last pipeline stage to the others);
    the last rank prints Megatron-LM-style iteration lines and appends rows to `out`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from hetccl.balance.emulate import slow_down_modules
    from hetccl import compat, config

    device = sess.device
    h = rec["hetccl"]
    iters = rec["train_iters"] if iters is None else int(iters)
    pp, dp = ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size()
    d = ps.get_data_parallel_rank()
    vpp = rec["num_virtual_stages_per_pipeline_rank"]
    mbs, seq = rec["micro_batch_size"], rec["seq_length"]
    micro = replica_micro_batches(rec, sess.layout, dp)
    plan_report = None
    layers = pipeline_layers(rec)
    layout = rec["pipeline_model_parallel_layout"]
    if pp > 1 and layers is None and layout is None:          # hetccl.stages: plan
        layers, plan_report = plan_pipeline(rec, sess, device, max(micro))
    if layers is None and layout is None:
        layers = [rec["num_layers"]]
    chunks, cfg = build_model(rec, layers, device, layout=layout)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=rec["overlap_grad_reduce"],
        overlap_param_gather=rec["overlap_param_gather"],
        use_distributed_optimizer=rec["use_distributed_optimizer"],
        average_in_collective=False)
    chunks = [DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=c,
                                      disable_bucketing=(i > 0))
              for i, c in enumerate(chunks)]
    for c in chunks:
        c.broadcast_params()
    opt_cfg = OptimizerConfig(
        optimizer=rec["optimizer"], lr=rec["lr"], min_lr=rec["min_lr"],
        weight_decay=rec["weight_decay"], adam_beta1=rec["adam_beta1"],
        adam_beta2=rec["adam_beta2"], adam_eps=rec["adam_eps"], clip_grad=rec["clip_grad"],
        bf16=rec["bf16"], params_dtype=torch.bfloat16 if rec["bf16"] else torch.float32,
        use_distributed_optimizer=rec["use_distributed_optimizer"])
    optimizer = get_megatron_optimizer(opt_cfg, chunks, use_gloo_process_groups=False)
    gb0 = sum(micro) * mbs
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if rec["lr_warmup_iters"] else rec["lr"], max_lr=rec["lr"],
        min_lr=rec["min_lr"], lr_warmup_steps=rec["lr_warmup_iters"] * gb0,
        lr_decay_steps=max(rec["lr_decay_iters"], 1) * gb0,
        lr_decay_style=rec["lr_decay_style"], start_wd=rec["weight_decay"],
        end_wd=rec["weight_decay"], wd_incr_steps=max(iters, 1) * gb0, wd_incr_style="constant")
    # Megatron-LM's hooks: finalize (DP grad reduction, tied-embedding all-reduce, per-token
    # scaling), the loss scale of the mixed-precision optimizer, DDP's no_sync.
    timing = {"compute_end": None}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def finalize(*a, **k):
        sync()
        timing["compute_end"] = time.perf_counter()
        return finalize_model_grads(*a, **k)
    cfg.finalize_model_grads_func = finalize
    cfg.grad_scale_func = optimizer.scale_loss
    cfg.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if rec["overlap_grad_reduce"]:
        cfg.grad_sync_func = [c.start_grad_sync for c in chunks]
        if len(chunks) == 1:
            cfg.grad_sync_func = cfg.grad_sync_func[0]
    if rec["overlap_param_gather"] and rec["use_distributed_optimizer"]:
        cfg.param_sync_func = [c.start_param_sync for c in chunks]
        if len(chunks) == 1:
            cfg.param_sync_func = cfg.param_sync_func[0]

    start_it, consumed = 0, 0
    if rec["load"]:
        got = load_checkpoint(rec["load"], chunks, optimizer, scheduler)
        if got is not None:
            start_it, extra = got
            consumed = int(extra.get("consumed_samples", 0))
            micro = extra.get("micro", micro)

    gpts = [gpt_of(c) for c in chunks]
    slow = slow_down_modules([m for g in gpts for m in list(g.decoder.layers)
                              + ([g.output_layer] if g.post_process else [])],
                             device=device if device == "cuda" else None)
    bal = None
    if h["balance"] == "auto":
        from hetccl.balance import Balancer
        by = {v["name"]: v for v in h["vendors"]}
        speeds = [min(by[v]["speed"] for v in vs) for vs in sess.layout.replica_vendors()]
        bal = Balancer(sum(micro), h["max_micro"], micro_batch=1, initial_speeds=speeds,
                       rank=d, world_size=dp, threshold=h["rebalance_threshold"])
        micro = bal.plan.counts()

    fb = get_forward_backward_func()
    loss_fn = _loss_func if rec["calculate_per_token_loss"] else _loss_func_mean
    flops_per_sample = flops_per_iteration(rec, 1)
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_last = dist.get_process_group_ranks(pp_group)[-1]
    is_logger = dist.get_rank() == dist.get_world_size() - 1
    rows = []
    bar = None
    if progress and is_logger:
        try:
            from tqdm import tqdm
            bar = tqdm(total=iters - start_it, desc=rec["name"], file=sys.stderr)
        except ImportError:
            bar = None
    for it in range(start_it, iters):
        sync()
        t0 = time.perf_counter()
        offsets = [sum(micro[:r]) * mbs for r in range(dp)]
        mine = _micro_batches(rec, consumed + offsets[d], [mbs] * micro[d], device)

        def data_iter():
            return iter(mine)
        data = [data_iter() for _ in chunks] if len(chunks) > 1 else data_iter()
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()

        def step_func(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return out, functools.partial(loss_fn, b["loss_mask"])
        losses = fb(forward_step_func=step_func, data_iterator=data, model=chunks,
                    num_microbatches=micro[d], seq_length=seq, micro_batch_size=mbs,
                    decoder_seq_length=seq, forward_only=False)
        compute_s = (timing["compute_end"] or time.perf_counter()) - t0
        ok, grad_norm, _ = optimizer.step()
        gb = sum(micro) * mbs
        scheduler.step(increment=gb)
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        if last_stage and losses:
            stats = torch.stack([x["lm loss"] for x in losses]).double().sum(0).to(device)
        if last_stage:
            dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
        if pp > 1:
            dist.broadcast(stats, src=pp_last, group=pp_group)
        sync()
        dt = time.perf_counter() - t0
        consumed += gb
        lr = optimizer.param_groups[0]["lr"]
        row = dict(iteration=it + 1, consumed_samples=consumed,
                   lm_loss=float(stats[0] / max(float(stats[1]), 1.0)), tokens=int(stats[1]),
                   grad_norm=None if grad_norm is None else float(grad_norm),
                   ms_per_iteration=dt * 1e3,
                   tflops_per_gpu=flops_per_sample * gb / dt / sess.world_size / 1e12,
                   lr=float(lr), global_batch=gb, micro_batches=list(micro),
                   skipped=0 if ok else 1, nan=int(not math.isfinite(float(stats[0]))),
                   stages=list(layers) if layers else None, vpp=vpp or 1,
                   backend=sess.backend, device=device, world=sess.world_size,
                   tp=ps.get_tensor_model_parallel_world_size(), pp=pp, dp=dp,
                   vendors=sess.layout.vendors, placement=sess.layout.placement,
                   megatron_core=compat.megatron_core_version(), recipe=rec["name"],
                   tag=rec.get("tag"), slowdown=float(config.get("HETCCL_SLOWDOWN")),
                   params=param_count(rec))
        if plan_report is not None and it == start_it:
            row["stage_plan"] = plan_report
        if bal is not None:
            rate = micro[d] * mbs / compute_s if compute_s > 0 and micro[d] else None
            rates: list = [None] * sess.world_size
            dist.all_gather_object(rates, rate)
            rep: list = [None] * dp
            for r, v in enumerate(rates):
                dr = sess.layout.dp_rank(r)
                if v is not None:
                    rep[dr] = v if rep[dr] is None else min(rep[dr], v)
            if bal.update([x / mbs if x else x for x in rep]):
                micro = bal.plan.counts()
            row["rates"] = rep
        rows.append(row)
        if is_logger:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['lm_loss']:.4f}", ms=f"{dt * 1e3:.0f}")
            elif not quiet and ((it + 1) % rec["log_interval"] == 0 or it + 1 == iters):
                print(_log_line(it + 1, iters, row), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        stop = rec["exit_interval"] is not None and it + 1 >= rec["exit_interval"]
        if rec["save"] and ((rec["save_interval"] and (it + 1) % rec["save_interval"] == 0)
                            or it + 1 == iters or stop):
            save_checkpoint(rec["save"], it + 1, chunks, optimizer, scheduler,
                            dict(consumed_samples=consumed, micro=list(micro)))
        if stop:
            break
    if bar is not None:
        bar.close()
    slow.remove()
    return rows
