"""Every rank's value, to every rank, through torch's store: the one exchange of start-up tables
(rank infos, settings, capability tables, transport addresses).

Contract: all_gather(store, name, rank, size, value, timeout) -> [value of rank 0, ..., rank
size-1] (bytes), the same list on every rank; every rank of the group must call it with the same
name. Each rank sets its own key; rank 0 waits for all of them, reads them in one request
(multi_get) and publishes the table under one key; every rank reads that one key. So the store
serves O(n) requests in total -- reading every rank's key from every rank would be n^2 (n = 1,024
ranks: about a million gets at the store's server for each table). The table itself is O(n) bytes
read by each rank. Trade-off: rank 0 reads and writes the table alone (one request each).

A rank that never arrives: the others raise, once the timeout has passed, an error naming the
ranks whose values are missing.
"""
from __future__ import annotations

import struct
from datetime import timedelta


def _pack(vals: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(v)) + v for v in vals)


def _unpack(blob: bytes, size: int) -> list[bytes]:
    out, i = [], 0
    for _ in range(size):
        (n,) = struct.unpack_from("<Q", blob, i)
        out.append(bytes(blob[i + 8:i + 8 + n]))
        i += 8 + n
    if len(out) != size or i != len(blob):
        raise RuntimeError(f"hetccl: internal error: a start-up table of {size} ranks is malformed")
    return out


def _multi_get(store, keys: list[str]) -> list[bytes]:
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(k) for k in keys]  # stores without multi_get


def _missing(store, name: str, size: int) -> list[int]:
    out = []
    for r in range(size):
        try:
            if not store.check([f"{name}/{r}"]):
                out.append(r)
        except Exception:  # noqa: BLE001 - a store that cannot tell: name none
            return []
    return out


def _wait(store, keys: list[str], timeout: timedelta, name: str, size: int) -> None:
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001 - the store's own timeout error, made specific
        missing = _missing(store, name, size)
        who = f"ranks {missing} never published theirs" if missing else "the table never came"
        try:
            err = type(e)(f"hetccl: start-up exchange '{name}' timed out after "
                          f"{timeout.total_seconds():.0f} s: {who} ({e})")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            raise e from None
        raise err from None


def all_gather(store, name: str, rank: int, size: int, value: bytes | str,
               timeout: timedelta) -> list[bytes]:
    if isinstance(value, str):
        value = value.encode()
    store.set(f"{name}/{rank}", value)
    if rank == 0:
        keys = [f"{name}/{r}" for r in range(size)]
        _wait(store, keys, timeout, name, size)
        store.set(f"{name}/all", _pack(_multi_get(store, keys)))
    _wait(store, [f"{name}/all"], timeout, name, size)
    return _unpack(store.get(f"{name}/all"), size)
