// Device plans: registration with the device runtime and the stream protocol (engine.h,
// "Device plans"; csrc/device_ops.h, "Flag words and positions").
//
// Contract. The device runtime (set_device_ops) page-locks, once per link, the link's flag
// words (Flags, engine_internal.h), its ring's regions (zero-copy links) or its staging slots
// (staged message links), when the first device plan that uses the link is posted or
// prepare_device asks (ensure_device_state). Issuing a device plan enqueues on its streams
// (enqueue_device): waits on `freed` / `avail` and writes of `sent` / `consumed` / `ready` at
// the chunks' positions (as counters, Word::counter), the copies between device memory and the
// slots, and, for async-checked plans, a wait on the verdict word (ensure_verdict_word,
// publish_verdicts). Without stream memory operations the posting thread plays the stream
// (drive_device_sync). The proxy plays the host side of the words (engine_ring.cc,
// engine_link.cc); release_device_waits (engine_failure.cc) lets every wait pass on failure.
//
// Locks: set_device_ops and prepare_device take mu_; stream_join and enqueue_device take
// issue_mu_ (events are reused), without mu_; drive_device_sync runs without either and takes
// mu_ to look at the engine; ensure_device_state, device_part_locked, ensure_verdict_word and
// publish_verdicts expect mu_ held; prepare_direct and direct_memory take none.
#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

void Engine::set_device_ops(std::shared_ptr<DeviceOps> ops) {
  std::lock_guard<std::mutex> g(mu_);
  if (dev_ && dev_ != ops) throw CommError("hetccl engine: a second device runtime for one engine");
  dev_ = std::move(ops);
}

void Engine::prepare_device(int device_index, const std::vector<int>& peers) {
  std::lock_guard<std::mutex> g(mu_);
  if (!dev_) throw CommError("hetccl engine: prepare_device without a device runtime");
  dev_->set_device(device_index);
  for (int p : peers)
    if (links_.count(p)) ensure_device_state(*links_.at(p));
}

void Engine::stream_join(int device_index, uintptr_t waiter, uintptr_t waitee) {
  if (!dev_) throw CommError("hetccl engine: stream_join without a device runtime");
  std::lock_guard<std::mutex> g(issue_mu_);
  dev_->set_device(device_index);
  if (!join_event_) join_event_ = dev_->event_create();
  dev_->event_record(join_event_, reinterpret_cast<void*>(waitee));
  dev_->stream_wait_event(reinterpret_cast<void*>(waiter), join_event_);
}

// ----------------------------------------------------------------------------- device plans
void Engine::ensure_device_state(Link& l) {
  // Flag words (and message-link staging slots) registered with the device runtime once per
  // link, when the first device plan that uses the link is posted (or prepare_device asks): a
  // communicator of many peers pays only for the links its device plans use (the C API's
  // rings: two).
  if (!l.flags) {
    void* page = nullptr;
    if (posix_memalign(&page, 4096, 4096) != 0) throw CommError("hetccl engine: out of memory");
    std::memset(page, 0, 4096);
    l.flags = new (page) Flags();
    flag_pages_.push_back(page);
    if (!dev_->host_register(page, 4096))
      throw CommError("hetccl engine: could not page-lock the device flag words");
    registered_.push_back(page);
    l.flags_dev = dev_->device_address(page);
    l.freed_dev = l.flags_dev + offsetof(Flags, freed_here);
    l.avail_dev = l.flags_dev + offsetof(Flags, avail_here);
    if (void* w = dev_->wait_word_alloc()) {
      wait_words_.push_back(w);
      l.flags->freed = new (w) Word();
      l.freed_dev = dev_->wait_word_address(w);
    }
    if (void* w = dev_->wait_word_alloc()) {
      wait_words_.push_back(w);
      l.flags->avail = new (w) Word();
      l.avail_dev = dev_->wait_word_address(w);
    }
    // a ring that carried host plans before: its positions are already past 0
    l.flags->freed->start(l.zc ? l.t->zc_send_counts(l.peer).second : l.send_pos);
    l.flags->avail->start(l.recv_pos);
    l.flags->sent.start(l.send_pos);
    l.flags->consumed.start(l.recv_pos);
    l.flags->ready.start(l.recv_pos);
    l.freed_seen = l.flags->freed->pos();
  }
  if (l.zc) {
    if (!l.rings_registered) {
      for (auto& r : l.t->zc_regions())
        if (dev_->host_register(r.first, r.second)) registered_.push_back(r.first);
      l.rings_registered = true;
    }
  } else if (l.stage_out.empty() && !l.direct) {  // direct links stage nothing
    for (uint32_t i = 0; i < l.out_depth; ++i) {
      for (auto* v : {&l.stage_out, &l.stage_in}) {
        void* m = nullptr;
        if (posix_memalign(&m, 4096, l.slot_bytes) != 0)
          throw CommError("hetccl engine: out of memory for device staging slots");
        flag_pages_.push_back(m);
        if (dev_->host_register(m, l.slot_bytes)) registered_.push_back(m);
        v->push_back(static_cast<char*>(m));
      }
    }
  }
}

