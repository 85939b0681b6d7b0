// See engine.h for the contracts. This file: the engine's construction and destruction (links
// made from the transports; what the destructor frees and unregisters, and when) and its small
// public entry points (set_position_base, drain, broken, rethrow_broken, stats), plus the lookups
// the other files share (link_transport, find). The rest of the engine, by concern:
//   engine_plan.cc      posting a plan, cutting it into chunks in ring order, plan completion
//   engine_check.cc     the check-header wire protocol, its comparison and mismatch text
//   engine_device.cc    device registration, flag words and the stream protocol
//   engine_ring.cc      zero-copy ring links: their send and receive progress
//   engine_link.cc      message links (plain transports): host, staged and direct device data
//   engine_failure.cc   deadlines, liveness, failing plans, breaking the engine
//   engine_proxy.cc     the progress pass, the waiting policy, the proxy thread, close()
//   engine_messages.cc  point-to-point messages of device data
// Internals they share (Plan, Link, chunks, flag words): engine_internal.h.
//
// Locks: the constructor runs before any other thread (it starts the proxy last); the
// destructor calls close() and then takes issue_mu_; set_position_base, drain, broken,
// rethrow_broken and stats take mu_ themselves; find() expects mu_ held; link_transport() takes
// none (links_ is fixed after construction).
#include "engine.h"

#include <stdlib.h>

#include <algorithm>

#include "common.h"
#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

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
      l->msg_limit = l->t->message_limit(l->peer);  // equal on both ends (transport.h)
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

void Engine::unregister_rings() {
  if (!dev_) return;
  std::lock_guard<std::mutex> g(mu_);  // registered_ grows under mu_ (ensure_device_state)
  for (auto& kv : links_) {
    Link& l = *kv.second;
    if (!l.zc || !l.rings_registered) continue;
    for (auto& r : l.t->zc_regions()) {
      auto it = std::find(registered_.begin(), registered_.end(), r.first);
      if (it == registered_.end()) continue;  // not this engine's registration
      dev_->host_unregister(r.first);
      registered_.erase(it);
    }
    l.rings_registered = false;
  }
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

}  // namespace hetccl
