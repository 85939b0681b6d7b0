"""The torch face's works with deferred joins (hetccl/face_capi.py CapiWork, HETCCL_FACE_DEFER_JOIN):
which stream each path joins a device-route call on, and when the call's tensors are handed
to the allocator. Runs on the CPU machine with the C API's join and the CUDA seam's streams
faked (a log of what would be enqueued); the C API's own join semantics are tested in
tests/test_capi.py (test_stream_path_deferred_joins) and the real path by the GPU suite
(face_capi_route mode)."""
from __future__ import annotations

import gc

from hetccl import face_capi


class FakeStreams:
    """CallerStream's deferred-join surface, logging what would be enqueued where."""

    def __init__(self, log):
        self.log, self.index, self.cur = log, 0, ("s-main", 11)

    def current(self):
        return True

    def current_stream(self):
        return self.cur

    def side(self):
        return "s-side", 99

    def keep_on(self, tensors, stream):
        self.log.append(("keep", tuple(tensors or ()), stream))

    def record_on(self, stream):
        self.log.append(("event", stream))
        return f"ev@{stream}"

    def query(self, ev):
        return ev == "ev@s-side"

    def wait(self, ev, index):
        self.log.append(("wait_event", ev))

    def future_after(self, ev, index, value):
        self.log.append(("future", ev))
        return value


class FakeRoute:
    def __init__(self, log):
        self.log = log

    def join(self, ticket, handle, cs):
        self.log.append(("join", ticket, handle))

    def raise_if_broken(self):
        pass


def _work(log, ticket=7, tensors=("t",)):
    return face_capi.CapiWork(FakeRoute(log), ["out"], None, FakeStreams(log), ticket, list(tensors))


def test_wait_joins_on_each_then_current_stream():
    log = []
    w = _work(log)
    w.wait()
    assert log == [("join", 7, 11), ("keep", ("t",), "s-main")], log
    w._cs.cur = ("s-other", 12)  # waited for again on another stream: joined there too (the
    w.wait()  # tensors were handed over once: the first join's stream holds them)
    assert log[2:] == [("join", 7, 12)], log


def test_future_and_is_completed_join_once_on_the_side_stream():
    log = []
    w = _work(log)
    assert w.get_future() == ["out"]
    assert log == [("join", 7, 99), ("keep", ("t",), "s-side"), ("event", "s-side"),
                   ("future", "ev@s-side")], log
    assert w.is_completed() and len(log) == 4  # the side join's event, not a second join


def test_dropped_unwaited_work_joins_on_the_side_stream():
    log = []
    w = _work(log)
    del w
    gc.collect()
    assert log == [("join", 7, 99), ("keep", ("t",), "s-side"), ("event", "s-side")], log


def test_waited_work_is_not_joined_again_when_dropped_and_undeferred_works_never_join():
    log = []
    w = _work(log)
    w.wait()
    n = len(log)
    del w
    gc.collect()
    assert len(log) == n
    log2 = []
    w = face_capi.CapiWork(FakeRoute(log2), ["out"], "ev", FakeStreams(log2))  # joined at issue
    w.wait()
    del w
    gc.collect()
    assert log2 == [("wait_event", "ev")], log2
