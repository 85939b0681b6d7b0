// Message links (every transport without a zc ring: tcp, ucx): chunks as tagged messages.
//
// Contract. Host data goes straight from and into the caller's memory (isend, irecv,
// irecv_reduce), device data through the link's pinned staging slots at the chunk's position
// modulo out_depth, or, on direct links, straight from and into device memory (isend_device,
// irecv_device; bind_direct binds the transport to the plan's device first). At most
// opts_.msg_window requests are in flight per direction; completions are taken in order. A
// staged device send is posted once the stream's `sent` word passed it and sets `freed` when it
// completed; a staged device receive is posted once its slot was `consumed` and sets `avail`
// when it arrived; a direct receive is posted once the stream is `ready` for it. A message of
// another size than the chunk due fails the engine (fail_mismatch, engine_check.cc).
//
// Locks: every function here expects mu_ held (the progress pass, engine_proxy.cc).
#include <algorithm>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

void Engine::bind_direct(Link& l, int device_index) {
  if (l.bound_device == device_index) return;
  // The device runtime says which memory type the transport declares to its library.
  auto dev = dev_;
  l.t->bind_device([dev, device_index] { dev->set_device(device_index); }, direct_memory());
  l.bound_device = device_index;
}

bool Engine::send_msg(Link& l) {
  bool moved = false;
  // completions, in order
  while (!l.sq.empty() && l.sq.front().issued && l.sq.front().req->test()) {
    SendChunk& c = l.sq.front();
    c.plan->send_done[c.idx] = 1;
    if (c.device) l.flags->freed->set(c.pos + 1);
    stats_[c.direct ? "msg_device_direct_bytes" : c.device ? "msg_device_bytes" : "msg_host_bytes"] += c.len;
    if (!c.device) {  // how host data was cut (message bound: Transport::message_limit)
      ++stats_["msg_host_chunks"];
      uint64_t& most = stats_["msg_host_chunk_max"];
      most = std::max<uint64_t>(most, c.len);
    }
    auto plan = c.plan;
    l.sq.pop_front();
    finish_chunk(*plan);
    moved = true;
  }
  size_t n = std::min<size_t>(l.sq.size(), size_t(opts_.msg_window));
  for (size_t i = 0; i < n; ++i) {
    SendChunk& c = l.sq[i];
    if (c.issued) continue;
    if (!c.plan->gate) break;
    const char* src = c.src;
    if (c.device) {
      if (!geq(l.flags->sent.pos(), c.pos + 1)) break;
      if (c.direct) {  // device memory straight to the transport
        bind_direct(l, c.plan->spec.device_index);
        c.req = l.t->isend_device(l.peer, src, c.len, c.tag);
        c.issued = true;
        moved = true;
        continue;
      }
      src = l.stage_out[c.pos % l.out_depth];
    }
    c.req = l.t->isend(l.peer, src, c.len, c.tag);
    c.issued = true;
    moved = true;
  }
  return moved;
}

bool Engine::recv_msg(Link& l) {
  bool moved = finish_consumed(l);
  auto arrived = [&](RecvChunk& c) {
    try {
      return c.req->test();
    } catch (const MessageTruncated& e) {  // the peer sent more than this chunk
      fail_mismatch(*c.plan, "hetccl: " + c.plan->spec.what + ": " + e.what() +
                                 ": the ranks disagree on the collective or its sizes");
    }
  };
  while (!l.rq.empty() && l.rq.front().issued && arrived(l.rq.front())) {
    RecvChunk& c = l.rq.front();
    size_t got = c.req->nbytes();
    if (got != c.len)
      fail_mismatch(*c.plan, "hetccl: " + c.plan->spec.what + ": peer rank " +
                                 std::to_string(l.peer) + " sent " + std::to_string(got) +
                                 " bytes where " + std::to_string(c.len) + " were due (tag " +
                                 std::to_string(c.tag) +
                                 "): the ranks disagree on the collective or its sizes");
    stats_[c.direct ? "msg_device_direct_bytes_in" : c.device ? "msg_device_bytes_in" : "msg_host_bytes_in"] += c.len;
    auto plan = c.plan;
    if (c.direct) {
      // landed in device memory: the stream may go on (it writes `consumed` itself)
      l.flags->avail->set(c.pos + 1);
      l.rq.pop_front();
      finish_chunk(*plan);
    } else if (c.device) {
      l.flags->avail->set(c.pos + 1);
      l.held.push_back(std::move(c));
      l.rq.pop_front();
    } else {
      if (c.ridx < plan->recv_done.size()) plan->recv_done[c.ridx] = 1;
      l.rq.pop_front();
      finish_chunk(*plan);
    }
    moved = true;
  }
  size_t n = std::min<size_t>(l.rq.size(), size_t(opts_.msg_window));
  for (size_t i = 0; i < n; ++i) {
    RecvChunk& c = l.rq[i];
    if (c.issued) continue;
    Plan& p = *c.plan;
    if (!p.gate) break;
    if (c.direct) {
      // the destination may be written once the stream has reached this position
      if (!geq(l.flags->ready.pos(), c.pos + 1)) break;
      bind_direct(l, p.spec.device_index);
      c.req = l.t->irecv_device(l.peer, c.dst, c.len, c.tag);
    } else if (c.device) {
      // staging slot pos % depth is free once the chunk depth positions earlier was consumed
      // (for a link's first depth chunks that position is before the start, which the
      // wrap-aware comparison finds reached; a sign test on the position, as here before, skipped
      // the check for half of the 32-bit positions: tests/test_device_protocol.py)
      if (!geq(l.flags->consumed.pos(), c.pos + 1 - l.out_depth)) break;
      c.req = l.t->irecv(l.peer, l.stage_in[c.pos % l.out_depth], c.len, c.tag);
    } else {
      if (!sends_left(p.send_done, c.after) || !sends_left(p.recv_done, c.after_recv)) break;
      c.req = p.spec.reduce ? l.t->irecv_reduce(l.peer, c.dst, c.len, c.tag, p.spec.op, p.spec.dtype)
                            : l.t->irecv(l.peer, c.dst, c.len, c.tag);
    }
    c.issued = true;
    moved = true;
  }
  return moved;
}

}  // namespace hetccl
