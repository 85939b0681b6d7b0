"""TEST ONLY: emulate a slower device on homogeneous hardware.

slow_down stretches the compute of the wrapped block by a factor f >= 1, so the rank's
throughput drops by f. The factor defaults to this rank's HETCCL_SLOWDOWN (hetccl.config,
default 1.0: no effect), so a launcher sets e.g. HETCCL_SLOWDOWN=2 on one rank to make it a
"2x slower GPU".

On a GPU (``device`` a CUDA device) the slow-down consumes the GPU, as a slower GPU would: the
block's device time d is measured with CUDA events and (f - 1) x d of extra matrix
multiplications are queued on the same stream right after it (GpuBurner, calibrated once).
Nothing blocks the host, so kernel overlap, stream order, communication behind compute and
device-event timing behave as on a real slower device; a host sleep would instead leave the GPU
idle and the host late. d is predicted from the block's work (``with slow.block(work):``, e.g.
its sample count) by a robust line fitted to earlier blocks (hetccl.balance.model.fit_line);
until the first blocks have completed, or for work far outside what was seen, the block is
measured by waiting for its end event (once).

On CPU (device None or CPU) the host fallback measures the block and then sleeps (f - 1) times
its duration: the rank takes f times as long without burning CPU that other ranks share.

    slow = slow_down()                         # host; factor from HETCCL_SLOWDOWN
    slow = slow_down(device="cuda:0")          # GPU-consuming
    with slow.block(n_samples):                # or `with slow:` (work 1 per block)
        loss = model(x).sum(); loss.backward()

    step = slow_down(step_fn)                  # wrapper (host)
    @slow_down(3.0)                            # decorator with an explicit factor (host)
    def step(...): ...

emulated_work(n, per_sample_s) is a deterministic stand-in for compute that costs a fixed time
per sample (a sleep), used by `hetccl bench straggler` on CPU so that the emulated speeds do
not depend on CPU contention.
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


def _check(factor: float) -> float:
    factor = float(factor)
    if not factor >= 1.0:
        raise ValueError(f"slow-down factor must be >= 1.0 (got {factor})")
    return factor


class _SlowDown:
    """Host fallback: time the block, then sleep (factor - 1) x its duration."""

    def __init__(self, factor: float | None):
        self.factor = slowdown_factor() if factor is None else _check(factor)
        self.elapsed = 0.0      # compute time of the last block
        self.slept = 0.0        # added time of the last block
        self.added = 0.0        # same as slept (common name with the GPU emulation)

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self._t0
        self.slept = (self.factor - 1.0) * self.elapsed
        if self.slept > 0:
            time.sleep(self.slept)
        self.added = self.slept
        return False

    def block(self, work: float = 1.0):
        return self

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with _SlowDown(self.factor):
                return fn(*a, **k)
        return wrapped


class GpuBurner:
    """Queues matrix multiplications on the current stream for a requested device time.

    Calibrated once (bf16 matmuls of two sizes, timed with events): a request of s seconds
    becomes round-down(s / t_big) large products plus small ones for the rest, so the error is
    below one small product (a few microseconds)."""

    def __init__(self, device, big: int = 4096, small: int = 1024):
        import torch
        self.device = torch.device(device)
        dt = torch.bfloat16
        self._big = [torch.randn(big, big, device=self.device, dtype=dt) for _ in range(2)]
        self._small = [torch.randn(small, small, device=self.device, dtype=dt) for _ in range(2)]
        self._out_big = torch.empty(big, big, device=self.device, dtype=dt)
        self._out_small = torch.empty(small, small, device=self.device, dtype=dt)
        self.t_big = self._time(self._big, self._out_big)
        self.t_small = self._time(self._small, self._out_small)
        self.burned = 0.0           # seconds requested so far

    def _time(self, ab, out, reps: int = 20) -> float:
        import torch
        s = torch.cuda.current_stream(self.device)
        for _ in range(3):
            torch.mm(ab[0], ab[1], out=out)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        for _ in range(reps):
            torch.mm(ab[0], ab[1], out=out)
        e1.record(s)
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3 / reps

    def burn(self, seconds: float) -> int:
        """Queue about ``seconds`` of device work; returns the number of kernels queued."""
        import torch
        if not seconds > 0:
            return 0
        self.burned += seconds
        nb = int(seconds // self.t_big)
        ns = int(round((seconds - nb * self.t_big) / self.t_small))
        for _ in range(nb):
            torch.mm(self._big[0], self._big[1], out=self._out_big)
        for _ in range(ns):
            torch.mm(self._small[0], self._small[1], out=self._out_small)
        return nb + ns


_BURNERS: dict = {}


def gpu_burner(device) -> GpuBurner:
    import torch
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _BURNERS:
        _BURNERS[dev] = GpuBurner(dev)
    return _BURNERS[dev]


class _GpuSlowDown:
    """GPU-consuming slow-down (module docstring)."""

    def __init__(self, factor: float | None, device):
        import torch
        self.factor = slowdown_factor() if factor is None else _check(factor)
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._burner: GpuBurner | None = None
        self._obs: list[tuple[float, float]] = []      # (work, device seconds) of done blocks
        self._pending: list = []                      # (start, end, work)
        self._model = None
        self._work = 1.0
        self.elapsed = 0.0      # predicted device time of the last block
        self.added = 0.0        # device time queued after the last block
        self.slept = 0.0        # always 0: nothing sleeps
        self.measured = 0       # blocks measured by waiting for them

    def block(self, work: float = 1.0):
        self._work = float(work)
        return self

    def _event(self):
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _poll(self) -> None:
        from .model import fit_line
        done = False
        while self._pending and self._pending[0][1].query():
            s, e, w = self._pending.pop(0)
            self._obs.append((w, s.elapsed_time(e) / 1e3))
            done = True
        if done:
            self._obs = self._obs[-64:]
            self._model = fit_line([o[0] for o in self._obs], [o[1] for o in self._obs])

    def _predict(self, work: float) -> float | None:
        m = self._model
        if m is None or m.count < 2:
            return None
        seen = [o[0] for o in self._obs]
        if work > 2 * max(seen) or work < 0.5 * min(seen):
            return None                                  # far from anything measured
        return m.time(work)

    def __enter__(self):
        if self.factor > 1.0:
            self._start = self._event()
        return self

    def __exit__(self, *exc):
        self.added = 0.0
        if self.factor <= 1.0 or exc[0] is not None:
            return False
        end = self._event()
        work, self._work = self._work, 1.0
        self._poll()
        d = self._predict(work)
        if d is None:                                    # measure this block (waits for it)
            end.synchronize()
            d = self._start.elapsed_time(end) / 1e3
            self._obs.append((work, d))
            self.measured += 1
            from .model import fit_line
            self._model = fit_line([o[0] for o in self._obs], [o[1] for o in self._obs])
        else:
            self._pending.append((self._start, end, work))
        if self._burner is None:
            self._burner = gpu_burner(self.device)
        self.elapsed = d
        self.added = (self.factor - 1.0) * d
        self._burner.burn(self.added)
        return False

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with self:
                return fn(*a, **k)
        return wrapped


def slow_down(fn_or_factor: Callable | float | None = None, factor: float | None = None,
              device=None) -> Any:
    """slow_down() / slow_down(2.0): context manager (also usable as decorator);
    slow_down(fn) / slow_down(fn, 2.0): fn wrapped so each call takes ``factor`` times as long.
    The factor defaults to hetccl.config.get("HETCCL_SLOWDOWN"). ``device``: a CUDA device
    makes the slow-down consume that GPU (module docstring); None or CPU: host sleep."""
    if callable(fn_or_factor):
        return _SlowDown(factor)(fn_or_factor)
    f = fn_or_factor if fn_or_factor is not None else factor
    if device is not None:
        import torch
        if torch.device(device).type == "cuda":
            return _GpuSlowDown(f, device)
    return _SlowDown(f)


@functools.lru_cache(maxsize=1)
def _mark():
    """An identity autograd function whose backward calls ``cb`` first: where a slowed backward
    block opens or closes. It clones (a view would clash with in-place ops downstream)."""
    import torch

    class _Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cb):
            ctx.cb = cb
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            ctx.cb()
            return g, None
    return _Mark


def _lazy_slow(slow: dict, f_fwd: float, f_bwd: float, device, params: Callable):
    """get("fwd" | "bwd"): the forward / backward slow-downs, created in ``slow`` on first use,
    on ``device`` or that of the first parameter ``params()`` yields (the model may move to
    its device after the hooks are installed); and a callback closing an open backward block
    (``state["open"]``)."""
    state = {"open": False}

    def get(which):
        if not slow:
            dev = device
            if dev is None:
                p = next(params(), None)
                dev = p.device if p is not None else None
            slow["fwd"] = slow_down(f_fwd, device=dev)
            slow["bwd"] = slow_down(f_bwd, device=dev)
        return slow[which]

    def bwd_end():
        if state["open"]:
            state["open"] = False
            get("bwd").__exit__(None, None, None)
    return get, state, bwd_end


def _work_of(args, kwargs) -> float:
    import torch
    x = kwargs.get("input_ids") if kwargs else None
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return float(x.numel()) if isinstance(x, torch.Tensor) and x.numel() else 1.0


def slow_down_module(model, factor: float | None = None, device=None, embeddings=None):
    """TEST ONLY: make ``model``'s forward AND backward ``factor`` times slower (default
    HETCCL_SLOWDOWN; 1.0: nothing is installed). Returns the handles (call .remove()).

    Forward: pre/post hooks around the model's forward. Backward: the model's output loss
    (``output["loss"]``/``output.loss``, or the output tensor itself) and the output of its
    input embeddings (``embeddings``, default ``model.get_input_embeddings()``) pass through
    identity autograd functions whose backward opens and closes a slowed block: the backward
    from the loss down to the embeddings is what a slower device would stretch. Without an
    embedding module only the forward is slowed (by 1 + 3 (f - 1): a backward costs about two
    forwards). On CUDA (``device`` or the parameters' device) the slow-down consumes the GPU,
    on CPU it sleeps. The work of a block is the number of input ids (or elements of the
    first tensor argument)."""
    import torch
    f = slowdown_factor() if factor is None else _check(factor)
    if f == 1.0:
        out = _Handles()
        out.slow = {}
        return out
    if embeddings is None and hasattr(model, "get_input_embeddings"):
        try:
            embeddings = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            embeddings = None
    f_fwd = f if embeddings is not None else 1.0 + 3.0 * (f - 1.0)
    slow = {}
    get, state, bwd_end = _lazy_slow(slow, f_fwd, f, device, model.parameters)
    state["work"] = 1.0
    _Mark = _mark()

    def bwd_begin():
        if not state["open"]:
            get("bwd").block(state["work"]).__enter__()
            state["open"] = True

    def pre(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            state["work"] = _work_of(args, kwargs)
            get("fwd").block(state["work"]).__enter__()
            state["fwd"] = True

    def post(module, args, kwargs, output):
        if not state.pop("fwd", False):
            return None
        get("fwd").__exit__(None, None, None)
        if embeddings is None:
            return None
        loss = None
        if isinstance(output, torch.Tensor):
            return _Mark.apply(output, bwd_begin) if output.requires_grad else None
        try:
            loss = output["loss"]
        except (KeyError, TypeError, IndexError):
            loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            output["loss"] = _Mark.apply(loss, bwd_begin)
        return output

    def emb_post(module, args, output):
        if module.training and torch.is_grad_enabled() and isinstance(output, torch.Tensor) \
                and output.requires_grad:
            return _Mark.apply(output, bwd_end)
        return None

    handles = _Handles([model.register_forward_pre_hook(pre, with_kwargs=True),
                        model.register_forward_hook(post, with_kwargs=True)])
    if embeddings is not None:
        handles.append(embeddings.register_forward_hook(emb_post))
    handles.slow = slow
    return handles


def slow_down_modules(modules, factor: float | None = None, device=None):
    """TEST ONLY: make the forward AND backward of each module in ``modules`` ``factor`` times
    slower (default HETCCL_SLOWDOWN; 1.0: nothing is installed). Returns the handles.

    For a model cut into pieces that do not see the whole step (a pipeline stage: its input
    arrives from another process, its output leaves to one), the slow-down is per module: a
    forward pre/post hook pair opens and closes a slowed block around each module's forward; the
    module's first tensor input (positional, or ``hidden_states=``) and first tensor output pass
    through identity autograd functions, so the backward from the output's gradient to the
    input's gradient is one slowed block too. A module whose input needs no gradient (e.g. the
    first layer fed by integer ids) is slowed in its forward only. Blocks run one at a time (the
    forward of a pipeline stage, then its backward, never interleaved on one rank's thread). On
    CUDA the slow-down consumes the GPU (matrix multiplications on the same stream), on CPU it
    sleeps (module docstring)."""
    import torch
    f = slowdown_factor() if factor is None else _check(factor)
    out = _Handles()
    out.slow = {}
    if f == 1.0:
        return out
    modules = list(modules)
    get, state, bwd_end = _lazy_slow(out.slow, f, f, device,
                                     lambda: (p for m in modules for p in m.parameters()))
    _Mark = _mark()

    def bwd_begin(work):
        def cb():
            if not state["open"]:
                get("bwd").block(work).__enter__()
                state["open"] = True
        return cb

    def first_tensor(args, kwargs):
        x = kwargs.get("hidden_states") if kwargs else None
        if isinstance(x, torch.Tensor):
            return x, "kw"
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return a, i
        return None, None

    def pre(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        x, where = first_tensor(args, kwargs)
        work = float(x.numel()) if x is not None and x.numel() else 1.0
        module._hetccl_slow = {"work": work, "marked": False}
        get("fwd").block(work).__enter__()
        if x is not None and x.requires_grad:
            y = _Mark.apply(x, bwd_end)
            module._hetccl_slow["marked"] = True
            if where == "kw":
                kwargs = {**kwargs, "hidden_states": y}
            else:
                args = args[:where] + (y,) + args[where + 1:]
            return args, kwargs
        return None

    def post(module, args, kwargs, output):
        st = getattr(module, "_hetccl_slow", None)
        if st is None:
            return None
        del module._hetccl_slow
        get("fwd").__exit__(None, None, None)
        if not st["marked"]:
            return None
        cb = bwd_begin(st["work"])
        if isinstance(output, torch.Tensor):
            return _Mark.apply(output, cb) if output.requires_grad else None
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) \
                and output[0].requires_grad:
            return (_Mark.apply(output[0], cb),) + tuple(output[1:])
        return None

    for m in modules:
        out.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        out.append(m.register_forward_hook(post, with_kwargs=True))
    return out


class _Handles(list):
    """Hook handles of slow_down_module; ``slow`` holds its forward/backward slow-downs once
    used ({"fwd": ..., "bwd": ...})."""
    slow: dict

    def remove(self) -> None:
        for h in self:
            h.remove()


def emulated_work(n_samples: int, per_sample_s: float, fixed_s: float = 0.0) -> None:
    """Stand-in compute: sleeps fixed_s + n_samples * per_sample_s (no CPU use)."""
    t = fixed_s + n_samples * per_sample_s
    if t > 0:
        time.sleep(t)


__all__ = ["slow_down", "slow_down_module", "slow_down_modules", "slowdown_factor",
           "emulated_work", "GpuBurner",
           "gpu_burner"]
