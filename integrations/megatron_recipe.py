"""Recipes for `hetccl megatron` in Megatron-LM's vocabulary (no Megatron import).

A recipe is a YAML mapping whose keys are Megatron-LM argument names (the ``dest`` of its
command-line options: ``--tensor-model-parallel-size`` is ``tensor_model_parallel_size``;
dashes are accepted and read as underscores), plus one ``hetccl:`` block for what Megatron-LM
has no words for: the vendor groups, data-parallel balancing and pipeline stage planning.

    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 2
    num_layers: 4
    hidden_size: 64
    ...
    hetccl:
      device: cpu
      vendors: [{name: v0, gpus: 1}, {name: v1, gpus: 1, slowdown: 2.0}]
      stages: plan

Every key is checked: an unknown key (top level or in the hetccl block) is an error that names
it and the closest known keys; a value of the wrong type is an error naming the key. `KEYS`
and `HETCCL_KEYS` are the whole vocabulary with defaults (docs/integrations/megatron.md lists
them).
"""
from __future__ import annotations

import difflib
from typing import Any

__all__ = ["RecipeError", "KEYS", "HETCCL_KEYS", "VENDOR_KEYS", "load_recipe", "recipe_labels",
           "pipeline_layers"]


class RecipeError(ValueError):
    """A recipe key or value is wrong (the message names the key)."""


_REQ = object()  # required key
# Megatron-LM argument name -> (type, default, what). Types: int, float, bool, str, "layers"
# (int, list of ints or str), "any".
KEYS: dict[str, tuple[Any, Any, str]] = {
    # parallelism
    "tensor_model_parallel_size": (int, 1, "TP size (inside a vendor group)"),
    "pipeline_model_parallel_size": (int, 1, "PP size (stages may sit on different vendors)"),
    "context_parallel_size": (int, 1, "CP size (inside a vendor group)"),
    "expert_model_parallel_size": (int, 1, "EP size (inside a vendor group)"),
    "expert_tensor_parallel_size": (int, None, "expert TP size (default: TP)"),
    "num_virtual_stages_per_pipeline_rank": (int, None, "interleaved 1F1B: model chunks per "
                                             "pipeline rank"),
    "num_layers_per_virtual_pipeline_stage": (int, None, "interleaved 1F1B, the other way to "
                                              "say it"),
    "decoder_first_pipeline_num_layers": (int, None, "uneven PP: layers of the first stage"),
    "decoder_last_pipeline_num_layers": (int, None, "uneven PP: layers of the last stage"),
    "pipeline_model_parallel_layout": ("any", None, "Megatron's layout string or list (e.g. "
                                       "'Et*3|t*1L'); exclusive with hetccl.stages"),
    "use_distributed_optimizer": (bool, True, "Megatron's DistributedOptimizer (ZeRO-1)"),
    "overlap_grad_reduce": (bool, False, "overlap DDP grad reduction with backward"),
    "overlap_param_gather": (bool, False, "overlap the dist-opt param all-gather"),
    "overlap_p2p_comm": (bool, True, "interleaved 1F1B: pipeline sends and receives as "
                         "separate isend/irecv overlapped with compute (Megatron-LM's default, "
                         "--no-overlap-p2p-communication turns it off: one batch_isend_irecv); "
                         "ignored without interleaving"),
    "calculate_per_token_loss": (bool, True, "normalise by the global token count (exact with "
                                 "unequal micro-batch counts per replica)"),
    # model
    "num_layers": (int, _REQ, "transformer layers"),
    "hidden_size": (int, _REQ, ""),
    "ffn_hidden_size": (int, None, "default 4 x hidden (SwiGLU: as Megatron-LM)"),
    "num_attention_heads": (int, _REQ, ""),
    "group_query_attention": (bool, False, ""),
    "num_query_groups": (int, None, ""),
    "seq_length": (int, _REQ, "tokens per sample"),
    "max_position_embeddings": (int, None, "default seq_length"),
    "position_embedding_type": (str, "learned_absolute", "learned_absolute | rope"),
    "normalization": (str, "LayerNorm", "LayerNorm | RMSNorm"),
    "swiglu": (bool, False, ""),
    "untie_embeddings_and_output_weights": (bool, False, ""),
    "hidden_dropout": (float, 0.0, "(0 keeps runs comparable)"),
    "attention_dropout": (float, 0.0, ""),
    "init_method_std": (float, 0.02, ""),
    "vocab_size": (int, 256, "vocabulary of the synthetic data (Megatron-LM: NullTokenizer)"),
    "tokenizer_type": (str, "NullTokenizer", "only NullTokenizer (synthetic data)"),
    "mock_data": (bool, True, "synthetic data made in code (the only data source)"),
    "bf16": (bool, False, ""),
    "fp16": (bool, False, "not supported (bf16 or fp32)"),
    # training
    "micro_batch_size": (int, _REQ, ""),
    "global_batch_size": (int, None, "default micro_batch_size x data-parallel size"),
    "train_iters": (int, _REQ, ""),
    "optimizer": (str, "adam", "adam | sgd"),
    "lr": (float, _REQ, ""),
    "min_lr": (float, 0.0, ""),
    "lr_warmup_iters": (int, 0, ""),
    "lr_decay_iters": (int, None, "default train_iters"),
    "lr_decay_style": (str, "constant", "constant | linear | cosine | inverse-square-root"),
    "weight_decay": (float, 0.0, ""),
    "clip_grad": (float, 1.0, "0: no clipping"),
    "adam_beta1": (float, 0.9, ""),
    "adam_beta2": (float, 0.999, ""),
    "adam_eps": (float, 1e-8, ""),
    "seed": (int, 1234, ""),
    "log_interval": (int, 1, "iterations between log lines"),
    "save": (str, None, "checkpoint directory (dist_checkpointing, torch_dist format)"),
    "load": (str, None, "resume from this directory (its latest iteration)"),
    "save_interval": (int, None, "iterations between checkpoints (and one at the end)"),
    "ckpt_format": (str, "torch_dist", "torch_dist only"),
    "exit_interval": (int, None, "stop after this iteration (a checkpoint is saved first)"),
}

