// all_reduce, ring algorithm: a reduce-scatter ring then an all-gather ring over the blocks of
// recvbuff, 2(n-1) steps, each one engine plan (send a block to the next rank, receive one from
// the previous rank, reduced into place for the first n-1 steps). Every rank ends with the same
// bits: each block is reduced once, by the rank that owns it, and copied to the others.
// Trade-off: 2(n-1) latencies per call (the schedule's table will pick trees or recursive
// doubling for small messages at scale); bandwidth 2(n-1)/n of the data per rank, optimal.
// AVG: the owner divides its reduced block by n (integers truncate, as torch) before the copies.
#include <cstring>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_reduce_ring(Comm& c, const void* send, void* recv, size_t count, DType dt, size_t es,
                     ReduceOp op) {
  char* buf = static_cast<char*>(recv);
  uint64_t seq;
  if (!c.begin_in_place(send, recv, count * es, seq)) return;
  const int n = c.size, r = c.rank;
  auto item = [&](int peer, bool s, int b) {
    return Comm::Item{peer, s, buf + block_lo(count, n, b) * es, block_len(count, n, b) * es};
  };
  uint32_t s = 0;
  for (int k = 0; k < n - 1; ++k, ++s)
    c.step(Comm::tag(seq, s), {item(c.next(), true, mod(r - k, n)), item(c.prev(), false, mod(r - k - 1, n))},
           true, op, dt);
  int own = mod(r + 1, n);
  if (op == ReduceOp::AVG)
    scale_div(dt, buf + block_lo(count, n, own) * es, block_len(count, n, own), n, c.settings.reduce_threads);
  for (int k = 0; k < n - 1; ++k, ++s)
    c.step(Comm::tag(seq, s), {item(c.next(), true, mod(r + 1 - k, n)), item(c.prev(), false, mod(r - k, n))});
}

}  // namespace api
}  // namespace hetccl
