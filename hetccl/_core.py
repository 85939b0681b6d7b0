"""Loads the C++ core (hetccl._C) and re-exports its error types.

UCX's shared libraries ship in the libucx wheel; they must be loaded before the extension when
the build includes the UCX transport."""
from __future__ import annotations

try:  # optional: only builds with the UCX transport need it
    import libucx  # type: ignore

    libucx.load_library()
except Exception:  # noqa: BLE001 - absent or unloadable UCX simply means no UCX transport
    pass

from . import _C, config  # noqa: E402

if config.get("HETCCL_CRASH_BACKTRACE"):  # debugging aid (csrc/bindings.cc)
    _C.enable_crash_backtrace()

CommError = _C.CommError
CommTimeout = _C.CommTimeout
PeerFailure = _C.PeerFailure
MessageTruncated = _C.MessageTruncated
ArgMismatch = _C.ArgMismatch

HOST_REDUCE_DTYPES = {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32",
                      "int64"}


def transport_names() -> list[str]:
    return list(_C.transport_names())