# hetccl's additions: key -> (type, default, what)
HETCCL_KEYS: dict[str, tuple[Any, Any, str]] = {
    "device": (str, "cpu", "cpu | cuda"),
    "vendors": (list, _REQ, "vendor groups in launch order: {name, gpus, ...} (VENDOR_KEYS)"),
    "balance": (str, "none", "data-parallel micro-batches per replica: none (equal, Megatron's) "
                "| static (vendors' micro_batches) | auto (hetccl.balance.Balancer)"),
    "stages": ("layers", "even", "layers per pipeline stage: even | plan (hetccl.balance."
               "plan_stages from measured per-layer time and memory) | [n0, n1, ...]"),
    "probe_iters": (int, 6, "stages: plan: timed forward+backward passes per probe"),
    "max_micro": (int, 64, "balance: auto: most micro-batches of one replica"),
    "rebalance_threshold": (float, 0.1, "balance: auto: re-plan when the predicted gain is "
                            "larger"),
}
VENDOR_KEYS: dict[str, tuple[Any, Any, str]] = {
    "name": (str, _REQ, "vendor label (HETCCL_VENDOR)"),
    "gpus": (int, _REQ, "processes of this vendor"),
    "micro_batches": (int, None, "balance: static: micro-batches per replica of this vendor"),
    "speed": (float, 1.0, "balance: auto: relative speed hint of the first plan"),
    "slowdown": (float, 1.0, "TEST ONLY: emulate a device this many times slower "
                 "(HETCCL_SLOWDOWN; consumes the GPU on CUDA)"),
    "memory_gib": (float, None, "memory the stage planner may use per device (default: the "
                   "device's free memory on CUDA, unlimited on CPU)"),
}


