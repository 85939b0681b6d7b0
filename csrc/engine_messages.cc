// Point-to-point messages of device data (PlanSpec::message): send/recv/isend/irecv across
// vendors, stream-ordered, without a host wait.
//
// Contract. A message plan has one item and moves it whole as ONE tagged message with the
// plan's tag over the peer's transport (Transport::isend / irecv), exactly as a host message of
// that tag: it matches the peer's message of the same (peer, tag) in posting order (the
// transports' matching rule), however the peer posted it (another message plan, or the face's
// host path for receives from any source), and it takes no ring position, so it is independent
// of the collectives on the link and of their order. Device data goes through a pinned staging
// buffer the engine owns:
//   send: the caller's stream copies device -> staging, then writes the message's `sig` word;
//         the proxy sees the word, posts the isend (sends to one peer are posted in plan order,
//         so FIFO matching holds), and recycles the buffer once the send completed;
//   recv: the irecv into staging is posted at once; when it completes the proxy checks its
//         size and sets the `wait` word; the stream waits on that word, copies staging ->
//         device and writes `sig`; the proxy recycles the buffer once it sees `sig`.
// The host never waits: the stream is what waits. A message whose size differs from the
// receiving buffer, a dead peer or a timeout breaks the engine (the stream already holds the
// copy), as for any device plan issued without a wait.
//
// Flag words: one slot (a `wait` word the stream waits on, a `sig` word it writes) per message
// in flight, reused once its message is finished; each use of a slot takes the slot's next
// generation, so a word only grows (Word's position rules, device_ops.h). Slots come in pages
// of kSlotsPerPage and are never freed before the destructor (streams may reference them).
// Staging buffers: capacities rounded up to a power of two (at least a page), registered with the
// device runtime once by the issuing thread and reused; the pool holds the most this engine had
// in flight per capacity until it closes (stats: message_staging_bytes). The proxy makes no
// runtime call for messages: it reads and writes words and posts transport requests only.
#include <stdlib.h>

#include <cstring>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

namespace {
constexpr uint32_t kSlotsPerPage = 512;                    // 8-byte words: one page each
}  // namespace

// What the issuing thread enqueues, copied under mu_ (the proxy may drop the Message meanwhile).
struct Engine::MessageCopy {
  bool send = false;
  char* device = nullptr;
  char* staging = nullptr;
  size_t len = 0;
  uint64_t wait_dev = 0, sig_dev = 0, wait_counter = 0, sig_counter = 0;
};

