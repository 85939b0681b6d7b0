// The C API's algorithm selection: the one table of switch points (comm.h: Algo), with the
// environment override HETCCL_CAPI_ALGO (settings.cc).
//
//   collective   condition                                   algorithm
//   all_reduce   bytes <= rd_max_bytes                        recursive doubling (log2 p steps,
//                                                            +2 folding when n is not p = 2^m)
//   all_reduce   otherwise                                   ring (2(n-1) steps)
//   check        every call                                  summary all_reduce (recursive
//                                                            doubling), then on a mismatch:
//   check        n a power of two                            recursive-doubling all-gather
//   check        otherwise                                   Bruck's all-gather (ceil(log2 n))
//   broadcast    bytes <= rd_max_bytes                        binomial tree (ceil(log2 n) steps)
//   broadcast    otherwise                                   pipelined chain (segments + n - 2)
//   all_gather   output bytes <= rd_max_bytes                 Bruck's (ceil(log2 n) steps)
//   all_gather   otherwise                                   ring (n-1 steps)
//   reduce_scat. input bytes <= rd_max_bytes                  recursive-doubling all_reduce of
//                                                            the input, own block kept
//   reduce_scat. otherwise                                   ring (n-1 steps)
//   all_reduce   HETCCL_CAPI_ALGO=hier, two or more vendor    hierarchical (coll_allreduce_hier.cc:
//                groups (lcm of their sizes <= 256)          reduce-scatter in each group, the
//                                                            owners' rings across groups, all-gather)
// HETCCL_CAPI_ALGO=ring forces rings everywhere (the check: its ring all-gather alone; broadcast:
// the chain), =rd the latency algorithms at every size, =hier the hierarchical all_reduce at
// every size (the other collectives as auto). Peers per rank: the two ring neighbours, plus
// O(log n) partners of the latency algorithms (connected on first use), at any n; hier adds
// group neighbours and owners of shared blocks (coll_allreduce_hier.cc).
// rd_max_bytes (64 KiB): where the ring's bandwidth starts to matter more than its step count
// on the 2-core machine's shm and tcp (docs/benchmarks.md, "C API latency"); re-measure
// before moving it.
#include "comm.h"

namespace hetccl {
namespace api {

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

namespace {
// The latency algorithm up to rd_max_bytes, the bandwidth one above (ring / rd force one).
Algo by_size(const Comm& c, size_t bytes, Algo bandwidth, Algo latency) {
  const std::string& force = c.settings.algo;
  if (force == "ring") return bandwidth;
  if (force == "rd") return latency;  // the latency algorithms everywhere
  return bytes <= c.settings.rd_max_bytes ? latency : bandwidth;
}
}  // namespace

Algo select_all_reduce(const Comm& c, size_t bytes) {
  // hier: two or more vendor groups whose sizes' lcm is at most kHierMaxBlocks (else the ring)
  if (c.settings.algo == "hier")
    return c.vgroups.size() >= 2 && c.vgroup_lcm > 0 ? Algo::Hierarchical : Algo::Ring;
  return by_size(c, bytes, Algo::Ring, Algo::RecursiveDoubling);
}
Algo select_broadcast(const Comm& c, size_t bytes) { return by_size(c, bytes, Algo::Chain, Algo::Binomial); }
Algo select_all_gather(const Comm& c, size_t out_bytes) { return by_size(c, out_bytes, Algo::Ring, Algo::Bruck); }
Algo select_reduce_scatter(const Comm& c, size_t in_bytes) {
  return by_size(c, in_bytes, Algo::Ring, Algo::RecursiveDoubling);
}

Algo select_check(const Comm& c) {
  if (c.settings.algo == "ring") return Algo::Ring;
  return power_of_two(c.size) ? Algo::RecursiveDoubling : Algo::Bruck;
}

}  // namespace api
}  // namespace hetccl
