// hetccl bridge core: the one Transport interface every transport implements.
//
// Layering (see docs/architecture.md):
//   transports (this interface; shm_transport.cc, tcp_transport.cc, ucx_transport.cc)
//   <- the C++ engine (engine*.cc: every collective's cross-vendor data, device point-to-point)
//      <- bindings.cc (pybind11, hetccl._C) <- Python engine / algorithms <- torch backend;
//   the Python bridge also hands host point-to-point to the transports directly (hetccl._C.
//   Transport), and the C API's communicator (csrc/api/comm.cc) runs its own Engine over them.
// Algorithms never include a transport's file: they hand plans to the engine.
//
// Contract of a Transport instance:
//  * It serves one "world" of `size` ranks; this process is `rank`. Ranks are those of the
//    process group that owns the bridge. Not every rank is a peer: connect() receives an empty
//    address for ranks this transport must not connect to (same-vendor ranks, or ranks served
//    by another transport).
//  * address() returns opaque bytes to publish out of band (Python puts them in the torch store).
//  * connect() blocks until every peer with a non-empty address is connected and has proved it
//    knows the group's secret, or throws CommError after timeout_ms.
//  * isend/irecv post an operation and return at once; progress is made by the transport's own
//    threads. Matching: a receive from `peer` with `tag` takes the earliest unmatched message
//    that `peer` sent to this rank with the same `tag` (FIFO per (peer, tag)). Messages with other
//    tags may be received in any order: a message that arrives before its receive is posted is
//    buffered on the heap (a memory cost, never a deadlock).
//  * A receive buffer larger than the message is fine (Request::nbytes() says what arrived);
//    a smaller one fails that request with MessageTruncated. One exception: UCX lanes with
//    striping on (option stripe_bytes) may fail a larger receive with MessageTruncated where
//    the two sizes split into parts that do not fit (ucx_transport.cc, UcxLaneThreads), and may
//    write past the message; never misplaced bytes. Every caller in hetccl posts exact sizes.
//  * irecv_reduce applies dst[i] = op(dst[i], incoming[i]) chunk by chunk as data arrives
//    (saves one full pass over memory compared with recv + reduce). The message must be exactly
//    `nbytes` long.
//  * Buffers must stay valid until the request completes. Zero-byte messages are legal.
//  * Tags are user values below 2^48 (kMaxTag below); isend/irecv throw CommError for a
//    larger one. The bits above are the transports' own (UCX packs the sender rank there).
//  * A send completes when its bytes are in the transport's hands (ring slot, socket buffer):
//    the buffer may then be reused; it does not mean the peer has received them.
//  * Failure: a peer that closes, dies or sends garbage fails every pending request naming
//    that peer (PeerFailure). close() fails all pending requests and frees every resource
//    (threads, sockets, shared memory); it is idempotent and the destructor calls it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "errors.h"  // CommError, CommTimeout, PeerFailure, MessageTruncated
#include "reduce.h"

namespace hetccl {

// User tags must be below this; the bits above belong to the transports (see the contract above).
constexpr uint64_t kMaxTag = uint64_t(1) << 48;

// Completion state of one posted operation; shared by the transport's threads and the caller.
class Request {
 public:
  enum class State { Pending, Done, Failed };
  enum class ErrorKind { None, Generic, Timeout, Peer, Truncated };

  Request(int peer, uint64_t tag, size_t nbytes) : peer_(peer), tag_(tag), nbytes_(nbytes) {}

