// hetccl C API bootstrap: the unique id, the root that gathers every rank's entry, and the one
// exchange of the whole table.
//
// Contract:
//  * make_root() opens a listener (settings: bootstrap address) and starts a detached thread that
//    serves exactly one communicator: it accepts connections until `nranks` distinct ranks have
//    joined (nranks comes from the first joiner; every joiner must agree), checks each joiner's
//    secret, then sends rank 0 the table of all entries (rank order), tells every other rank
//    that its copy comes from its parent in a binomial tree over the ranks, and exits. A wrong
//    secret, a rank out of range, a duplicate rank or a different nranks is answered with an
//    error text to that joiner alone; ranks that do not all join within the init timeout get the
//    list of missing ranks as their error. O(n) connections and messages in total; the root
//    sends one copy of the table and no rank more than ceil(log2 n) (bootstrap.cc, wire).
//  * join() listens for its parent, connects to the root named by the id (retrying until the
//    deadline: the root process may still be starting its listener), sends this rank's entry,
//    receives the table (from the root or its parent), forwards it to its children and returns
//    it, or throws CommError with the root's error text or CommTimeout (naming the parent
//    that did not send it).
//  * An entry is opaque bytes to the bootstrap (comm.cc encodes key/value pairs).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../hetccl.h"

namespace hetccl {
namespace api {

struct UniqueIdData {
  std::string root;    // "host:port" of the root listener
  std::string secret;  // 16 raw bytes: proves membership to the root and to the transports
  int64_t root_timeout_ms = 0;  // how long the root waits for every rank: a joiner waits for
                                // the table at least that long (plus a margin), so that the
                                // root's verdict (which ranks are missing) reaches it
};

UniqueIdData decode_id(const hetcclUniqueId& id);  // throws CommError if it is not one of ours

// Starts the root (see the contract) and returns the id that names it.
hetcclUniqueId make_root(const std::string& bind_host, int64_t timeout_ms);

// bind_host: where this rank listens for its parent's copy of the table (the bootstrap's tree).
// keep_listener / listeners (optional): that listener is handed to the caller (its fd; the
// caller closes it: Mailbox) instead of being closed, and every rank's listener address is
// returned in rank order.
std::vector<std::string> join(const UniqueIdData& id, int rank, int nranks,
                              const std::string& entry, const std::string& bind_host,
                              int64_t timeout_ms, int* keep_listener = nullptr,
                              std::vector<std::string>* listeners = nullptr);

// A rank's bootstrap listener kept for its communicator's life: a thread accepts messages
//   magic "hetcMAIL" | secret (16) | u64 key | u32 len | payload (at most 4 KiB)
// from the communicator's other ranks (anything else is dropped) and keeps the latest payload
// per key until wait() takes it. hetcclCommShrink's leader sends the new unique id this way, so
// a shrink needs no collective over the parent, which may be broken (a dead peer).
class Mailbox {
 public:
  Mailbox(int listen_fd, std::string secret);  // takes the fd
  ~Mailbox();                                  // stops the thread and closes the listener
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;
  // The payload sent under key, waiting up to timeout_ms; CommTimeout naming `who` after it.
  std::string wait(uint64_t key, int64_t timeout_ms, const std::string& who);

 private:
  void loop();
  struct State;
  std::unique_ptr<State> st_;
};
// Sends payload under key to the Mailbox listening at `listener` ("host:port"); CommError or
// CommTimeout naming `who` when it cannot be reached within timeout_ms.
void mail(const std::string& listener, const std::string& secret, uint64_t key,
          const std::string& payload, int64_t timeout_ms, const std::string& who);

// The local address that routes to `host` ("127.0.0.1" for a loopback host): what this rank's
// transports listen on and advertise.
std::string local_addr_towards(const std::string& host);
// The bootstrap root's default address: the first up, non-loopback IPv4 interface, else 127.0.0.1.
std::string default_root_host();

// Key/value entries (length-prefixed), for the table's entries.
std::string encode_kv(const std::vector<std::pair<std::string, std::string>>& kv);
std::vector<std::pair<std::string, std::string>> decode_kv(const std::string& s);

}  // namespace api
}  // namespace hetccl
