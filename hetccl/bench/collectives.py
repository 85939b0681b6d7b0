"""`hetccl bench collectives`: nccl-tests style figures for hetccl beside the native backends.

Launches its own local ranks (one process per rank) once per backend configuration, e.g.
  hetccl bench collectives --vendors 1+1 --backends hetccl,gloo
runs hetccl with two emulated vendors and plain gloo on the same number of ranks, in one run,
and prints rows  size count type redop time algbw busbw #wrong  per collective and backend.
"hetccl:1v" runs hetccl with every rank of one vendor (the native pass-through).

Correctness: before the timed iterations every row runs one collective on data whose exact
result is known and counts the wrong elements (#wrong); timed iterations follow (--warmup,
--iters), timed on every rank with a barrier before; time is the slowest rank's mean.
busbw factors are nccl-tests' (hetccl.bench.report.BUS_FACTOR).
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import parse_size
from .report import BUS_FACTOR, Table, hardware, today

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int32": torch.int32}
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def size_list(lo: int, hi: int, factor: int) -> list[int]:
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _pattern(rank: int, n: int, dtype, device) -> torch.Tensor:
    # small integers: exact in every dtype, so results can be checked exactly
    i = torch.arange(n, device=device)
    return ((i % 5) + 1 + rank).to(dtype)


def _expected(coll: str, rank: int, world: int, n: int, dtype, device, op: str):
    if coll == "all_reduce":
        parts = torch.stack([_pattern(r, n, torch.float64, device) for r in range(world)])
        ref = parts.sum(0) if op == "sum" else parts.max(0).values if op == "max" else parts.min(0).values
        return ref.to(dtype)
    if coll == "all_gather":
        return torch.cat([_pattern(r, n, dtype, device) for r in range(world)])
    if coll == "reduce_scatter":
        parts = torch.stack([_pattern(r, n * world, torch.float64, device) for r in range(world)])
        ref = parts.sum(0) if op == "sum" else parts.max(0).values if op == "max" else parts.min(0).values
        return ref[rank * n:(rank + 1) * n].to(dtype)
    raise ValueError(coll)


def _rank_main(ctx, cfg: dict) -> list[dict]:
    import hetccl  # noqa: F401

    backend = cfg["backend"]
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend.split(":")[0], init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=cfg["timeout"]))
    rank, world = ctx.rank, ctx.world_size
    dtype = DTYPES[cfg["dtype"]]
    esize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    bar = None
    total = len(cfg["colls"]) * len(cfg["sizes"])
    if rank == 0 and cfg["progress"]:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=f"{backend} {cfg['vendors']}", leave=False, file=sys.stderr)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for coll in cfg["colls"]:
        for size in cfg["sizes"]:
            n = max(1, size // esize)
            if coll in ("all_gather", "reduce_scatter"):
                n = max(1, n // world)  # size = the larger (gathered / scattered) buffer
            op = cfg["op"] if coll != "all_gather" else None
            redop = OPS[cfg["op"]] if op else None

            def make():
                if coll == "all_reduce":
                    return (_pattern(rank, n, dtype, device),)
                if coll == "all_gather":
                    return (torch.empty(n * world, dtype=dtype, device=device),
                            _pattern(rank, n, dtype, device))
                return (torch.empty(n, dtype=dtype, device=device),
                        _pattern(rank, n * world, dtype, device))

            def run(bufs):
                if coll == "all_reduce":
                    dist.all_reduce(bufs[0], op=redop)
                elif coll == "all_gather":
                    dist.all_gather_into_tensor(bufs[0], bufs[1])
                else:
                    dist.reduce_scatter_tensor(bufs[0], bufs[1], op=redop)

            bufs = make()
            run(bufs)
            sync()
            ref = _expected(coll, rank, world, n, dtype, device, cfg["op"])
            wrong = int((bufs[0] != ref).sum().item())
            # small messages take microseconds: run more of them so that one timing covers
            # at least ~the time of the largest size (same count on every rank)
            iters = cfg["iters"] * max(1, min(20, (64 << 20) // max(1, size)))
            for _ in range(cfg["warmup"]):
                run(bufs)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run(bufs)
            sync()
            t = (time.perf_counter() - t0) / iters
            # the slowest rank's time and the total of wrong elements, on the benchmark's device
            # (a plain nccl group has no cpu backend)
            stats = torch.tensor([t, float(wrong)], dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            t, wrong = stats[0].item(), int(stats[1].item())
            nbytes = (n * world if coll != "all_reduce" else n) * esize
            algbw = nbytes / t / 1e9
            busbw = algbw * BUS_FACTOR[coll](world)
            rows.append({"collective": coll, "size_bytes": nbytes, "count": n if coll == "all_reduce" else n * world,
                         "dtype": cfg["dtype"], "redop": op or "none", "backend": backend,
                         "vendors": cfg["vendors"], "world_size": world,
                         "device": cfg["device"], "hardware": cfg["hardware"],
                         "busbw_gbs": busbw, "algbw_gbs": algbw, "time_us": t * 1e6,
                         "wrong": wrong, "date": today()})
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def configs(args) -> list[dict]:
    out = []
    world = sum(int(x) for x in args.vendors.split("+"))
    for b in args.backends.split(","):
        b = b.strip()
        if b == "hetccl":
            out.append({"backend": "hetccl", "vendors": args.vendors})
        elif b == "hetccl:1v":
            out.append({"backend": "hetccl:1v", "vendors": str(world)})
        else:
            out.append({"backend": b, "vendors": "-"})
    return out


def main(argv: list[str] | None = None) -> int:
    from ..launch import spawn

    p = argparse.ArgumentParser(prog="hetccl bench collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vendors", default="1+1", help="vendor split for hetccl, e.g. 1+1, 2+2")
    p.add_argument("--backends", default="hetccl,hetccl:1v,gloo",
                   help="comma list: hetccl, hetccl:1v (one vendor: pass-through), gloo, nccl")
    p.add_argument("--colls", default="all_reduce,all_gather,reduce_scatter")
    p.add_argument("--minbytes", default="1M")
    p.add_argument("--maxbytes", default="64M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--op", default="sum", choices=sorted(OPS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per backend run")
    p.add_argument("--jsonl", default=None, help="append one JSON object per row")
    p.add_argument("--plot", default=None, help="write busbw vs size to this PNG")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    sizes = size_list(parse_size(args.minbytes), parse_size(args.maxbytes), args.factor)
    world = sum(int(x) for x in args.vendors.split("+"))
    hw = hardware()
    if args.device == "cuda":
        hw = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {hw}"
    print(f"# hetccl bench collectives: {world} ranks on {args.device}, hetccl vendors "
          f"{args.vendors}, dtype {args.dtype}, op {args.op}, {args.iters} iters, {today()}, "
          f"{hw}")
    table = Table([("collective", 14), ("backend", 10), ("vendors", 7), ("size", 11),
                   ("count", 10), ("type", 8), ("redop", 5), ("time(us)", 10),
                   ("algbw", 7), ("busbw", 7), ("#wrong", 6)], jsonl=args.jsonl)
    table.header()
    all_rows = []
    cfgs = configs(args)
    if args.device == "cuda" and torch.cuda.device_count() < world:
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected");
        # with ranks sharing GPUs (rank % device_count) gloo on CUDA tensors is the baseline
        for cfg in cfgs:
            if cfg["backend"] == "nccl":
                cfg["backend"] = "gloo"
                print(f"# nccl needs one GPU per rank ({world} ranks, "
                      f"{torch.cuda.device_count()} GPUs): gloo is the baseline instead")
        cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]
    for cfg in cfgs:
        rc = dict(cfg, colls=args.colls.split(","), sizes=sizes, dtype=args.dtype, op=args.op,
                  device=args.device, iters=args.iters, warmup=args.warmup,
                  timeout=args.timeout, progress=not args.no_progress, hardware=hw)
        vendors = cfg["vendors"] if cfg["backend"].startswith("hetccl") else None
        rows = spawn(_rank_main, world, args=(rc,), vendors=vendors if vendors else None,
                     timeout=args.timeout)[0]
        for r in rows:
            table.row([r["collective"], r["backend"], r["vendors"], r["size_bytes"],
                       r["count"], r["dtype"], r["redop"], r["time_us"], r["algbw_gbs"],
                       r["busbw_gbs"], r["wrong"]], r)
        all_rows += rows
    table.close()
    summarize(all_rows)
    if args.plot:
        plot(all_rows, args.plot)
    return 1 if any(r["wrong"] for r in all_rows) else 0


def summarize(rows: list[dict]) -> None:
    """Ratios at the largest size of each collective: hetccl vs every other backend."""
    print("\n# summary (busbw ratios at the largest size, measured in this run)")
    by = {}
    for r in rows:
        by.setdefault((r["collective"], r["size_bytes"]), {})[r["backend"]] = r
    for coll in dict.fromkeys(r["collective"] for r in rows):
        sizes = sorted(s for c, s in by if c == coll)
        for size in sizes[-1:] + ([s for s in sizes if s == 1 << 20] if len(sizes) > 1 else []):
            cell = by[(coll, size)]
            parts = [f"{b} {v['busbw_gbs']:.2f} GB/s" for b, v in cell.items()]
            ratios = []
            if "hetccl" in cell:
                for b, v in cell.items():
                    if b != "hetccl" and v["busbw_gbs"] > 0:
                        ratios.append(f"hetccl/{b} = {cell['hetccl']['busbw_gbs'] / v['busbw_gbs']:.2f}x")
            native = cell.get("nccl") or cell.get("gloo")
            if "hetccl:1v" in cell and native:
                ratios.append(f"pass-through/{native['backend']} = "
                              f"{cell['hetccl:1v']['busbw_gbs'] / native['busbw_gbs']:.3f}")
            print(f"#  {coll:<14} {size / 2**20:8.2f} MiB: " + ", ".join(parts)
                  + ("  |  " + ", ".join(ratios) if ratios else ""))
    wrong = sum(r["wrong"] for r in rows)
    print(f"# rows: {len(rows)}, wrong elements: {wrong}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = list(dict.fromkeys(r["collective"] for r in rows))
    fig, axes = plt.subplots(1, len(colls), figsize=(5 * len(colls), 4), squeeze=False)
    for ax, coll in zip(axes[0], colls):
        for b in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted((r["size_bytes"], r["busbw_gbs"]) for r in rows
                         if r["collective"] == coll and r["backend"] == b)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(coll)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
