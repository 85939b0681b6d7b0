"""`hetccl` console script: a thin dispatcher. Each subcommand lives in its own module and
exposes main(argv) -> int; this file only maps names to modules (imported lazily so that
`hetccl doctor` does not pay for DeepSpeed's import)."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("hetccl.demo", "run a local emulated mixed-vendor cluster on CPU: check the "
             "collectives and train a small model"),
    "doctor": ("hetccl.doctor", "print what this rank sees: vendor, device, backends, transports"),
    "run": ("hetccl.run", "torchrun wrapper: run an unchanged script over hetccl "
            "[--vendors SPLIT]"),
    "bench": (None, "benchmarks: transport | collectives | straggler | soak | ddp | train | "
              "footprint | scale"),
    "deepspeed": ("hetccl.integrations.deepspeed", "deepspeed launcher wrapper: workers over "
                  "hetccl [--vendors SPLIT]"),
    "megatron": ("hetccl.integrations.megatron", "train a megatron-core GPT from a recipe YAML "
                 "[--vendors SPLIT]"),
}
BENCHES = {
    "transport": "hetccl.bench.transport",
    "collectives": "hetccl.bench.collectives",
    "straggler": "hetccl.bench.straggler",
    "soak": "hetccl.bench.soak",
    "ddp": "hetccl.bench.ddp",
    "train": "hetccl.bench.train",
    "footprint": "hetccl.bench.footprint",
    "scale": "hetccl.bench.scale",
}


def _usage() -> str:
    lines = ["usage: hetccl <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "benchmarks: " + ", ".join(f"hetccl bench {b}" for b in BENCHES)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"usage: hetccl bench {{{'|'.join(BENCHES)}}} [args]", file=sys.stderr)
            return 2
        module, rest = BENCHES[rest[0]], rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd][0]
    else:
        print(f"hetccl: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(module)
    entry = getattr(mod, "cli_main", None) or getattr(mod, "main")
    try:
        code = int(entry(rest) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away (`hetccl doctor | head`): as for any Unix filter, that is not an
        # error of ours. Point stdout at /dev/null so that the interpreter's own flush at exit
        # does not raise again (the recipe of Python's signal documentation).
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
