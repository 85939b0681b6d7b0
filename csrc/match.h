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
    auto it = first_of(msgs_, k);
    return it == msgs_.end() ? nullptr : &it->second;
  }
  const Msg* peek_msg(const Key& k) const {
    auto it = msgs_.lower_bound(k);
    return it == msgs_.end() || msgs_.key_comp()(k, it->first) ? nullptr : &it->second;
  }
  // Queues behind the older ones of its key (a multimap keeps equal keys in insertion order).
  // Only with the other side of `k` empty (the caller asked take_* first): the rule above.
  void wait(const Key& k, Recv r) { recvs_.emplace_hint(recvs_.upper_bound(k), k, std::move(r)); }
  void park(const Key& k, Msg m) { msgs_.emplace_hint(msgs_.upper_bound(k), k, std::move(m)); }

  // The first waiting receive, under any key, that pred accepts, left in place (nullptr: none);
  // the key it waits under goes to *key (when given).
  template <class Pred>
  Recv* find_recv(Pred pred, Key* key = nullptr) {
    for (auto& kv : recvs_)
      if (pred(kv.second)) {
        if (key) *key = kv.first;
        return &kv.second;
      }
    return nullptr;
  }
  // Removes the first waiting receive of `k` that pred accepts (cancel); false when none does.
  template <class Pred>
  bool withdraw_recv(const Key& k, Pred pred) { return remove_first(recvs_, k, pred); }
  // Removes the first parked message of `k` that pred accepts; false when none does.
  template <class Pred>
  bool remove_msg(const Key& k, Pred pred) { return remove_first(msgs_, k, pred); }

  // Every waiting receive, removed (oldest first per key): the transport fails them.
  template <class F>
  void drain_recvs(F f) {
    auto all = std::move(recvs_);
    recvs_.clear();
    for (auto& kv : all) f(kv.first, kv.second);
  }
  // Keeps, per key, the leading parked messages that keep() accepts and drops the rest (a
  // later message behind a dropped one could never be reached in order).
  template <class Keep>
  void trim_msgs(Keep keep) {
    for (auto it = msgs_.begin(); it != msgs_.end();) {
      auto end = msgs_.upper_bound(it->first);
      while (it != end && keep(it->second)) ++it;
      it = msgs_.erase(it, end);
    }
  }
  template <class F>
  void for_each_msg(F f) {
    for (auto& kv : msgs_) f(kv.first, kv.second);
  }
  void clear_msgs() { msgs_.clear(); }

 private:
  // One node per waiting element (no per-key container: tcp's keys hold one element each).
  template <class T>
  using Table = std::multimap<Key, T>;
  template <class T>
  static typename Table<T>::iterator first_of(Table<T>& m, const Key& k) {
    auto it = m.lower_bound(k);
    return it == m.end() || m.key_comp()(k, it->first) ? m.end() : it;
  }
  template <class T>
  static std::optional<T> take(Table<T>& m, const Key& k) {
    auto it = first_of(m, k);
    if (it == m.end()) return std::nullopt;
    std::optional<T> v(std::move(it->second));
    m.erase(it);
    return v;
  }
  template <class T, class Pred>
  static bool remove_first(Table<T>& m, const Key& k, Pred pred) {
    for (auto it = first_of(m, k); it != m.end() && !m.key_comp()(k, it->first); ++it)
      if (pred(it->second)) {
        m.erase(it);
        return true;
      }
    return false;
  }

  Table<Recv> recvs_;
  Table<Msg> msgs_;
};

}  // namespace hetccl
