// See engine.h for the contracts. This file: plans and their chunks, the two kinds of links
// (zero-copy ring, messages), the check-header exchange, device enqueueing, the proxy thread.
#include "engine.h"

#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "common.h"
#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;
namespace {

// One cache line per word: the GPU writes three of them, the proxy the other two. The two words
// streams wait on (freed, avail) live here unless the runtime requires its own memory for them
// (DeviceOps::wait_word_alloc: HIP's signal memory); `freed` / `avail` point at them.
struct Flags {
  alignas(64) Word sent;  // stream: data of position p is in the outgoing slot  -> p + 1
                          //   (direct links: the device data of position p is ready to send)
  alignas(64) Word freed_here;  // proxy: the peer released our outgoing slots up to -> count
                                //   (message links: the send of position p completed -> p + 1)
  alignas(64) Word avail_here;  // proxy: incoming slot of position p is ready         -> p + 1
                                //   (direct links: the data of position p has landed in device
                                //   memory)
  alignas(64) Word consumed;  // stream: incoming slot of position p has been copied -> p + 1
                              //   (direct links: the stream is past position p)
  alignas(64) Word ready;  // stream, direct links only: the stream reached receive position p, so
                           //   its destination may be written                   -> p + 1
  Word* freed = &freed_here;
  Word* avail = &avail_here;
};
static_assert(sizeof(Flags) <= 4096, "flags fit one page");

constexpr uint32_t kHdrMagic = 0x48434B31;  // "1KCH"
struct WireHeader {
  uint32_t magic;
  uint32_t status;     // 0: ok; 1: the sender knows the call is wrong (text follows)
  uint32_t for_group;  // 1: the sender's whole vendor group has this header (checked natively)
  uint32_t text_len;
  uint32_t waits;      // 1: the sender holds its data until every header is known (wait_check)
  uint32_t reserved;
  int64_t f[CheckHeader::kFields];
};
constexpr size_t kMaxText = 4096;
constexpr size_t kHdrCap = sizeof(WireHeader) + kMaxText;
// fail_mismatch: how long a chunk that does not fit waits for the headers that name why
constexpr int64_t kMismatchHeaderWaitMs = 2000;

const char* const kFieldWhat[CheckHeader::kFields] = {
    "collective", "number of elements", "dtype", "reduction op", "root", "device type"};


}  // namespace

// ----------------------------------------------------------------------------- data structures
struct Engine::SendChunk {
  std::shared_ptr<Plan> plan;
  const char* src;
  size_t len;
  uint64_t tag;
  uint32_t pos;  // ring position (zero-copy links; device staging on message links)
  uint32_t idx;  // index among the plan's send chunks (reduce-after-send ordering)
  bool device;
  bool direct = false;  // device data handed to the transport (isend_device)
  bool issued = false;
  RequestPtr req;
  char* slot = nullptr;  // round trip: the slot to copy the sum back from
};

struct Engine::RecvChunk {
  std::shared_ptr<Plan> plan;
  char* dst;
  size_t len;
  uint64_t tag;
  uint32_t pos;
  bool device;
  bool direct = false;  // received straight into device memory (irecv_device)
  std::vector<uint32_t> after;  // send chunks (idx) that read this memory: they go first
  bool issued = false;
  RequestPtr req;
};

struct Engine::Link {
  int peer;
  std::shared_ptr<Transport> t;
  bool zc;
  bool direct = false;  // message link whose device data goes to the transport directly
  int bound_device = -1;  // device index the transport was bound to (Transport::bind_device)
  uint32_t out_depth = 0;  // zero-copy: outgoing ring slots; message links: staging slots
  size_t slot_bytes = 0;
  uint32_t send_pos = 0, recv_pos = 0;  // next positions to assign (post order)
  std::deque<SendChunk> sq;
  std::deque<RecvChunk> rq;
  std::deque<SendChunk> back;   // round-trip sends committed, waiting for the peer's sums
  std::deque<RecvChunk> held;   // device receives handed to the stream, waiting for `consumed`
  std::deque<SendChunk> inflight_dev;  // message links: device sends issued, in order
  Flags* flags = nullptr;
  uint64_t flags_dev = 0;  // device address of *flags
  uint64_t freed_dev = 0, avail_dev = 0;  // device addresses of *flags->freed, *flags->avail
  bool rings_registered = false;
  std::vector<char*> stage_out, stage_in;  // message links: staging slots for device data
  uint32_t freed_seen = 0;
  int64_t checked_ms = 0;
};

