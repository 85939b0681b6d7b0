// hetccl C API: block and tree arithmetic shared by the algorithms (coll_*.cc, bootstrap.cc).
#pragma once

#include <algorithm>
#include <cstddef>

namespace hetccl {
namespace api {

// Block b of n over count elements: [lo, hi), sizes differing by at most one element.
inline size_t block_lo(size_t count, int n, int b) { return count / size_t(n) * size_t(b) + std::min(size_t(b), count % size_t(n)); }
inline size_t block_len(size_t count, int n, int b) { return count / size_t(n) + (size_t(b) < count % size_t(n) ? 1 : 0); }
inline int mod(int a, int n) { return ((a % n) + n) % n; }

// Binomial tree over positions 0..n-1 rooted at 0 (broadcast_binomial, the bootstrap's table):
// position v > 0 receives from binomial_parent(v) = v - lowbit(v); its children are v + d for
// the powers of two d < binomial_span(v, n) with v + d < n (the root's span: the least power of
// two >= n).
inline int binomial_parent(int v) { return v - (v & -v); }
inline int binomial_span(int v, int n) {
  if (v) return v & -v;
  int top = 1;
  while (top < n) top <<= 1;
  return top;
}

}  // namespace api
}  // namespace hetccl
