// hetccl C API: block and tree arithmetic shared by the algorithms (coll_*.cc, bootstrap.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

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

// The pipelined chain's segment (broadcast_chain, host and device route): the whole message
// for two ranks (one plan: the engine pipelines its chunks itself), else 512 KiB or more, so
// that the segments' tags fit a call's Comm::kMaxSteps steps.
inline size_t chain_segment(size_t nbytes, int n, size_t max_steps) {
  return n == 2 ? nbytes : std::max<size_t>(size_t(512) << 10, (nbytes + max_steps - 2) / (max_steps - 1));
}

// Recursive doubling among the largest power of two p <= n ranks, with MPICH's fold for the
// rem = n - p others (coll_allreduce_rd.cc describes the steps): calls
// xchg(step, peer, send, recv) for this rank's exchanges in order -- send: this rank sends its
// buffer; recv: it receives the peer's and combines it into its own, except at the fold out,
// where an even rank of the first 2*rem receives the result as it is (combine = false).
// Shared by the all_reduce (engine plans) and the argument check's summary (tagged messages).
template <class F>
void recursive_doubling(int n, int r, F&& xchg) {
  if (n == 1) return;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;
  const uint32_t out_step = 1 + uint32_t(__builtin_ctz(unsigned(p)));
  int v;  // virtual rank among the p doubling ranks, -1: sits out
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      xchg(0u, r + 1, true, false, true);
      v = -1;
    } else {
      xchg(0u, r - 1, false, true, true);
      v = r / 2;
    }
  } else {
    v = r - rem;
  }
  if (v >= 0) {
    uint32_t s = 1;
    for (int d = 1; d < p; d <<= 1, ++s) {
      int pv = v ^ d;
      xchg(s, pv < rem ? 2 * pv + 1 : pv + rem, true, true, true);
    }
  }
  if (r < 2 * rem) {
    if (r % 2) xchg(out_step, r - 1, true, false, true);
    else xchg(out_step, r + 1, false, true, false);
  }
}

}  // namespace api
}  // namespace hetccl