// ----------------------------------------------------------------------------- construction
Engine::Engine(std::map<int, std::shared_ptr<Transport>> links, EngineOptions opts)
    : opts_(std::move(opts)) {
  for (auto& kv : links) {
    auto l = std::make_unique<Link>();
    l->peer = kv.first;
    l->t = kv.second;
    l->zc = l->t->zc_supported();
    if (l->zc) {
      l->out_depth = l->t->zc_depth(l->peer);
      l->slot_bytes = l->t->zc_slot_bytes(l->peer);
      // Positions continue from wherever the rings are (0 for fresh transports).
      l->send_pos = l->t->zc_send_counts(l->peer).first;
      l->recv_pos = l->t->zc_recv_pos(l->peer);
    } else {
      l->out_depth = opts_.device_slots;
      l->slot_bytes = opts_.device_slot_bytes;  // also the chunk bound of direct device data
    }
    links_[kv.first] = std::move(l);
  }
  for (int peer : opts_.device_direct_peers) {
    auto it = links_.find(peer);
    if (it == links_.end())
      throw CommError("hetccl engine: device_direct_peers names rank " + std::to_string(peer) +
                      ", which is not a cross-vendor peer of this engine");
    Link& l = *it->second;
    if (l.zc || !l.t->device_direct())
      throw CommError("hetccl engine: the direct device path to rank " + std::to_string(peer) +
                      " needs a message transport that takes device memory; " + l.t->name() +
                      " does not (its capabilities must list the device's memory type)");
    l.direct = true;
  }
  proxy_ = std::thread([this] { proxy_loop(); });
}

Engine::~Engine() {
  close();
  if (dev_) {
    std::lock_guard<std::mutex> g(issue_mu_);
    for (void* e : events_) dev_->event_destroy(e);
    if (join_event_) dev_->event_destroy(join_event_);
    for (void* r : registered_) dev_->host_unregister(r);
  }
  events_.clear();
  join_event_ = nullptr;
  registered_.clear();
  // Drop the links (and the transports they hold) first: a transport this engine held the
  // last reference to closes now, before the slots its receives may target are freed.
  // Transports still owned elsewhere must be closed by their owner before it drops the
  // engine (hetccl/engine.py closes the bridge and keeps the core until then).
  links_.clear();
  graveyard_.clear();
  for (void* pg : flag_pages_) free(pg);  // see close(): only now can no transport write here
  flag_pages_.clear();
  for (void* w : wait_words_) dev_->wait_word_free(w);  // only a device runtime allocates them
  wait_words_.clear();
}

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

void Engine::set_position_base(uint32_t base) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : links_) {
    Link& l = *kv.second;
    if (l.zc) throw CommError("hetccl engine: set_position_base: zero-copy links keep the rings' positions");
    if (l.send_pos != 0 || l.recv_pos != 0 || l.flags)
      throw CommError("hetccl engine: set_position_base after the first plan");
    l.send_pos = l.recv_pos = base;
  }
}

void Engine::stream_join(int device_index, uintptr_t waiter, uintptr_t waitee) {
  if (!dev_) throw CommError("hetccl engine: stream_join without a device runtime");
  std::lock_guard<std::mutex> g(issue_mu_);
  dev_->set_device(device_index);
  if (!join_event_) join_event_ = dev_->event_create();
  dev_->event_record(join_event_, reinterpret_cast<void*>(waitee));
  dev_->stream_wait_event(reinterpret_cast<void*>(waiter), join_event_);
}