// Without mu_ (runtime calls must not hold up the proxy): one more page of slots, added under mu_.
void Engine::grow_slots() {
  void* wait_page = nullptr;
  void* sig_page = nullptr;
  if (posix_memalign(&wait_page, 4096, 4096) != 0 || posix_memalign(&sig_page, 4096, 4096) != 0)
    throw CommError("hetccl engine: out of memory for message flag words");
  std::memset(wait_page, 0, 4096);
  std::memset(sig_page, 0, 4096);
  bool ok = dev_->host_register(wait_page, 4096) && dev_->host_register(sig_page, 4096);
  std::vector<std::unique_ptr<MessageSlot>> made;
  std::vector<void*> words;
  if (ok) {
    for (uint32_t i = 0; i < kSlotsPerPage; ++i) {
      auto sl = std::make_unique<MessageSlot>();
      sl->sig = new (static_cast<Word*>(sig_page) + i) Word();
      sl->sig_dev = dev_->device_address(sig_page) + i * sizeof(Word);
      if (void* w = dev_->wait_word_alloc()) {  // the runtime's own memory for waited words
        words.push_back(w);
        sl->wait = new (w) Word();
        sl->wait_dev = dev_->wait_word_address(w);
      } else {
        sl->wait = new (static_cast<Word*>(wait_page) + i) Word();
        sl->wait_dev = dev_->device_address(wait_page) + i * sizeof(Word);
      }
      made.push_back(std::move(sl));
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  flag_pages_.push_back(wait_page);
  flag_pages_.push_back(sig_page);
  if (ok) {
    registered_.push_back(wait_page);
    registered_.push_back(sig_page);
  }
  for (void* w : words) wait_words_.push_back(w);
  if (!ok) throw CommError("hetccl engine: could not page-lock the message flag words");
  const uint32_t base = uint32_t(msg_slots_.size());
  for (uint32_t i = 0; i < kSlotsPerPage; ++i) {
    msg_slots_.push_back(std::move(made[i]));
    msg_free_slots_.push_back(base + kSlotsPerPage - 1 - i);  // lowest first
  }
}

// Under mu_; post_message made sure one is free.
uint32_t Engine::slot_take() {
  uint32_t i = msg_free_slots_.back();
  msg_free_slots_.pop_back();
  return i;
}

// Under mu_: a free buffer of capacity cap, or nullptr (post_message then makes one).
char* Engine::staging_take(size_t cap) {
  auto it = staging_free_.find(cap);
  if (it == staging_free_.end() || it->second.empty()) return nullptr;
  char* p = it->second.back();
  it->second.pop_back();
  staging_free_bytes_ -= cap;
  return p;
}

// Under mu_, on the proxy thread too: the buffer goes back to the pool. It is never unregistered
// or freed here: a device runtime call on the proxy can wait for a stream that waits for the
// proxy (cuMemHostUnregister on the proxy while a receive's stream waited on its word was a
// deadlock on the GPU box). The pool keeps the most this engine had in flight per capacity;
// everything is released when the engine closes (registered_ / flag_pages_).
void Engine::staging_give(char* p, size_t cap) {
  staging_free_[cap].push_back(p);
  staging_free_bytes_ += cap;
}

Engine::MessageCopy Engine::start_message_locked(const std::shared_ptr<Plan>& pp, char* staging,
                                                   size_t cap) {
  Plan& p = *pp;
  const PlanSpec& s = p.spec;
  const PlanItem& it = s.items[0];
    auto m = std::make_unique<Message>();
  m->plan = pp;
  m->peer = it.peer;
  m->send = it.send;
  m->device = reinterpret_cast<char*>(it.ptr);
  m->len = it.nbytes;
  m->tag = s.tag_base;
  m->cap = cap;
  m->slot = slot_take();
  MessageSlot& sl = *msg_slots_[m->slot];
  m->gen = ++sl.gen;
  m->staging = staging;
  if (!m->send) m->req = link_transport(m->peer).irecv(m->peer, m->staging, m->len, m->tag);
  MessageCopy c;
  c.send = m->send;
  c.device = m->device;
  c.staging = m->staging;
  c.len = m->len;
  c.wait_dev = sl.wait_dev;
  c.sig_dev = sl.sig_dev;
  c.wait_counter = sl.wait->counter(m->gen);
  c.sig_counter = sl.sig->counter(m->gen);
  p.pending = 1;
  p.started = true;
  ++stats_["plans_device"];
  ++stats_["messages"];
  device_active_.fetch_add(1);  // mark_done / fail_plan take it back
  messages_.push_back(std::move(m));
  return c;
}

uint64_t Engine::post_message(const std::shared_ptr<Plan>& p) {
  const PlanSpec& s = p->spec;
  if (s.items.size() != 1 || !s.device || s.check || s.reduce || s.roundtrip)
    throw CommError("hetccl engine: " + s.what + ": a message plan has exactly one item of "
                    "device data and no check, reduction or round trip");
  if (!dev_) throw CommError("hetccl engine: device plan without a device runtime");
  if (!dev_->stream_mem_ops(s.device_index))
    throw CommError("hetccl engine: " + s.what + ": messages need stream memory operations, "
                    "which device " + std::to_string(s.device_index) + " does not offer");
  size_t cap = 4096;
  while (cap < s.items[0].nbytes) cap <<= 1;
  char* staging;
  bool need_slots;
  {
    std::lock_guard<std::mutex> g(mu_);
    staging = staging_take(cap);
    need_slots = msg_free_slots_.empty();
  }
  if (need_slots) {
    dev_->set_device(s.device_index);
    grow_slots();
  }
  if (!staging) {
    // a new pinned buffer, made without holding mu_ (registering is a runtime call that must
    // not hold up the proxy)
    void* m = nullptr;
    if (posix_memalign(&m, 4096, cap) != 0)
      throw CommError("hetccl engine: out of memory for a " + std::to_string(cap) +
                      "-byte message staging buffer");
    dev_->set_device(s.device_index);
    bool pinned = dev_->host_register(m, cap);
    std::lock_guard<std::mutex> g(mu_);
    flag_pages_.push_back(m);  // freed in the destructor (a transport may still use it)
    if (pinned) registered_.push_back(m);
    stats_["message_staging_bytes"] += cap;
    staging = static_cast<char*>(m);
  }
  MessageCopy c;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_ || !broken_.empty()) {
      staging_give(staging, cap);
      if (closed_) throw CommError("hetccl engine: closed");
      throw_kind(broken_kind_, broken_);
    }
    if (msg_free_slots_.empty()) {  // another thread took the slots grown for this one
      staging_give(staging, cap);
      throw CommError("hetccl engine: " + s.what + ": no message slot free; post again");
    }
    p->id = next_id_++;
    plans_[p->id] = p;
    c = start_message_locked(p, staging, cap);
  }
  try {
    enqueue_message(s, c);
    std::lock_guard<std::mutex> g(mu_);
    ++stats_["device_enqueues"];
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(mu_);
    break_engine(std::string("hetccl: ") + s.what + ": device copies failed: " + e.what(),
                 kGeneric);
    throw;
  }
  cv_.notify_all();
  return p->id;
}

