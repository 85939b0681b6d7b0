// all_reduce, recursive doubling, any n: log2(p) steps among the largest power of two p <= n
// ranks, with a fold for the rem = n - p others, as MPICH's recursive doubling:
//   fold in:  of the first 2*rem ranks, each even rank sends its buffer to the odd rank after
//             it, which reduces it into its own; the even ranks then sit out;
//   doubling: the p remaining ranks (virtual rank v: odd r < 2*rem -> r/2, r >= 2*rem ->
//             r - rem) run log2(p) steps; at step k a rank exchanges its whole buffer with
//             virtual rank v ^ 2^k and reduces the partner's copy into its own;
//   fold out: each odd rank of the first 2*rem sends the result back to the even rank before it.
// Every reduction is op(mine, theirs) with commutative ops (IEEE addition and multiplication,
// min, max): the partners hold the same bits after each step, so every rank ends with the same
// bits. Trade-off: log2(p) (+2 when n is not a power of two) latencies instead of the ring's
// 2(n-1), but each step moves the whole buffer: the latency path for small messages, chosen by
// select.cc. Peers per rank: log2(p) partners plus the fold partner, connected on first use.
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
  const size_t nb = count * es;
  std::vector<char> theirs(nb);
  ReduceOp pairwise = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;
  const uint32_t out_step = 1 + uint32_t(__builtin_ctz(unsigned(p)));  // after the doubling
  int v;  // virtual rank among the p doubling ranks, -1: sits out
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      c.step(Comm::tag(seq, 0), {{r + 1, true, buf, nb}});
      v = -1;
    } else {
      c.step(Comm::tag(seq, 0), {{r - 1, false, theirs.data(), nb}});
      reduce_into(pairwise, dt, buf, theirs.data(), count, c.settings.reduce_threads);
      v = r / 2;
    }
  } else {
    v = r - rem;
  }
  if (v >= 0) {
    uint32_t s = 1;
    for (int d = 1; d < p; d <<= 1, ++s) {
      int pv = v ^ d;
      int peer = pv < rem ? 2 * pv + 1 : pv + rem;
      c.step(Comm::tag(seq, s), {{peer, true, buf, nb}, {peer, false, theirs.data(), nb}});
      reduce_into(pairwise, dt, buf, theirs.data(), count, c.settings.reduce_threads);
    }
  }
  if (r < 2 * rem) {
    if (r % 2) c.step(Comm::tag(seq, out_step), {{r - 1, true, buf, nb}});
    else c.step(Comm::tag(seq, out_step), {{r + 1, false, buf, nb}});
  }
  if (op == ReduceOp::AVG) scale_div(dt, buf, count, n, c.settings.reduce_threads);
}

}  // namespace api
}  // namespace hetccl
