// Progress and waiting: the progress pass, the waiting policy of wait(), the proxy thread and
// close() (engine.h, "Host plans" and "Device plans").
//
// Contract. progress_locked is one pass over the engine: check headers compared as they arrive,
// plans marked done, verdicts published, finished device plans dropped, every link's sends and
// receives advanced (engine_ring.cc, engine_link.cc) and the point-to-point messages
// (engine_messages.cc); any exception it meets breaks the engine with that exception's kind.
// wait() drives the pass itself (spin, then yield, then sleep on a zero-copy ring's futex) and
// checks deadlines and liveness when idle; the proxy thread drives it while device plans are in
// flight and sleeps on cv_ otherwise. close() fails what is left, releases the streams and
// joins the proxy; memory the streams or transports may still touch stays until ~Engine.
//
// Locks: progress_locked and progress_link expect mu_ held; wait, test, proxy_loop and close
// take it themselves.
#include <sched.h>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

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
          check_liveness_due();
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
        check_liveness_due();
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
    // as break_engine: the callers see their plans fail only after this (they need mu_), and
    // may then free their memory, so issued host receives no data reached are withdrawn first
    // (an abort from another thread closes the engine while a call waits in a host plan)
    withdraw_host_requests();
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