def _check_keys(where: str, got: dict, known: dict) -> dict:
    out = {}
    for k, v in got.items():
        key = str(k).replace("-", "_")
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise RecipeError(f"{where}: unknown key {k!r}{hint} (known keys: "
                              f"{', '.join(sorted(known))})")
        out[key] = v
    for k, (typ, default, _) in known.items():
        if k not in out:
            if default is _REQ:
                raise RecipeError(f"{where}: missing required key {k!r}")
            out[k] = default
            continue
        v = out[k]
        if v is None:
            continue
        try:
            if typ is bool:
                if not isinstance(v, bool):
                    raise TypeError
            elif typ is int:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError
            elif typ is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError
                v = float(v)
            elif typ is str:
                if not isinstance(v, str):
                    raise TypeError
            elif typ is list:
                if not isinstance(v, list):
                    raise TypeError
            elif typ == "layers":
                if not (isinstance(v, str) or (isinstance(v, list) and all(
                        isinstance(x, int) and not isinstance(x, bool) for x in v))):
                    raise TypeError
        except TypeError:
            want = {"layers": "even, plan or a list of integers"}.get(typ, getattr(typ, "__name__",
                                                                                   str(typ)))
            raise RecipeError(f"{where}: {k} must be {want}, got {v!r}") from None
        out[k] = v
    return out


