"""TEST ONLY: emulate a slower device on homogeneous hardware.

slow_down stretches the wall time of the wrapped compute by a factor f >= 1: it measures the
block and then sleeps (f - 1) times its duration, so the block takes f times as long and the
rank's throughput drops by f, without burning CPU (other ranks sharing the cores are not
slowed). The factor defaults to this rank's HETCCL_SLOWDOWN (hetccl.config, default 1.0: no
effect), so a launcher sets e.g. HETCCL_SLOWDOWN=2 on one rank to make it a "2x slower GPU":

    with slow_down():                 # context manager
        loss = model(x).sum(); loss.backward()

    step = slow_down(step_fn)         # wrapper
    @slow_down(3.0)                   # decorator with an explicit factor
    def step(...): ...

On a GPU, synchronize inside the block (or the block only measures kernel launches).
emulated_work(n, per_sample_s) is a deterministic stand-in for compute that costs a fixed time
per sample (a sleep), used by `hetccl bench straggler` so that the emulated speeds do not
depend on CPU contention.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable


def slowdown_factor() -> float:
    from hetccl import config
    f = float(config.get("HETCCL_SLOWDOWN"))
    if not f >= 1.0:
        raise ValueError(f"HETCCL_SLOWDOWN must be >= 1.0 (got {f})")
    return f


class _SlowDown:
    def __init__(self, factor: float | None):
        self.factor = slowdown_factor() if factor is None else float(factor)
        if not self.factor >= 1.0:
            raise ValueError(f"slow-down factor must be >= 1.0 (got {self.factor})")
        self.elapsed = 0.0      # compute time of the last block
        self.slept = 0.0        # added time of the last block

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self._t0
        self.slept = (self.factor - 1.0) * self.elapsed
        if self.slept > 0:
            time.sleep(self.slept)
        return False

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with _SlowDown(self.factor):
                return fn(*a, **k)
        return wrapped


def slow_down(fn_or_factor: Callable | float | None = None, factor: float | None = None) -> Any:
    """slow_down() / slow_down(2.0): context manager (also usable as decorator);
    slow_down(fn) / slow_down(fn, 2.0): fn wrapped so each call takes ``factor`` times as long.
    The factor defaults to hetccl.config.get("HETCCL_SLOWDOWN")."""
    if callable(fn_or_factor):
        return _SlowDown(factor)(fn_or_factor)
    return _SlowDown(fn_or_factor if fn_or_factor is not None else factor)


def emulated_work(n_samples: int, per_sample_s: float, fixed_s: float = 0.0) -> None:
    """Stand-in compute: sleeps fixed_s + n_samples * per_sample_s (no CPU use)."""
    t = fixed_s + n_samples * per_sample_s
    if t > 0:
        time.sleep(t)
