// Failure: deadlines, liveness, failing plans and breaking the engine (engine.h, "Failure").
//
// Contract. check_deadlines fails the engine with CommTimeout's text ("Timed out", naming the
// peers the first overdue plan waits for); check_liveness asks zero-copy links whether their
// peer is alive (message links fail their requests by themselves). break_engine records the
// first failure and its kind (broken_, broken_kind_), stops the process when a device plan was
// pending and opts_.abort_on_device_failure says so, fails every plan, withdraws or waits out
// the transport requests that point into the caller's memory (withdraw_host_requests), drops
// the link queues, releases every stream wait (release_device_waits) and drops the messages.
//
// Locks: every function here expects mu_ held.
#include <sched.h>

#include <set>

#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;

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

void Engine::check_liveness_due() {
  if (now_ms() - last_liveness_ms_ <= 100) return;
  last_liveness_ms_ = now_ms();
  try {
    check_liveness();
  } catch (const PeerFailure& e) {
    break_engine(e.what(), kPeer);
  } catch (const CommError& e) {
    break_engine(e.what(), kGeneric);
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

}  // namespace hetccl
