// all_to_all, pairwise exchange: this rank's own block is copied, then n-1 steps; at step k
// rank r sends block r+k to rank r+k and receives block r-k from rank r-k. Each step pairs every
// rank with one sender and one receiver, so no link carries two steps at once; every byte
// crosses the network once (the minimum), n-1 latencies. In place (send == recv) works on a
// copy of the send blocks.
#include <cstring>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_to_all_pairwise(Comm& c, const void* send, void* recv, size_t blk) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  if (blk == 0) return;
  char* out = static_cast<char*>(recv);
  std::vector<char> copy;
  const char* in = static_cast<const char*>(send);
  if (send == recv && n > 1) {
    copy.assign(in, in + blk * size_t(n));
    in = copy.data();
  }
  if (in + size_t(r) * blk != out + size_t(r) * blk) std::memmove(out + size_t(r) * blk, in + size_t(r) * blk, blk);
  for (int k = 1; k < n; ++k) {
    int to = mod(r + k, n), from = mod(r - k, n);
    c.step(Comm::tag(seq, uint32_t(k)),
           {{to, true, const_cast<char*>(in) + size_t(to) * blk, blk}, {from, false, out + size_t(from) * blk, blk}});
  }
}

}  // namespace api
}  // namespace hetccl
