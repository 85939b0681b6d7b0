// Plans: posting, chunk cutting and ring order, completion (engine.h has the contracts).
//
// Contract. post() checks a plan's items, posts its check headers (engine_check.cc) and, with
// wait_check, decides the check before anything moves; then, under mu_, start_locked() cuts each
// item into chunks per (peer, direction) in the order the items are listed, assigns ring
// positions in post order (zero-copy links and device data) and tags tag_base | k, so both ends
// of a link cut alike, and records which send chunks a host receive must wait for
// (reduce-after-send ordering). Device plans are then enqueued on their streams, or driven by
// the posting thread without stream memory operations (engine_device.cc). mark_done and
// finish_chunk complete a plan; bury keeps a dropped plan's header buffers alive while its
// requests may still be posted in a transport.
//
// Locks: post() takes mu_ itself and enqueues device work without it (enqueue_device takes
// issue_mu_). start_locked, bury, mark_done and finish_chunk expect mu_ held.
#include <algorithm>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

// ----------------------------------------------------------------------------- posting
uint64_t Engine::post(const PlanSpec& spec, bool wait_check) {
  auto p = std::make_shared<Plan>();
  p->spec = spec;
  p->deadline_ms = spec.timeout_ms < 0 ? -1 : now_ms() + spec.timeout_ms;
  for (auto& it : spec.items)
    if (!links_.count(it.peer))
      throw CommError("hetccl engine: rank " + std::to_string(it.peer) +
                      " is not a cross-vendor peer of rank " + std::to_string(opts_.rank));
  if (spec.device && !dev_) throw CommError("hetccl engine: device plan without a device runtime");
  if (spec.device) {
    // Direct device path: a receive lands whenever the transport delivers it, so it must not
    // overlap memory a send of the same plan reads. Device plans receive into buffers of their
    // own (the staged path does not order such copies either); refuse before anything moves.
    for (auto& r : spec.items) {
      if (r.send || !r.nbytes || !links_.at(r.peer)->direct) continue;
      for (auto& w : spec.items)
        if (w.send && w.nbytes && w.ptr < r.ptr + r.nbytes && r.ptr < w.ptr + w.nbytes)
          throw CommError("hetccl engine: " + spec.what + ": a device plan over the direct path "
                          "to rank " + std::to_string(r.peer) + " receives into memory it also "
                          "sends; device plans must receive into separate buffers");
    }
  }
  if (spec.message) return post_message(p);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw CommError("hetccl engine: closed");
    if (!broken_.empty()) throw_kind(broken_kind_, broken_);
    p->id = next_id_++;
  }
  if (spec.check) post_headers(*p, wait_check);
  if (spec.check && wait_check) {
    // The posting thread waits for every header (they travel on the transports' tagged paths,
    // which progress on their own) and decides before anything else moves.
    try {
      for (auto& in : p->hdr_in) {
        try {
          in.req->wait(to_ms_left(p->deadline_ms));
        } catch (const CommTimeout&) {
          throw CommTimeout("hetccl: Timed out after " + std::to_string(spec.timeout_ms) +
                            " ms in " + spec.what + " waiting for the argument header of peer rank " +
                            std::to_string(in.peer) + " (it has not called this collective)");
        }
      }
      for (auto& r : p->hdr_out) r->wait(to_ms_left(p->deadline_ms));
    } catch (const CommTimeout& e) {
      std::lock_guard<std::mutex> g(mu_);
      bury(p);
      break_engine(e.what(), kTimeout);
      throw;
    } catch (const PeerFailure& e) {
      std::lock_guard<std::mutex> g(mu_);
      bury(p);
      break_engine(e.what(), kPeer);
      throw;
    } catch (const CommError& e) {
      std::lock_guard<std::mutex> g(mu_);
      bury(p);
      break_engine(e.what(), kGeneric);
      throw;
    }
    p->headers_done = true;
    std::string bad = compare_headers(*p);
    {
      std::lock_guard<std::mutex> g(mu_);
      ++stats_["checks_blocking"];
    }
    if (!bad.empty()) {
      // Every rank that waited raises this text at the call. Contract (hetccl/checks.py): the
      // group stays usable only when every rank held its data back; a peer that did not
      // (HETCCL_CHECK_ARGS=async on its device tensors) has issued data that no receive will
      // ever take, and breaks its own engine when it sees our header. So we break too, with
      // the same text, and every rank's next call fails alike instead of timing out.
      if (a_peer_did_not_wait(*p)) {
        std::lock_guard<std::mutex> g(mu_);
        bury(p);
        break_engine(bad + " (a peer had already issued its data; the group is unusable from "
                           "here on)",
                     kArg);
      }
      throw ArgMismatch(bad);
    }
    p->gate = true;
  } else if (spec.check) {
    std::lock_guard<std::mutex> g(mu_);
    ++stats_["checks_async"];
  }
  DevicePart part;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!broken_.empty()) {
      // Broken since the headers were posted (the progress loop compared an earlier plan's):
      // this plan never enters plans_, so its header receives must be withdrawn or kept alive
      // here. Dropping it with them posted let a peer's header land in freed memory (UCX;
      // tests/test_engine.py earlier_plan_mismatch, found with AddressSanitizer).
      bury(p);
      throw_kind(broken_kind_, broken_);
    }
    if (spec.device) {
      dev_->set_device(spec.device_index);
      for (auto& it : spec.items) ensure_device_state(*links_.at(it.peer));
    }
    plans_[p->id] = p;
    start_locked(p);
    if (spec.device && !p->headers_done) {  // async check: the stream waits for the verdict
      ensure_verdict_word();
      p->verdict_pos = ++verdict_issued_;
      verdict_q_.push_back(p);
    }
    if (spec.device) part = device_part_locked(*p);
  }
  if (spec.device) {
    try {
      if (dev_->stream_mem_ops(spec.device_index))
        enqueue_device(*p, part);
      else
        drive_device_sync(*p, part);
      std::lock_guard<std::mutex> g(mu_);
      ++stats_["device_enqueues"];
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g(mu_);
      break_engine(std::string("hetccl: ") + spec.what + ": device copies failed: " + e.what(),
                   kGeneric);
      throw;
    }
    cv_.notify_all();
  }
  return p->id;
}