void Engine::enqueue_message(const PlanSpec& s, const MessageCopy& c) {
  std::lock_guard<std::mutex> g(issue_mu_);
  dev_->set_device(s.device_index);
  void* S = reinterpret_cast<void*>(s.stream);
  if (c.send) {
    if (c.len) dev_->memcpy_async(c.staging, c.device, c.len, S);
    dev_->write(S, c.sig_dev, c.sig_counter);
  } else {
    dev_->wait_geq(S, c.wait_dev, c.wait_counter);
    if (c.len) dev_->memcpy_async(c.device, c.staging, c.len, S);
    dev_->write(S, c.sig_dev, c.sig_counter);
  }
}

// One pass (under mu_); throws what a request throws (progress_locked breaks the engine).
bool Engine::progress_messages() {
  bool moved = false;
  std::vector<int> blocked;  // peers with an earlier send not posted yet: FIFO per peer
  for (auto& mp : messages_) {
    Message& m = *mp;
    MessageSlot& sl = *msg_slots_[m.slot];
    if (m.send) {
      if (m.state == 0) {
        if (std::find(blocked.begin(), blocked.end(), m.peer) != blocked.end()) continue;
        if (!geq(sl.sig->pos(), m.gen)) {
          blocked.push_back(m.peer);
          continue;
        }
        m.req = link_transport(m.peer).isend(m.peer, m.staging, m.len, m.tag);
        m.state = 1;
        moved = true;
      }
      if (m.state == 1 && m.req->test()) {
        m.state = 2;
        moved = true;
      }
    } else {
      if (m.state == 0 && m.req->test()) {
        size_t got = m.req->nbytes();
        if (got != m.len)
          throw CommError("hetccl: " + m.plan->spec.what + ": the message from rank " +
                          std::to_string(m.peer) + " carried " + std::to_string(got) +
                          " bytes, the receiving tensor has " + std::to_string(m.len) +
                          " (the ranks' send and recv tensors differ in size)");
        sl.wait->set(m.gen);
        m.state = 1;
        moved = true;
      }
      if (m.state == 1 && geq(sl.sig->pos(), m.gen)) {
        m.state = 2;
        moved = true;
      }
    }
  }
  for (auto it = messages_.begin(); it != messages_.end();) {
    Message& m = **it;
    if (m.state != 2) {
      ++it;
      continue;
    }
    stats_["message_bytes"] += m.len;
    ++stats_["messages_done"];
    staging_give(m.staging, m.cap);
    msg_free_slots_.push_back(m.slot);
    finish_chunk(*m.plan);
    it = messages_.erase(it);
  }
  return moved;
}

// break_engine / close: every stream waiting on a message passes (its data is not copied).
void Engine::release_message_waits() {
  for (auto& mp : messages_) msg_slots_[mp->slot]->wait->set(mp->gen + (1u << 20));
}

// break_engine: unfinished messages are dropped. Their slots and staging buffers are not reused
// (a stream may still write a slot's word, a transport may still read or write the buffer); they
// stay allocated until the destructor.
void Engine::drop_messages() { messages_.clear(); }

}  // namespace hetccl
