// The C API's algorithm selection: the one table of switch points (comm.h: Algo), with the
// environment override HETCCL_CAPI_ALGO (settings.cc).
//
//   collective   condition                                   algorithm
//   all_reduce   n a power of two, bytes <= rd_max_bytes      recursive doubling (log2 n steps)
//   all_reduce   otherwise                                   ring (2(n-1) steps)
//   check        n a power of two                            recursive-doubling all-gather
//   check        otherwise                                   ring all-gather
// rd_max_bytes (64 KiB): where the ring's bandwidth starts to matter more than its step count
// on the 2-core machine's shm and tcp (docs/benchmarks.md, "C API latency"); re-measure
// before moving it.
#include "comm.h"

namespace hetccl {
namespace api {

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

Algo select_all_reduce(const Comm& c, size_t bytes) {
  const std::string& force = c.settings.algo;
  if (force == "ring") return Algo::Ring;
  bool rd_ok = power_of_two(c.size);
  if (force == "rd") return rd_ok ? Algo::RecursiveDoubling : Algo::Ring;
  return rd_ok && bytes <= c.settings.rd_max_bytes ? Algo::RecursiveDoubling : Algo::Ring;
}

Algo select_check(const Comm& c) {
  if (c.settings.algo == "ring") return Algo::Ring;
  return power_of_two(c.size) ? Algo::RecursiveDoubling : Algo::Ring;
}

}  // namespace api
}  // namespace hetccl
