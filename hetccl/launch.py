"""Local multi-process launcher used by tests, `hetccl demo` and `hetccl bench`.

spawn(fn, world_size, ...) starts `world_size` processes on this host (multiprocessing 'spawn'
context, so no state leaks from the parent), hands each a torch TCPStore client connected to a
server the parent owns on a free port (never a fixed port), runs fn(ctx, *args) and returns
the per-rank results in rank order.

Failure contract: if any rank raises, spawn raises RankError carrying every failing rank's
traceback; if the ranks do not all finish within `timeout` seconds, the survivors are killed and
spawn raises RankTimeout naming the ranks that were still running, with every thread's Python
stack of each (faulthandler on SIGUSR1, written to a file the parent reads before the kill:
which call each rank was blocked in). It never hangs.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence


class RankError(RuntimeError):
    pass


class RankTimeout(RankError):
    pass


@dataclasses.dataclass
class RankContext:
    rank: int
    world_size: int
    host: str
    port: int
    vendor: str

    def store(self, timeout_s: float = 60.0):
        import torch.distributed as dist

        return dist.TCPStore(self.host, self.port, self.world_size, False,
                             timeout=timedelta(seconds=timeout_s))

    def init_method(self) -> str:
        """env:// rendezvous against the parent's store: the parent plays torchrun's agent
        (TORCHELASTIC_USE_AGENT_STORE), so no rank has to open a listening port for it."""
        return "env://"


def vendor_labels(split: Sequence[int] | str) -> list[str]:
    """'2+1' or [2, 1] -> ['v0', 'v0', 'v1']: consecutive ranks share a vendor label."""
    if isinstance(split, str):
        split = [int(x) for x in split.split("+") if x]
    labels = []
    for g, n in enumerate(split):
        labels += [f"v{g}"] * int(n)
    return labels


def share_gpus(env=None, argv: list[str] | None = None) -> str | None:
    """Put the workers of an emulated mixed-vendor job on the GPUs this host has.

    Contract: when vendors are emulated (HETCCL_VENDOR_SPLIT or HETCCL_VENDOR set) and a host
    runs more workers (LOCAL_WORLD_SIZE) than it has GPUs, the worker of local rank r is shown
    exactly one GPU, number r % n of the n it would see, and LOCAL_RANK becomes 0: the index of
    that GPU among the ones it sees. Frameworks bind LOCAL_RANK to a GPU index (DeepSpeed, HF
    accelerate, Megatron's scripts: `cuda:{LOCAL_RANK}`), which on a one-GPU box fails for every
    rank but the first, and two ranks of one GPU index refuse each other in some of them. The
    real local rank stays in HETCCL_LOCAL_RANK, and an argv holding `--local_rank=N` /
    `--local_rank N` (the deepspeed launcher passes one) gets 0 too. Trade-off: several workers
    of a host now see LOCAL_RANK 0, so code that does once-per-host work on local rank 0 does it
    in each of them. HETCCL_SHARE_GPUS=off leaves everything as the launcher set it, on forces
    it without emulation. Must run before the worker initialises its GPU runtime. Returns a
    line saying what it did, or None. env: the worker's environment (default os.environ)."""
    from . import config
    from . import device as devices

    env = os.environ if env is None else env
    mode = config.get("HETCCL_SHARE_GPUS")
    emulated = bool(env.get("HETCCL_VENDOR_SPLIT") or env.get("HETCCL_VENDOR"))
    if mode == "off" or (mode == "auto" and not emulated) or "HETCCL_LOCAL_RANK" in env:
        return None
    try:
        # torchrun and hetccl.launch say LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
        local = int(env["LOCAL_RANK"])
        workers = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or "0")
    except (KeyError, ValueError):
        return None
    seam, gpus = devices.visible_accelerators(env)
    if not gpus or (mode == "auto" and workers <= len(gpus)):
        return None
    mine = gpus[local % len(gpus)]
    seam.show_only(env, mine)
    env["HETCCL_LOCAL_RANK"] = str(local)
    env["LOCAL_RANK"] = "0"
    if argv is not None:
        for i, a in enumerate(argv):
            if a.startswith("--local_rank=") or a.startswith("--local-rank="):
                argv[i] = a.split("=", 1)[0] + "=0"
            elif a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
                argv[i + 1] = "0"
    return (f"hetccl: {workers} workers on {len(gpus)} GPU(s) (vendors emulated): local rank "
            f"{local} uses GPU {mine} as its only GPU (LOCAL_RANK=0, HETCCL_LOCAL_RANK={local})")


