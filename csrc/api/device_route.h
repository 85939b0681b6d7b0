// hetccl C API: the device route of stream-ordered calls. A collective on a stream whose data is
// large enough (Settings::stream_device_bytes) never leaves device memory but for the bridge's
// own copies: the executor of the stream path (stream_path.h) posts the algorithm's steps as
// engine device plans (engine.h: the copy engines move chunks between device memory and the
// links' pinned slots, the stream waiting on flag words) and reduces with the device runtime's
// kernels (device_ops.h, reduce_kernels.cu), all on two streams of the route's own:
//
//   caller's stream: write ready=seq |                                  (then) wait done>=seq | write freed=seq
//   route's main:                wait ready>=seq | plans' receives, kernels | write done=seq
//   route's side:                                 plans' sends (forked from and joined into main)
//   executor thread: argument check (host) -> posts the plans and kernels -> next call
//   issuing thread:  enqueues write ready, hands the call over, waits until the executor has
//                    enqueued it, then enqueues the wait for done
//
// Contracts:
//  * No stream waits for work submitted after its wait. A stream memory wait blocks its
//    hardware queue, and streams beyond the device's queues share one (CUDA: 8 per context by
//    default): had the caller's wait for done been enqueued before the route's work that writes
//    done, a shared queue deadlocked (seen on one H200: the drop-in's every-family test, three
//    processes with many process groups). So the issuing thread enqueues its wait only after
//    the executor has enqueued the call: the caller's issue cost includes the executor's turn
//    (the argument check's round trip with the peers, and the earlier calls still queued: a
//    staged call ahead of it waits for its stream's data). The executor never waits for the
//    device itself.
//  * Every rank decides the route alike from the call alone (collective, bytes, a stream given,
//    the runtime's support, the setting); the argument check also compares it, and where a rank
//    took the host route (a host call, or a runtime without the route) every rank runs the
//    call staged through host memory instead (run by the executor on the route's main stream),
//    so routes never meet on the wire.
//  * The caller's buffers are read and written by the route's streams only between ready and
//    done, so the caller's stream order (and torch's caching allocator) is kept as with NCCL.
//  * Device scratch memory is stream-ordered (mem_alloc_async / mem_free_async on main, through
//    RouteScratch); a call that fails before freeing it leaves it to the route, which frees it
//    once its streams drained.
//  * Only the ring collectives take the route (all_reduce, reduce, reduce_scatter, all_gather,
//    broadcast: their peers are the ring neighbours), and those two links are registered with
//    the device runtime when the route is made, on the issuing thread, like the kernels: no
//    registration ever runs while a stream of this process waits on an engine word (a driver
//    call that waits for the device would deadlock there). all_to_all, whose peers are every
//    rank, stays staged.
//  * The kernels' arithmetic is reduce.cc's (reduce.h), so each block is reduced by one owner
//    with the same operations the host route uses, and every rank ends with the same bits.
// Trade-off: every plan's chunk is three stream operations (wait for a slot, copy, write a
// flag), enqueued by the executor: large calls cost executor time in proportion to their chunk
// count, not the caller's; small calls stay on the host route, whose latency is lower
// (docs/capi.md has the figures that set the switch point).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../device_ops.h"
#include "../reduce.h"

namespace hetccl {
namespace api {

class Comm;

struct DeviceRoute {
  // On the issuing thread, the caller's device current: loads the kernels there (before any of
  // this communicator's waits is on a stream: device_ops.h prepare_kernels) and makes the
  // route's two streams.
  explicit DeviceRoute(DeviceOps& ops);
  ~DeviceRoute();  // waits for both streams, then destroys them
  DeviceRoute(const DeviceRoute&) = delete;
  DeviceRoute& operator=(const DeviceRoute&) = delete;
  DeviceOps& ops;
  int device = 0;
  void* main = nullptr;
  void* side = nullptr;
  // Scratch of calls that threw before freeing it (a failed step): a stream may still write
  // into it, so it is freed only once both streams drained (~DeviceRoute). The executor's
  // thread only.
  std::vector<void*> orphans;
};

// One call's stream-ordered scratch on main: release() frees it in stream order after the
// call's last use; a call that throws first hands it to the route's orphans instead.
class RouteScratch {
 public:
  RouteScratch(DeviceRoute& d, size_t nbytes) : d_(d), p_(d.ops.mem_alloc_async(nbytes, d.main)) {}
  ~RouteScratch() {
    if (p_) d_.orphans.push_back(p_);
  }
  RouteScratch(const RouteScratch&) = delete;
  RouteScratch& operator=(const RouteScratch&) = delete;
  char* get() const { return static_cast<char*>(p_); }
  void release() {
    void* p = p_;
    p_ = nullptr;  // a free that throws does not leave it to the orphans as well
    d_.ops.mem_free_async(p, d_.main);
  }

 private:
  DeviceRoute& d_;
  void* p_;
};

// The collectives on device memory (coll_*_device.cc): the same steps as their host twins,
// every step one engine device plan on the route's streams; receives that reduce land in
// stream-ordered scratch and are reduced by a kernel on main. Counts in elements.
void all_reduce_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t count, DType dt,
                            size_t esize, ReduceOp op);
// scalar_dev / scalar_host (PreMulSum, at most one set): the input's working copy is scaled first.
void reduce_scatter_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t recvcount,
                                DType dt, size_t esize, ReduceOp op, const void* scalar_dev = nullptr,
                                const void* scalar_host = nullptr);
void all_gather_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t sendcount,
                            size_t esize);
void broadcast_chain_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t nbytes, int root);

}  // namespace api
}  // namespace hetccl
