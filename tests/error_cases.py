"""Rank-side bad-input checks: every rank must get a clear error (never a hang or a wrong
result), and the group must stay usable after an argument error."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def _expect(fn, exc, *words):
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w.lower() not in msg.lower()]
        return f"message lacks {missing}: {msg}" if missing else "ok"
    except Exception as e:  # noqa: BLE001
        return f"wrong exception {type(e).__name__}: {e}"
    return "no error raised"


def run(ctx) -> dict[str, str]:
    import hetccl  # noqa: F401

    rank, world = ctx.rank, ctx.world_size
    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    out = {}
    # sizes differ between rank 0 and the others (rank 0 and 1 share a vendor in 2+1)
    n = 10 if rank == 0 else 12
    out["size_mismatch"] = _expect(lambda: dist.all_reduce(torch.ones(n)), ValueError,
                                   "number of elements", "ranks")
    dt = torch.float64 if rank == world - 1 else torch.float32
    out["dtype_mismatch"] = _expect(lambda: dist.all_reduce(torch.ones(4, dtype=dt)),
                                    ValueError, "dtype")
    out["all_gather_size_mismatch"] = _expect(
        lambda: dist.all_gather_into_tensor(torch.empty(world * (3 + (rank == 1))),
                                            torch.ones(3 + (rank == 1))),
        ValueError, "number of elements")
    out["bitwise_op_on_float"] = _expect(lambda: dist.all_reduce(torch.ones(4),
                                                                 op=dist.ReduceOp.BAND),
                                         ValueError, "BAND", "integer", "float32")
    out["sparse_non_sum"] = _expect(
        lambda: dist.all_reduce(torch.ones(4).to_sparse(), op=dist.ReduceOp.MAX),
        ValueError, "sparse", "SUM")
    # bool is reduced on its bytes, but checked as bool: uint8 on another rank is a mismatch
    bt = torch.bool if rank == world - 1 else torch.uint8
    out["bool_against_uint8"] = _expect(
        lambda: dist.all_reduce(torch.ones(4, dtype=bt), op=dist.ReduceOp.MAX), ValueError,
        "dtype")
    out["bool_against_uint8_reduce_scatter"] = _expect(
        lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=bt),
                                           torch.ones(2 * world, dtype=bt)),
        ValueError, "dtype")
    out["avg_on_bool"] = _expect(lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool),
                                                         op=dist.ReduceOp.AVG),
                                 TypeError, "AVG", "boolean")
    out["invalid_root"] = _expect(lambda: dist.broadcast(torch.ones(3), src=world + 5),
                                  (ValueError, RuntimeError), "rank")
    # uneven all_gather (list): rank 1's input does not match outs[1], which every rank
    # expects: reported on every rank by broadcast 1's check
    out["uneven_all_gather_input_mismatch"] = _expect(
        lambda: dist.all_gather([torch.empty(2 + k) for k in range(world)],
                                torch.ones(2 + rank + (rank == 1))),
        ValueError, "number of elements")
    out["uneven_reduce_scatter_output_mismatch"] = _expect(
        lambda: dist.reduce_scatter(torch.empty(2 + rank + (rank == 1)),
                                    [torch.ones(2 + k) for k in range(world)]),
        ValueError, "number of elements")
    ins = [1] * world
    outs = [1] * world
    if rank == 0:
        ins[world - 1] = 2  # rank 0 sends 2 rows to the last rank, which expects 1
    out["a2a_split_mismatch"] = _expect(
        lambda: dist.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), outs, ins),
        ValueError, "split")
    # still usable after the argument errors
    x = torch.full((1000,), float(rank))
    dist.all_reduce(x)
    out["usable_after_errors"] = "ok" if torch.all(x == sum(range(world))) else f"wrong {x[:3]}"
    # which check ran: one exchange over the links where same-vendor ranks are linked too
    # (one host, HETCCL_GROUP_LINKS), through the bridge where two groups of equal size 2^m
    # allow it, else the native all-gather inside the vendor group (checks.py)
    engine = dist.group.WORLD.engine
    stats = dict(engine.stats)
    sizes = sorted(len(g) for g in engine.topo.groups)
    bridge = len(sizes) == 2 and sizes[0] == sizes[1] > 1 and not sizes[0] & (sizes[0] - 1)
    linked = engine.check_linked
    alone = engine.local is None  # a group of one has nothing to gather
    ran = (stats.get("check_bridge", 0), stats.get("check_native", 0), stats.get("check_linked", 0))
    if linked:
        want = ran[2] > 0 and ran[0] == ran[1] == 0
    elif bridge:
        want = ran[0] > 0 and ran[1] == ran[2] == 0
    else:
        want = ran[0] == ran[2] == 0 and (ran[1] > 0) != alone
    out["check_path"] = "ok" if want else f"bridge/native/linked {ran} (linked {linked})"
    dist.destroy_process_group()
    return out
