// hetccl bridge core: message matching, written once for the transports (transport.h's
// contract): a receive from `peer` with `tag` takes the earliest unmatched message `peer` sent
// with that tag; messages of other tags may be received in any order.
//
// MatchQueues<Key, Recv, Msg> holds, per key, the receives that wait for a message and the
// messages that wait for a receive (parked), each oldest first. Whoever comes second takes the
// oldest of the other side: an arriving message the oldest waiting receive (take_recv), a
// posted receive the oldest parked message (take_msg). So for any key at most one side is
// non-empty, and the k-th receive of a key meets the k-th message of that key as long as
// messages are offered in send order.
//
// Who uses it, with which key:
//  * shm (shm_transport.cc): key = tag, one table per peer; a message is offered when its first
//    ring slot is read (the ring delivers each peer's messages in send order).
//  * tcp (tcp_transport.cc): key = (tag, seq), one table per peer; frames of one message arrive
//    on several connections out of order, so the sender numbers the messages of a tag (seq)
//    and the k-th receive of the tag waits under (tag, k): each key then sees one receive and
//    one message, and the table pairs them whichever comes first.
//  * UCX (ucx_transport.cc): UCX matches posted receives itself; messages the progress thread
//    drains from UCX's unexpected queue are parked here, key = (lane, UCX tag), and a receive
//    posted later takes the oldest (take_msg) before it is handed to UCX.
//
// Withdrawing a waiting receive (cancel) removes it from its queue: the message it would have
// taken goes to the next receive of the key, if any. Not thread-safe: the transport's lock for
// the peer guards the table.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <utility>

namespace hetccl {

template <class Key, class Recv, class Msg>
class MatchQueues {
 public:
  // A message arrived: the oldest receive waiting for `k`, removed from the table; nullopt when
  // none waits (the caller parks the message with park()).
  std::optional<Recv> take_recv(const Key& k) { return take(recvs_, k); }
  // A receive was posted: the oldest message parked under `k`, removed; nullopt when none is
  // here (the caller makes the receive wait with wait()).
  std::optional<Msg> take_msg(const Key& k) { return take(msgs_, k); }
  // The oldest message parked under `k`, left in place (nullptr: none).
  Msg* peek_msg(const Key& k) {
    auto it = msgs_.find(k);
    return it == msgs_.end() ? nullptr : &it->second.front();
  }
  const Msg* peek_msg(const Key& k) const {
    auto it = msgs_.find(k);
    return it == msgs_.end() ? nullptr : &it->second.front();
  }
  // Queues behind the older ones of its key. Only with the other side of `k` empty (the caller
  // asked take_* first): the rule above.
  void wait(const Key& k, Recv r) { recvs_[k].push_back(std::move(r)); }
  void park(const Key& k, Msg m) { msgs_[k].push_back(std::move(m)); }

  // The first waiting receive, under any key, that pred accepts, left in place (nullptr: none);
  // the key it waits under goes to *key (when given).
  template <class Pred>
  Recv* find_recv(Pred pred, Key* key = nullptr) {
    for (auto& kv : recvs_)
      for (auto& r : kv.second)
        if (pred(r)) {
          if (key) *key = kv.first;
          return &r;
        }
    return nullptr;
  }
  // Removes the first waiting receive of `k` that pred accepts (cancel); false when none does.
  template <class Pred>
  bool withdraw_recv(const Key& k, Pred pred) { return remove_first(recvs_, k, pred); }
  // Removes the first parked message of `k` that pred accepts; false when none does.
  template <class Pred>
  bool remove_msg(const Key& k, Pred pred) { return remove_first(msgs_, k, pred); }
  // Removes the first waiting receive, under any key, that pred accepts; the key it waited
  // under goes to *key (when given). False when none does.
  template <class Pred>
  bool withdraw_recv_any(Pred pred, Key* key = nullptr) {
    for (auto it = recvs_.begin(); it != recvs_.end(); ++it)
      for (auto r = it->second.begin(); r != it->second.end(); ++r)
        if (pred(*r)) {
          if (key) *key = it->first;
          it->second.erase(r);
          if (it->second.empty()) recvs_.erase(it);
          return true;
        }
    return false;
  }

  // Every waiting receive, removed (oldest first per key): the transport fails them.
  template <class F>
  void drain_recvs(F f) {
    auto all = std::move(recvs_);
    recvs_.clear();
    for (auto& kv : all)
      for (auto& r : kv.second) f(kv.first, r);
  }
  // Keeps, per key, the leading parked messages that keep() accepts and drops the rest (a
  // later message behind a dropped one could never be reached in order).
  template <class Keep>
  void trim_msgs(Keep keep) {
    for (auto it = msgs_.begin(); it != msgs_.end();) {
      auto& q = it->second;
      size_t n = 0;
      while (n < q.size() && keep(q[n])) ++n;
      q.erase(q.begin() + n, q.end());
      it = q.empty() ? msgs_.erase(it) : std::next(it);
    }
  }
  template <class F>
  void for_each_msg(F f) {
    for (auto& kv : msgs_)
      for (auto& m : kv.second) f(kv.first, m);
  }
  void clear_msgs() { msgs_.clear(); }
  bool has_recvs() const { return !recvs_.empty(); }

 private:
  template <class T>
  static std::optional<T> take(std::map<Key, std::deque<T>>& m, const Key& k) {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    std::optional<T> v(std::move(it->second.front()));
    it->second.pop_front();
    if (it->second.empty()) m.erase(it);
    return v;
  }
  template <class T, class Pred>
  static bool remove_first(std::map<Key, std::deque<T>>& m, const Key& k, Pred pred) {
    auto it = m.find(k);
    if (it == m.end()) return false;
    for (auto x = it->second.begin(); x != it->second.end(); ++x)
      if (pred(*x)) {
        it->second.erase(x);
        if (it->second.empty()) m.erase(it);
        return true;
      }
    return false;
  }

  std::map<Key, std::deque<Recv>> recvs_;
  std::map<Key, std::deque<Msg>> msgs_;
};

}  // namespace hetccl
