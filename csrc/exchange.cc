// See exchange.h for the contracts.
#include "exchange.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace hetccl {
namespace {

size_t nchunks(size_t bytes, size_t chunk) { return (bytes + chunk - 1) / chunk; }

size_t chunk_len(size_t bytes, size_t chunk, size_t k) { return std::min(chunk, bytes - k * chunk); }

}  // namespace

void pair_allreduce(Transport& t, int peer, void* give_p, size_t give_bytes, void* keep_p,
                    size_t keep_bytes, ReduceOp op, DType dtype, size_t chunk_bytes, uint64_t tag,
                    int64_t timeout_ms) {
  const size_t es = dtype_size(dtype);
  if (give_bytes % es || keep_bytes % es)
    throw CommError("hetccl pair_allreduce: sizes are not whole " + std::string(dtype_name(dtype)) +
                    " elements");
  char* give = static_cast<char*>(give_p);
  char* keep = static_cast<char*>(keep_p);
  const size_t chunk = std::max(es, chunk_bytes / es * es);  // whole elements
  const size_t ng = nchunks(give_bytes, chunk), nk = nchunks(keep_bytes, chunk);
  const uint32_t depth = t.zc_depth(peer);
  // Our outgoing slots counted from here: slots acquired before this call (another operation's)
  // are not ours to read back, and the peer may still release some of them during the call.
  const uint32_t base = t.zc_send_counts(peer).first;
  std::vector<char*> slot_of(ng);
  size_t sent = 0, back = 0, in = 0;  // give chunks sent / copied back; keep chunks reduced
  Deadline deadline(timeout_ms);
  const std::string who = "hetccl pair_allreduce with peer rank " + std::to_string(peer);
  auto where = [&] {
    return " (sent " + std::to_string(sent) + "/" + std::to_string(ng) + " chunks, got back " +
           std::to_string(back) + ", reduced " + std::to_string(in) + "/" + std::to_string(nk) + ")";
  };
  int idle = 0;
  while (back < ng || in < nk) {
    bool moved = false;
    // 1. Finished give chunks: slots the peer has released hold their sums. Copy them out before
    //    anything can reuse the slot (only this loop acquires slots of this ring meanwhile).
    if (back < sent) {
      int64_t released = int32_t(t.zc_send_counts(peer).second - base);
      while (int64_t(back) < std::min<int64_t>(released, int64_t(sent))) {
        std::memcpy(give + back * chunk, slot_of[back], chunk_len(give_bytes, chunk, back));
        ++back;
        moved = true;
      }
    }
    // 2. Next give chunk into a free slot whose previous round trip (if ours) has been copied out.
    if (sent < ng && sent - back < depth) {
      auto slot = t.zc_send_try(peer);
      if (slot.first) {
        const size_t len = chunk_len(give_bytes, chunk, sent);
        if (len > slot.second)
          throw CommError(who + ": chunk of " + std::to_string(len) + " bytes exceeds the slot "
                          "capacity " + std::to_string(slot.second));
        std::memcpy(slot.first, give + sent * chunk, len);
        t.zc_send_commit(peer, len, tag);
        slot_of[sent++] = static_cast<char*>(slot.first);
        moved = true;
      }
    }
    // 3. The peer's next give chunk (= our keep chunk `in`): reduce, write the sum back, release.
    if (in < nk) {
      auto m = t.zc_recv_try(peer);
      if (char* src = static_cast<char*>(std::get<0>(m))) {
        const size_t len = chunk_len(keep_bytes, chunk, in);
        if (std::get<2>(m) != tag || std::get<1>(m) != len) {
          t.zc_recv_release(peer);
          throw CommError(who + ": got a " + std::to_string(std::get<1>(m)) + "-byte chunk with "
                          "tag " + std::to_string(std::get<2>(m)) + " where a " +
                          std::to_string(len) + "-byte chunk with tag " + std::to_string(tag) +
                          " was due" + where() + "; the ranks disagree on the collective, its "
                          "sizes or the chunk size");
        }
        char* dst = keep + in * chunk;
        reduce_into(op, dtype, dst, src, len / es, 1);
        std::memcpy(src, dst, len);  // dst is in cache: the sum goes back to the peer
        t.zc_recv_release(peer);
        ++in;
        moved = true;
      }
    }
    if (moved) {
      idle = 0;
      continue;
    }
    // Nothing to do: spin briefly (the peer is usually mid-copy), then yield the core, then sleep
    // (oversubscribed hosts: the peer may need this very core to make progress).
    if (++idle < 256) {
      cpu_relax();
    } else if (idle < 512) {
      sched_yield();
    } else {
      if (deadline.expired())
        throw CommTimeout(who + ": timed out after " + std::to_string(timeout_ms) + " ms" + where());
      t.zc_wait(peer, std::min<int64_t>(deadline.left_ms(), 100));
    }
  }
}

}  // namespace hetccl