bool Engine::drain(int64_t timeout_ms) {
  const int64_t until = now_ms() + std::max<int64_t>(0, timeout_ms);
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!broken_.empty() || closed_) return false;
      bool pending = false;
      for (auto& kv : plans_)
        pending = pending || (kv.second->spec.device && kv.second->state == Plan::Pending);
      if (!pending) return true;
    }
    if (now_ms() >= until) return false;
    cv_.notify_all();  // the proxy drives device plans; make sure it is awake
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string Engine::broken() {
  std::lock_guard<std::mutex> g(mu_);
  return broken_;
}

void Engine::rethrow_broken() {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_.empty()) throw_kind(broken_kind_, broken_);
}

std::map<std::string, uint64_t> Engine::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

Transport& Engine::link_transport(int peer) { return *links_.at(peer)->t; }

std::shared_ptr<Engine::Plan> Engine::find(uint64_t id) {
  auto it = plans_.find(id);
  return it == plans_.end() ? nullptr : it->second;
}

// ----------------------------------------------------------------------------- check headers
void Engine::post_headers(Plan& p, bool waits) {
  const PlanSpec& s = p.spec;
  WireHeader h{};
  h.magic = kHdrMagic;
  h.waits = waits ? 1 : 0;
  h.status = s.error.empty() ? 0 : 1;
  h.for_group = s.header_for_group ? 1 : 0;
  std::string text = s.error.substr(0, kMaxText);
  h.text_len = uint32_t(text.size());
  for (int i = 0; i < CheckHeader::kFields; ++i) h.f[i] = s.header.f[i];
  p.my_hdr.resize(sizeof(h) + text.size());
  std::memcpy(p.my_hdr.data(), &h, sizeof(h));
  std::memcpy(p.my_hdr.data() + sizeof(h), text.data(), text.size());
  for (int peer : opts_.check_peers) {
    auto it = links_.find(peer);
    if (it == links_.end()) continue;
    Plan::HdrIn in;
    in.peer = peer;
    in.buf.resize(kHdrCap);
    in.req = it->second->t->irecv(peer, in.buf.data(), in.buf.size(), s.header_tag);
    p.hdr_in.push_back(std::move(in));
  }
  for (int peer : opts_.check_peers) {
    auto it = links_.find(peer);
    if (it == links_.end()) continue;
    p.hdr_out.push_back(it->second->t->isend(peer, p.my_hdr.data(), p.my_hdr.size(), s.header_tag));
  }
  p.headers_done = false;
  // Data is not held back for the headers: data tags carry the arguments' signature, so data of
  // a collective whose arguments differ never matches (message links) or is refused on arrival
  // (zero-copy rings), and the headers, compared as they arrive, name the difference.
}

