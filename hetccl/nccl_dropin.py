"""Where the drop-in NCCL/RCCL libraries are (csrc/nccl/dropin.cc, built as
hetccl/dropin/libnccl.so.2 and librccl.so.1) and which real library they forward to: used by
`hetccl run` (LD_PRELOAD and HETCCL_NCCL_LIBRARY for the ranks), `hetccl doctor` and the tests.
Imports neither torch nor the rest of hetccl."""
from __future__ import annotations

import importlib.util
import os
import sys

SONAMES = {"nccl": "libnccl.so.2", "rccl": "librccl.so.1"}
REAL_ENV = {"nccl": "HETCCL_NCCL_LIBRARY", "rccl": "HETCCL_RCCL_LIBRARY"}

# The names torch 2.11's libtorch_cuda.so imports from libnccl.so.2 (read on the GPU box with
# nm -D --undefined-only), and what other NCCL users commonly call beside them.
TORCH_IMPORTS = """ncclAllGather ncclAllReduce ncclAlltoAll ncclBcast ncclBroadcast ncclCommAbort
ncclCommCount ncclCommDeregister ncclCommDestroy ncclCommFinalize ncclCommGetAsyncError
ncclCommInitAll ncclCommInitRank ncclCommInitRankConfig ncclCommInitRankScalable ncclCommRegister
ncclCommShrink ncclCommSplit ncclCommUserRank ncclCommWindowDeregister ncclCommWindowRegister
ncclDevCommCreate ncclDevCommDestroy ncclGetErrorString ncclGetLastError ncclGetUniqueId
ncclGetVersion ncclGroupEnd ncclGroupSimulateEnd ncclGroupStart ncclMemAlloc ncclMemFree ncclRecv
ncclRedOpCreatePreMulSum ncclRedOpDestroy ncclReduce ncclReduceScatter ncclSend""".split()
OTHER_USERS = ["ncclCommCuDevice", "ncclGather", "ncclScatter", "ncclCommRevoke"]


def library_path(flavour: str = "nccl") -> str:
    """The built drop-in: beside this file (a wheel), else in a hetccl/ directory on sys.path
    (an editable install keeps the built files in site-packages)."""
    name = SONAMES[flavour]
    cands = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "dropin", name)]
    cands += [os.path.join(d, "hetccl", "dropin", name) for d in sys.path if d]
    for c in cands:
        if os.path.exists(c):
            return c
    raise FileNotFoundError(f"{name} (the drop-in) not found; build hetccl. Looked in " + ", ".join(cands[:3]))


def real_library(flavour: str = "nccl") -> str | None:
    """The real library the program would have loaded: the variable if set, else torch's
    (the nvidia-nccl wheel beside torch for NCCL), else None."""
    env = os.environ.get(REAL_ENV[flavour])
    if env:
        return None if env == "none" else env
    if flavour == "nccl":
        spec = importlib.util.find_spec("nvidia")
        for d in (spec.submodule_search_locations or []) if spec else []:
            p = os.path.join(d, "nccl", "lib", "libnccl.so.2")
            if os.path.exists(p):
                return p
    return None


def nccl_header() -> str | None:
    """nccl.h of the real library (the nvidia-nccl wheel ships it), for the ABI check."""
    lib = real_library("nccl")
    if lib:
        h = os.path.join(os.path.dirname(os.path.dirname(lib)), "include", "nccl.h")
        if os.path.exists(h):
            return h
    return os.environ.get("HETCCL_NCCL_H") or None


def launch_env(flavour: str = "nccl", env: dict | None = None) -> dict:
    """The variables that put the drop-in in front of a rank: LD_PRELOAD (kept in front of what
    was there) and the real library's path."""
    env = dict(os.environ if env is None else env)
    lib = library_path(flavour)
    pre = env.get("LD_PRELOAD", "")
    if lib not in pre.split(":"):
        env["LD_PRELOAD"] = lib + (":" + pre if pre else "")
    real = real_library(flavour)
    env.setdefault(REAL_ENV[flavour], real or "none")
    return env


def default_launch(cuda_build: bool, gpus: int) -> tuple[bool, str]:
    """Whether a launcher (`hetccl run`, `hetccl deepspeed`) puts the drop-in NCCL in front of its
    workers when neither --dropin nor --torch-face is given, and why, in one line. The drop-in
    when the machine runs a CUDA build of torch with a GPU, the drop-in is built and the real
    NCCL is found (torch's nvidia-nccl wheel, or HETCCL_NCCL_LIBRARY): unchanged NCCL programs
    then keep torch's own "nccl" process group, served across vendors by hetccl's core. The
    torch face otherwise (CPU machines; ROCm builds, whose torch loads librccl: the RCCL drop-in
    needs HETCCL_RCCL_LIBRARY and an explicit launch, docs/dropin.md)."""
    if not cuda_build or gpus < 1:
        return False, "no CUDA GPU: the torch face (init_process_group redirected to hetccl)"
    try:
        library_path("nccl")
    except FileNotFoundError as e:
        return False, f"the drop-in is not built ({e}): the torch face"
    if not real_library("nccl"):
        return False, ("no real libnccl.so.2 found (torch's nvidia-nccl wheel, or "
                       "HETCCL_NCCL_LIBRARY): the torch face")
    return True, "CUDA GPU: the drop-in NCCL in front of every worker (--torch-face for the torch face)"
