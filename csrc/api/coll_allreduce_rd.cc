// all_reduce, recursive doubling (n a power of two): log2(n) steps; at step k rank r exchanges
// its whole buffer with rank r ^ 2^k and reduces the partner's copy into its own. Every rank
// computes op(mine, theirs) with commutative ops (IEEE addition and multiplication, min, max),
// so the partners hold the same bits after each step and all ranks end with the same bits.
// Trade-off: log2(n) latencies instead of the ring's 2(n-1), but each step moves the whole
// buffer (log2(n) times the data per rank against the ring's 2(n-1)/n): the latency path for
// small messages, chosen by select.cc. One scratch buffer of the message; partners 2^k apart
// are connected on first use (log2(n) peers per rank).
#include <cstring>
#include <vector>

#include "comm.h"

namespace hetccl {
namespace api {

void all_reduce_recursive_doubling(Comm& c, const void* send, void* recv, size_t count, DType dt,
                                   size_t es, ReduceOp op) {
  char* buf = static_cast<char*>(recv);
  if (send != recv && count) std::memmove(buf, send, count * es);
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  if (n == 1 || count == 0) return;
  std::vector<char> theirs(count * es);
  ReduceOp pairwise = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  uint32_t s = 0;
  for (int d = 1; d < n; d <<= 1, ++s) {
    int peer = r ^ d;
    c.step(Comm::tag(seq, s), {{peer, true, buf, count * es}, {peer, false, theirs.data(), count * es}});
    reduce_into(pairwise, dt, buf, theirs.data(), count, c.settings.reduce_threads);
  }
  if (op == ReduceOp::AVG) scale_div(dt, buf, count, n, c.settings.reduce_threads);
}

}  // namespace api
}  // namespace hetccl
