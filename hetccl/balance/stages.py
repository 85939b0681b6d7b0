"""Pipeline stage planner: which layers each pipeline stage holds, on devices of unequal speed
and memory (framework-neutral; integrations/megatron_train.py turns a plan into megatron-core's
``pipeline_model_parallel_layout``).

Model
-----
A model of ``L`` identical-interface layers (transformer layers) runs on ``p`` pipeline stages
in order; stage ``s`` runs on its own device and holds a contiguous run of ``n_s >= min_layers``
layers (``sum n_s = L``). ``StageDevice`` describes stage ``s``'s device:

    t_s = first_time [s == 0] + sum over its layers i of layer_time_s[i] + last_time [s == p-1]

seconds per micro-batch (forward + backward), measured on that device (``layer_time`` is a scalar
when all layers cost the same, or one value per layer). With ``m`` micro-batches per step and the
1F1B schedule the step takes about

    step = (m - 1) * max_s t_s + sum_s t_s                                   (v = 1)

(the slowest stage gates the steady state; fill and drain pass every stage once). With
interleaving, ``v`` model chunks per stage (layers split as evenly as possible over the chunks),
the fill and drain shrink by ``v``:

    step = (m - 1 / v) * max_s t_s + sum_s t_s / v

Point-to-point time between stages is not modelled (it is the same for every split of one
model: one activation per micro-batch per stage boundary). Forward and backward are assumed to
scale alike on every device (what a per-layer forward+backward time measures).

Memory of stage ``s`` (bytes, ``LayerMemory``): every layer holds ``static`` bytes (parameters,
gradients, optimizer state) plus ``activation`` bytes per micro-batch in flight, and the first
(last) stage adds the embedding's (output layer's) bytes:

    mem_s = n_s * (static + a_s * activation) + [s == 0] (first_static + a_s * first_activation)
            + [s == p-1] (last_static + a_s * last_activation)

with ``a_s`` the micro-batches whose activations stage ``s`` holds at once under 1F1B:
``min(m, p - s)``; interleaved: ``min(m v, 2 (p - s - 1) + (v - 1) p + 1)`` chunks of
``n_s / v`` layers (Megatron's warm-up count plus the one in flight). A split is feasible when
``mem_s <= memory_s`` for every stage.

Optimality
----------
``plan_stages`` returns a split minimising ``step`` over every feasible split (``optimal``).
The objective is not additive (it mixes a max and a sum), so the planner runs a dynamic
programme over (stages placed, layers placed) that keeps, for each state, the Pareto frontier
of (max stage time, sum of stage times): a prefix that is worse in both can never finish better,
because ``step`` is non-decreasing in both. At the end the frontier of (p, L) holds every
candidate optimum. Cost: O(p L^2 F) with F the frontier size (small: at most the distinct
maxima), well under a second for hundreds of layers. tests/test_balance_stages.py checks the
value against exhaustive search over all splits, with per-layer times, extras, memory limits and
interleaving.

With ``v > 1`` the layers of one stage are not contiguous (chunk c of stage s holds virtual
stage ``c p + s``), so the planner needs scalar per-device layer times there (a per-layer list
raises ValueError).

Impossible requests (too few layers for the stages, a device that cannot hold its minimum,
devices that together hold fewer layers than the model) raise ``StagePlanError`` naming the
stage, its memory and what one layer needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["StageDevice", "LayerMemory", "StagePlan", "StagePlanError", "plan_stages",
           "stage_times", "stage_memory", "step_time", "even_split", "chunk_split",
           "inflight", "evaluate"]


class StagePlanError(ValueError):
    """No split of the layers over the stages satisfies the constraints (the message says
    which constraint and what to change)."""


@dataclass(frozen=True)
class StageDevice:
    """The device that runs one pipeline stage.

    layer_time   seconds of forward + backward of one micro-batch per layer on this device:
                 a scalar (all layers alike) or one value per layer of the model.
    memory       bytes this device can give to the stage (inf: unlimited).
    first_time   extra seconds per micro-batch when this device holds the first stage
                 (embedding); last_time likewise for the last stage (output layer and loss).
    name         for messages (e.g. "stage 1 (v1: cuda:1)")."""
    layer_time: float | Sequence[float]
    memory: float = math.inf
    first_time: float = 0.0
    last_time: float = 0.0
    name: str = ""

    def times(self, num_layers: int) -> list[float]:
        if isinstance(self.layer_time, (int, float)):
            return [float(self.layer_time)] * num_layers
        t = [float(x) for x in self.layer_time]
        if len(t) != num_layers:
            raise ValueError(f"{self.name or 'a stage device'}: layer_time has {len(t)} entries "
                             f"for {num_layers} layers")
        return t


@dataclass(frozen=True)
class LayerMemory:
    """Bytes a stage needs (module docstring): per layer ``static`` + ``activation`` per
    micro-batch in flight; the first stage adds ``first_static`` + ``first_activation`` per
    micro-batch in flight (embedding), the last stage ``last_static`` + ``last_activation``
    (output layer, logits, loss)."""
    static: float = 0.0
    activation: float = 0.0
    first_static: float = 0.0
    first_activation: float = 0.0
    last_static: float = 0.0
    last_activation: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """layers[s]: layers of stage s (contiguous, in order; with v > 1 their total over the
    stage's chunks, see ``chunks``). est_step_time: the model's step (seconds per step).
    stage_times[s]: t_s. memory[s]: mem_s (bytes). optimal: proved minimal (module docstring)."""
    layers: tuple[int, ...]
    est_step_time: float
    stage_times: tuple[float, ...]
    memory: tuple[float, ...]
    micro_batches: int
    vpp: int = 1
    optimal: bool = False
    names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.stage_times)), key=lambda s: self.stage_times[s])

    def chunks(self) -> list[list[int]]:
        """Layers of each (stage, chunk): chunks()[s][c] (chunk split of chunk_split)."""
        return [chunk_split(n, self.vpp) for n in self.layers]

    def virtual_stages(self) -> list[int]:
        """Layers per virtual stage in model order (virtual stage c p + s = chunk c of stage
        s), what a framework's layout lists."""
        ch, p = self.chunks(), len(self.layers)
        return [ch[k % p][k // p] for k in range(p * self.vpp)]

    def describe(self) -> str:
        parts = []
        for s, n in enumerate(self.layers):
            name = self.names[s] if s < len(self.names) and self.names[s] else f"stage {s}"
            mem = self.memory[s]
            m = "" if mem == 0 else f", {mem / 2**20:.1f} MiB"
            parts.append(f"{name}: {n} layers, {self.stage_times[s] * 1e3:.3g} ms/micro-batch{m}")
        return (f"stages {list(self.layers)} (vpp={self.vpp}, {self.micro_batches} micro-batches):"
                f" modelled step {self.est_step_time * 1e3:.4g} ms; " + "; ".join(parts))


def chunk_split(n: int, v: int) -> list[int]:
    """n layers over v chunks, as even as possible, larger chunks first."""
    q, r = divmod(int(n), int(v))
    return [q + 1] * r + [q] * (v - r)


def even_split(num_layers: int, stages: int) -> list[int]:
    """Layers per stage of an even split (the first stages take the remainder)."""
    return chunk_split(num_layers, stages)


def inflight(s: int, p: int, m: int, v: int = 1) -> float:
    """Micro-batches of activations stage s holds at once, in units of a whole stage's layers
    (v = 1: min(m, p - s); interleaved: chunks in flight / v)."""
    if v == 1:
        return float(min(m, p - s))
    return min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) / v


def step_time(times: Sequence[float], m: int, v: int = 1) -> float:
    """The model's step time for stage times t_s (module docstring)."""
    if not times:
        return 0.0
    return (m - 1.0 / v) * max(times) + sum(times) / v


def _prefix(times: list[float]) -> list[float]:
    out = [0.0]
    for t in times:
        out.append(out[-1] + t)
    return out


def stage_times(layers: Sequence[int], devices: Sequence[StageDevice]) -> list[float]:
    """t_s of a split (contiguous layers in stage order)."""
    L, p = sum(layers), len(layers)
    out, j = [], 0
    for s, (n, d) in enumerate(zip(layers, devices)):
        t = sum(d.times(L)[j:j + n])
        t += (d.first_time if s == 0 else 0.0) + (d.last_time if s == p - 1 else 0.0)
        out.append(t)
        j += n
    return out


def _stage_bytes(s: int, n: int, p: int, m: int, v: int, mem: LayerMemory) -> float:
    """mem_s of stage s of p holding n layers (module docstring)."""
    a = inflight(s, p, m, v)
    b = n * (mem.static + a * mem.activation)
    if s == 0:
        b += mem.first_static + a * mem.first_activation
    if s == p - 1:
        b += mem.last_static + a * mem.last_activation
    return b


def stage_memory(layers: Sequence[int], m: int, mem: LayerMemory, v: int = 1) -> list[float]:
    """mem_s of a split (module docstring)."""
    p = len(layers)
    return [_stage_bytes(s, n, p, m, v, mem) for s, n in enumerate(layers)]


def evaluate(layers: Sequence[int], devices: Sequence[StageDevice], micro_batches: int, *,
             memory: LayerMemory = LayerMemory(), vpp: int = 1) -> StagePlan:
    """The plan object (modelled times, memory) of a given split, e.g. the even one."""
    if len(layers) != len(devices):
        raise ValueError(f"{len(layers)} stage sizes for {len(devices)} stage devices")
    t = stage_times(layers, devices)
    return StagePlan(layers=tuple(int(n) for n in layers),
                     est_step_time=step_time(t, micro_batches, vpp), stage_times=tuple(t),
                     memory=tuple(stage_memory(layers, micro_batches, memory, vpp)),
                     micro_batches=micro_batches, vpp=vpp, optimal=False,
                     names=tuple(d.name for d in devices))


def _fits(s: int, n: int, p: int, m: int, v: int, mem: LayerMemory, cap: float) -> bool:
    if math.isinf(cap):
        return True
    return _stage_bytes(s, n, p, m, v, mem) <= cap * (1 + 1e-12)


def _gib(x: float) -> str:
    return "unlimited" if math.isinf(x) else f"{x / 2**30:.3g} GiB"


def _explain(L, devices, m, v, mem, min_layers) -> str:
    p = len(devices)
    need = p * v * min_layers
    if L < need:
        return (f"{L} layers cannot give each of the {p} stages"
                + (f" x {v} chunks" if v > 1 else "") + f" at least {min_layers} layer(s) "
                f"({need} needed): use fewer pipeline stages"
                + (" or less interleaving" if v > 1 else ""))
    most = []
    for s, d in enumerate(devices):
        k = 0
        while k < L and _fits(s, k + 1, p, m, v, mem, d.memory):
            k += 1
        most.append(k)
        if k < v * min_layers:
            a = inflight(s, p, m, v)
            per = mem.static + a * mem.activation
            extra = ""
            if s == 0:
                extra = f" plus the embedding's {(mem.first_static + a * mem.first_activation) / 2**20:.1f} MiB"
            if s == p - 1:
                extra += f" plus the output layer's {(mem.last_static + a * mem.last_activation) / 2**20:.1f} MiB"
            return (f"{d.name or f'stage {s}'} ({_gib(d.memory)}) cannot hold {v * min_layers} "
                    f"layer(s): one layer needs {per / 2**20:.1f} MiB ({mem.static / 2**20:.1f} MiB "
                    f"of weights and optimizer state + {a:g} micro-batches in flight x "
                    f"{mem.activation / 2**20:.1f} MiB of activations){extra}; give the stage a "
                    f"device with more memory, fewer micro-batches in flight, or activation "
                    f"recomputation")
    if sum(most) < L:
        return (f"the stages hold at most {most} = {sum(most)} layers together, the model has "
                f"{L}: add pipeline stages or memory, or lower the memory per layer")
    return (f"no split of {L} layers satisfies the memory limits and at least "
            f"{min_layers} layer(s) per stage (most layers per stage: {most})")


def plan_stages(num_layers: int, devices: Sequence[StageDevice], micro_batches: int, *,
                memory: LayerMemory = LayerMemory(), vpp: int = 1,
                min_layers: int = 1) -> StagePlan:
    """The split of ``num_layers`` layers over ``len(devices)`` pipeline stages that minimises
    the modelled step time under the memory limits (module docstring). Among equal optima the
    choice is deterministic (the same inputs give the same split on every rank). Raises
    StagePlanError when no split exists."""
    L, p, m, v = int(num_layers), len(devices), int(micro_batches), int(vpp)
    if p < 1:
        raise ValueError("plan_stages needs at least one stage device")
    if m < 1 or v < 1 or min_layers < 0:
        raise ValueError(f"micro_batches ({m}) and vpp ({v}) must be >= 1, min_layers >= 0")
    if v > 1 and any(not isinstance(d.layer_time, (int, float)) for d in devices):
        raise ValueError("with vpp > 1 a stage's layers are not contiguous: give each stage "
                         "device a scalar layer_time")
    lo = v * min_layers
    if L < p * lo:
        raise StagePlanError(_explain(L, devices, m, v, memory, min_layers))
    pref = [_prefix(d.times(L)) for d in devices]

    def cost(s: int, j: int, n: int) -> float:
        t = pref[s][j + n] - pref[s][j]
        if s == 0:
            t += devices[s].first_time
        if s == p - 1:
            t += devices[s].last_time
        return t

    # front[s][j]: Pareto frontier of (max, sum, n_s, index in front[s-1][j-n_s]) over
    # placements of the first j layers on the first s stages; sorted by max, sums decreasing.
    front: list[dict[int, list[tuple[float, float, int, int]]]] = [{0: [(0.0, 0.0, -1, -1)]}]
    for s in range(p):
        nxt: dict[int, list] = {}
        left = p - s - 1
        for j, fr in front[s].items():
            rest_min = left * lo
            for n in range(lo, L - j - rest_min + 1):
                if s == p - 1 and j + n != L:
                    continue
                if not _fits(s, n, p, m, v, memory, devices[s].memory):
                    break  # memory grows with n
                t = cost(s, j, n)
                cand = nxt.setdefault(j + n, [])
                for k, (mx, sm, _, _) in enumerate(fr):
                    cand.append((max(mx, t), sm + t, n, k))
        for j, cand in nxt.items():
            # Pareto prune: ascending max, keep strictly decreasing sum. Ties on both: larger
            # n first (earlier stages take more), so the choice is deterministic.
            cand.sort(key=lambda e: (e[0], e[1], -e[2]))
            kept, best = [], math.inf
            for e in cand:
                if e[1] < best * (1 - 1e-12) or (not kept):
                    kept.append(e)
                    best = e[1]
            nxt[j] = kept
        front.append(nxt)
    final = front[p].get(L)
    if not final:
        raise StagePlanError(_explain(L, devices, m, v, memory, min_layers))
    score = [(m - 1.0 / v) * mx + sm / v for mx, sm, _, _ in final]
    best = min(score)
    k = min(i for i, sc in enumerate(score) if sc <= best * (1 + 1e-12))
    layers, j = [], L
    for s in range(p, 0, -1):
        _, _, n, prev = front[s][j][k]
        layers.append(n)
        j, k = j - n, prev
    layers.reverse()
    plan = evaluate(layers, devices, m, memory=memory, vpp=v)
    return StagePlan(layers=plan.layers, est_step_time=plan.est_step_time,
                     stage_times=plan.stage_times, memory=plan.memory, micro_batches=m, vpp=v,
                     optimal=True, names=plan.names)