// The stream side of a device plan, copied out of the link queues under the lock (the chunks
// themselves may be finished and dropped by the proxy while the copies are being enqueued).
Engine::DevicePart Engine::device_part_locked(Plan& p) {
  DevicePart part;
  for (auto& kv : links_) {
    Link& l = *kv.second;
    DeviceLane lane;
    lane.link = &l;
    lane.direct = l.direct;
    for (auto& c : l.sq)
      if (c.plan.get() == &p) {
        void* slot = l.direct ? nullptr
                     : l.zc   ? l.t->zc_slot(l.peer, true, c.pos)
                              : l.stage_out[c.pos % l.out_depth];
        lane.sends.push_back({slot, const_cast<char*>(c.src), c.len, c.pos});
      }
    for (auto& c : l.rq)
      if (c.plan.get() == &p) {
        void* slot = l.direct ? nullptr
                     : l.zc   ? l.t->zc_slot(l.peer, false, c.pos)
                              : l.stage_in[c.pos % l.out_depth];
        lane.recvs.push_back({c.dst, slot, c.len, c.pos});
      }
    if (!lane.sends.empty() || !lane.recvs.empty()) part.push_back(std::move(lane));
  }
  return part;
}

// Memory type the direct path declares to the transport (the device runtime's).
std::string Engine::direct_memory() const { return dev_->memory_type(); }

// Direct links: the transport prepares every device range of the plan here, on the issuing
// thread, before the proxy can post any of them (Transport::prepare_device: UCX maps them, so
// that no driver call that takes the context's lock is left for the proxy's posts). A lane's
// chunks of one buffer are adjacent: each run of adjacent chunks is prepared as one range.
void Engine::prepare_direct(const DevicePart& part) {
  const std::string memory = direct_memory();
  for (auto& lane : part) {
    if (!lane.direct) continue;
    for (int dir = 0; dir < 2; ++dir) {
      const auto& v = dir == 0 ? lane.sends : lane.recvs;
      const char* lo = nullptr;
      const char* hi = nullptr;
      for (const DeviceCopy& c : v) {
        const char* b = static_cast<const char*>(dir == 0 ? c.src : c.dst);
        if (!c.len) continue;
        if (lo && b == hi) {
          hi = b + c.len;
          continue;
        }
        if (lo) lane.link->t->prepare_device(lo, size_t(hi - lo), memory);
        lo = b;
        hi = b + c.len;
      }
      if (lo) lane.link->t->prepare_device(lo, size_t(hi - lo), memory);
    }
  }
}