// "" when every header received matches ours (and nobody reported an error), else the text
// every rank derives alike: the first reported error (lowest rank), or the first field that
// differs with the ranks holding each value.
std::string Engine::compare_headers(Plan& p) {
  const PlanSpec& s = p.spec;
  struct Entry {
    const WireHeader* h;
    std::string text;
  };
  std::map<int, Entry> by_rank;  // rank -> header it holds (whole groups when vouched for)
  auto add = [&](int from, const WireHeader* h, const std::string& text) {
    if (h->for_group && from < int(opts_.group_of.size())) {
      for (int r : opts_.groups[opts_.group_of[from]]) by_rank[r] = Entry{h, text};
    } else {
      by_rank[from] = Entry{h, text};
    }
  };
  const auto* mine = reinterpret_cast<const WireHeader*>(p.my_hdr.data());
  add(opts_.rank, mine, s.error.substr(0, kMaxText));
  for (auto& in : p.hdr_in) {
    size_t n = in.req->nbytes();
    const auto* h = reinterpret_cast<const WireHeader*>(in.buf.data());
    if (n < sizeof(WireHeader) || h->magic != kHdrMagic || sizeof(WireHeader) + h->text_len != n)
      return "hetccl: " + s.what + ": peer rank " + std::to_string(in.peer) +
             " sent a malformed argument header (" + std::to_string(n) +
             " bytes); the ranks run different hetccl versions or collectives";
    add(in.peer, h, std::string(in.buf.data() + sizeof(WireHeader), h->text_len));
  }
  for (auto& kv : by_rank)
    if (kv.second.h->status != 0) return kv.second.text;
  uint32_t mask = s.compare_mask;
  for (int f = 0; f < CheckHeader::kFields; ++f) {
    if (!(mask & (1u << f))) continue;
    std::map<int64_t, std::vector<int>> vals;
    for (auto& kv : by_rank) vals[kv.second.h->f[f]].push_back(kv.first);
    if (vals.size() <= 1) continue;
    // order values by their lowest rank, so every rank prints them alike. (Plain string
    // building: no iostreams in the engine -- their locale machinery is one more thing that can
    // differ between the process's C++ runtime and ours.)
    std::vector<std::pair<int, int64_t>> order;
    for (auto& v : vals) order.emplace_back(v.second.front(), v.first);
    std::sort(order.begin(), order.end());
    std::string coll = std::to_string(mine->f[0]);
    if (!opts_.field_names.empty()) {
      auto it = opts_.field_names[0].find(mine->f[0]);
      if (it != opts_.field_names[0].end()) coll = it->second;
    }
    std::string msg = "hetccl: " + coll + ": " + kFieldWhat[f] + " differs across ranks (";
    bool first = true;
    for (auto& o : order) {
      auto& ranks = vals[o.second];
      std::string name = std::to_string(o.second);
      if (f < int(opts_.field_names.size())) {
        auto it = opts_.field_names[f].find(o.second);
        if (it != opts_.field_names[f].end()) name = it->second;
      }
      msg += (first ? "" : "; ");
      msg += "ranks [";
      for (size_t i = 0; i < ranks.size(); ++i) msg += (i ? ", " : "") + std::to_string(ranks[i]);
      msg += "]: " + name;
      first = false;
    }
    msg += "). Every rank must call the same collective with matching tensors.";
    return msg;
  }
  return "";
}

// Whether a peer's header says it did not hold its data for the check (it issued the collective
// and its data may already be on the way or in our slots). Call once every header is in.
bool Engine::a_peer_did_not_wait(const Plan& p) const {
  for (auto& in : p.hdr_in) {
    if (in.req->nbytes() < sizeof(WireHeader)) continue;  // malformed: compare_headers says so
    if (!reinterpret_cast<const WireHeader*>(in.buf.data())->waits) return true;
  }
  return false;
}

