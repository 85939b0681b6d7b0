// broadcast, pipelined chain along the ring from the root: the data is cut into segments; at
// step t a rank receives segment t from the previous rank and forwards segment t-1 to the next
// (the last rank of the chain only receives). Time ~ (segments + n - 2) segment transfers:
// bandwidth-optimal for large messages, n-1 latencies for small ones (one segment). The
// receive and the forward of one step are separate plans (their tags are the segments').
#include <algorithm>
#include <cstring>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void broadcast_chain(Comm& c, const void* send, void* recv, size_t nbytes, int root) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  char* buf = static_cast<char*>(recv);
  if (r == root && send != recv && nbytes) std::memmove(buf, send, nbytes);
  if (n == 1 || nbytes == 0) return;
  const int d = mod(r - root, n);  // position in the chain
  size_t seg = chain_segment(nbytes, n, Comm::kMaxSteps);
  size_t k = (nbytes + seg - 1) / seg;
  auto part = [&](size_t i) { return std::make_pair(buf + i * seg, std::min(seg, nbytes - i * seg)); };
  for (size_t t = 0; t <= k; ++t) {
    uint64_t a = 0, b = 0;
    if (d > 0 && t < k) {
      auto p = part(t);
      a = c.post(Comm::tag(seq, uint32_t(t)), {{c.prev(), false, p.first, p.second}});
    }
    size_t fwd = d == 0 ? t : t - 1;  // the root sends segment t at step t
    if (d < n - 1 && (d == 0 ? t < k : t >= 1)) {
      auto p = part(fwd);
      b = c.post(Comm::tag(seq, uint32_t(fwd)), {{c.next(), true, p.first, p.second}});
    }
    c.wait(a);
    c.wait(b);
  }
}

}  // namespace api
}  // namespace hetccl
