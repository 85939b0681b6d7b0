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
#include "ring.h"

namespace hetccl {
namespace api {

void all_reduce_recursive_doubling(Comm& c, const void* send, void* recv, size_t count, DType dt,
                                   size_t es, ReduceOp op) {
  char* buf = static_cast<char*>(recv);
  uint64_t seq;
  if (!c.begin_in_place(send, recv, count * es, seq)) return;
  const int n = c.size, r = c.rank;
  const size_t nb = count * es;
  std::vector<char> theirs(nb);
  ReduceOp pairwise = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  recursive_doubling(n, r, [&](uint32_t s, int peer, bool send, bool recv, bool combine) {
    std::vector<Comm::Item> items;
    if (send) items.push_back({peer, true, buf, nb});
    if (recv) items.push_back({peer, false, combine ? theirs.data() : buf, nb});
    c.step(Comm::tag(seq, s), items);
    if (recv && combine) reduce_into(pairwise, dt, buf, theirs.data(), count, c.settings.reduce_threads);
  });
  if (op == ReduceOp::AVG) scale_div(dt, buf, count, n, c.settings.reduce_threads);
}

}  // namespace api
}  // namespace hetccl