bool Engine::progress_headers(Plan& p) {
  if (p.headers_done) return false;
  for (auto& in : p.hdr_in)
    if (!in.req->test()) return false;  // test() throws the request's failure
  for (auto& r : p.hdr_out)
    if (!r->test()) return false;  // our header's buffer lives in the plan until it has left
  p.headers_done = true;
  std::string bad = compare_headers(p);
  if (!bad.empty()) {
    // Data of this plan may already sit in our slots or on the streams: the rings are out of
    // step from here on.
    break_engine(bad + " (detected after the collective was issued; the group is unusable "
                       "from here on)",
                 kArg);
    return true;
  }
  p.gate = true;
  return true;
}

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
  uint32_t nsend = 0;
  // Chunk size per (peer, direction), from the bytes that direction carries in this plan: both
  // ends of a link see the same bytes, so they cut alike (hetccl/tuning.py).
  std::map<std::pair<int, bool>, size_t> total;
  for (auto& it : s.items) total[{it.peer, it.send}] += it.nbytes;
  auto chunk_of = [&](const Link& l, bool send) {
    size_t chunk = s.chunk_bytes;
    if (!chunk) chunk = size_t(opts_.force_chunk);
    if (!chunk) {
      const auto& table = s.device ? opts_.device_chunks : l.zc ? opts_.host_chunks : opts_.msg_chunks;
      const size_t n = total[{l.peer, send}];
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
        l.rq.push_back(std::move(c));
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
    for (auto& kv : links_)
      for (auto& rc : kv.second->rq) {
        if (rc.plan.get() != &p) continue;
        uintptr_t lo = reinterpret_cast<uintptr_t>(rc.dst), hi = lo + rc.len;
        // first send starting at or after lo - maxlen can overlap
        auto first = std::lower_bound(sends.begin(), sends.end(), lo > maxlen ? lo - maxlen : 0,
                                      [](const SendRef& a, uintptr_t v) { return a.lo < v; });
        for (auto s2 = first; s2 != sends.end() && s2->lo < hi; ++s2)
          if (s2->hi > lo) rc.after.push_back(s2->idx);
      }
  }
  p.started = true;
  ++stats_[s.device ? "plans_device" : "plans_host"];
  if (s.device) device_active_.fetch_add(1);  // mark_done / fail_plan take it back
  if (p.pending == 0 && p.headers_done) mark_done(p);
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

// ----------------------------------------------------------------------------- progress
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

// A host receive may touch its memory once every send of its plan that reads it has left.
static bool sends_left(const std::vector<uint8_t>& send_done, const std::vector<uint32_t>& after) {
  for (uint32_t i : after)
    if (!send_done[i]) return false;
  return true;
}

// A chunk that does not fit its plan (size or tag): the ranks disagree. When plans carry
// argument headers (HETCCL_CHECK_ARGS=async lets data move before they are compared), the
// headers name the difference (field and values) where the chunk cannot -- this plan's, or an
// earlier plan's still being checked: a device plan returns to its caller before its headers
// are compared, so a mismatching collective with no receive from this peer (a broadcast whose
// ranks disagree on the root) leaves its peer's data in the ring for the next plan to meet.
// A peer posts its header before its data, so the headers have been sent even when our
// receives of them have not completed yet (the transport's own threads complete them): wait
// for them briefly -- bounded, the engine is failing anyway, and a peer at another collective
// may never send the one we expect -- then compare, earliest plan first. Caller holds mu_.
// Throws ArgMismatch with the header text, else PeerFailure(generic).
void Engine::fail_mismatch(Plan& p, const std::string& generic) {
  const int64_t until = now_ms() + kMismatchHeaderWaitMs;
  for (auto& kv : plans_) {  // by id: the earliest plan's verdict first
    if (kv.first > p.id) break;
    Plan& q = *kv.second;
    if (q.hdr_in.empty()) continue;
    bool all = true;
    for (auto& in : q.hdr_in) {
      try {
        in.req->wait(std::max<int64_t>(0, until - now_ms()));
      } catch (const std::exception&) {
        all = false;  // not here in time, or failed
        break;
      }
    }
    if (!all) continue;
    std::string bad = compare_headers(q);
    if (!bad.empty())
      throw ArgMismatch(bad + " (detected after the collective was issued; the group is "
                              "unusable from here on)");
  }
  throw PeerFailure(generic);
}

bool Engine::recv_zc(Link& l) {
  bool moved = finish_consumed(l);
  while (!l.rq.empty()) {
    RecvChunk& c = l.rq.front();
    Plan& p = *c.plan;
    if (!p.gate) break;
    if (!c.device) {
      if (!l.held.empty()) break;  // releases go in acquisition order
      if (!sends_left(p.send_done, c.after)) break;
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
    l.rq.pop_front();
    finish_chunk(*plan);
    moved = true;
  }
  return moved;
}

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
      if (!sends_left(p.send_done, c.after)) break;
      c.req = p.spec.reduce ? l.t->irecv_reduce(l.peer, c.dst, c.len, c.tag, p.spec.op, p.spec.dtype)
                            : l.t->irecv(l.peer, c.dst, c.len, c.tag);
    }
    c.issued = true;
    moved = true;
  }
  return moved;
}

bool Engine::progress_link(Link& l) {
  if (l.zc) {
    bool a = send_zc(l);
    bool b = recv_zc(l);
    return a || b;
  }
  bool a = send_msg(l);
  bool b = recv_msg(l);
  return a || b;
}