  // Called by transports exactly once.
  void complete(size_t nbytes_done) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (state_ != State::Pending) return;
      done_bytes_ = nbytes_done;
      state_ = State::Done;
      hook.swap(hook_);
    }
    cv_.notify_all();
    if (hook) hook();
  }
  void fail(ErrorKind kind, const std::string& msg) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (state_ != State::Pending) return;
      error_kind_ = kind;
      error_ = msg;
      state_ = State::Failed;
      hook.swap(hook_);
    }
    cv_.notify_all();
    if (hook) hook();
  }
  // Runs `fn` once this request is finished (done or failed): at once on the calling thread if
  // it already is, else on the thread that finishes it, right after the state is set (no lock
  // held). One hook per request (a second replaces the first). For requests made of others
  // (a UCX message striped over lanes): fn must be short and must not wait on a transport.
  void on_finish(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (state_ == State::Pending) {
        hook_ = std::move(fn);
        return;
      }
    }
    fn();
  }
  // The failure as (kind, text); kind None while pending or done.
  std::pair<ErrorKind, std::string> error() {
    std::lock_guard<std::mutex> g(mu_);
    return {state_ == State::Failed ? error_kind_ : ErrorKind::None, error_};
  }

  bool test() {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ == State::Failed) rethrow_locked();
    return state_ == State::Done;
  }
  // Finished (done or failed), without raising.
  bool test_nothrow() {
    std::lock_guard<std::mutex> g(mu_);
    return state_ != State::Pending;
  }

  // Blocks until done (returns bytes transferred), failed (throws) or timeout_ms passes
  // (throws CommTimeout naming the peer and tag; the request stays pending). timeout_ms < 0: forever.
  size_t wait(int64_t timeout_ms) {
    std::unique_lock<std::mutex> g(mu_);
    auto pred = [&] { return state_ != State::Pending; };
    if (timeout_ms < 0) {
      cv_.wait(g, pred);
    } else if (!cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), pred)) {
      throw CommTimeout("hetccl: timed out after " + std::to_string(timeout_ms) +
                        " ms waiting for peer rank " + std::to_string(peer_) + " (tag " +
                        std::to_string(tag_) + ", " + std::to_string(nbytes_) + " bytes)");
    }
    if (state_ == State::Failed) rethrow_locked();
    return done_bytes_;
  }

  int peer() const { return peer_; }
  uint64_t tag() const { return tag_; }
  // Posted size while pending; once done, the bytes that actually arrived (a receive buffer may
  // be larger than the message).
  size_t nbytes() {
    std::lock_guard<std::mutex> g(mu_);
    return state_ == State::Done ? done_bytes_ : nbytes_;
  }
  size_t posted_nbytes() const { return nbytes_; }

 private:
  void rethrow_locked() {
    switch (error_kind_) {
      case ErrorKind::Timeout: throw CommTimeout(error_);
      case ErrorKind::Peer: throw PeerFailure(error_);
      case ErrorKind::Truncated: throw MessageTruncated(error_);
      default: throw CommError(error_);
    }
  }

  const int peer_;
  const uint64_t tag_;
  const size_t nbytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::Pending;
  ErrorKind error_kind_ = ErrorKind::None;
  std::string error_;
  size_t done_bytes_ = 0;
  std::function<void()> hook_;
};

using RequestPtr = std::shared_ptr<Request>;

