"""`hetccl run`: torchrun, but every worker runs over hetccl.

    hetccl run --nproc_per_node 4 train.py --lr 3e-4
    hetccl run --vendors 2+2 --nproc_per_node 4 train.py     # emulate two vendors

Takes torchrun's options (torchrun's own parser, with hetccl's --vendors added) and runs the
script through hetccl.shim, so a script that calls init_process_group("nccl") runs unchanged
over hetccl. Options are read up to the script path only: everything after it, a --vendors
included, belongs to the script.

The option set shared by `hetccl run`, `hetccl deepspeed` and `hetccl megatron` (one meaning
everywhere, `--vendors 2+2` and `--vendors=2+2` both accepted):

  --vendors SPLIT   EMULATION: give blocks of consecutive ranks the vendor labels v0, v1, ...
                    (sets HETCCL_VENDOR_SPLIT; rank r gets the label of the block holding r).
                    Real mixed clusters detect each rank's vendor and need no flag.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

VENDORS_HELP = ("EMULATION ONLY: vendor split such as 2+2 or 1+1+1; blocks of consecutive "
                "ranks get vendor labels v0, v1, ... (sets HETCCL_VENDOR_SPLIT). Real "
                "mixed-vendor clusters detect each rank's vendor and need no flag. Read before "
                "the script path only: a --vendors after it belongs to the script.")


def parse_split(text: str) -> list[int]:
    """'2+2' -> [2, 2]; argparse type for --vendors (a clear error for anything else)."""
    parts = str(text).split("+")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(
            f"--vendors {text!r}: expected ranks per vendor joined by '+', e.g. 2+2 or 1+1+1")
    return sizes


def add_vendors_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add hetccl's --vendors (see the module docstring) to a launcher's parser."""
    group = parser.add_argument_group("hetccl")
    group.add_argument("--vendors", type=str, default=None, metavar="SPLIT", help=VENDORS_HELP)
    return parser


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    face = p.add_mutually_exclusive_group()
    face.add_argument("--dropin", action="store_true",
                      help="hetccl: put the drop-in NCCL (hetccl/dropin/libnccl.so.2) in front of every "
                           "worker (LD_PRELOAD, HETCCL_NCCL_LIBRARY = the real library) instead of "
                           "redirecting init_process_group to the torch face: torch's own 'nccl' "
                           "process group then runs across vendors (CUDA tensors; CPU tensors need "
                           "gloo as with NCCL). The default on a machine with a CUDA GPU")
    face.add_argument("--torch-face", action="store_true",
                      help="hetccl: redirect init_process_group to the torch face (backend "
                           "'hetccl') even on a machine with a CUDA GPU (the default elsewhere)")
    p.prog = "hetccl run"
    p.usage = ("hetccl run [--vendors SPLIT] [torchrun options] training_script "
               "[training_script_args ...]")
    p.description = ("torchrun, with every worker over hetccl: the script runs unchanged. On a "
                     "machine with a CUDA GPU the drop-in NCCL serves torch's own 'nccl' process "
                     "group across vendors; elsewhere (or with --torch-face) "
                     "init_process_group('nccl'/'gloo'/...) is redirected to 'hetccl'. All "
                     "torchrun options apply; hetccl adds --vendors, --dropin, --torch-face.")
    return add_vendors_argument(p)


def _expected_world(args) -> int | None:
    """Total ranks torchrun will start, when the options fix it (else None)."""
    try:
        nproc = int(args.nproc_per_node)
        nnodes = str(args.nnodes)
        if ":" in nnodes:
            lo, hi = nnodes.split(":")
            if lo != hi:
                return None
            nnodes = lo
        return nproc * int(nnodes)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def _machine_default() -> tuple[bool, str]:
    import torch

    from . import nccl_dropin

    cuda = bool(torch.version.cuda) and torch.cuda.is_available()
    return nccl_dropin.default_launch(cuda, torch.cuda.device_count() if cuda else 0)


_announced: list[bool] = []


def default_dropin(announce: bool = False) -> bool:
    """The launchers' default face (nccl_dropin.default_launch) on this machine, worked out once
    per process; announce: one line on stderr saying which and why (once per process)."""
    dropin, why = _machine_default()
    if announce and not _announced:
        _announced.append(True)
        print(f"hetccl: {why}", file=sys.stderr, flush=True)
    return dropin


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import run

    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if args.module or args.no_python:
        p.error("-m/--module and --no-python are not supported: pass a script file "
                "(hetccl runs it with `python -m hetccl.shim script.py`)")
    if args.vendors is not None:
        try:
            split = parse_split(args.vendors)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        world = _expected_world(args)
        if world is not None and sum(split) != world:
            p.error(f"--vendors {args.vendors} covers {sum(split)} ranks, but torchrun starts "
                    f"{world} (--nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node})")
        os.environ["HETCCL_VENDOR_SPLIT"] = args.vendors
    dropin = args.dropin or (not args.torch_face and default_dropin(announce=True))
    if dropin:
        from . import nccl_dropin

        os.environ.update(nccl_dropin.launch_env("nccl"))
        os.environ["HETCCL_DROPIN"] = "1"
    del args.dropin, args.torch_face
    script = args.training_script
    args.module = True
    args.training_script = "hetccl.shim"
    args.training_script_args = [script, *args.training_script_args]
    del args.vendors
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