bool Engine::progress_locked() {
  if (!broken_.empty()) return false;
  bool moved = false;
  try {
    for (auto& kv : plans_) {
      Plan& p = *kv.second;
      if (!p.headers_done && progress_headers(p)) moved = true;
      if (!broken_.empty()) return true;
      if (p.headers_done && p.pending == 0 && p.state == Plan::Pending) {
        mark_done(p);
        moved = true;
      }
    }
    publish_verdicts();
    // drop finished device plans (host plans are dropped by their waiter)
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (it->second->spec.device && it->second->state != Plan::Pending) {
        bury(it->second);
        it = plans_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& kv : links_)
      if (progress_link(*kv.second)) moved = true;
    if (!messages_.empty() && progress_messages()) moved = true;
  } catch (const ArgMismatch& e) {
    break_engine(e.what(), kArg);
    return true;
  } catch (const CommTimeout& e) {
    break_engine(e.what(), kTimeout);
    return true;
  } catch (const PeerFailure& e) {
    break_engine(e.what(), kPeer);
    return true;
  } catch (const std::exception& e) {
    break_engine(e.what(), kGeneric);
    return true;
  }
  return moved;
}

void Engine::check_deadlines() {
  const int64_t t = now_ms();
  for (auto& kv : plans_) {
    Plan& p = *kv.second;
    if (p.state != Plan::Pending || p.deadline_ms < 0 || t < p.deadline_ms) continue;
    std::set<int> waiting;
    for (auto& lk : links_) {
      Link& l = *lk.second;
      for (auto& c : l.sq)
        if (c.plan.get() == &p) waiting.insert(l.peer);
      for (auto& c : l.rq)
        if (c.plan.get() == &p) waiting.insert(l.peer);
      for (auto& c : l.held)
        if (c.plan.get() == &p) waiting.insert(l.peer);
      for (auto& c : l.back)
        if (c.plan.get() == &p) waiting.insert(l.peer);
    }
    for (auto& m : messages_)
      if (m->plan.get() == &p) waiting.insert(m->peer);
    if (!p.headers_done)
      for (auto& in : p.hdr_in)
        if (!in.req->test()) waiting.insert(in.peer);
    std::string msg = "hetccl: Timed out after " + std::to_string(p.spec.timeout_ms) + " ms in " +
                      p.spec.what + " waiting for peer rank" + (waiting.size() == 1 ? " " : "s [");
    bool first = true;
    for (int r : waiting) {
      msg += (first ? "" : ", ") + std::to_string(r);
      first = false;
    }
    if (waiting.size() != 1) msg += "]";
    if (p.spec.device) msg += " (or for this rank's own stream to reach the collective)";
    break_engine(msg, kTimeout);
    return;
  }
}

void Engine::check_liveness() {
  // zc_wait(peer, 0) checks that the peer's process is alive (at most every 100 ms per peer)
  // and throws PeerFailure otherwise; message links fail their requests by themselves.
  for (auto& kv : links_) {
    Link& l = *kv.second;
    if (!l.zc || (l.sq.empty() && l.rq.empty() && l.held.empty() && l.back.empty())) continue;
    l.t->zc_wait(l.peer, 0);
  }
}

void Engine::fail_plan(Plan& p, const std::string& msg, int kind) {
  if (p.state != Plan::Pending) return;
  if (p.spec.device) device_active_.fetch_sub(1);
  p.state = Plan::Failed;
  p.error = msg;
  p.error_kind = kind;
}

void Engine::release_device_waits() {
  // Let every stream wait pass: no stream may stay blocked on a word nobody will write again.
  for (auto& kv : links_) {
    Link& l = *kv.second;
    if (!l.flags) continue;
    l.flags->freed->set(l.send_pos + (1u << 20));
    l.flags->avail->set(l.recv_pos + (1u << 20));
  }
  if (verdict_) static_cast<Word*>(verdict_)->set(verdict_issued_ + (1u << 20));
  verdict_q_.clear();
  release_message_waits();
}