void Engine::enqueue_device(Plan& p, const DevicePart& part) {
  std::lock_guard<std::mutex> g(issue_mu_);
  const PlanSpec& s = p.spec;
  dev_->set_device(s.device_index);
  prepare_direct(part);
  void* S = reinterpret_cast<void*>(s.stream);
  void* Sd = reinterpret_cast<void*>(s.side_stream ? s.side_stream : s.stream);
  // Latency path: at most one chunk each way per peer -- nothing to overlap, so the sends go on
  // the main stream too and the fork/join of the side stream (four calls, two cross-stream
  // dependencies on the device) is skipped.
  bool single = true;
  for (auto& lane : part) single = single && lane.sends.size() <= 1 && lane.recvs.size() <= 1;
  if (single) Sd = S;
  if (events_.empty()) {
    events_.push_back(dev_->event_create());
    events_.push_back(dev_->event_create());
  }
  if (Sd != S) {
    dev_->event_record(events_[0], S);
    dev_->stream_wait_event(Sd, events_[0]);
  }
  // Sends (device -> outgoing slot) on the side stream, receives (incoming slot -> device) on
  // the main stream, so both copy directions run at once; round robin over links so every
  // peer's ring fills at once.
  // Positions become counters (Word::counter) against each word's current value.
  const uint64_t sent_off = offsetof(Flags, sent), cons_off = offsetof(Flags, consumed);
  const uint64_t ready_off = offsetof(Flags, ready);
  // Direct device path, first part: no copies and no waits -- the send side says "data of
  // position p is ready" (the proxy then hands device memory to the transport), the receive side
  // says "the stream reached position q" (the proxy may then let the transport write the
  // destination). Issued before anything that waits, so a peer never waits on a direct
  // signal stuck behind one of our staged waits. The words are monotone positions and all of
  // a lane's chunks become ready at the same point of the stream, so one write of the last
  // position covers them all.
  for (auto& lane : part) {
    if (!lane.direct) continue;
    if (!lane.sends.empty())
      dev_->write(Sd, lane.link->flags_dev + sent_off,
                  lane.link->flags->sent.counter(lane.sends.back().pos + 1));
    if (!lane.recvs.empty())
      dev_->write(S, lane.link->flags_dev + ready_off,
                  lane.link->flags->ready.counter(lane.recvs.back().pos + 1));
  }
  size_t most = 0;
  for (auto& lane : part)
    if (!lane.direct) most = std::max({most, lane.sends.size(), lane.recvs.size()});
  for (size_t k = 0; k < most; ++k) {
    for (auto& lane : part) {
      if (lane.direct || k >= lane.sends.size()) continue;
      const Link& l = *lane.link;
      const DeviceCopy& c = lane.sends[k];
      // the slot is free once the peer released the chunk depth positions earlier (for a link's
      // first depth chunks that position is before the start: the wait passes at once)
      dev_->wait_geq(Sd, l.freed_dev, l.flags->freed->counter(c.pos + 1 - l.out_depth));
      dev_->memcpy_async(c.dst, c.src, c.len, Sd);
      dev_->write(Sd, l.flags_dev + sent_off, l.flags->sent.counter(c.pos + 1));
    }
    for (auto& lane : part) {
      if (lane.direct || k >= lane.recvs.size()) continue;
      const Link& l = *lane.link;
      const DeviceCopy& c = lane.recvs[k];
      dev_->wait_geq(S, l.avail_dev, l.flags->avail->counter(c.pos + 1));
      dev_->memcpy_async(c.dst, c.src, c.len, S);
      dev_->write(S, l.flags_dev + cons_off, l.flags->consumed.counter(c.pos + 1));
    }
  }
  // Direct device path, second part: later work on the main stream waits until every receive
  // has landed and (below) every send has left, so the stream may then reuse or overwrite the
  // buffers -- the same guarantee the staged path's copies give.
  // (`avail` advances in position order: the proxy completes a link's receives in order.)
  for (auto& lane : part) {
    if (!lane.direct || lane.recvs.empty()) continue;
    const Link& l = *lane.link;
    dev_->wait_geq(S, l.avail_dev, l.flags->avail->counter(lane.recvs.back().pos + 1));
    dev_->write(S, l.flags_dev + cons_off, l.flags->consumed.counter(lane.recvs.back().pos + 1));
  }
  if (Sd != S) {
    dev_->event_record(events_[1], Sd);
    dev_->stream_wait_event(S, events_[1]);
  }
  for (auto& lane : part)
    if (lane.direct && !lane.sends.empty())
      dev_->wait_geq(S, lane.link->freed_dev,
                     lane.link->flags->freed->counter(lane.sends.back().pos + 1));
  if (p.verdict_pos)
    dev_->wait_geq(S, verdict_dev_, static_cast<Word*>(verdict_)->counter(p.verdict_pos));
}

