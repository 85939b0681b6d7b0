"""hetccl.rendezvous.all_gather: every rank's value to every rank in O(n) store requests."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hetccl import rendezvous


class _Counting:
    """A store that counts the requests it serves (wraps torch's HashStore)."""

    def __init__(self):
        self.s, self.n, self.mu = dist.HashStore(), 0, threading.Lock()

    def __getattr__(self, name):
        fn = getattr(self.s, name)

        def call(*a, **k):
            with self.mu:
                self.n += 1
            return fn(*a, **k)
        return call


def _run(store, size, values, timeout=timedelta(seconds=20), ranks=None):
    out, errs = {}, {}

    def body(r):
        try:
            out[r] = rendezvous.all_gather(store, "t", r, size, values[r], timeout)
        except Exception as e:  # noqa: BLE001
            errs[r] = e
    th = [threading.Thread(target=body, args=(r,)) for r in (ranks or range(size))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out, errs


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_every_rank_gets_every_value_in_order(size):
    values = [bytes([r % 256]) * (r % 5) + b"\x00\xff\x80" if r % 3 else b"" for r in range(size)]
    store = _Counting()
    out, errs = _run(store, size, values)
    assert not errs, errs
    assert all(out[r] == values for r in range(size)), out
    # set + wait + get per rank, plus rank 0's wait, multi_get and set of the table: O(n)
    assert store.n <= 3 * size + 3, store.n


def test_str_values_and_a_missing_rank_is_named():
    out, errs = _run(dist.HashStore(), 2, ["a", "b"])
    assert out[0] == [b"a", b"b"] == out[1]
    t0 = time.monotonic()
    out, errs = _run(dist.HashStore(), 3, [b"x", b"y", b"z"], timedelta(seconds=1), ranks=[0, 1])
    assert set(errs) == {0, 1} and time.monotonic() - t0 < 15
    assert all("ranks [2] never published" in str(e) for e in errs.values()), errs
