// reduce_scatter, ring algorithm: n-1 steps over a scratch copy of sendbuff (sendbuff stays
// unchanged, as NCCL's); at step k rank r sends block r-k-1 to the next rank and reduces block
// r-k-2 from the previous one into place, so after n-1 steps block r holds every rank's
// contribution. Trade-off: one scratch buffer of the whole input per call (the engine's plans
// reduce into memory they can write; reducing out of the peer's slot into recvbuff directly
// needs a plan kind of its own).
#include <cstring>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void reduce_scatter_ring(Comm& c, const void* send, void* recv, size_t recvcount, DType dt,
                         size_t es, ReduceOp op) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  const size_t blk = recvcount * es;
  if (recvcount == 0) return;
  if (n == 1) {
    if (send != recv) std::memmove(recv, send, blk);
    if (op == ReduceOp::AVG) scale_div(dt, recv, recvcount, 1, c.settings.reduce_threads);
    return;
  }
  std::vector<char> acc(static_cast<const char*>(send), static_cast<const char*>(send) + blk * size_t(n));
  auto item = [&](int peer, bool s, int b) { return Comm::Item{peer, s, acc.data() + size_t(b) * blk, blk}; };
  for (int k = 0; k < n - 1; ++k)
    c.step(Comm::tag(seq, uint32_t(k)),
           {item(c.next(), true, mod(r - k - 1, n)), item(c.prev(), false, mod(r - k - 2, n))}, true, op, dt);
  std::memcpy(recv, acc.data() + size_t(r) * blk, blk);
  if (op == ReduceOp::AVG) scale_div(dt, recv, recvcount, n, c.settings.reduce_threads);
}

}  // namespace api
}  // namespace hetccl
