// hetccl host progress engine: collective kernels that run on the calling thread over the
// Transport interface (zero-copy ring API only; no transport file is included here).
//
// Why on the calling thread: on a host whose cores are shared by the ranks, every extra thread
// that touches the data (a transport's send thread copying while its receive thread reduces)
// competes with the peer rank for the same cores and caches. One loop per rank that alternates
// "fill the next outgoing slot" and "consume the next incoming slot" keeps one thread per rank
// busy and hands chunks over while they are still in cache.
#pragma once
#include <cstddef>
#include <cstdint>

#include "reduce.h"
#include "transport.h"

namespace hetccl {

// Two-rank all-reduce of one range between this rank and `peer`, in place, with the reduction
// done in the shared slots (a round trip through each rank's outgoing ring):
//   * the range is split in `give` (reduced by the peer) and `keep` (reduced here);
//   * this rank copies its give chunks into its outgoing slots;
//   * it reduces each incoming slot (the peer's give = our keep) in place: keep = op(keep, slot)
//     and the result is written back into the slot, which is then released;
//   * a released outgoing slot therefore holds the finished sum of one give chunk: it is copied
//     back over give before the slot is reused.
// Three passes over memory per byte (copy in, reduce, copy out) instead of four for a ring over
// one-way slots, and one thread per rank. Contract: the peer calls this with give/keep sizes
// mirrored (its give is our keep), the same chunk_bytes and the same tag; every slot carries
// `tag` and its exact length, and a message that does not match raises CommError naming the peer
// (a peer in another collective, or with different sizes, is an error, never a wrong result).
// Both ranks end with bit-identical values (each chunk is reduced once, on one rank). AVG
// reduces as SUM (callers divide). timeout_ms < 0: no limit; else CommTimeout saying how far it
// got. A dead peer raises PeerFailure. Requires t.zc_supported(); give/keep must not overlap.
void pair_allreduce(Transport& t, int peer, void* give, size_t give_bytes, void* keep,
                    size_t keep_bytes, ReduceOp op, DType dtype, size_t chunk_bytes, uint64_t tag,
                    int64_t timeout_ms);

}  // namespace hetccl