def _entry(fn, ctx: RankContext, env: dict, args, q, stacks: str):
    os.environ.update(env)
    share_gpus()
    # a rank that dies on a signal (a native abort or crash) prints every thread's Python stack
    # to its stderr first, so the parent's "exited with code -6" has a place to look
    faulthandler.enable(all_threads=True)
    # a rank still running at spawn's timeout: SIGUSR1 writes its threads' stacks for the report
    # (the file stays open for the process's life: faulthandler writes to its descriptor)
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)
    if "OMP_NUM_THREADS" in env:
        import torch  # may already be imported (with the parent's thread count) by fn's module

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        # Plain pickle (by value): torch's multiprocessing reductions would pass tensors as
        # shared-memory handles that die with this process.
        q.put((ctx.rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((ctx.rank, False, traceback.format_exc()))


def _stacks(procs, ranks, stack_dir: str, limit: int = 6000) -> str:
    """Every thread's Python stack of each rank in `ranks` still alive (SIGUSR1: _entry), for
    the timeout's report; the last `limit` characters per rank (the innermost frames)."""
    alive = [r for r in ranks if procs[r].is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0 if alive else 0)  # the handler writes at once; this covers a busy machine
    out = ""
    for r in alive:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.txt")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            out += f"\n--- rank {r} stacks at the timeout:\n{text[-limit:]}"
    return out


def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
          vendors: Sequence[str] | Sequence[int] | str | None = None,
          env: dict | None = None, rank_env: Sequence[dict] | None = None,
          timeout: float = 120.0, may_die: Sequence[int] = ()) -> list[Any]:
    """may_die: ranks whose death or failure is part of the test; their result is None."""
    import torch.distributed as dist

    if vendors is not None and (isinstance(vendors, str) or
                                (len(vendors) and isinstance(vendors[0], int))):
        vendors = vendor_labels(vendors)
    if vendors is not None and len(vendors) != world_size:
        raise ValueError(f"vendors has {len(vendors)} labels for world_size {world_size}")
    server = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout))
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    procs = []
    stack_dir = tempfile.mkdtemp(prefix="hetccl-spawn-")
    for r in range(world_size):
        e = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
             "RANK": str(r), "WORLD_SIZE": str(world_size),
             "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world_size),
             "TORCHELASTIC_USE_AGENT_STORE": "True",
             # as torchrun does for several workers per host: one intra-op thread per rank,
             # so ranks (and their communication threads) do not oversubscribe the cores
             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if vendors is not None:
            e["HETCCL_VENDOR"] = vendors[r]
        e.update(env or {})
        if rank_env is not None:
            e.update(rank_env[r])
        ctx = RankContext(r, world_size, "127.0.0.1", server.port, e.get("HETCCL_VENDOR", ""))
        p = ctx_mp.Process(target=_entry, args=(fn, ctx, e, args, q,
                                                os.path.join(stack_dir, f"rank{r}.txt")),
                           daemon=True)
        p.start()
        procs.append(p)

    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        may_die = set(may_die)
        while len(results) + len(failures) < world_size:
            if may_die and all(i in results or i in failures or i in may_die
                               for i in range(world_size)):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                detail = "".join(f"\n--- rank {r} failed:\n{t}" for r, t in failures.items())
                raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f} s"
                                  + detail + _stacks(procs, missing, stack_dir))
            try:
                r, ok, val = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                # A rank that died without reporting (segfault, SIGKILL) never reports.
                dead = [i for i, p in enumerate(procs)
                        if not p.is_alive() and i not in results and i not in failures
                        and p.exitcode not in (0, None)]
                for i in dead:
                    failures[i] = f"process exited with code {procs[i].exitcode}"
                continue
            (results if ok else failures)[r] = pickle.loads(val) if ok else val
            if failures and not ok:
                # Give the others a short grace period to report their own errors.
                deadline = min(deadline, time.monotonic() + min(30.0, timeout))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del server
        shutil.rmtree(stack_dir, ignore_errors=True)
    failures = {r: t for r, t in failures.items() if r not in may_die}
    if failures:
        msg = "".join(f"\n--- rank {r}:\n{t}" for r, t in sorted(failures.items()))
        raise RankError(f"{len(failures)} of {world_size} ranks failed:{msg}")
    return [results.get(r) for r in range(world_size)]
