// all_gather on device memory, ring algorithm (host twin: coll_allgather_ring.cc, the same
// blocks and steps): rank r's block goes into place, then n-1 engine device plans; at step k
// rank r forwards block r-k to the next rank and receives block r-k-1 from the previous one
// straight into recvbuff (no scratch, no kernel).
#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_gather_ring_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t sendcount,
                            size_t es) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  const size_t blk = sendcount * es;
  char* out = static_cast<char*>(recv);
  if (blk && send != out + size_t(r) * blk) d.ops.memcpy_async(out + size_t(r) * blk, send, blk, d.main);
  if (n == 1 || blk == 0) return;
  auto item = [&](int peer, bool s, int b) { return Comm::Item{peer, s, out + size_t(b) * blk, blk}; };
  for (int k = 0; k < n - 1; ++k)
    c.post_device(Comm::tag(seq, uint32_t(k)), {item(c.next(), true, mod(r - k, n)), item(c.prev(), false, mod(r - k - 1, n))}, d);
}

}  // namespace api
}  // namespace hetccl