void Engine::break_engine(const std::string& msg, int kind) {
  if (broken_.empty()) {
    broken_ = msg;
    broken_kind_ = kind;
    if (!stop_.load()) log_warn("engine", "rank " + std::to_string(opts_.rank) + ": " + msg);
    bool device_pending = false;
    for (auto& kv : plans_)
      device_pending = device_pending || (kv.second->spec.device && kv.second->state == Plan::Pending);
    if (device_pending && opts_.abort_on_device_failure && !stop_.load()) {
      log_warn("engine", "rank " + std::to_string(opts_.rank) +
                             ": a device collective failed after it was issued; stopping the "
                             "process so that its result is never used "
                             "(HETCCL_ASYNC_ERROR_HANDLING=raise reports it at the next call instead)");
      std::abort();
    }
  }
  for (auto& kv : plans_) fail_plan(*kv.second, broken_, broken_kind_);
  withdraw_host_requests();
  for (auto& kv : links_) {
    Link& l = *kv.second;
    l.sq.clear();
    l.rq.clear();
    l.held.clear();
    l.back.clear();
  }
  release_device_waits();
  drop_messages();
}

// Host data on message links goes between the transport and the caller's memory directly (no
// staging), and once a collective has failed the caller may free that memory: the face keeps
// no reference to its tensors after the error (engine.py, _with_hosts). So before the queues
// are dropped, every issued host receive that no data has reached is withdrawn
// (Transport::cancel: its buffer is never written); a receive whose data is arriving and an
// issued send (it reads the caller's memory) cannot be withdrawn (stats "withdrawn_receives"
// counts those that were), and are waited for, up to
// kStaleWaitMs in all (a live peer's data lands in microseconds; a failed peer's requests fail
// at once). What is still in flight after that is counted in stats "left_in_flight". Direct
// device chunks (isend_device / irecv_device on the caller's device memory,
// HETCCL_UCX_DEVICE=auto) are treated the same way: the caller may free that memory too (an
// async mismatch breaking the engine with direct receives posted, then the memory freed, was
// an intermittent segfault of tests/test_engine.py::test_engine_device_direct). Staged device
// chunks are not touched: they move through the engine's own staging slots, which flag_pages_
// keeps until the destructor.
void Engine::withdraw_host_requests() {
  constexpr int64_t kStaleWaitMs = 1000;
  std::vector<RequestPtr> waiting;
  for (auto& kv : links_) {
    Link& l = *kv.second;
    if (l.zc) continue;  // zero-copy rings: the engine itself copies, and stops with the queues
    for (auto& c : l.rq) {
      if ((c.device && !c.direct) || !c.issued || !c.req || c.req->test_nothrow()) continue;
      if (l.t->cancel(c.req)) {
        stats_["withdrawn_receives"] += 1;
      } else {
        waiting.push_back(c.req);
      }
    }
    for (auto& c : l.sq)
      if ((!c.device || c.direct) && c.issued && c.req && !c.req->test_nothrow())
        waiting.push_back(c.req);
  }
  int64_t until = now_ms() + kStaleWaitMs;
  for (auto& r : waiting) {
    while (!r->test_nothrow() && now_ms() < until) sched_yield();
    if (!r->test_nothrow()) stats_["left_in_flight"] += 1;
  }
}

