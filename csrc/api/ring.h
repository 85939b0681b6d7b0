// hetccl C API: block arithmetic shared by the ring algorithms (coll_*_ring.cc).
#pragma once

#include <algorithm>
#include <cstddef>

namespace hetccl {
namespace api {

// Block b of n over count elements: [lo, hi), sizes differing by at most one element.
inline size_t block_lo(size_t count, int n, int b) { return count / size_t(n) * size_t(b) + std::min(size_t(b), count % size_t(n)); }
inline size_t block_len(size_t count, int n, int b) { return count / size_t(n) + (size_t(b) < count % size_t(n) ? 1 : 0); }
inline int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace api
}  // namespace hetccl
