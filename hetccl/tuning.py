"""Where the engine switches between its latency and bandwidth paths: data in one place.

Each table maps the bytes a link carries in one direction during one transfer (equal on both
ends of the link, so both cut alike) to the chunk size the engine pipelines with. A message up
to the first row's size travels as one chunk: one copy in, one handshake, one copy out -- the
latency path. Larger messages are cut so that the copies into the ring, the peer's copies out
of it and (for host data) the reductions overlap -- the bandwidth path. Chunks never exceed a
ring slot (csrc/engine_plan.cc clamps them).

How the rows were chosen: `hetccl bench collectives --chunk-sweep` (docs/benchmarks.md,
"engine chunk sizes") on the machines named there; re-measure before changing a row.
"""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20
INF = (1 << 63) - 1

# Host memory (CPU tensors): the engine thread copies into / reduces out of the shared slots.
# 128 KiB chunks keep a reduced chunk in L2 when its sum is written back (round trip).
HOST = [
    (256 * KiB, 256 * KiB),
    (INF, 128 * KiB),
]
# Two-rank round trip of the host pair all-reduce.
ROUNDTRIP_CHUNK = 128 * KiB

# Device memory (GPU tensors): copy engines move chunks between device memory and pinned slots.
DEVICE = [
    (512 * KiB, 512 * KiB),   # latency path: one chunk
    (4 * MiB, 512 * KiB),
    (32 * MiB, 2 * MiB),
    (INF, 4 * MiB),
]


def max_chunk(table) -> int:
    """The largest chunk a table asks for: a ring slot larger than this is never filled."""
    return max(chunk for _, chunk in table)


# Message transports (tcp, ucx) with host data: requests of this size stream from user memory.
MESSAGE = [
    (1 * MiB, 1 * MiB),
    (INF, 4 * MiB),
]
