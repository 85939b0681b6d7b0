"""`hetccl bench soak`: thousands of randomised collectives over mixed emulated vendors,
every one verified against a float64 (or exact) reference; then a leak check.

All ranks draw the same random choices (shared seed), so they issue the same sequence:
collective, element count (0 .. --max-elems), dtype, reduction op, root, process group
(WORLD or a multi-vendor subgroup). Each rank generates every rank's input from a per-op seed,
so it checks its own result locally. Bounded by --seconds (default 120) and --max-ops; the
stop decision is itself a collective, so every rank stops after the same operation.

Prints a progress bar and a summary: operations, bytes moved, wrong results (must be 0),
leaks (shared-memory segments, threads, file descriptors after destroy_process_group: must
be 0). Exit status 1 if anything was wrong or leaked.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .report import hardware, today

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.uint8]
COLLS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
         "barrier"]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "avg": dist.ReduceOp.AVG}


def _data(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    hi = 4 if dtype == torch.uint8 else 100
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def _reduce(xs, op):
    st = torch.stack([x.double() for x in xs])
    if op in ("sum", "avg"):
        r = st.sum(0)
        return r / len(xs) if op == "avg" else r
    return st.max(0).values if op == "max" else st.min(0).values


def _close(got, ref, dtype, n_contrib) -> bool:
    if got.numel() == 0:
        return True
    if dtype.is_floating_point:
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2,
               torch.float16: 3e-3}[dtype] * n_contrib
        return bool((got.double() - ref).abs().max() <= tol)
    return torch.equal(got.to(torch.int64), ref.to(torch.int64))


def _rank_main(ctx, cfg) -> dict:
    import warnings

    import hetccl  # noqa: F401

    warnings.filterwarnings("ignore")
    base_threads = threading.active_count()
    base_fds = set(os.listdir("/proc/self/fd"))
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    rank, world = ctx.rank, ctx.world_size
    labels = hetccl.vendor_of_ranks()
    # WORLD plus every subgroup that drops one rank and still spans two vendors
    groups = [(list(range(world)), dist.group.WORLD)]
    for drop in range(world):
        ranks = [r for r in range(world) if r != drop]
        pg = dist.new_group(ranks, backend="hetccl")  # collective: every rank calls it
        if len({labels[r] for r in ranks}) > 1:
            groups.append((ranks, pg))
    rnd = random.Random(cfg["seed"])
    bar = None
    if rank == 0 and cfg["progress"]:
        from tqdm import tqdm
        bar = tqdm(total=cfg["seconds"], desc="soak (s)", file=sys.stderr,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
    ops = wrong = moved = 0
    failures = []
    t0 = time.monotonic()
    while True:
        if ops % 25 == 0:
            flag = torch.tensor([float(time.monotonic() - t0 > cfg["seconds"]
                                       or ops >= cfg["max_ops"])])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if bar is not None:
                bar.n = min(cfg["seconds"], time.monotonic() - t0)
                bar.set_postfix_str(f"{ops} ops, {wrong} wrong")
                bar.refresh()
            if flag.item() > 0:
                break
        seed = rnd.randrange(1 << 30)
        coll = rnd.choice(COLLS)
        dtype = rnd.choice(DTYPES)
        n = rnd.choice([0, 1, 7, 1000, rnd.randrange(1, cfg["max_elems"] + 1)])
        opn = rnd.choice(list(OPS) if dtype.is_floating_point else ["sum", "max", "min"])
        granks, pg = rnd.choice(groups)
        root_i = rnd.randrange(len(granks))
        ops += 1
        if rank not in granks:
            continue
        me, w = granks.index(rank), len(granks)
        xs = [_data(seed, r, n, dtype) for r in granks]
        ok = True
        try:
            if coll == "all_reduce":
                x = xs[me].clone()
                dist.all_reduce(x, op=OPS[opn], group=pg)
                ok = _close(x, _reduce(xs, opn), dtype, w)
            elif coll == "broadcast":
                x = xs[me].clone() if me == root_i else torch.zeros(n, dtype=dtype)
                dist.broadcast(x, src=granks[root_i], group=pg)
                ok = torch.equal(x, xs[root_i])
            elif coll == "all_gather":
                out = torch.empty(w * n, dtype=dtype)
                dist.all_gather_into_tensor(out, xs[me], group=pg)
                ok = torch.equal(out, torch.cat(xs))
            elif coll == "reduce_scatter":
                k = n // w
                full = [x[:k * w] for x in xs]
                out = torch.empty(k, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[me].clone(), op=OPS[opn], group=pg)
                ok = _close(out, _reduce(full, opn)[me * k:(me + 1) * k], dtype, w)
            elif coll == "all_to_all":
                k = n // w
                out = torch.empty(k * w, dtype=dtype)
                dist.all_to_all_single(out, xs[me][:k * w].clone(), group=pg)
                ok = torch.equal(out, torch.cat([x[me * k:(me + 1) * k] for x in xs]))
            elif coll == "reduce":
                x = xs[me].clone()
                dist.reduce(x, dst=granks[root_i], op=OPS[opn], group=pg)
                ok = me != root_i or _close(x, _reduce(xs, opn), dtype, w)
            else:
                dist.barrier(group=pg)
        except Exception as e:  # noqa: BLE001
            ok = False
            failures.append(f"{coll} {dtype} n={n}: {e}")
            break
        if not ok:
            wrong += 1
            failures.append(f"{coll} {dtype} {opn} n={n} group={granks}: wrong result")
        moved += n * torch.empty(0, dtype=dtype).element_size()
    if bar is not None:
        bar.close()
    elapsed = time.monotonic() - t0
    dist.destroy_process_group()
    import gc
    gc.collect()
    time.sleep(0.5)
    return {"ops": ops, "wrong": wrong, "bytes": moved, "elapsed": elapsed,
            "failures": failures[:10],
            "thread_leak": threading.active_count() - base_threads,
            "fd_leak": _new_fds(base_fds)}


def _new_fds(base: set) -> list[str]:
    out = []
    for fd in set(os.listdir("/proc/self/fd")) - base:
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the fd of the listdir itself
    return out


def main(argv=None) -> int:
    from ..launch import spawn

    p = argparse.ArgumentParser(prog="hetccl bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vendors", default="2+1+1", help="vendor split (3-4 ranks recommended)")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--max-ops", type=int, default=100_000)
    p.add_argument("--max-elems", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", default=None, help="force HETCCL_TRANSPORT (shm, tcp, ucx)")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--netns", type=int, default=0, metavar="HOSTS",
                   help="run across HOSTS emulated hosts (network namespaces with their own "
                        "address, /dev/shm and hostname, torchrun --nnodes HOSTS; needs root; "
                        "hetccl/netns.py); --per-host gives each host's vendor labels")
    p.add_argument("--per-host", default="a,b",
                   help="with --netns: vendor label of each local rank of a host (default a,b: "
                        "two ranks per host, one of each vendor)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # torchrun rank entry
    args = p.parse_args(argv)
    if args.worker:
        return _netns_worker(args.worker)
    if args.netns:
        return _netns_main(args)
    world = sum(int(x) for x in args.vendors.split("+"))
    shm_before = set(glob.glob("/dev/shm/hetccl*"))
    env = {"HETCCL_TRANSPORT": args.transport} if args.transport else None
    cfg = dict(seconds=args.seconds, max_ops=args.max_ops, max_elems=args.max_elems,
               seed=args.seed, progress=not args.no_progress)
    res = spawn(_rank_main, world, args=(cfg,), vendors=args.vendors, env=env,
                timeout=args.seconds + 300)
    shm_leak = len(set(glob.glob("/dev/shm/hetccl*")) - shm_before)
    return _summary(args, res, shm_leak, args.vendors, world)


def _summary(args, res, shm_leak, vendors, world) -> int:
    ops = res[0]["ops"]
    wrong = sum(r["wrong"] for r in res)
    moved = sum(r["bytes"] for r in res)
    threads = max(r["thread_leak"] for r in res)
    fd_names = sorted({n for r in res for n in r["fd_leak"]})
    fds = max(len(r["fd_leak"]) for r in res)
    leaks = shm_leak + max(0, threads) + max(0, fds)
    print(f"hetccl soak: {world} ranks, vendors {vendors}, transport "
          f"{args.transport or 'auto'}, {res[0]['elapsed']:.0f} s")
    print(f"  operations        : {ops} collectives (per rank), {moved / 1e9:.2f} GB of "
          f"inputs checked")
    print(f"  wrong results     : {wrong}")
    print(f"  leaks             : {leaks} (shm segments {shm_leak}, threads {threads}, "
          f"fds {fds}{': ' + ', '.join(fd_names) if fd_names else ''})")
    for r, out in enumerate(res):
        for f in out["failures"]:
            print(f"  rank {r}: {f}")
    ok = wrong == 0 and leaks == 0 and not any(r["failures"] for r in res)
    print(f"  verdict           : {'OK' if ok else 'FAILED'}")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps({"bench": "soak", "vendors": vendors, "world_size": world,
                                "transport": args.transport or "auto", "ops": ops,
                                "wrong": wrong, "bytes": moved, "leaks": leaks,
                                "seconds": res[0]["elapsed"], "hardware": hardware(),
                                "date": today()}) + "\n")
    return 0 if ok else 1


class _TorchrunCtx:
    """The launch.RankContext shape _rank_main needs, for a torchrun worker."""

    def __init__(self):
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    @staticmethod
    def init_method():
        return "env://"


def _netns_worker(spec: str) -> int:
    """A rank of `--netns`, under torchrun on one emulated host: writes its result (and the
    hetccl segments left in its host's /dev/shm after the group is gone) to the out folder."""
    cfg = json.loads(spec)
    labels = cfg.pop("per_host").split(",")
    os.environ["HETCCL_VENDOR"] = labels[int(os.environ["LOCAL_RANK"])]
    out = cfg.pop("out")
    ctx = _TorchrunCtx()
    res = _rank_main(ctx, cfg)
    res["shm_left"] = sorted(glob.glob("/dev/shm/hetccl*"))
    res["host"] = os.uname().nodename
    with open(os.path.join(out, f"rank{ctx.rank}.json.tmp"), "w") as f:
        json.dump(res, f)
    os.replace(os.path.join(out, f"rank{ctx.rank}.json.tmp"),
               os.path.join(out, f"rank{ctx.rank}.json"))
    return 0


def _netns_main(args) -> int:
    import subprocess
    import tempfile

    from .. import netns

    ok, why = netns.available()
    if not ok:
        print(f"hetccl soak --netns: cannot create emulated hosts here: {why}", file=sys.stderr)
        return 2
    per = args.per_host.split(",")
    world = args.netns * len(per)
    out = tempfile.mkdtemp(prefix="hetccl-soak-")
    cfg = dict(seconds=args.seconds, max_ops=args.max_ops, max_elems=args.max_elems,
               seed=args.seed, progress=False, per_host=args.per_host, out=out)
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", HETCCL_LOG_LEVEL="WARNING")
    for k in ("HETCCL_EMULATE_HOSTS", "HETCCL_VENDOR_SPLIT", "HETCCL_VENDOR"):
        env.pop(k, None)
    if args.transport:
        env["HETCCL_TRANSPORT"] = args.transport
    with netns.Hosts(args.netns) as h:
        procs = [h.torchrun(i, ["-m", "hetccl.bench.soak", "--worker", json.dumps(cfg)],
                            nproc=len(per), port=29400 + os.getpid() % 500, env=env,
                            stdout=open(os.path.join(out, f"host{i}.log"), "w"),
                            stderr=subprocess.STDOUT)
                 for i in range(args.netns)]
        bar = None
        if not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=int(args.seconds), desc=f"soak over {args.netns} hosts (s)",
                       file=sys.stderr)
        t0, limit = time.monotonic(), args.seconds + 300
        while (len(glob.glob(os.path.join(out, "rank*.json"))) < world
               and time.monotonic() - t0 < limit and all(p.poll() in (None, 0) for p in procs)):
            time.sleep(0.5)
            if bar is not None:
                bar.n = min(int(args.seconds), int(time.monotonic() - t0))
                bar.refresh()
        if bar is not None:
            bar.close()
        files = sorted(glob.glob(os.path.join(out, "rank*.json")))
        if len(files) < world:
            logs = "".join(open(os.path.join(out, f"host{i}.log")).read()[-2000:]
                           for i in range(args.netns))
            print(f"hetccl soak --netns: {len(files)} of {world} ranks finished\n{logs}")
            return 1
    res = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    shm_leak = len({s for r in res for s in r["shm_left"]})
    hosts = sorted({r["host"] for r in res})
    return _summary(args, res, shm_leak,
                    f"{args.per_host} on each of {args.netns} hosts ({', '.join(hosts)})", world)


if __name__ == "__main__":
    sys.exit(main())
