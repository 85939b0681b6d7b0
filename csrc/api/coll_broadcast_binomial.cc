// broadcast, binomial tree from the root: with v = (rank - root) mod n, a rank receives the
// whole message from v - 2^k (2^k: v's lowest set bit) and then sends it to v + 2^j for every
// j < k with v + 2^j < n (the root: every 2^j < n), the largest subtree first.
// ceil(log2 n) latencies against the chain's n-1, each moving the whole message, and at most
// ceil(log2 n) + 1 peers per rank: the latency path for small messages, chosen by select.cc.
#include <cstring>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void broadcast_binomial(Comm& c, const void* send, void* recv, size_t nbytes, int root) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  char* buf = static_cast<char*>(recv);
  if (r == root && send != recv && nbytes) std::memmove(buf, send, nbytes);
  if (n == 1 || nbytes == 0) return;
  const int v = mod(r - root, n);
  const int top = binomial_span(v, n);  // the children's distances are the powers of two below
  // step index: the parent's distance (one tag per tree level, unique in the collective)
  if (v) c.step(Comm::tag(seq, uint32_t(__builtin_ctz(unsigned(top)))), {{mod(binomial_parent(v) + root, n), false, buf, nbytes}});
  for (int d = top >> 1; d >= 1; d >>= 1)
    if (v + d < n) c.step(Comm::tag(seq, uint32_t(__builtin_ctz(unsigned(d)))), {{mod(v + d + root, n), true, buf, nbytes}});
}

}  // namespace api
}  // namespace hetccl
