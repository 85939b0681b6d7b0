"""`hetccl run`: torchrun, but every worker runs over hetccl.

    hetccl run --nproc_per_node 4 train.py --lr 3e-4

takes exactly torchrun's options (parsed by torchrun's own parser) and runs the script through
hetccl.shim, so a script that calls init_process_group("nccl") runs unchanged over hetccl.
Vendor emulation: pass --vendors 2+2 to give consecutive local ranks vendor labels v0, v1, ...
(sets HETCCL_VENDOR per worker through the shim)."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import get_args_parser, run

    argv = list(sys.argv[1:] if argv is None else argv)
    vendors = None
    if "--vendors" in argv:
        i = argv.index("--vendors")
        vendors = argv[i + 1]
        del argv[i:i + 2]
    args = get_args_parser().parse_args(argv)
    script = args.training_script
    if args.module:
        raise SystemExit("hetccl run: -m/--module scripts are not supported; pass a file")
    args.module = True
    args.training_script = "hetccl.shim"
    args.training_script_args = [script, *args.training_script_args]
    if vendors:
        os.environ["HETCCL_VENDOR_SPLIT"] = vendors
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
