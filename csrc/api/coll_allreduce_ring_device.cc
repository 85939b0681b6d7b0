// all_reduce on device memory, ring algorithm (the host twin: coll_allreduce_ring.cc, the same
// blocks, steps and tags): a reduce-scatter ring then an all-gather ring over the blocks of
// recvbuff, 2(n-1) engine device plans on the route's streams. A reduce-scatter step receives
// the previous rank's partial block into stream-ordered scratch and a kernel reduces it into
// place on main before the next step's send forks from main, so each block is reduced once per
// step by one rank and copied after: every rank ends with the same bits. AVG: the owner's kernel
// divides its block by n before the all-gather. PreMulSum: the caller scales recvbuff (a copy of
// sendbuff) first.
// Trade-off: the bandwidth-optimal ring (each rank's copy engines move 2(n-1)/n of the data each
// way) at 2(n-1) plan latencies; the device route carries large calls only (device_route.h).
#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_reduce_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t count, DType dt,
                            size_t es, ReduceOp op) {
  char* buf = static_cast<char*>(recv);
  if (send != recv && count) d.ops.memcpy_async(buf, send, count * es, d.main);
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  if (n == 1 || count == 0) return;
  auto item = [&](int peer, bool s, int b) {
    return Comm::Item{peer, s, buf + block_lo(count, n, b) * es, block_len(count, n, b) * es};
  };
  size_t most = block_len(count, n, 0);  // block 0 is the largest
  RouteScratch held(d, most * es);
  char* scratch = held.get();
  uint32_t s = 0;
  for (int k = 0; k < n - 1; ++k, ++s) {
    int in = mod(r - k - 1, n);
    size_t len = block_len(count, n, in);
    c.post_device(Comm::tag(seq, s), {item(c.next(), true, mod(r - k, n)), {c.prev(), false, scratch, len * es}}, d);
    d.ops.reduce(buf + block_lo(count, n, in) * es, scratch, len, dt, op, d.main);
  }
  held.release();
  int own = mod(r + 1, n);
  if (op == ReduceOp::AVG)
    d.ops.scale_div(buf + block_lo(count, n, own) * es, block_len(count, n, own), dt, n, d.main);
  for (int k = 0; k < n - 1; ++k, ++s)
    c.post_device(Comm::tag(seq, s), {item(c.next(), true, mod(r + 1 - k, n)), item(c.prev(), false, mod(r - k, n))}, d);
}

}  // namespace api
}  // namespace hetccl
