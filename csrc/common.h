// hetccl bridge core: helpers shared by the transports (never by algorithms): logging, clocks,
// futexes, hashing, option parsing, random bytes. Implemented in transport.cc.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"
#include "transport.h"

namespace hetccl {

// ---- logging: one line to stderr, prefixed "hetccl WARN <subsystem>: " (the Python side owns
// log levels; the core only reports what an operator must see).
void log_warn(const char* subsystem, const std::string& msg);

// ---- time
using Clock = std::chrono::steady_clock;
inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
// Deadline helper: timeout_ms < 0 means never.
struct Deadline {
  explicit Deadline(int64_t timeout_ms) : infinite(timeout_ms < 0), at(now_ms() + (timeout_ms < 0 ? 0 : timeout_ms)) {}
  bool infinite;
  int64_t at;
  bool expired() const { return !infinite && now_ms() >= at; }
  int64_t left_ms() const { return infinite ? INT64_MAX : std::max<int64_t>(0, at - now_ms()); }
};

// ---- futex on a 32-bit word in (possibly shared) memory. Not FUTEX_PRIVATE: the word may live in a
// MAP_SHARED mapping used by another process. wait returns on wake, value change, timeout or
// signal; callers re-check their condition.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ms);
void futex_wake(std::atomic<uint32_t>* word, int count = INT32_MAX);

// ---- the receive side shared by the byte-stream transports (shm, tcp) ----
// A posted receive: incoming bytes are copied into buf (at most cap bytes), or, for
// irecv_reduce, reduced into it (the message must be exactly cap bytes).
struct RecvOp {
  RequestPtr req;
  char* buf = nullptr;
  size_t cap = 0;
  bool reduce = false;
  ReduceOp op = ReduceOp::SUM;
  DType dtype = DType::FLOAT32;
  static RecvOp copying(void* buf, size_t cap);
  // Throws CommError (prefixed with `who`) unless nbytes is a whole number of elements.
  static RecvOp reducing(const char* who, void* dst, size_t nbytes, ReduceOp op, DType dtype);
};
// Applies len incoming bytes at `offset` of the receive (copy, or reduce on this thread).
void deliver(const RecvOp& op, size_t offset, const char* src, size_t len);
// "" when a message of `total` bytes fits the receive, else the error text (prefixed with `who`).
std::string size_mismatch(const char* who, const RecvOp& op, size_t total, int peer,
                          uint64_t tag);

// ---- identity of processes and hosts (used by the transports' liveness checks) ----
// Start time of process `pid` (field 22 of /proc/pid/stat), "" if it does not exist; *zombie
// (if given) tells whether it is a zombie. (pid, start time) names a process across pid reuse.
std::string proc_start(pid_t pid, bool* zombie);
// This host's shared-memory domain: kernel boot id, /dev/shm file system and pid namespace
// (transport.cc says why these and not the hostname). Equal ids <=> shm can connect.
std::string host_id();

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// ---- hashing. SHA-256, used for secret proofs (tcp handshake) and shm header checks.
std::string sha256(const std::string& data);  // 32 raw bytes
std::string to_hex(const std::string& raw);
std::string random_bytes(size_t n);  // getrandom(); throws CommError if the kernel refuses

// ---- options
int64_t opt_int(const Options& o, const char* key, int64_t dflt, int64_t lo, int64_t hi);
std::string opt_str(const Options& o, const char* key, const std::string& dflt);

// ---- argument checks shared by the transports' post calls; throw CommError naming the value.
// check_tag enforces tag < kMaxTag (transport.h).
void check_tag(uint64_t tag);
void check_peer(int peer, int rank, int size);

// A request that has already failed (posting to a dead peer, after close()).
RequestPtr failed_request(int peer, uint64_t tag, size_t nbytes, Request::ErrorKind kind,
                          const std::string& msg);

std::string errno_str(int err);

}  // namespace hetccl
