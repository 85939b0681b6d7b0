// Zero-copy ring links (transports with a zc ring: shm): the engine's side of the ring.
//
// Contract. send_zc acquires the peer's slots in position order and copies host chunks in (or,
// for device chunks, commits the slot once the stream's `sent` word passed the chunk), copies
// round trips' sums back out of released slots, and mirrors the ring's release count into the
// link's `freed` word. recv_zc takes incoming slots in order, refuses a chunk whose size or tag
// differs from the one due (fail_mismatch, engine_check.cc), copies or reduces host chunks out
// of the slot (a host receive waits for the sends of its plan that read its memory), and hands
// device chunks to the stream through `avail`; finish_consumed releases the slots of device
// receives the stream has copied out (`consumed`), in order -- for message links' staged device
// receives too (engine_link.cc).
//
// Locks: every function here expects mu_ held (the progress pass, engine_proxy.cc).
#include <cstring>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

bool Engine::send_zc(Link& l) {
  bool moved = false;
  // Round trips: a slot the peer released holds the finished sum of our chunk: copy it out
  // before the slot can be acquired again.
  if (!l.back.empty()) {
    uint32_t released = l.t->zc_send_counts(l.peer).second;
    while (!l.back.empty() && geq(released, l.back.front().pos + 1)) {
      SendChunk& c = l.back.front();
      std::memcpy(const_cast<char*>(c.src), c.slot, c.len);
      stats_["roundtrip_bytes"] += c.len;
      auto plan = c.plan;
      l.back.pop_front();
      finish_chunk(*plan);
      moved = true;
    }
  }
  if (l.flags) {
    uint32_t released = l.t->zc_send_counts(l.peer).second;
    if (released != l.freed_seen) {
      l.flags->freed->set(released);
      l.freed_seen = released;
    }
  }
  while (!l.sq.empty()) {
    SendChunk& c = l.sq.front();
    Plan& p = *c.plan;
    if (!p.gate) break;
    if (c.device) {
      if (!geq(l.flags->sent.pos(), c.pos + 1)) break;
    } else if (!l.back.empty() && geq(c.pos, l.back.front().pos + l.out_depth)) {
      break;  // that slot still holds a sum we have not copied out
    }
    auto slot = l.t->zc_send_try(l.peer);
    if (!slot.first) break;
    if (c.len > slot.second)
      throw CommError("hetccl engine: " + p.spec.what + ": chunk of " + std::to_string(c.len) +
                      " bytes exceeds the zero-copy slot (" + std::to_string(slot.second) + ")");
    if (!c.device && c.len) std::memcpy(slot.first, c.src, c.len);
    l.t->zc_send_commit(l.peer, c.len, c.tag);
    stats_[c.device ? "zc_device_bytes" : "zc_host_bytes"] += c.len;
    p.send_done[c.idx] = 1;
    if (p.spec.roundtrip) {
      c.slot = static_cast<char*>(slot.first);
      l.back.push_back(std::move(c));
      l.sq.pop_front();
    } else {
      auto plan = c.plan;
      l.sq.pop_front();
      finish_chunk(*plan);
    }
    moved = true;
  }
  return moved;
}

// Device receives the stream has copied out (`consumed`): their slots go back (zero-copy links
// release them to the peer), in order.
bool Engine::finish_consumed(Link& l) {
  bool moved = false;
  while (!l.held.empty() &&
         geq(l.flags->consumed.pos(), l.held.front().pos + 1)) {
    if (l.zc) l.t->zc_recv_release(l.peer);
    auto plan = l.held.front().plan;
    l.held.pop_front();
    finish_chunk(*plan);
    moved = true;
  }
  return moved;
}

bool Engine::recv_zc(Link& l) {
  bool moved = finish_consumed(l);
  while (!l.rq.empty()) {
    RecvChunk& c = l.rq.front();
    Plan& p = *c.plan;
    if (!p.gate) break;
    if (!c.device) {
      if (!l.held.empty()) break;  // releases go in acquisition order
      if (!sends_left(p.send_done, c.after) || !sends_left(p.recv_done, c.after_recv)) break;
    }
    auto m = l.t->zc_recv_try(l.peer);
    char* src = static_cast<char*>(std::get<0>(m));
    if (!src) break;
    if (std::get<1>(m) != c.len || std::get<2>(m) != c.tag) {
      l.t->zc_recv_release(l.peer);
      fail_mismatch(p, "hetccl: " + p.spec.what + ": peer rank " + std::to_string(l.peer) +
                           " sent a " + std::to_string(std::get<1>(m)) + "-byte chunk with tag " +
                           std::to_string(std::get<2>(m)) + " where a " + std::to_string(c.len) +
                           "-byte chunk with tag " + std::to_string(c.tag) +
                           " was due: the ranks disagree on the collective, its sizes or the "
                           "order of collectives");
    }
    if (c.device) {
      l.flags->avail->set(c.pos + 1);
      l.held.push_back(std::move(c));
      l.rq.pop_front();
      moved = true;
      continue;
    }
    if (p.spec.reduce) {
      const size_t es = dtype_size(p.spec.dtype);
      reduce_into(p.spec.op, p.spec.dtype, c.dst, src, c.len / es, opts_.threads);
      if (p.spec.roundtrip) std::memcpy(src, c.dst, c.len);  // the sum goes back to the peer
    } else if (c.len) {
      std::memcpy(c.dst, src, c.len);
    }
    l.t->zc_recv_release(l.peer);
    stats_["zc_host_bytes_in"] += c.len;
    auto plan = c.plan;
    if (c.ridx < plan->recv_done.size()) plan->recv_done[c.ridx] = 1;
    l.rq.pop_front();
    finish_chunk(*plan);
    moved = true;
  }
  return moved;
}

}  // namespace hetccl