// Options come from Python (hetccl/config.py is the one place that reads the environment);
// the C++ core reads no environment variable of its own (UCX reads its own UCX_* ones).
// Known keys (all optional, values are strings):
//   "secret"      group secret (hex); peers must present it in their handshake
//   "nconn"       tcp: connections per peer (default 4)
//   "bind_addr"   tcp/ucx: interface address to listen on (default: all interfaces; Python
//                 resolves HETCCL_SOCKET_IFNAME to an address)
//   "slot_bytes"  shm: bytes per ring slot (default 1 MiB)
//   "nslots"      shm: slots per ring (default 8)
//   "threads"     reduction threads for large buffers (default: hardware concurrency)
//   "progress_threads"  tcp: epoll progress threads (default min(nconn, 2))
//   "chunk_bytes"       tcp: striping unit of large messages (default 512 KiB)
//   "handshake_timeout_ms"  tcp: a connection that has not completed its handshake by then is
//                 dropped (default 5000)
using Options = std::map<std::string, std::string>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  virtual std::string address() = 0;
  virtual void connect(const std::vector<std::string>& addresses, int64_t timeout_ms) = 0;
  virtual RequestPtr isend(int peer, const void* buf, size_t nbytes, uint64_t tag) = 0;
  virtual RequestPtr irecv(int peer, void* buf, size_t nbytes, uint64_t tag) = 0;
  virtual RequestPtr irecv_reduce(int peer, void* dst, size_t nbytes, uint64_t tag, ReduceOp op,
                                  DType dtype) = 0;
  virtual void close() = 0;

  // Withdraws a posted receive (irecv / irecv_reduce) that no data has reached yet: returns
  // true when it did -- the request has failed with "cancelled" and the transport will never
  // write into its buffer -- and false when it cannot (a send, a receive already matched or
  // finished, data arriving, or a transport without cancel): the request then completes or
  // fails as before, and the caller keeps the buffer until it does. For the callers of a
  // collective that failed (engine_plan.cc bury), so that its buffers need not live until close().
  // The message the withdrawn receive would have taken is not delivered to it; whether a later
  // receive of the same (peer, tag) takes it (shm, UCX) or it is dropped on arrival (tcp, whose
  // matching is by sequence number) is the transport's: callers cancel only receives whose tag
  // is never posted again (the engine's tags carry the collective's sequence number).
  // unpost = true asks for the first behaviour on every transport: the receive is withdrawn
  // only if the message it would have taken then goes to the next receive of (peer, tag), as if
  // it had never been posted (tcp: only the latest receive of its tag, rewinding the sequence
  // number; otherwise false). For receives posted speculatively (recv from any source:
  // backend.py), whose tag is posted again.
  virtual bool cancel(const RequestPtr& req, bool unpost = false) {
    (void)req;
    (void)unpost;
    return false;
  }

  // What this instance runs with, for reports and tests (`hetccl doctor`, tests/test_ucx.py):
  // key -> value, e.g. UCX's "tls" as read back from UCX after hetccl's restrictions.
  virtual std::map<std::string, std::string> info() { return {}; }

  // The largest host message worth sending to `peer` in one piece, 0 for no bound (the
  // default): larger messages still work, but take a slower path in the transport (UCX over
  // tcp: copies through its segments instead of zero-copy). Equal on both ends of a link after
  // connect() -- a transport that derives it from its own settings publishes it in its address
  // and both ends take the same combination -- so callers that cut a stream into messages and
  // must cut alike on both ends (the engine's host chunks on message links, engine_plan.cc)
  // may cap their messages at it. A multiple of 4096 (whole elements of every dtype).
  virtual size_t message_limit(int peer) const {
    (void)peer;
    return 0;
  }

  // Device memory handed to the transport directly (only where TransportCaps::memory lists the
  // device's kind; the defaults say "not supported"). Same matching as isend/irecv, but in a
  // tag space of their own (a device message never matches a host receive), and a weaker
  // completion contract: a device send may complete only once the peer has posted the matching
  // irecv_device (no unexpected device message is buffered on the host, where the transport
  // could not copy it into device memory). Callers must therefore post every device receive
  // without waiting for their own device sends to complete (engine_link.cc's direct path does).
  virtual bool device_direct() const { return false; }
  virtual RequestPtr isend_device(int peer, const void* buf, size_t nbytes, uint64_t tag) {
    throw no_device();
  }
  virtual RequestPtr irecv_device(int peer, void* buf, size_t nbytes, uint64_t tag) {
    throw no_device();
  }
  // Device binding for transports that take device memory. `make_current` makes the caller's
  // device context current on the calling thread: the transport runs it on each thread of its
  // own that calls into its library before that thread next does so (CUDA's and HIP's copy
  // engines need a current context on the thread that progresses a device copy or arms a
  // worker; UCX's cuda_copy hangs or crashes without one). `memory` is the memory type of every
  // later isend_device/irecv_device buffer ("cuda", "rocm", or "host" for the emulated device),
  // declared to the library instead of being detected per call (detection takes the driver's
  // context locks on the data path). The engine calls this before its first device message
  // on a link and again if the plan's device changes. Default: nothing to bind.
  virtual void bind_device(std::function<void()> make_current, const std::string& memory) {
    (void)make_current;
    (void)memory;
  }
  // Called by the thread that issues a collective (never the engine's proxy), before the
  // device buffer [ptr, ptr + nbytes) is handed to isend_device/irecv_device from another thread:
  // the transport may do here, where no CUDA/HIP call of the application can be waiting on the
  // collective's stream, the driver calls its library would otherwise make on the data path
  // (UCX: the memory query that takes the CUDA context's lock, see ucx_transport.cc).
  // Default: nothing to prepare. Errors are not fatal: a buffer not prepared is still sent.
  virtual void prepare_device(const void* ptr, size_t nbytes, const std::string& memory) {
    (void)ptr;
    (void)nbytes;
    (void)memory;
  }

  // Zero-copy ring (shm only; the defaults say "not supported"). A second strictly ordered ring
  // per direction beside the tagged one, used by one caller at a time that drives both
  // directions of a peer from one thread (engine_ring.cc): the sender acquires the next free slot
  // (page-aligned memory the caller fills, e.g. by a D2H copy), then commits it with its length
  // and tag; the receiver acquires the next filled slot, consumes it in place and releases it.
  // Up to nslots slots may be acquired before committing/releasing; commits and releases happen
  // in acquisition order. zc_regions() lists all ring memory (for cudaHostRegister).
  //  * zc_send_try / zc_recv_try acquire and never wait: {nullptr, 0} when no slot is free,
  //    {nullptr, 0, 0} when nothing has arrived (zc_wait below is the wait).
  //  * Round trip: a receiver may write into a slot it holds (e.g. reduce into it in place), and
  //    the sender may read a slot back after the receiver released it, until it reacquires it.
  //    zc_send_counts(peer) returns {slots acquired by this side, slots the peer has released}
  //    as free-running counters; the i-th acquired slot is released once released > i.
  //    zc_depth(peer) is the number of slots of the outgoing ring.
  //  * zc_wait sleeps until the peer moves either ring (commits a slot to us or releases one of
  //    ours) or timeout_ms passes (then it just returns); PeerFailure if the peer died or closed.
  virtual bool zc_supported() const { return false; }
  virtual std::vector<std::pair<void*, size_t>> zc_regions() { throw no_zc(); }
  virtual std::pair<void*, size_t> zc_send_try(int peer) { throw no_zc(); }
  virtual void zc_send_commit(int peer, size_t nbytes, uint64_t tag) { throw no_zc(); }
  virtual std::tuple<void*, size_t, uint64_t> zc_recv_try(int peer) { throw no_zc(); }
  virtual void zc_recv_release(int peer) { throw no_zc(); }
  virtual std::pair<uint32_t, uint32_t> zc_send_counts(int peer) { throw no_zc(); }
  virtual uint32_t zc_depth(int peer) { throw no_zc(); }
  // Slot capacity in bytes, and the address of the slot that carries ring position `pos` of the
  // outgoing (or incoming) ring: position i lives in slot i % depth. For callers that let a
  // device fill or drain slots ahead of the host-side protocol (engine_device.cc).
  virtual size_t zc_slot_bytes(int peer) { throw no_zc(); }
  // Positions already taken from the incoming ring (slots acquired so far).
  virtual uint32_t zc_recv_pos(int peer) { throw no_zc(); }
  virtual void* zc_slot(int peer, bool outgoing, uint32_t pos) { throw no_zc(); }
  virtual void zc_wait(int peer, int64_t timeout_ms) { throw no_zc(); }

 private:
  CommError no_device() const {
    return CommError("hetccl: the " + name() +
                     " transport does not take device memory directly (device_direct is False)");
  }
  CommError no_zc() const {
    return CommError("hetccl: the " + name() +
                     " transport has no zero-copy ring (zc_supported is False; only shm has one)");
  }
};

