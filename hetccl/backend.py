"""The torch.distributed face of hetccl: backend "hetccl".

A thin layer. The creator learns the group's vendor layout through the group's store; a group
whose ranks are all of one vendor becomes a plain c10d ProcessGroup with the native backends
registered (gloo for cpu, nccl for cuda: NCCL or RCCL), so it runs at native speed with no
Python in the data path. A multi-vendor group becomes a HetcclProcessGroup, whose methods
translate torch's arguments (flattening, op names, splits) and hand a closure to the Engine.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import compat, device as devices, tags
from .algorithms import select
from .engine import Engine
from .native import REDUCE_DTYPES
from .topology import Topology
from .work import AllWork as _AllWork
from .work import HetcclWork

log = logging.getLogger("hetccl")

BACKEND_NAME = "hetccl"

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.AVG: "avg",
}
SUPPORTED_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
_INT_DTYPES = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool}


def op_name(op) -> str:
    red = getattr(op, "op", op)
    for k, v in _OPS.items():
        if red == k:
            return v
    raise NotImplementedError(
        f"hetccl: reduction op {red} is not supported across vendor groups "
        f"(supported: {', '.join(SUPPORTED_OPS)})")


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D contiguous view of t, or a contiguous copy (second item True: copy back after)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True


class HetcclProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta, topo: Topology,
                 group_id: str = ""):
        super().__init__(rank, size)
        self._hc_name = group_id
        self.engine = Engine(store, rank, size, timeout, topo, name=group_id)
        self.topo = topo
        self._coalescing: list | None = None
        log.info("hetccl: group %r rank %d/%d vendors %s", group_id, rank, size, topo.describe())

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # torch's _set_group_name (C++) calls the virtual setGroupName, which lands here.
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._hc_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._hc_name

    @property
    def group_name(self) -> str:
        return self._hc_name

    def shutdown(self) -> None:
        self.engine.close()

    def abort(self) -> None:
        self.engine.close()

    def __del__(self):
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ plumbing
    def _submit(self, coll: str, nbytes: int, body, outputs, tensors, opts=None) -> HetcclWork:
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"hetccl: {coll}: tensors of one collective must be on one device, "
                             f"got {sorted(str(d) for d in devices)}")
        algo_name, algo = select(coll, nbytes, self.engine.algo_overrides)
        device = next(iter(devices), torch.device("cpu"))
        engine = self.engine

        def run(launch):
            ctx = engine.next_ctx(device, launch)
            body(ctx, algo)
            ctx.flush()

        async_op = self._coalescing is not None or bool(getattr(opts, "asyncOp", True))
        work = engine.submit(run, outputs, tensors, async_op=async_op)
        return self._track(work)

    def _track(self, work):
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _check(self, ctx, coll, numel, dtype, op=None, root=-1, same_numel=True):
        ctx.begin(coll, numel, dtype, op, root, same_numel)

    def _validate_reduce(self, t: torch.Tensor, op: str) -> None:
        ok = REDUCE_DTYPES.get(t.device.type, set())
        if t.dtype not in ok:
            raise NotImplementedError(
                f"hetccl: reductions of dtype {t.dtype} on {t.device.type} tensors are not "
                f"supported (supported: {', '.join(sorted(str(d)[6:] for d in ok))})")
        if op == "avg" and t.dtype in _INT_DTYPES:
            raise NotImplementedError(f"hetccl: ReduceOp.AVG is not supported for integer dtype "
                                      f"{t.dtype} (use SUM and divide)")
        if t.is_complex() and op in ("min", "max"):
            raise NotImplementedError(f"hetccl: {op} is not defined for complex dtype {t.dtype}")

    def _validate_root(self, root: int, what: str = "root") -> None:
        if not 0 <= root < self.size():
            raise ValueError(f"hetccl: invalid {what} rank {root} for a group of size "
                             f"{self.size()}")

    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, tensors, opts=None):
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            self._validate_reduce(t, op)
        flats = [_flat(t) for t in tensors]
        world = self.size()

        def body(ctx, algo):
            for (t, (f, copied)) in zip(tensors, flats):
                self._check(ctx, "all_reduce", f.numel(), f.dtype, op)
                _, fn = select("all_reduce", f.numel() * f.element_size(),
                               self.engine.algo_overrides)
                fn(ctx, f, "sum" if op == "avg" else op)
                if op == "avg":
                    f.div_(world) if f.is_floating_point() or f.is_complex() else None
                if copied:
                    t.copy_(f.view_as(t))

        return self._submit("all_reduce", sum(t.numel() * t.element_size() for t in tensors),
                            body, tensors, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        o = dist.AllreduceOptions()
        o.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self.allreduce(tensors, o)

    # ------------------------------------------------------------------ broadcast / reduce
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._validate_root(root)
        flats = [_flat(t) for t in tensors]

        def body(ctx, algo):
            for t, (f, copied) in zip(tensors, flats):
                self._check(ctx, "broadcast", f.numel(), f.dtype, None, root)
                algo(ctx, f, root)
                if copied:
                    t.copy_(f.view_as(t))

        return self._submit("broadcast", 0, body, tensors, tensors, opts)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._validate_root(root)
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            self._validate_reduce(t, op)
        flats = [_flat(t) for t in tensors]
        world = self.size()
        me = self.rank()

        def body(ctx, algo):
            for t, (f, copied) in zip(tensors, flats):
                self._check(ctx, "reduce", f.numel(), f.dtype, op, root)
                algo(ctx, f, root, "sum" if op == "avg" else op)
                if me == root:
                    if op == "avg":
                        f.div_(world)
                    if copied:
                        t.copy_(f.view_as(t))

        return self._submit("reduce", 0, body, tensors, tensors, opts)

    # ------------------------------------------------------------------ all-gather
    def _all_gather_flat(self, out_flat: torch.Tensor, inp: torch.Tensor, after=None):
        x, _ = _flat(inp)

        def body(ctx, algo):
            self._check(ctx, "all_gather", x.numel(), x.dtype)
            if out_flat.numel() != x.numel() * self.size():
                raise ValueError(f"hetccl: all_gather output has {out_flat.numel()} elements, "
                                 f"expected {self.size()} x {x.numel()}")
            if out_flat.dtype != x.dtype:
                raise TypeError(f"hetccl: all_gather output dtype {out_flat.dtype} differs "
                                f"from input dtype {x.dtype}")
            algo(ctx, out_flat, x)
            if after is not None:
                after()

        return body

    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1:
            raise ValueError("hetccl: allgather takes exactly one input tensor per rank")
        inp = input_tensors[0]
        outs = output_tensors[0]
        if len(outs) != self.size():
            raise ValueError(f"hetccl: all_gather needs {self.size()} output tensors, got "
                             f"{len(outs)}")
        for o in outs:
            if o.numel() != inp.numel():
                raise ValueError(f"hetccl: all_gather output tensor has {o.numel()} elements, "
                                 f"input has {inp.numel()}")
        buf = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device=inp.device)
        n = inp.numel()

        def scatter_out():
            for r, o in enumerate(outs):
                o.copy_(buf[r * n:(r + 1) * n].view_as(o))

        return self._submit("all_gather", 0, self._all_gather_flat(buf, inp, scatter_out),
                            output_tensors, [inp, *outs])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        works = [self.allgather([outs], [inp], opts) for outs, inp in zip(output_lists, input_list)]
        return _AllWork(works, output_lists)

    def _hc_all_gather_single(self, output, input, opts=None):
        out_flat, copied = _flat(output)
        after = (lambda: output.copy_(out_flat.view_as(output))) if copied else None
        return self._submit("all_gather", 0, self._all_gather_flat(out_flat, input, after),
                            [output], [output, input], opts)

    def _hc_all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._hc_all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllWork(works, outputs)

    # ------------------------------------------------------------------ reduce-scatter
    def _reduce_scatter_flat(self, out: torch.Tensor, inp_flat: torch.Tensor, op: str):
        o, copied = _flat(out)
        world = self.size()

        def body(ctx, algo):
            self._check(ctx, "reduce_scatter", o.numel(), o.dtype, op)
            if inp_flat.numel() != o.numel() * world:
                raise ValueError(f"hetccl: reduce_scatter input has {inp_flat.numel()} elements,"
                                 f" expected {world} x {o.numel()}")
            algo(ctx, o, inp_flat, "sum" if op == "avg" else op)
            if op == "avg":
                o.div_(world)
            if copied:
                out.copy_(o.view_as(out))

        return body

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        out = output_tensors[0]
        ins = input_tensors[0]
        self._validate_reduce(out, op)
        if len(ins) != self.size():
            raise ValueError(f"hetccl: reduce_scatter needs {self.size()} input tensors, got "
                             f"{len(ins)}")
        inp = torch.cat([t.reshape(-1) for t in ins])
        return self._submit("reduce_scatter", 0, self._reduce_scatter_flat(out, inp, op),
                            output_tensors, [out, inp])

    def _hc_reduce_scatter_single(self, output, input, opts=None):
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._validate_reduce(output, op)
        inp, _ = _flat(input)
        return self._submit("reduce_scatter", 0, self._reduce_scatter_flat(output, inp, op),
                            [output], [output, inp], opts)

    def _hc_reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._hc_reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllWork(works, outputs)

    # ------------------------------------------------------------------ all-to-all
    def _hc_all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                              opts=None):
        w = self.size()
        if input.dtype != output.dtype:
            raise TypeError(f"hetccl: all_to_all input dtype {input.dtype} != output dtype "
                            f"{output.dtype}")
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        ins = list(input_split_sizes) or ([input.shape[0] // w] * w if input.dim() else [0] * w)
        outs = list(output_split_sizes) or ([output.shape[0] // w] * w if output.dim() else [0] * w)
        if len(ins) != w or len(outs) != w:
            raise ValueError(f"hetccl: all_to_all split sizes must have {w} entries")
        if input.dim() and sum(ins) != input.shape[0]:
            raise ValueError(f"hetccl: all_to_all input split sizes {ins} do not add up to the "
                             f"input's first dimension {input.shape[0]}")
        if output.dim() and sum(outs) != output.shape[0]:
            raise ValueError(f"hetccl: all_to_all output split sizes {outs} do not add up to "
                             f"the output's first dimension {output.shape[0]}")
        in_counts = [s * row_in for s in ins]
        out_counts = [s * row_out for s in outs]
        x, _ = _flat(input)
        o, copied = _flat(output)

        def body(ctx, algo):
            self._check(ctx, "all_to_all", 0, x.dtype, same_numel=False)
            self._check_a2a_counts(ctx, in_counts, out_counts)
            algo(ctx, o, x, out_counts, in_counts)
            if copied:
                output.copy_(o.view_as(output))

        return self._submit("all_to_all", 0, body, [output], [output, input])

    def _check_a2a_counts(self, ctx, in_counts, out_counts):
        """Every rank learns what every rank sends to and expects from every rank (all-gathered
        like the headers) and checks every pair, so all ranks reach the same verdict."""
        if self.engine.check_mode == "off":
            return
        w = self.size()
        mine = torch.tensor(list(in_counts) + list(out_counts), dtype=torch.int64)
        out = torch.empty(w * 2 * w, dtype=torch.int64)
        from .algorithms.allgather import all_gather_hier
        all_gather_hier(ctx, out, mine, phase=1)
        m = out.view(w, 2, w)  # m[s][0][d]: s sends to d; m[d][1][s]: d expects from s
        bad = [(s, d, int(m[s][0][d]), int(m[d][1][s])) for s in range(w) for d in range(w)
               if int(m[s][0][d]) != int(m[d][1][s])]
        if bad:
            detail = "; ".join(f"rank {s} sends {a} elements to rank {d}, which expects {b}"
                               for s, d, a, b in bad[:8])
            raise ValueError(f"hetccl: all_to_all split sizes disagree across ranks: {detail}")

    def alltoall(self, output_tensors, input_tensors, opts=None):
        w = self.size()
        if len(output_tensors) != w or len(input_tensors) != w:
            raise ValueError(f"hetccl: all_to_all needs {w} input and output tensors")
        inp = torch.cat([t.reshape(-1) for t in input_tensors])
        out = torch.empty(sum(t.numel() for t in output_tensors), dtype=inp.dtype,
                          device=inp.device)
        in_counts = [t.numel() for t in input_tensors]
        out_counts = [t.numel() for t in output_tensors]

        def body(ctx, algo):
            self._check(ctx, "all_to_all", 0, inp.dtype, same_numel=False)
            self._check_a2a_counts(ctx, in_counts, out_counts)
            algo(ctx, out, inp, out_counts, in_counts)
            pos = 0
            for t in output_tensors:
                t.copy_(out[pos:pos + t.numel()].view_as(t))
                pos += t.numel()

        return self._submit("all_to_all", 0, body, output_tensors,
                            [*output_tensors, inp, out])

    # ------------------------------------------------------------------ gather / scatter
    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._validate_root(root)
        x, _ = _flat(input_tensors[0])
        me = self.rank()
        outs = output_tensors[0] if me == root and output_tensors else None
        if me == root:
            if outs is None or len(outs) != self.size():
                raise ValueError(f"hetccl: gather root needs {self.size()} output tensors")
            flats = [_flat(o) for o in outs]
        else:
            flats = []

        def body(ctx, algo):
            self._check(ctx, "gather", x.numel(), x.dtype, None, root)
            algo(ctx, [f for f, _ in flats] if flats else None, x, root)
            for o, (f, copied) in zip(outs or [], flats):
                if copied:
                    o.copy_(f.view_as(o))

        return self._submit("gather", 0, body, output_tensors,
                            [input_tensors[0], *(outs or [])])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._validate_root(root)
        out = output_tensors[0]
        o, copied = _flat(out)
        me = self.rank()
        ins = None
        if me == root:
            if not input_tensors or len(input_tensors[0]) != self.size():
                raise ValueError(f"hetccl: scatter root needs {self.size()} input tensors")
            ins = [_flat(t)[0] for t in input_tensors[0]]

        def body(ctx, algo):
            self._check(ctx, "scatter", o.numel(), o.dtype, None, root)
            algo(ctx, o, ins, root)
            if copied:
                out.copy_(o.view_as(out))

        return self._submit("scatter", 0, body, output_tensors, [out, *(ins or [])])

    # ------------------------------------------------------------------ barrier
    def barrier(self, opts=None):
        t = torch.zeros(1)

        def body(ctx, algo):
            self._check(ctx, "barrier", 1, t.dtype, "sum")
            algo(ctx, t, "sum")

        return self._submit("all_reduce", 4, body, [t], [t], opts)

    # ------------------------------------------------------------------ point to point
    def _p2p_peer(self, peer: int, what: str):
        self._validate_root(peer, what)
        if peer == self.rank():
            raise ValueError(f"hetccl: {what} rank {peer} is this rank itself")

    def send(self, tensors, dst, tag=0):
        self._p2p_peer(dst, "destination")
        t = tensors[0]
        topo = self.topo
        if topo.group_of[dst] == topo.my_group:
            return self._track(self.engine.local.send(_flat(t)[0], topo.local_rank_of[dst], tag))
        return self._track(_P2PWork.send(self.engine, dst, t, tags.p2p(tag)))

    def recv(self, tensors, src, tag=0):
        self._p2p_peer(src, "source")
        t = tensors[0]
        topo = self.topo
        if topo.group_of[src] == topo.my_group:
            f, copied = _flat(t)
            if copied:
                raise ValueError("hetccl: recv into a non-contiguous tensor is not supported")
            return self._track(self.engine.local.recv(f, topo.local_rank_of[src], tag))
        return self._track(_P2PWork.recv(self.engine, src, t, tags.p2p(tag)))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("hetccl: recv from any source is not supported; name the "
                                  "source rank")

    # ------------------------------------------------------------------ coalescing
    def _start_coalescing(self, device=None):
        if self._coalescing is not None:
            raise RuntimeError("hetccl: coalescing already started")
        self._coalescing = []

    def _end_coalescing(self, device=None):
        works, self._coalescing = self._coalescing or [], None
        return _AllWork(works, None)


compat.install_aliases(HetcclProcessGroup)


class _P2PWork(HetcclWork):
    """Point-to-point over the bridge: posted at once, completed by wait()."""

    def __init__(self, engine, req, tensor, finish=None):
        self.engine, self.req, self.tensor, self._finish = engine, req, tensor, finish
        self._done = False
        super().__init__(torch.futures.Future(), [tensor])

    @classmethod
    def send(cls, engine, peer, t, tag):
        src = t.contiguous()
        if src.is_cuda:
            src = src.to("cpu")
        return cls(engine, engine.bridge.isend(peer, src.view(-1), tag), src)

    @classmethod
    def recv(cls, engine, peer, t, tag):
        if t.is_cuda or not t.is_contiguous():
            host = torch.empty(t.shape, dtype=t.dtype)
            return cls(engine, engine.bridge.irecv(peer, host.view(-1), tag), host,
                       finish=lambda: t.copy_(host))
        return cls(engine, engine.bridge.irecv(peer, t.view(-1), tag), t)

    def wait(self, timeout=None):
        if not self._done:
            limit = timeout.total_seconds() if timeout else self.engine.timeout.total_seconds()
            try:
                nbytes = self.req.wait(time.monotonic() + limit)
                expect = self.tensor.numel() * self.tensor.element_size()
                if nbytes != expect:
                    raise ValueError(f"hetccl: point-to-point message with peer rank "
                                     f"{self.req.req.peer} carried {nbytes} bytes, the tensor "
                                     f"has {expect}")
                if self._finish is not None:
                    self._finish()
                self._done = True
                self.fut.set_result([self.tensor])
            except BaseException as e:
                if not self.fut.done():
                    self.fut.set_exception(e)
                raise
        return True

    def is_completed(self):
        return self._done or self.req.req.test()

    def get_future(self):
        return self.fut


# ---------------------------------------------------------------------- registration
def _create(dist_backend_opts, pg_options=None):
    store, rank, size, timeout, global_ranks, group_id = compat.backend_opts(dist_backend_opts)
    # torch reuses group names (and so store prefixes) after destroy_process_group: an atomic
    # counter gives every incarnation of the group its own key space, so no rank reads a
    # previous incarnation's addresses.
    generation = (store.add("hetccl/incarnations", 1) - 1) // size
    store = dist.PrefixStore(f"hetccl/{generation}/", store)
    topo = Topology.exchange(store, rank, size, timeout)
    if topo.num_groups == 1:
        backends = {}
        for dtype in ["cpu", *devices.accelerator_types()]:
            seam = devices.seam(dtype)
            backends[dtype] = (seam.native_backend, seam.new_native(
                dist.PrefixStore(f"hetccl/native/{dtype}/", store), rank, size, timeout,
                group_id, global_ranks))
        log.info("hetccl: group %r is single-vendor (%s): native pass-through", group_id,
                 topo.labels[0])
        return compat.passthrough_group(store, rank, size, backends)
    return HetcclProcessGroup(store, rank, size, timeout, topo, group_id)


def register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    compat.register_backend(BACKEND_NAME, _create, ["cpu", "cuda"])