void Engine::start_locked(std::shared_ptr<Plan> pp) {
  Plan& p = *pp;
  const PlanSpec& s = p.spec;
  // A plan whose headers are still outstanding (async check) starts all the same: the progress
  // loop compares them as they arrive.
  // Cut each item into chunks, per peer in listed order (both ends do the same).
  std::map<int, uint32_t> send_k, recv_k;
  const uint64_t idx_mask = (uint64_t(1) << s.index_bits) - 1;
  struct SendRef {
    uintptr_t lo, hi;
    uint32_t idx;
  };
  std::vector<SendRef> sends;
  std::vector<RecvChunk*> host_recvs;  // this plan's receive chunks of host data (deque
                                       // elements keep their address as more are appended)
  uint32_t nsend = 0, nrecv = 0;
  // Chunk size per (peer, direction), from the bytes that direction carries in this plan: both
  // ends of a link see the same bytes, so they cut alike (hetccl/tuning.py).
  std::map<std::pair<int, bool>, size_t> total;
  for (auto& it : s.items) total[{it.peer, it.send}] += it.nbytes;
  auto chunk_of = [&](const Link& l, bool send) {
    const size_t n = total[{l.peer, send}];
    size_t chunk = s.chunk_bytes;
    if (!chunk) chunk = size_t(opts_.force_chunk);
    if (!chunk) {
      const auto& table = s.device ? opts_.device_chunks : l.zc ? opts_.host_chunks : opts_.msg_chunks;
      chunk = table.empty() ? (1 << 20) : size_t(table.back().second);
      for (auto& row : table)
        if (n <= row.first) {
          chunk = size_t(row.second);
          break;
        }
    }
    // Chunks never exceed a slot (zero-copy rings; staging slots of device data). Slot sizes are
    // equal on every rank (checked when the bridge starts), so both ends cut alike.
    if (l.zc || s.device) chunk = std::min(chunk, l.slot_bytes);
    // Host data on a message link: no chunk above the transport's message bound, equal on both
    // ends (Transport::message_limit, whole pages; UCX over tcp: its largest zero-copy
    // message), cut into equal page-rounded parts rather than bound-sized ones and a sliver.
    // Device data keeps its staging slots' chunks: capping those too was slower on one H100 at
    // 16-64 MiB (docs/transports.md, docs/benchmarks.md session 24).
    else if (l.msg_limit && chunk > l.msg_limit && !s.chunk_bytes && !opts_.force_chunk) {
      const size_t parts = (n + l.msg_limit - 1) / l.msg_limit;
      chunk = parts > 1 ? ((n + parts - 1) / parts + 4095) / 4096 * 4096 : l.msg_limit;
      chunk = std::min(chunk, l.msg_limit);
    }
    return std::max<size_t>(chunk, 1);
  };
  for (auto& it : s.items) {
    Link& l = *links_[it.peer];
    const size_t chunk = chunk_of(l, it.send);
    for (size_t off = 0; off < it.nbytes; off += chunk) {
      size_t len = std::min(chunk, it.nbytes - off);
      if (it.send) {
        uint32_t k = send_k[it.peer]++;
        SendChunk c;
        c.plan = pp;
        c.src = reinterpret_cast<const char*>(it.ptr + off);
        c.len = len;
        c.tag = s.tag_base | (k & idx_mask);
        c.pos = (l.zc || s.device) ? l.send_pos++ : 0;
        c.idx = nsend++;
        c.device = s.device;
        c.direct = s.device && l.direct;
        sends.push_back({it.ptr + off, it.ptr + off + len, c.idx});
        l.sq.push_back(std::move(c));
      } else {
        uint32_t k = recv_k[it.peer]++;
        RecvChunk c;
        c.plan = pp;
        c.dst = reinterpret_cast<char*>(it.ptr + off);
        c.len = len;
        c.tag = s.tag_base | (k & idx_mask);
        c.pos = (l.zc || s.device) ? l.recv_pos++ : 0;
        c.device = s.device;
        c.direct = s.device && l.direct;
        c.ridx = nrecv++;
        l.rq.push_back(std::move(c));
        if (!s.device) host_recvs.push_back(&l.rq.back());
      }
      ++p.pending;
    }
  }
  p.send_done.assign(nsend, 0);
  if (!s.device && !sends.empty()) {
    // A receive may overwrite (or reduce into) memory a send of this plan still reads: it
    // waits for those sends (transfer()'s contract, docs/algorithms.md).
    std::sort(sends.begin(), sends.end(), [](const SendRef& a, const SendRef& b) { return a.lo < b.lo; });
    uintptr_t maxlen = 0;
    for (auto& sr : sends) maxlen = std::max<uintptr_t>(maxlen, sr.hi - sr.lo);
    for (RecvChunk* rc : host_recvs) {
      uintptr_t lo = reinterpret_cast<uintptr_t>(rc->dst), hi = lo + rc->len;
      // first send starting at or after lo - maxlen can overlap
      auto first = std::lower_bound(sends.begin(), sends.end(), lo > maxlen ? lo - maxlen : 0,
                                    [](const SendRef& a, uintptr_t v) { return a.lo < v; });
      for (auto s2 = first; s2 != sends.end() && s2->lo < hi; ++s2)
        if (s2->hi > lo) rc->after.push_back(s2->idx);
    }
  }
  p.recv_done.assign(nrecv, 0);
  if (s.reduce && host_recvs.size() > 1) {
    // Two reducing receives into overlapping memory never run at once: the message transports
    // reduce on their own threads (tcp's progress threads, UCX's), the engine reduces zero-copy
    // chunks on its own, so two peers' contributions to one element would race (a lost update:
    // a silent wrong sum, seen in 1+1+1 reduce_scatter between hosts). Each receive waits for
    // the earlier receive chunks of the plan (lower ridx, i.e. earlier in item order) whose
    // memory it overlaps. The waits point to lower indices only, and a link's chunks are in
    // increasing order, so they cannot form a cycle; a message that arrives meanwhile waits in
    // its transport (unexpected messages are buffered; a ring slot stays committed).
    struct RecvRef {
      uintptr_t lo, hi;
      RecvChunk* c;
    };
    std::vector<RecvRef> refs;
    for (RecvChunk* rc : host_recvs)
      if (rc->len) {
        uintptr_t lo = reinterpret_cast<uintptr_t>(rc->dst);
        refs.push_back({lo, lo + rc->len, rc});
      }
    std::sort(refs.begin(), refs.end(), [](const RecvRef& a, const RecvRef& b) { return a.lo < b.lo; });
    std::vector<const RecvRef*> open;  // intervals that may still overlap the next ones
    for (auto& r : refs) {
      open.erase(std::remove_if(open.begin(), open.end(), [&](const RecvRef* o) { return o->hi <= r.lo; }),
                 open.end());
      for (const RecvRef* o : open) {  // o->lo <= r.lo < o->hi: they overlap
        if (o->c->ridx < r.c->ridx) r.c->after_recv.push_back(o->c->ridx);
        else o->c->after_recv.push_back(r.c->ridx);
      }
      open.push_back(&r);
    }
  }
  p.started = true;
  ++stats_[s.device ? "plans_device" : "plans_host"];
  if (s.device) device_active_.fetch_add(1);  // mark_done / fail_plan take it back
  if (p.pending == 0 && p.headers_done) mark_done(p);
}

// ----------------------------------------------------------------------------- completion
// A plan leaving plans_ whose header requests may still be posted in a transport (it failed
// before they completed): its header receives are withdrawn (Transport::cancel); what cannot be
// withdrawn (a send, a receive whose data is arriving) keeps the plan's buffers alive until
// close().
void Engine::bury(const std::shared_ptr<Plan>& p) {
  bool pending = false;
  for (auto& in : p->hdr_in) {
    if (in.req->test_nothrow()) continue;
    auto it = links_.find(in.peer);
    if (it != links_.end() && it->second->t->cancel(in.req)) {
      stats_["cancelled_receives"] += 1;
      continue;
    }
    pending = true;
  }
  for (auto& r : p->hdr_out) pending = pending || !r->test_nothrow();
  if (pending) graveyard_.push_back(p);
}

void Engine::mark_done(Plan& p) {
  if (p.state != Plan::Pending) return;
  p.state = Plan::Done;
  if (p.spec.device) device_active_.fetch_sub(1);
}

void Engine::finish_chunk(Plan& p) {
  if (--p.pending == 0 && p.headers_done) mark_done(p);
}

}  // namespace hetccl