// The verdict word (engine.h): one page-locked word, or the runtime's own wait word.
void Engine::ensure_verdict_word() {
  if (verdict_) return;
  if (void* w = dev_->wait_word_alloc()) {
    wait_words_.push_back(w);
    verdict_ = new (w) Word();
    verdict_dev_ = dev_->wait_word_address(w);
    return;
  }
  void* page = nullptr;
  if (posix_memalign(&page, 4096, 4096) != 0) throw CommError("hetccl engine: out of memory");
  std::memset(page, 0, 4096);
  flag_pages_.push_back(page);
  if (!dev_->host_register(page, 4096))
    throw CommError("hetccl engine: could not page-lock the device flag words");
  registered_.push_back(page);
  verdict_ = new (page) Word();
  verdict_dev_ = dev_->device_address(page);
}

// Publishes, in issue order, the verdicts of the async-checked device plans whose headers are
// compared (a mismatch breaks the engine first, which releases the word). Caller holds mu_.
void Engine::publish_verdicts() {
  while (!verdict_q_.empty() &&
         (verdict_q_.front()->headers_done || verdict_q_.front()->state != Plan::Pending)) {
    static_cast<Word*>(verdict_)->set(verdict_q_.front()->verdict_pos);
    verdict_q_.pop_front();
  }
}

// Fallback without stream memory operations: the posting thread plays the stream's part
// (copies, then host writes of the same words), blocking until the plan is done.
void Engine::drive_device_sync(Plan& p, const DevicePart& part) {
  const PlanSpec& s = p.spec;
  dev_->set_device(s.device_index);
  prepare_direct(part);
  void* S = reinterpret_cast<void*>(s.stream);
  dev_->sync(S);  // the stream has reached this plan
  std::vector<size_t> ns(part.size(), 0), nr(part.size(), 0);
  // Direct device path: the data is ready and every destination may be written (the stream
  // reached the plan): say so for every chunk at once; the receives below wait for `avail`.
  for (size_t i = 0; i < part.size(); ++i) {
    if (!part[i].direct) continue;
    Flags* f = part[i].link->flags;
    for (auto& c : part[i].sends) f->sent.set(c.pos + 1);
    for (auto& c : part[i].recvs) f->ready.set(c.pos + 1);
    ns[i] = part[i].sends.size();
  }
  int idle = 0;
  for (;;) {
    bool left = false, moved = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!broken_.empty()) throw_kind(broken_kind_, broken_);
    }
    for (size_t i = 0; i < part.size(); ++i) {
      const Link& l = *part[i].link;
      if (ns[i] < part[i].sends.size()) {
        left = true;
        const DeviceCopy& c = part[i].sends[ns[i]];
        if (geq(l.flags->freed->pos(), c.pos + 1 - l.out_depth)) {
          dev_->memcpy_async(c.dst, c.src, c.len, S);
          dev_->sync(S);
          l.flags->sent.set(c.pos + 1);
          ++ns[i];
          moved = true;
        }
      }
      if (nr[i] < part[i].recvs.size()) {
        left = true;
        const DeviceCopy& c = part[i].recvs[nr[i]];
        if (geq(l.flags->avail->pos(), c.pos + 1)) {
          if (!part[i].direct) {
            dev_->memcpy_async(c.dst, c.src, c.len, S);
            dev_->sync(S);
          }
          l.flags->consumed.set(c.pos + 1);
          ++nr[i];
          moved = true;
        }
      }
    }
    if (!left) break;
    if (moved) {
      idle = 0;
    } else if (++idle > 64) {
      sched_yield();
    }
  }
  // the proxy finishes the chunks as it sees the words; wait for that
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (p.state == Plan::Failed) throw_kind(p.error_kind, p.error);
      if (p.state == Plan::Done) break;
    }
    sched_yield();
  }
}

}  // namespace hetccl
