// all_gather, Bruck's algorithm (any n): rot[i] is rank (r + i) % n's block; at step k (d = 2^k)
// a rank sends its first min(d, n - d) blocks to rank r - d and receives as many from rank r + d
// behind them; then the blocks are rotated into place. ceil(log2 n) latencies against the
// ring's n-1, but a rank sends about n blocks in total over 2 ceil(log2 n) peers plus one copy
// for the rotation: the latency path for small outputs, chosen by select.cc.
#include <algorithm>
#include <cstring>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_gather_bruck(Comm& c, const void* send, void* recv, size_t sendcount, size_t es) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  const size_t blk = sendcount * es;
  char* out = static_cast<char*>(recv);
  if (blk == 0) return;
  if (n == 1) {
    if (send != out) std::memmove(out, send, blk);
    return;
  }
  std::vector<char> rot(blk * size_t(n));
  std::memcpy(rot.data(), send, blk);  // send may be recv's block r (in place): read it first
  uint32_t k = 0;
  for (int d = 1; d < n; d <<= 1, ++k) {
    size_t cnt = size_t(std::min(d, n - d));
    c.step(Comm::tag(seq, k), {{mod(r - d, n), true, rot.data(), cnt * blk},
                               {mod(r + d, n), false, rot.data() + size_t(d) * blk, cnt * blk}});
  }
  for (int i = 0; i < n; ++i) std::memcpy(out + size_t(mod(r + i, n)) * blk, rot.data() + size_t(i) * blk, blk);
}

}  // namespace api
}  // namespace hetccl
