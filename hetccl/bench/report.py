"""Shared output for every `hetccl bench` command: nccl-tests style tables and JSONL rows.

Columns follow nccl-tests (size, count, type, redop, time, algbw, busbw, #wrong); extra
leading columns (backend, vendors, ...) are allowed. GB/s means 1e9 bytes per second.
busbw factors are those of nccl-tests (see BUS_FACTOR)."""
from __future__ import annotations

import datetime as _dt
import json
import platform
from typing import IO, Any, Sequence

# busbw = algbw * factor(n), as in nccl-tests' src/*.cu
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def hardware() -> str:
    import os
    return f"{platform.machine()} {os.cpu_count()} cores"


def today() -> str:
    return _dt.date.today().isoformat()


class Table:
    """Prints aligned rows as they come (so progress is visible) and optionally appends JSONL."""

    def __init__(self, columns: Sequence[tuple[str, int]], out: IO[str] | None = None,
                 jsonl: str | None = None):
        import sys
        self.columns = list(columns)
        self.out = out or sys.stdout
        self.jsonl = open(jsonl, "a") if jsonl else None
        self.rows: list[dict[str, Any]] = []

    def header(self) -> None:
        print("#" + " ".join(f"{name:>{w}}" for name, w in self.columns), file=self.out)
        self.out.flush()

    def row(self, cells: Sequence[Any], record: dict[str, Any] | None = None) -> None:
        def fmt(v, w):
            if isinstance(v, float):
                return f"{v:>{w}.2f}" if abs(v) < 1e6 else f"{v:>{w}.3g}"
            return f"{v!s:>{w}}"
        print(" " + " ".join(fmt(v, w) for v, (_, w) in zip(cells, self.columns)), file=self.out)
        self.out.flush()
        if record is not None:
            self.rows.append(record)
            if self.jsonl:
                self.jsonl.write(json.dumps(record) + "\n")
                self.jsonl.flush()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g}{unit}" if unit == "B" else f"{n / 1:.0f}{unit}" if n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
