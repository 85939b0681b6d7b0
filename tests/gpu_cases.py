"""Rank-side GPU checks: run() for tests/test_gpu.py (CUDA tensors across emulated vendors);
below it the device-generic cases of tests/test_gpu_suite.py."""
from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from collective_cases import case_device


def run(ctx) -> dict:
    import hetccl

    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    rank, world = ctx.rank, ctx.world_size
    pg = dist.group.WORLD
    out = {}
    out["is_hetccl_group"] = isinstance(pg, hetccl.HetcclProcessGroup)
    # emulated vendors share nothing but host memory: no native (NCCL) communicator between
    # the two groups, shm bridge between the ranks
    out["native_comm_across_groups"] = pg.engine.local is not None
    out["bridge_kinds"] = sorted(set(pg.engine.bridge.kind_of.values()))

    def inputs(n, dtype, seed):
        return [torch.randn(n, generator=torch.Generator().manual_seed(seed + r),
                            dtype=torch.float64) for r in range(world)]

    errs = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n in (1, 1001, (8 << 20) // 2 + 7, 64 << 20 >> 2):
            xs = inputs(n, dtype, n)
            x = xs[rank].to(dtype).to(dev)
            dist.all_reduce(x)
            ref = torch.stack([v.to(dtype).double() for v in xs]).sum(0)
            errs[f"all_reduce/{dtype}/{n}"] = (x.double().cpu() - ref).abs().max().item() / max(1, ref.abs().max().item()) <= tol
            y = xs[rank].to(dtype).to(dev)
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
            errs[f"all_reduce_max/{dtype}/{n}"] = torch.equal(
                y.cpu(), torch.stack([v.to(dtype) for v in xs]).max(0).values)
        n = 3 << 20
        xs = inputs(n, dtype, 7)
        big = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(big, xs[rank].to(dtype).to(dev))
        errs[f"all_gather/{dtype}"] = torch.equal(big.cpu(), torch.cat([v.to(dtype) for v in xs]))
        full = inputs(world * n, dtype, 11)
        o = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(o, full[rank].to(dtype).to(dev))
        ref = torch.stack([v.to(dtype).double() for v in full]).sum(0)[rank * n:(rank + 1) * n]
        errs[f"reduce_scatter/{dtype}"] = (o.double().cpu() - ref).abs().max().item() <= tol * 4
        b = xs[rank].to(dtype).to(dev) if rank == 1 else torch.zeros(n, dtype=dtype, device=dev)
        dist.broadcast(b, src=1)
        errs[f"broadcast/{dtype}"] = torch.equal(b.cpu(), xs[1].to(dtype))
    out["correct"] = errs

    # stream semantics: the collective waits for work queued before it on the caller's
    # stream, returns without blocking the host, and wait() orders the caller's stream after it
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
    x.fill_(rank + 1.0)  # queued behind the sleep
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    issue_s = time.perf_counter() - t0
    work.wait()
    wait_s = time.perf_counter() - t0
    y = x * 2  # on the caller's stream, after wait()
    torch.cuda.synchronize()
    out["stream"] = {"issue_s": issue_s, "wait_s": wait_s,
                     "value_ok": bool((y == 2 * sum(r + 1.0 for r in range(world))).all())}
    # issuing never waits for the data: eight 8 MiB all-reduces queued behind 0.2 s of GPU work
    # return in a few milliseconds, and the values are right once the stream gets there
    xs = [torch.full((2 << 20,), float(rank + k), device=dev) for k in range(8)]
    for v in xs:  # warm-up: buffers, streams and kernels of this size exist before timing
        dist.all_reduce(v.clone())
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    works = [dist.all_reduce(v, async_op=True) for v in xs]
    out["async_issue_s"] = time.perf_counter() - t0
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    out["async_values_ok"] = all(
        bool((v == sum(r + k for r in range(world))).all()) for k, v in enumerate(xs))

    # two groups and host collectives interleaved with device ones, issued from two threads
    import threading

    g2 = dist.new_group(list(range(world)))
    results = {}

    def worker(name, group, base):
        vals = []
        for k in range(20):
            v = torch.full((1000 + k,), float(base + rank + k), device=dev)
            w = dist.all_reduce(v, group=group, async_op=True)
            h = torch.full((7,), float(rank), dtype=torch.float64)
            dist.all_reduce(h, group=group)
            w.wait()
            vals.append(bool((v == sum(base + r + k for r in range(world))).all())
                        and bool((h == sum(range(world))).all()))
        torch.cuda.synchronize()
        results[name] = all(vals)

    ts = [threading.Thread(target=worker, args=("world", None, 0)),
          threading.Thread(target=worker, args=("g2", g2, 100))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out["concurrent_groups_ok"] = results.get("world") and results.get("g2")

    # DDP: gradients equal the average of the per-rank gradients (computed without DDP)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                              torch.nn.Linear(2048, 512)).to(dev)
    ref = [p.detach().clone() for p in net.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[dev.index],
                                                    bucket_cap_mb=1)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(64, 512, generator=g) for _ in range(world)]
    ddp(data[rank].to(dev)).square().mean().backward()
    local = []
    for r in range(world):
        m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).to(dev)
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref):
                p.copy_(q)
        m(data[r].to(dev)).square().mean().backward()
        local.append([p.grad for p in m.parameters()])
    torch.cuda.synchronize()
    errs = [(p.grad - sum(lg[i] for lg in local) / world).abs().max().item()
            for i, p in enumerate(net.parameters())]
    out["ddp_grad_err"] = max(errs)

    # arguments that differ across ranks: a clear error on every rank, the group stays usable
    z = torch.ones(8) if rank == 0 else torch.ones(8, device=dev)
    try:
        dist.all_reduce(z)
        out["device_mismatch"] = "no error"
    except ValueError as e:
        out["device_mismatch"] = "ok" if "device type" in str(e) else str(e)
    z = torch.ones(100 + rank, device=dev)
    try:
        dist.all_reduce(z)
        out["size_mismatch"] = "no error"
    except ValueError as e:
        out["size_mismatch"] = "ok" if "number of elements" in str(e) else str(e)
    z = torch.ones(77, device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    out["usable_after_errors"] = bool((z == world).all())
    out["stats"] = pg.engine.stats
    dist.destroy_process_group()
    return out


# ======================================================================================
# Device-generic rank-side cases of tests/test_gpu_suite.py. `device` is "cuda" (GPU
# rank % device_count) or "cpu" (HETCCL_GPU_SUITE_DEVICE=cpu: the same logic on host tensors,
# to validate the cases on a machine without a GPU). Every case reports through `record`
# (case, verdict) as soon as it has a verdict, so the parent keeps what was done when a rank dies.
# ======================================================================================

def recorded_entry(ctx, tmp: str, fn, kwargs: dict, stacks_after: float = 0):
    """Runs fn(ctx, record=..., **kwargs); record(case, verdict) appends one JSON line to
    tmp/rank<r>.jsonl at once (flushed), for the parent to read even if this rank dies.
    stacks_after > 0: if the rank is still running that many seconds from now, every thread's
    Python stack is written to tmp/rank<r>.stacks (faulthandler), so a hang names the call it
    is blocked in."""
    import faulthandler
    import json

    f = open(os.path.join(tmp, f"rank{ctx.rank}.jsonl"), "a", buffering=1)
    stacks = None
    if stacks_after > 0:
        stacks = open(os.path.join(tmp, f"rank{ctx.rank}.stacks"), "w")
        faulthandler.dump_traceback_later(stacks_after, repeat=False, file=stacks)

    def record(case, verdict):
        f.write(json.dumps([case, verdict]) + "\n")
        f.flush()

    try:
        fn(ctx, record=record, **kwargs)
    finally:
        if stacks is not None:
            faulthandler.cancel_dump_traceback_later()
            stacks.close()
        f.close()
    return None


# Bad input (tests/test_gpu_suite.py): rank 0 calls with value A, every other rank with value B.
# kind -> (words the error must contain, what the wrong call is)
ERROR_KINDS = {
    "size": ["number of elements", "10", "12"],
    "dtype": ["dtype", "float32", "float64"],
    "op": ["reduction op", "sum", "max"],
    "root": ["root"],
}
# orders of earlier (successful) calls before the mismatching one:
#   fresh      nothing before, in a fresh group
#   r0_used    every rank already ran rank 0's call (rank 0 has used its arguments before, the
#              others have not used theirs: the order that once made ranks take different
#              check protocols)
#   rest_used  every rank already ran the others' call (the reverse)
#   both_used  every rank already ran both calls: every rank has used its own arguments
ERROR_ORDERS = ["fresh", "r0_used", "rest_used", "both_used"]


def _error_call(kind: str, side: str, dev, group):
    """The call of `side` ("A": rank 0's, "B": the others') for mismatch `kind`."""
    if kind == "size":
        x = torch.ones(10 if side == "A" else 12, device=dev)
        return lambda: dist.all_reduce(x, group=group)
    if kind == "dtype":
        x = torch.ones(16, dtype=torch.float32 if side == "A" else torch.float64, device=dev)
        return lambda: dist.all_reduce(x, group=group)
    if kind == "op":
        x = torch.ones(16, device=dev)
        op = dist.ReduceOp.SUM if side == "A" else dist.ReduceOp.MAX
        return lambda: dist.all_reduce(x, op=op, group=group)
    if kind == "root":
        x = torch.ones(16, device=dev)
        src = 0 if side == "A" else 1
        return lambda: dist.broadcast(x, src=src, group=group)
    raise ValueError(kind)


def _usable(dev, group, world) -> str | None:
    """A correct all_reduce on `group` succeeds with the right value."""
    x = torch.full((1000,), 1.0, device=dev) * (dist.get_rank() + 1)
    dist.all_reduce(x, group=group)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    want = float(sum(range(1, world + 1)))
    return None if bool((x.cpu() == want).all()) else f"wrong value {x[:3].tolist()} != {want}"


def run_errors(ctx, device: str, orders: list[str], check: str = "on", record=None,
               timeout_s: float = 10):
    """Every (kind, order) of ERROR_KINDS x orders, each in a fresh hetccl group over all ranks,
    under HETCCL_CHECK_ARGS=`check` (the parent sets it for the ranks). Verdict per case:
      ok        check "on" (the default; hetccl/checks.py): the mismatching call itself raised a
                ValueError on this rank whose text names what differs (field and values),
                whatever the order of earlier calls, and a correct all_reduce on the group
                succeeds afterwards (an argument error leaves the group usable:
                docs/reliability.md).
                check "async": the mismatch was raised, naming what differs, by the call (a
                ValueError where the call itself saw it; the group's CommError where the engine
                found it after issue and the call's wait reported it) or by the next call
                (device calls do not wait: the engine compares the headers as they arrive,
                HETCCL_ASYNC_ERROR_HANDLING=raise), and afterwards the group either works or refuses every call at once (a broken group), never a hang
                or a wrong value.
      else      the failure.
    The ranks run with HETCCL_ASYNC_ERROR_HANDLING=raise (tests/test_gpu_suite.py), so an
    asynchronous verdict is an exception here, not a stopped process."""
    import hetccl  # noqa: F401

    rank, world = ctx.rank, ctx.world_size
    dev = case_device(rank, device)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    side = "A" if rank == 0 else "B"
    out = {}
    for order in orders:
        for kind, words in ERROR_KINDS.items():
            name = f"{kind}/{order}" + ("" if check == "on" else f"/{check}")
            g = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
            try:
                verdict = _one_error_case(kind, order, side, words, dev, g, world, check)
            except Exception:  # noqa: BLE001
                verdict = "unexpected: " + traceback.format_exc(limit=4)
            out[name] = verdict
            if record is not None:
                record(name, verdict)
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a broken group may refuse; the next is fresh
                pass
    dist.barrier()
    dist.destroy_process_group()
    return out


def _one_error_case(kind, order, side, words, dev, g, world, check):
    prep = {"fresh": [], "r0_used": ["A"], "rest_used": ["B"], "both_used": ["A", "B"]}[order]
    for s in prep:  # earlier successful calls: every rank makes the same call
        _error_call(kind, s, dev, g)()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    bad = _error_call(kind, side, dev, g)

    def named(msg):
        missing = [w for w in words if w.lower() not in msg.lower()]
        return f"message lacks {missing}: {msg[:300]}" if missing else None

    def async_verdict(e):
        # reported after issue (HETCCL_CHECK_ARGS=async): the text must name what differs,
        # and the group then works or refuses at once
        err = named(str(e))
        return ("async report " + err) if err else (fails_fast() or "ok")

    def fails_fast():
        t1 = time.monotonic()
        try:
            res = _usable(dev, g, world)
        except Exception:  # noqa: BLE001
            took = time.monotonic() - t1
            return None if took < 2 else f"a later call took {took:.1f} s to fail"
        return None if res is None else "a later call gave " + res

    try:
        bad()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001
        if check == "async" and isinstance(e, RuntimeError):
            # found by the engine after the call was issued (the headers compared as they
            # arrived): reported by the call's own wait -- torch's dist.all_reduce waits the
            # work -- as the group's failure (CommError, a RuntimeError), naming what differs
            return async_verdict(e)
        if not isinstance(e, ValueError):
            return f"wrong exception {type(e).__name__}: {str(e)[:300]}"
        err = named(str(e))
        if err:
            return err
        if check == "async":
            return fails_fast() or "ok"
        after = _usable(dev, g, world)
        return "ok" if after is None else "group not usable after the error: " + after
    # not raised by the call itself
    t0 = time.monotonic()
    try:
        res = _usable(dev, g, world)
    except Exception as e:  # noqa: BLE001
        if check != "async":
            return (f"not raised by the mismatching call (order {order}); the next call "
                    f"raised {type(e).__name__}: {str(e)[:300]}")
        return async_verdict(e)
    return (f"no error raised (order {order}); the next correct call "
            f"{'succeeded' if res is None else 'gave ' + res} after {time.monotonic() - t0:.1f} s")


def peer_dies_device(ctx, device: str, victim: int, nelem: int, timeout_s: float):
    """The victim SIGKILLs itself while large all_reduces of device tensors are in flight; each
    survivor must raise an error (through wait() / the next call: HETCCL_ASYNC_ERROR_HANDLING=
    raise) within the group's timeout, and later calls must fail at once."""
    import signal
    import threading

    import hetccl  # noqa: F401

    dev = case_device(ctx.rank, device)
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s))
    x = torch.ones(nelem, device=dev)
    dist.all_reduce(x)  # connected, signature checked
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    if ctx.rank == victim:
        def die():
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
        for _ in range(100000):
            dist.all_reduce(x)
        return None
    t0 = time.monotonic()
    n = 0
    try:
        for n in range(100000):
            w = dist.all_reduce(x, async_op=True)
            w.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001
        elapsed = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3, device=dev))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            again = "second op succeeded"
        except Exception as e2:  # noqa: BLE001
            again = f"{type(e2).__name__}: {e2}"
        return {"error": f"{type(e).__name__}: {e}", "elapsed": elapsed, "iters": n,
                "again": again, "again_s": time.monotonic() - t1}
    return {"error": None, "iters": n}