def load_recipe(path_or_dict) -> dict:
    """Read and check a recipe; returns a flat dict of every Megatron key (defaults filled in)
    with the checked hetccl block under "hetccl" and the name under "name"."""
    if isinstance(path_or_dict, dict):
        raw = dict(path_or_dict)
        where = "recipe"
    else:
        import yaml
        with open(path_or_dict) as f:
            raw = yaml.safe_load(f)
        where = str(path_or_dict)
        if not isinstance(raw, dict):
            raise RecipeError(f"{where}: a recipe is a YAML mapping of Megatron-LM arguments")
    name = raw.pop("name", None)
    het = raw.pop("hetccl", None)
    if het is None:
        raise RecipeError(f"{where}: missing the 'hetccl:' block (device, vendors, ...)")
    if not isinstance(het, dict):
        raise RecipeError(f"{where}: 'hetccl' must be a mapping")
    rec = _check_keys(where, raw, KEYS)
    h = _check_keys(f"{where}: hetccl", het, HETCCL_KEYS)
    vendors = []
    for i, v in enumerate(h["vendors"]):
        if not isinstance(v, dict):
            raise RecipeError(f"{where}: hetccl.vendors[{i}] must be a mapping {{name, gpus}}")
        vendors.append(_check_keys(f"{where}: hetccl.vendors[{i}]", v, VENDOR_KEYS))
    h["vendors"] = vendors
    names = [v["name"] for v in vendors]
    if not vendors:
        raise RecipeError(f"{where}: hetccl.vendors is empty")
    if len(set(names)) != len(names):
        raise RecipeError(f"{where}: hetccl.vendors has duplicate names {names}")
    for v in vendors:
        if v["gpus"] < 1:
            raise RecipeError(f"{where}: hetccl.vendors {v['name']}: gpus must be >= 1")
        if v["slowdown"] < 1.0:
            raise RecipeError(f"{where}: hetccl.vendors {v['name']}: slowdown must be >= 1")
    if h["device"] not in ("cpu", "cuda"):
        raise RecipeError(f"{where}: hetccl.device must be cpu or cuda, got {h['device']!r}")
    if h["balance"] not in ("none", "static", "auto"):
        raise RecipeError(f"{where}: hetccl.balance must be none, static or auto, "
                          f"got {h['balance']!r}")
    if h["balance"] == "static" and any(v["micro_batches"] is None for v in vendors):
        raise RecipeError(f"{where}: hetccl.balance: static needs micro_batches for every vendor")
    if isinstance(h["stages"], str) and h["stages"] not in ("even", "plan"):
        raise RecipeError(f"{where}: hetccl.stages must be even, plan or a list of layers per "
                          f"stage, got {h['stages']!r}")
    for k, choices in (("optimizer", ("adam", "sgd")),
                       ("position_embedding_type", ("learned_absolute", "rope")),
                       ("normalization", ("LayerNorm", "RMSNorm")),
                       ("lr_decay_style", ("constant", "linear", "cosine",
                                           "inverse-square-root")),
                       ("tokenizer_type", ("NullTokenizer",)), ("ckpt_format", ("torch_dist",))):
        if rec[k] not in choices:
            raise RecipeError(f"{where}: {k} must be one of {', '.join(choices)}, got {rec[k]!r}")
    if rec["fp16"]:
        raise RecipeError(f"{where}: fp16: true is not supported by hetccl megatron (use bf16)")
    if not rec["mock_data"]:
        raise RecipeError(f"{where}: mock_data: false: the runner trains on synthetic data only")
    pp = rec["pipeline_model_parallel_size"]
    if rec["pipeline_model_parallel_layout"] is not None and h["stages"] != "even":
        raise RecipeError(f"{where}: pipeline_model_parallel_layout and hetccl.stages both set "
                          f"the layers per stage; keep one")
    if isinstance(h["stages"], list) and len(h["stages"]) != pp:
        raise RecipeError(f"{where}: hetccl.stages lists {len(h['stages'])} stages, "
                          f"pipeline_model_parallel_size is {pp}")
    if isinstance(h["stages"], list) and sum(h["stages"]) != rec["num_layers"]:
        raise RecipeError(f"{where}: hetccl.stages {h['stages']} sums to {sum(h['stages'])}, "
                          f"num_layers is {rec['num_layers']}")
    vpp = rec["num_virtual_stages_per_pipeline_rank"]
    if rec["num_layers_per_virtual_pipeline_stage"] is not None:
        per = rec["num_layers_per_virtual_pipeline_stage"]
        if vpp is not None:
            raise RecipeError(f"{where}: set num_virtual_stages_per_pipeline_rank or "
                              f"num_layers_per_virtual_pipeline_stage, not both")
        if rec["num_layers"] % (per * pp):
            raise RecipeError(f"{where}: num_layers_per_virtual_pipeline_stage={per}: num_layers "
                              f"{rec['num_layers']} is not a multiple of {per} x {pp} stages")
        vpp = rec["num_layers"] // (per * pp)
    rec["num_virtual_stages_per_pipeline_rank"] = vpp if vpp and vpp > 1 else None
    if rec["num_virtual_stages_per_pipeline_rank"] and pp == 2 and not rec["overlap_p2p_comm"]:
        # Megatron-LM refuses this too (interleaving without p2p overlap needs pp > 2): the
        # batched exchange puts a send to the previous and one to the next stage -- the same
        # rank when pp = 2 -- in one batch, in an order (send_prev, recv_prev, send_next,
        # recv_next) that pairs one stage's gradient with the other's activation buffer on a
        # backend that matches messages between two ranks in order (gloo, hetccl): measured,
        # the losses then differ from pp=1 from the first iteration.
        raise RecipeError(f"{where}: interleaved 1F1B with pipeline_model_parallel_size=2 "
                          f"needs overlap_p2p_comm: true (Megatron-LM's default): without it "
                          f"both directions to the one other stage share a batch")
    if rec["max_position_embeddings"] is None:
        rec["max_position_embeddings"] = rec["seq_length"]
    if rec["lr_decay_iters"] is None:
        rec["lr_decay_iters"] = rec["train_iters"]
    rec["hetccl"] = h
    rec["name"] = name or (where.rsplit("/", 1)[-1].rsplit(".", 1)[0] if where != "recipe"
                           else "recipe")
    return rec


def recipe_labels(rec: dict) -> list[str]:
    """Vendor labels by launch rank of the recipe's cluster (launch order)."""
    return [v["name"] for v in rec["hetccl"]["vendors"] for _ in range(v["gpus"])]


