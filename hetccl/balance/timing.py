"""Step timers for the Balancer: host clock on CPU, device events on GPUs.

GPU work is asynchronous: the host returns from forward/backward long before the device has
run the kernels, so a host clock around them measures kernel *launches* (roughly the same on
every rank, whatever its batch) unless the device is synchronised, and synchronising stalls
the pipeline. CudaEventTimer records a pair of torch.cuda.Event on the current stream instead
and reads the elapsed device time once the end event has completed, without blocking
(poll(wait=False)); the measurement then reaches the Balancer one step or so later.

Every timer has the same interface:

    start()             open an interval (a step, or one forward for ForwardTimer)
    stop(tag)           close it; tag travels with the measurement (the Balancer passes
                        (samples, micro-batches, use))
    poll(wait=False)    completed measurements [(tag, seconds)], oldest first; wait=True blocks
                        until all are complete

ForwardTimer sums the forward passes of a module within one step (hooks): what frameworks that
do their own gradient communication inside backward (DDP's last micro-batch, the HF Trainer,
DeepSpeed ZeRO-2/3) need, because their backward waits on the other ranks and would make every
rank measure the slowest rank's pace.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable


class HostTimer:
    """Wall-clock intervals from ``clock`` (default time.perf_counter). Time only work that is
    complete when stop() runs (CPU work, or GPU work after a synchronize)."""

    kind = "host"

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._t0: float | None = None
        self._ready: list[tuple[Any, float]] = []

    def start(self) -> None:
        self._t0 = self.clock()

    def stop(self, tag: Any = None) -> None:
        if self._t0 is None:
            raise RuntimeError("timer stop() without start()")
        self._ready.append((tag, self.clock() - self._t0))
        self._t0 = None

    def poll(self, wait: bool = False) -> list[tuple[Any, float]]:
        out, self._ready = self._ready, []
        return out


class _EventPool:
    def __init__(self):
        self.free: list = []

    def get(self):
        import torch
        return self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)

    def put(self, *evs) -> None:
        self.free.extend(evs)


class CudaEventTimer:
    """Device time between two events recorded on the current CUDA stream of ``device``
    (default: the current device). Non-blocking: poll() returns the intervals whose end event
    has completed."""

    kind = "cuda-events"

    def __init__(self, device=None):
        import torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self._pool = _EventPool()
        self._start = None
        self._pending: deque = deque()

    def _record(self):
        import torch
        ev = self._pool.get()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self) -> None:
        self._start = self._record()

    def stop(self, tag: Any = None) -> None:
        if self._start is None:
            raise RuntimeError("timer stop() without start()")
        self._pending.append(([(self._start, self._record())], tag))
        self._start = None

    def poll(self, wait: bool = False) -> list[tuple[Any, float]]:
        out = []
        while self._pending:
            pairs, tag = self._pending[0]
            last = pairs[-1][1] if pairs else None
            if last is not None and not last.query():
                if not wait:
                    break
                last.synchronize()
            self._pending.popleft()
            secs = sum(s.elapsed_time(e) for s, e in pairs) / 1e3
            for s, e in pairs:
                self._pool.put(s, e)
            out.append((tag, secs))
        return out


class ForwardTimer:
    """Sum of a module's forward passes between start() and stop(tag).

    attach(module) installs outermost forward hooks (prepended, so other hooks such as an
    emulated slow-down run inside the timed interval). A forward of a module whose parameters
    live on a CUDA device is timed with device events (no synchronisation); otherwise with the
    host ``clock``. Nested forwards (a module calling itself) count once. Forwards outside
    start()/stop() (evaluation) are not counted."""

    def __init__(self, module=None, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._handles: list = []
        self._depth = 0
        self._open = False
        self._cur: list = []            # intervals of the open step: (kind, a, b)
        self._t0 = None
        self._pool = _EventPool()
        self._pending: deque = deque()
        if module is not None:
            self.attach(module)

    @property
    def kind(self) -> str:
        return "forward"

    def attach(self, module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._pre, prepend=True))
        self._handles.append(module.register_forward_hook(self._post))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @staticmethod
    def _device(module):
        p = next(module.parameters(), None)
        return p.device if p is not None and p.is_cuda else None

    def _pre(self, module, args):
        if self._depth == 0 and self._open:
            dev = self._device(module)
            if dev is not None:
                import torch
                ev = self._pool.get()
                ev.record(torch.cuda.current_stream(dev))
                self._t0 = ("cuda", ev, dev)
            else:
                self._t0 = ("host", self.clock(), None)
        self._depth += 1

    def _post(self, module, args, output):
        self._depth -= 1
        if self._depth == 0 and self._t0 is not None:
            kind, a, dev = self._t0
            self._t0 = None
            if kind == "cuda":
                import torch
                ev = self._pool.get()
                ev.record(torch.cuda.current_stream(dev))
                self._cur.append(("cuda", a, ev))
            else:
                self._cur.append(("host", a, self.clock()))

    def start(self) -> None:
        self._open = True
        self._cur = []

    def stop(self, tag: Any = None) -> None:
        self._open = False
        self._pending.append((self._cur, tag))
        self._cur = []

    def poll(self, wait: bool = False) -> list[tuple[Any, float]]:
        out = []
        while self._pending:
            ivs, tag = self._pending[0]
            cuda = [(a, b) for k, a, b in ivs if k == "cuda"]
            if cuda and not cuda[-1][1].query():
                if not wait:
                    break
                cuda[-1][1].synchronize()
            self._pending.popleft()
            secs = sum(b - a for k, a, b in ivs if k == "host")
            secs += sum(a.elapsed_time(b) for a, b in cuda) / 1e3
            for a, b in cuda:
                self._pool.put(a, b)
            out.append((tag, secs))
        return out


def default_timer(device=None, clock: Callable[[], float] | None = None):
    """HostTimer(clock) when ``clock`` is given or the device is not CUDA; CudaEventTimer on
    CUDA. device=None: CUDA when torch.cuda is initialised in this process (the training runs
    there), else the host clock."""
    if clock is not None:
        return HostTimer(clock)
    import torch
    if device is None:
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        dev = None
    else:
        dev = torch.device(device)
        use_cuda = dev.type == "cuda"
    return CudaEventTimer(dev) if use_cuda else HostTimer()
