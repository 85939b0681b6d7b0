// broadcast on device memory, pipelined chain from the root along the ring (host twin:
// coll_broadcast_chain.cc, the same segments and tags): at step t a rank forwards segment t-1 to
// the next rank and receives segment t from the previous one, each an engine device plan; the
// forward is posted first, so it forks from main after segment t-1 landed and overlaps the
// receive of segment t. Two ranks: one plan of the whole message.
#include <algorithm>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void broadcast_chain_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t nbytes, int root) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  char* buf = static_cast<char*>(recv);
  if (r == root && send != recv && nbytes) d.ops.memcpy_async(buf, send, nbytes, d.main);
  if (n == 1 || nbytes == 0) return;
  const int pos = mod(r - root, n);  // position in the chain
  size_t seg = chain_segment(nbytes, n, Comm::kMaxSteps);
  size_t k = (nbytes + seg - 1) / seg;
  auto part = [&](size_t i) { return std::make_pair(buf + i * seg, std::min(seg, nbytes - i * seg)); };
  for (size_t t = 0; t <= k; ++t) {
    size_t fwd = pos == 0 ? t : t - 1;  // the root sends segment t at step t
    if (pos < n - 1 && (pos == 0 ? t < k : t >= 1)) {
      auto p = part(fwd);
      c.post_device(Comm::tag(seq, uint32_t(fwd)), {{c.next(), true, p.first, p.second}}, d);
    }
    if (pos > 0 && t < k) {
      auto p = part(t);
      c.post_device(Comm::tag(seq, uint32_t(t)), {{c.prev(), false, p.first, p.second}}, d);
    }
  }
}

}  // namespace api
}  // namespace hetccl