// ---------------------------------------------------------------------------- registry
// Transport choice is data (docs/transports.md, "Choosing a transport"): every transport file
// declares, next to its factory, what it can do -- which peers it reaches, which memory it takes,
// and where it stands in the order of preference -- and registers both with one line:
//
//     HETCCL_REGISTER_TRANSPORT(tcp, tcp_caps, make_tcp_transport);
//
// Adding a transport is one file with that line (CMakeLists.txt compiles csrc/*_transport.cc):
// the torch face's bridge, the engine and the C API go by its capabilities, never by its name;
// a transport's own option names are known only to it and to hetccl/transports.py (options()).
// The Python bridge walks the table (transport_table(), sorted by preference) per peer, the way
// NCCL asks each transport's canConnect (hetccl/transports.py); the C API's communicator takes
// the most preferred transport with zero-copy rings on one host for its ring neighbours there
// and the most preferred one that reaches other hosts with lazy connections for every other
// peer (csrc/api/comm.cc).
struct TransportCaps {
  std::string name;
  // Lower is preferred when several transports reach a peer. The bridge orders a pair by the
  // larger of the two ranks' values (then by name), so both ends choose alike.
  int preference = 100;
  bool same_host = false;   // reaches peers on this host (same kernel, same /dev/shm)
  bool other_host = false;  // reaches peers on other hosts
  // Memory the transport's isend/irecv accept: always "host"; "cuda" / "rocm" when it takes
  // device pointers directly (isend_device / irecv_device; UCX built with that support and able
  // to use it in this process).
  std::vector<std::string> memory{"host"};
  bool zero_copy = false;   // has the zero-copy ring (zc_* below)
  // Connects a peer on first use when the options say lazy=1 (connect() only records the
  // addresses): a communicator of n ranks pays only for the peers it exchanges data with.
  bool lazy_connect = false;
  bool rdma = false;        // reaches other hosts over RDMA (rc, dc, ud, ...)
  // Device memory types (a subset of `memory`) the transport moves without calling the device
  // runtime on any thread but the issuing one -- neither its own threads nor the engine's proxy
  // when it posts. Only these may go to it directly by default (HETCCL_UCX_DEVICE=auto): a
  // runtime call there can deadlock against an application thread blocked in the runtime behind
  // the collective's stream (docs/transports.md). UCX lists none yet (ucx_caps() says why).
  std::vector<std::string> runtime_free;
  std::string detail;       // one line for `hetccl doctor` (library version, devices, ...)
};
using CapsFn = TransportCaps (*)();
using FactoryFn = std::unique_ptr<Transport> (*)(int rank, int size, const Options& opts);
// Called by HETCCL_REGISTER_TRANSPORT at load time; a duplicate name is a programming error
// (reported on stderr, the first registration wins).
bool register_transport(const char* name, CapsFn caps, FactoryFn make);
#define HETCCL_REGISTER_TRANSPORT(NAME, CAPS, MAKE) \
  static const bool hetccl_transport_registered_##NAME = ::hetccl::register_transport(#NAME, CAPS, MAKE)

// Every registered transport's capabilities, most preferred first (capabilities are computed
// once per process: UCX's needs a UCP context).
std::vector<TransportCaps> transport_table();
std::unique_ptr<Transport> make_transport(const std::string& name, int rank, int size,
                                          const Options& opts);  // throws CommError on unknown
std::vector<std::string> transport_names();  // sorted by name

}  // namespace hetccl
