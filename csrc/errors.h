// hetccl bridge core: the error types every layer throws. They live in their own header so that
// reduce.h and transport.h can both use them without including each other.
// bindings.cc maps them to Python: CommError(RuntimeError), CommTimeout(CommError, TimeoutError),
// PeerFailure(CommError), MessageTruncated(CommError).
#pragma once

#include <stdexcept>

namespace hetccl {

struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// An operation or connect() did not finish within its timeout.
struct CommTimeout : CommError {
  using CommError::CommError;
};
// A peer died, closed its end or sent something that breaks the protocol. The message names
// the peer rank and how to find it (pid for shm, host:port for tcp).
struct PeerFailure : CommError {
  using CommError::CommError;
};
// A message was longer than the receive buffer posted for it (or, for irecv_reduce, not exactly
// the posted length). The message names both sizes, the peer and the tag.
struct MessageTruncated : CommError {
  using CommError::CommError;
};

}  // namespace hetccl