// ----------------------------------------------------------------------------- waiting
void Engine::wait(uint64_t id) {
  waiters_.fetch_add(1);
  struct Guard {
    std::atomic<int>& w;
    ~Guard() { w.fetch_sub(1); }
  } guard{waiters_};
  int idle = 0;
  int64_t spin_until = now_ns() + 50000;
  for (;;) {
    std::shared_ptr<Plan> p;
    {
      std::lock_guard<std::mutex> g(mu_);
      p = find(id);
      if (!p) {
        if (!broken_.empty()) throw_kind(broken_kind_, broken_);
        return;  // finished and collected (device plans)
      }
      bool moved = progress_locked();
      if (p->state == Plan::Pending && !moved) {
        if (++idle % 64 == 0) {
          check_deadlines();
          if (now_ms() - last_liveness_ms_ > 100) {
            last_liveness_ms_ = now_ms();
            try {
              check_liveness();
            } catch (const PeerFailure& e) {
              break_engine(e.what(), kPeer);
            } catch (const CommError& e) {
              break_engine(e.what(), kGeneric);
            }
          }
        }
      } else {
        idle = 0;
        spin_until = now_ns() + 50000;
      }
      if (p->state != Plan::Pending) {
        bury(p);
        plans_.erase(id);
        if (p->state == Plan::Failed) throw_kind(p->error_kind, p->error);
        return;
      }
    }
    if (idle == 0) continue;
    if (now_ns() < spin_until) {
      cpu_relax();
    } else if (idle < 2000) {
      sched_yield();
    } else {
      // Sleep until a peer moves a ring (futex) or a short slice passes.
      Link* zl = nullptr;
      {
        std::lock_guard<std::mutex> g(mu_);
        for (auto& kv : links_)
          if (kv.second->zc && (!kv.second->sq.empty() || !kv.second->rq.empty())) zl = kv.second.get();
      }
      if (zl) {
        try {
          zl->t->zc_wait(zl->peer, 1);
        } catch (const CommError&) {
          // noticed by the next liveness check
        }
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
}

bool Engine::test(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = find(id);
  if (!p) {
    if (!broken_.empty()) throw_kind(broken_kind_, broken_);
    return true;
  }
  progress_locked();
  if (p->state == Plan::Failed) {
    bury(p);
    plans_.erase(id);
    throw_kind(p->error_kind, p->error);
  }
  return p->state == Plan::Done;
}

void Engine::proxy_loop() {
  pthread_setname_np(pthread_self(), "hetccl-proxy");  // names the thread in stack dumps
  int idle = 0;
  int64_t last_check = now_ms();
  int64_t spin_until = 0;
  for (;;) {
    if (stop_.load()) return;
    if (device_active_.load() <= 0) {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait_for(g, std::chrono::milliseconds(100),
                   [&] { return stop_.load() || device_active_.load() > 0; });
      if (stop_.load()) return;
      // host plans have waiters; still notice their deadlines if a waiter went away
      check_deadlines();
      continue;
    }
    bool moved;
    {
      std::lock_guard<std::mutex> g(mu_);
      moved = progress_locked();
      if (now_ms() - last_check > 20) {
        last_check = now_ms();
        check_deadlines();
        if (now_ms() - last_liveness_ms_ > 100) {
          last_liveness_ms_ = now_ms();
          try {
            check_liveness();
          } catch (const PeerFailure& e) {
            break_engine(e.what(), kPeer);
          } catch (const CommError& e) {
            break_engine(e.what(), kGeneric);
          }
        }
      }
    }
    if (moved) {
      idle = 0;
      spin_until = now_ns() + 100000;  // stay hot while chunks flow
      continue;
    }
    ++idle;
    if (now_ns() < spin_until) {
      for (int i = 0; i < 32; ++i) cpu_relax();
    } else if (idle < 4000) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
    if (broken_.empty()) {
      broken_ = "hetccl engine: closed";
      broken_kind_ = kGeneric;
    }
    stop_.store(true);
    for (auto& kv : plans_) fail_plan(*kv.second, broken_, broken_kind_);
    release_device_waits();
  }
  cv_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : links_) {
    kv.second->sq.clear();
    kv.second->rq.clear();
    kv.second->held.clear();
    kv.second->back.clear();
  }
  drop_messages();
  // graveyard_ and flag_pages_ (flag words and the message links' staging slots) stay until
  // the destructor: the transports close after the engine, and a receive still posted in one
  // (a failed or broken plan's, e.g. into a staging slot) may complete until then. Freeing the
  // slots here corrupted the heap when UCX's close progressed such a receive. Their
  // registrations and the events stay too: streams released above (release_device_waits) run
  // the rest of their plans' copies and flag writes after this returns, and the issuing thread
  // may be enqueueing under issue_mu_ right now (an abort from another thread); the C API's
  // communicator syncs its route's streams before it drops the engine (Comm::abort).
}

}  // namespace hetccl
