// reduce_scatter for small inputs (any n): the whole input reduced by the recursive-doubling
// all_reduce (coll_allreduce_rd.cc, folded where n is not a power of two) into a scratch copy,
// then this rank keeps its block. log2 latencies against the ring's n-1, but every step moves
// the whole input (n blocks): the latency path for small inputs, chosen by select.cc. sendbuff
// stays unchanged; AVG divides by n as the all_reduce does.
#include <cstring>
#include <vector>

#include "comm.h"

namespace hetccl {
namespace api {

void reduce_scatter_rd(Comm& c, const void* send, void* recv, size_t recvcount, DType dt,
                       size_t es, ReduceOp op) {
  const int n = c.size, r = c.rank;
  const size_t blk = recvcount * es;
  std::vector<char> acc(blk * size_t(n));
  all_reduce_recursive_doubling(c, send, acc.data(), recvcount * size_t(n), dt, es, op);
  if (blk) std::memcpy(recv, acc.data() + size_t(r) * blk, blk);
}

}  // namespace api
}  // namespace hetccl