# ----------------------------------------------------------------------------- training
def run_training(ctx, device: str, which: list[str], backend: str = "hetccl") -> dict:
    """DDP and FSDP2 (fully_shard) over hetccl on `device`, tests/training_cases.py's model and
    data (each rank its slice of the global batch): final parameters per run, and the
    per-step losses, for comparison with the float64 single-process reference.
    which: "ddp", "fsdp2" (fp32), "fsdp2_bf16" (MixedPrecisionPolicy: bf16 parameters and
    gradient reduction in fp32)."""
    import training_cases as tc

    import hetccl  # noqa: F401

    dev = case_device(ctx.rank, device)
    dist.init_process_group(backend, init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    out = {}
    for w in which:
        if w == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(
                tc.make_model().to(dev), bucket_cap_mb=0.01,
                device_ids=[dev.index] if dev.type == "cuda" else None)
            losses = _train_slices(model, ctx, dev, tc)
            params = [p.detach().cpu().clone() for p in model.module.parameters()]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(dev.type, (ctx.world_size,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if w == "fsdp2_bf16" else MixedPrecisionPolicy()
            model = tc.make_model().to(dev)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            losses = _train_slices(model, ctx, dev, tc)
            params = [p.full_tensor().detach().cpu().float().clone() for p in model.parameters()]
        out[w] = {"params": params, "losses": losses}
    dist.destroy_process_group()
    return out


def _train_slices(model, ctx, dev, tc) -> list[float]:
    """tc.STEPS of SGD, each rank on its equal slice of the global batch; the global mean loss
    of each step (all-reduced)."""
    opt = torch.optim.SGD(model.parameters(), lr=tc.LR)
    per = tc.GLOBAL_BATCH // ctx.world_size
    losses = []
    for step in range(tc.STEPS):
        x, y = tc.batch(step)
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        loss = torch.nn.functional.mse_loss(model(x[sl].to(dev)).float(), y[sl].to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().reshape(1).float()
        dist.all_reduce(t)
        losses.append(t.item() / ctx.world_size)
    return losses


def reference_losses() -> list[float]:
    """Per-step full-batch loss of the float64 single-process reference (training_cases)."""
    import training_cases as tc

    model = tc.make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=tc.LR)
    out = []
    for step in range(tc.STEPS):
        x, y = tc.batch(step)
        loss = torch.nn.functional.mse_loss(model(x.double()), y.double())
        out.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


# ----------------------------------------------------------------------------- Megatron
def megatron_tiny(vendors, device: str, *, pp=1, stages="even", **over) -> dict:
    """A tiny GPT recipe for megatron-core (tests/test_megatron.py's, on `device`: bf16 on
    CUDA, fp32 on the CPU)."""
    rec = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": pp,
           "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
           "max_position_embeddings": 32, "vocab_size": 128, "micro_batch_size": 2,
           "global_batch_size": 8, "train_iters": 4, "lr": 0.01, "seed": 7, "log_interval": 100,
           "bf16": device == "cuda",
           "hetccl": {"device": device, "vendors": vendors, "stages": stages, "probe_iters": 3}}
    rec.update(over)
    return rec


def run_megatron(ctx, device: str, runs: list) -> dict:
    """One megatron-core session (pp from the first recipe), the recipes of `runs` (recipe,
    {rank: env}) trained in turn: rows per run."""
    from hetccl.integrations import megatron as m

    rec0 = m.load_recipe(runs[0][0])
    sess = m.initialize(tp=1, pp=rec0["pipeline_model_parallel_size"], store=ctx.store(),
                        launch_rank=ctx.rank, world_size=ctx.world_size, device=device,
                        seed=rec0["seed"])
    out = []
    for raw, env in runs:
        os.environ.update(env.get(ctx.rank, {}))
        out.append(m.train(m.load_recipe(raw), sess, quiet=True))
        for k in env.get(ctx.rank, {}):
            os.environ.pop(k, None)
    sess.destroy()
    return {"rank": ctx.rank, "runs": out}