def world_size(rec: dict) -> int:
    return sum(v["gpus"] for v in rec["hetccl"]["vendors"])


def pipeline_layers(rec: dict) -> list[int] | None:
    """Layers per pipeline stage the recipe fixes without measuring (None: 'plan', or a
    pipeline_model_parallel_layout given in Megatron's own syntax). even: Megatron's split
    (num_layers divisible by pp x vpp) unless decoder_first/last_pipeline_num_layers say
    otherwise."""
    h = rec["hetccl"]
    pp, L = rec["pipeline_model_parallel_size"], rec["num_layers"]
    if rec["pipeline_model_parallel_layout"] is not None or h["stages"] == "plan":
        return None
    if isinstance(h["stages"], list):
        return list(h["stages"])
    first, last = (rec["decoder_first_pipeline_num_layers"],
                   rec["decoder_last_pipeline_num_layers"])
    if pp == 1:
        return [L]
    if first is None and last is None:
        vpp = rec["num_virtual_stages_per_pipeline_rank"] or 1
        if L % (pp * vpp):
            raise RecipeError(f"num_layers {L} is not divisible by pipeline_model_parallel_size "
                              f"{pp}" + (f" x {vpp} virtual stages" if vpp > 1 else "")
                              + ": set hetccl.stages (plan or a list) or "
                              "decoder_first/last_pipeline_num_layers")
        return [L // pp] * pp
    rest = L - (first or 0) - (last or 0)
    mid = pp - (first is not None) - (last is not None)
    if mid and rest % mid or (not mid and rest) or rest < 0:
        raise RecipeError(f"decoder_first/last_pipeline_num_layers {first}/{last} leave {rest} "
                          f"layers for {mid} middle stages")
    out = [rest // mid if mid else 0] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def flops_per_iteration(rec: dict, global_batch: int) -> float:
    """Model FLOPs of one iteration (forward + backward = 3 x forward), counted as Megatron-LM's
    num_floating_point_operations does for a GPT without MoE: the dense matmuls (QKV with
    query groups, attention scores and values over the full sequence, projection, MLP with
    SwiGLU's third matrix) and the logits."""
    L, h, s = rec["num_layers"], rec["hidden_size"], rec["seq_length"]
    V = rec["vocab_size"]
    ffn = rec["ffn_hidden_size"] or (int(8 * h / 3) if rec["swiglu"] else 4 * h)
    heads = rec["num_attention_heads"]
    groups = rec["num_query_groups"] if rec["group_query_attention"] and rec["num_query_groups"] \
        else heads
    kv = h * groups / heads
    per_token_layer = (2 * h * (h + 2 * kv)       # QKV
                       + 2 * 2 * s * h             # scores + values (full s x s)
                       + 2 * h * h                 # projection
                       + 2 * h * ffn * (3 if rec["swiglu"] else 2))
    per_token = L * per_token_layer + 2 * h * V
    return 3.0 * per_token * s * global_batch


def param_count(rec: dict) -> int:
    """Parameters of the model (tied embeddings counted once)."""
    L, h, V = rec["num_layers"], rec["hidden_size"], rec["vocab_size"]
    ffn = rec["ffn_hidden_size"] or (int(8 * h / 3) if rec["swiglu"] else 4 * h)
    heads = rec["num_attention_heads"]
    groups = rec["num_query_groups"] if rec["group_query_attention"] and rec["num_query_groups"] \
        else heads
    kv = h * groups / heads
    norm = 2 * h if rec["normalization"] == "LayerNorm" else h
    layer = int(h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + h * ffn * (3 if rec["swiglu"]
                                                                          else 2)
                + (ffn * (2 if rec["swiglu"] else 1)) + h + 2 * norm)
    emb = V * h + (rec["max_position_embeddings"] * h
                   if rec["position_embedding_type"] == "learned_absolute" else 0)
    out = 0 if not rec["untie_embeddings_and_output_weights"] else V * h
    return L * layer + emb + out + norm

