"""Work objects the torch face returns (c10d's Work protocol, backed by torch Futures).

Contract: wait() raises the operation's error, if any. Host operations complete their future
when their data has moved. Device operations complete their future on the engine's comm stream
when everything has been enqueued, so wait() (torch's Future semantics for device futures) only
makes the caller's current stream wait; the host never blocks there. A device operation that
fails after issue (a peer dies mid-transfer) breaks the engine: wait() and every later call on
the group raise that error (and with HETCCL_ASYNC_ERROR_HANDLING=abort the process stops, as
torch's NCCL backend does, so results of a failed collective are never consumed).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _detached(e: BaseException) -> BaseException:
    """A copy of the exception a future holds, to raise in its place. The future keeps its
    exception, and an exception raised gets the frames it passes through attached: raising the
    stored one would link the future (a C++ object the garbage collector cannot look into) to
    the frames of this wait and of the caller, which hold the Work and the collective's
    tensors -- a cycle that is never freed. The stored one loses the frames it got here."""
    e.__traceback__ = None
    try:
        copy = type(e)(*e.args)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return e
    return copy


def _wait_done(done, timeout: timedelta | None) -> None:
    """c10d's Work::wait(timeout): a timeout of None or zero (kNoTimeout) waits as long as the
    operation takes (the group's timeout bounds it); a positive one raises "Operation timed
    out!" (torch's wording) once it passes with the operation unfinished. The operation itself
    goes on (as in c10d): its outputs are undefined until it completes."""
    secs = timeout.total_seconds() if timeout else 0.0
    if secs <= 0 or done():
        return
    import time

    from ._core import CommTimeout

    end = time.monotonic() + secs
    pause = 1e-5
    while not done():
        if time.monotonic() >= end:
            raise CommTimeout(f"hetccl: Operation timed out! (wait(timeout={secs:g} s) passed "
                              f"with the operation unfinished; it continues)")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class HetcclWork(dist.Work):
    """Work backed by a torch Future that the engine completes (or fails)."""

    def __init__(self, fut: torch.futures.Future, outputs: Any = None, engine=None):
        super().__init__()
        self.fut = fut
        self.outputs = outputs
        self._engine = engine  # device works: asks the engine whether it broke meanwhile

    def wait(self, timeout: timedelta | None = None) -> bool:
        _wait_done(self.fut.done, timeout)
        try:
            self.fut.wait()
        except Exception as e:  # noqa: BLE001
            raise _detached(e) from None
        if self._engine is not None:
            self._engine.raise_if_broken()
        return True

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        """c10d's: True unless the work failed (a work still running has not failed)."""
        return self.exception() is None

    def exception(self):
        """c10d's: the error of a failed work, None while it runs or once it succeeded (reading
        a running future's value would raise torch's own assertion instead)."""
        if not self.fut.done():
            return None
        try:
            self.fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def result(self):
        return self.outputs


class AllWork(HetcclWork):
    """Completes when every child work completes; wait() raises the first error."""

    def __init__(self, works, outputs):
        fut = torch.futures.collect_all([w.get_future() for w in works]) if works else None
        if fut is None:
            fut = torch.futures.Future()
            fut.set_result([])
        super().__init__(fut, outputs)
        self.works = works

    def wait(self, timeout=None):
        if timeout:
            _wait_done(self.is_completed, timeout)
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self):
        outputs = self.outputs

        def unwrap(f):
            for x in f.value():
                x.value()  # re-raise a child's error
            return outputs

        return self.fut.then(unwrap)


class DeviceWork(dist.Work):
    """Work of a device collective: everything it does is enqueued on its group's comm stream.

    wait() makes the caller's current stream wait for the comm stream (one stream-wait through
    the engine; the host never blocks once the collective has been issued); get_future() makes
    the torch Future that DDP and friends chain on, completed on the comm stream, only when it
    is asked for. A collective queued behind earlier asynchronous host work (engine.submit) is
    issued by the group's worker: wait() first waits on the host for it to be issued.
    """

    def __init__(self, engine, launch, outputs: Any):
        super().__init__()
        self._engine, self._launch, self.outputs = engine, launch, outputs
        self._exc: BaseException | None = None
        self._issued = None  # threading.Event while queued behind host work
        self._fut = None
        self._event = None  # is_completed(): recorded on the comm stream at its first call

    # engine side (called once the body has run, with the comm stream current)
    def set_result(self, outputs) -> None:
        if self._issued is not None:
            self._issued.set()

    def set_exception(self, e: BaseException) -> None:
        self._exc = e
        if self._issued is not None:
            self._issued.set()

    # c10d side
    def _ready(self) -> None:
        if self._issued is not None:
            self._issued.wait()
        if self._exc is not None:
            raise self._exc

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002
        self._ready()
        self._engine.join_current(self._launch)
        self._engine.raise_if_broken()
        return True

    def is_completed(self) -> bool:
        """True once the device has run the collective (as NCCL's work asks its end event), so
        a caller that polls this and then reads the tensors without wait() reads the result.
        The event is recorded on the comm stream at the first call, so it also covers work
        queued there after this collective: late, never early."""
        if self._issued is not None and not self._issued.is_set():
            return False
        if self._exc is not None:
            return True
        if self._event is None:
            self._event = self._launch.record()
        if not self._launch.query(self._event):
            return False
        return True

    def is_success(self) -> bool:  # c10d's: True unless the work failed
        return self._exc is None and not self._engine.core.broken()

    def exception(self):
        return self._exc

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            fut = self._launch.future()
            try:
                self._ready()
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(e)
            else:
                with self._launch:
                    fut.set_result(self.outputs)
            self._fut = fut
        return self._fut

    def result(self):
        return self.outputs


class StreamWork(dist.Work):
    """Work of a point-to-point message of device tensors (Engine.device_message): the message
    is enqueued on its stream and an event recorded right after it. wait() makes the caller's
    current stream wait for that event (the host does not wait, as with NCCL); is_completed()
    asks the event; get_future() is completed on a stream that waits for it. A failure found
    after issue (a dead peer, a size mismatch) breaks the group: the next call raises it."""

    def __init__(self, engine, launch, event, outputs: Any):
        super().__init__()
        self._engine, self._launch, self._event, self.outputs = engine, launch, event, outputs
        self._fut = None

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002
        self._launch.wait_event(self._event)
        self._engine.raise_if_broken()
        return True

    def is_completed(self) -> bool:
        return self._launch.query(self._event)

    def is_success(self) -> bool:  # c10d's: True unless the work failed
        return not self._engine.core.broken()

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            self._fut = self._launch.future()
            self._launch.complete_after(self._event, self._fut, self.outputs)
        return self._fut

    def result(self):
        return self.outputs


def done_work(outputs: Any = None) -> HetcclWork:
    fut = torch.futures.Future()
    fut.set_result(outputs)
    return HetcclWork(fut, outputs)
