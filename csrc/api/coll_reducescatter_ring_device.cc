// reduce_scatter on device memory, ring algorithm (host twin: coll_reducescatter_ring.cc, the
// same blocks and steps): n-1 engine device plans over a stream-ordered scratch copy of
// sendbuff (sendbuff stays unchanged, as NCCL's); at step k rank r sends block r-k-1 to the next
// rank and a kernel reduces block r-k-2, received into a second scratch block, into place.
// Block r then holds every rank's contribution and is copied to recvbuff (AVG: divided by n
// there). PreMulSum: the caller's scale runs on the copy (premul).
// Trade-off: scratch of the whole input plus one block per call, stream-ordered (no host
// synchronisation to allocate or free it).
#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void reduce_scatter_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t recvcount,
                                DType dt, size_t es, ReduceOp op, const void* scalar_dev,
                                const void* scalar_host) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  const size_t blk = recvcount * es;
  if (recvcount == 0) return;
  const bool scaled = scalar_dev || scalar_host;
  if (n == 1) {
    if (send != recv) d.ops.memcpy_async(recv, send, blk, d.main);
    if (scaled) d.ops.scale_mul(recv, recvcount, dt, scalar_dev, scalar_host, d.main);
    return;
  }
  RouteScratch held(d, blk * size_t(n + 1));
  char* acc = held.get();
  char* in = acc + blk * size_t(n);
  d.ops.memcpy_async(acc, send, blk * size_t(n), d.main);
  if (scaled) d.ops.scale_mul(acc, recvcount * size_t(n), dt, scalar_dev, scalar_host, d.main);
  for (int k = 0; k < n - 1; ++k) {
    int b = mod(r - k - 2, n);
    c.post_device(Comm::tag(seq, uint32_t(k)),
                  {{c.next(), true, acc + size_t(mod(r - k - 1, n)) * blk, blk}, {c.prev(), false, in, blk}}, d);
    d.ops.reduce(acc + size_t(b) * blk, in, recvcount, dt, op, d.main);
  }
  d.ops.memcpy_async(recv, acc + size_t(r) * blk, blk, d.main);
  held.release();
  if (op == ReduceOp::AVG) d.ops.scale_div(recv, recvcount, dt, n, d.main);
}

}  // namespace api
}  // namespace hetccl
