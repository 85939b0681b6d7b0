// all_to_all on device memory, pairwise exchange (host twin: coll_alltoall_pairwise.cc, the same
// steps and tags): this rank's own block is copied, then n-1 engine device plans; at step k rank
// r sends block r+k to rank r+k and receives block r-k from rank r-k straight into recvbuff. In
// place (send == recv): the send blocks are read from a stream-ordered scratch copy.
#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_to_all_pairwise_device(Comm& c, DeviceRoute& d, const void* send, void* recv, size_t blk) {
  const int n = c.size, r = c.rank;
  uint64_t seq = c.begin();
  if (blk == 0) return;
  char* out = static_cast<char*>(recv);
  const char* in = static_cast<const char*>(send);
  char* copy = nullptr;
  if (send == recv && n > 1) {
    copy = static_cast<char*>(d.ops.mem_alloc_async(blk * size_t(n), d.main));
    d.ops.memcpy_async(copy, in, blk * size_t(n), d.main);
    in = copy;
  }
  if (in + size_t(r) * blk != out + size_t(r) * blk) d.ops.memcpy_async(out + size_t(r) * blk, in + size_t(r) * blk, blk, d.main);
  for (int k = 1; k < n; ++k) {
    int to = mod(r + k, n), from = mod(r - k, n);
    c.post_device(Comm::tag(seq, uint32_t(k)),
                  {{to, true, const_cast<char*>(in) + size_t(to) * blk, blk}, {from, false, out + size_t(from) * blk, blk}}, d);
  }
  if (copy) d.ops.mem_free_async(copy, d.main);
}

}  // namespace api
}  // namespace hetccl
