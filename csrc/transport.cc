// Transport registry (make_transport, transport_names) and the helpers of common.h.
#include <linux/futex.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <vector>
#include <string>
#include <sstream>
#include <fstream>
#include <algorithm>
#include <mutex>

#include "common.h"
#include "reduce.h"
#include "transport.h"

namespace hetccl {

RecvOp RecvOp::copying(void* buf, size_t cap) {
  RecvOp op;
  op.buf = static_cast<char*>(buf);
  op.cap = cap;
  return op;
}

RecvOp RecvOp::reducing(const char* who, void* dst, size_t nbytes, ReduceOp rop, DType dtype) {
  if (nbytes % dtype_size(dtype))
    throw CommError(std::string(who) + ": irecv_reduce of " + std::to_string(nbytes) +
                    " bytes is not a whole number of " + dtype_name(dtype) + " elements");
  RecvOp op = copying(dst, nbytes);
  op.reduce = true;
  op.op = rop;
  op.dtype = dtype;
  return op;
}

void deliver(const RecvOp& op, size_t offset, const char* src, size_t len) {
  if (len == 0) return;
  if (op.reduce)
    reduce_into(op.op, op.dtype, op.buf + offset, src, len / dtype_size(op.dtype), 1);
  else
    std::memcpy(op.buf + offset, src, len);
}

std::string size_mismatch(const char* who, const RecvOp& op, size_t total, int peer,
                          uint64_t tag) {
  if (op.reduce ? total == op.cap : total <= op.cap) return "";
  return std::string(who) + ": message from peer rank " + std::to_string(peer) + " with tag " +
         std::to_string(tag) + " has " + std::to_string(total) + " bytes but the " +
         (op.reduce ? "irecv_reduce expects exactly " : "receive buffer holds only ") +
         std::to_string(op.cap) + " bytes";
}

std::string proc_start(pid_t pid, bool* zombie) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!f || !std::getline(f, s)) return "";
  size_t r = s.rfind(')');
  if (r == std::string::npos) return "";
  std::istringstream in(s.substr(r + 2));
  std::string field;
  std::vector<std::string> v;
  while (in >> field) v.push_back(field);
  // v[0] is field 3 (state); field 22 is v[19].
  if (v.size() < 20) return "";
  if (zombie) *zombie = v[0] == "Z" || v[0] == "X";
  return v[19];
}

std::string host_id() {
  // What makes the shm transport (and UCX's shared-memory paths) reach a peer, and nothing else:
  //  * the same kernel (boot id): futexes and shared mappings work only inside one kernel;
  //  * the same /dev/shm file system (device and inode of its root): shm_open names a file in
  //    the /dev/shm this process sees; a container or a mount namespace with a tmpfs of its own
  //    has a different device, even on one kernel;
  //  * the same pid namespace: the liveness checks read /proc/<peer pid> (and UCX's cma uses
  //    process_vm_readv on it), which names another process in another pid namespace.
  // The hostname (UTS namespace) and the network namespace are left out on purpose: neither
  // changes whether shared memory works (two containers with --ipc=host and their own network
  // still share /dev/shm); different hosts differ in the boot id anyway. The result contains no
  // space and no '|' (both transports' addresses are separated by them).
  std::string boot;
  {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
  }
  if (boot.empty()) boot = "noboot";
  std::string shm = "noshm";
  struct stat st;
  if (::stat("/dev/shm", &st) == 0)
    shm = std::to_string(major(st.st_dev)) + "." + std::to_string(minor(st.st_dev)) + "." +
          std::to_string(st.st_ino);
  std::string pidns = "nopidns";
  if (::stat("/proc/self/ns/pid", &st) == 0) pidns = std::to_string(st.st_ino);
  return boot + "/shm" + shm + "/pidns" + pidns;
}


// ------------------------------------------------------------------ registry
namespace {
struct Registered {
  std::string name;
  CapsFn caps;
  FactoryFn make;
};
// Function-local: registrations run from other files' static initialisers, in any order.
std::vector<Registered>& registry() {
  static std::vector<Registered> r;
  return r;
}
}  // namespace

bool register_transport(const char* name, CapsFn caps, FactoryFn make) {
  for (auto& r : registry())
    if (r.name == name) {
      log_warn("transport", std::string("transport '") + name + "' registered twice; keeping the first");
      return false;
    }
  registry().push_back({name, caps, make});
  return true;
}

std::vector<std::string> transport_names() {
  std::vector<std::string> v;
  for (auto& r : registry()) v.push_back(r.name);
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<TransportCaps> transport_table() {
  static std::mutex mu;
  static std::vector<TransportCaps> table;  // computed once: UCX's needs a UCP context
  std::lock_guard<std::mutex> g(mu);
  if (table.empty()) {
    for (auto& r : registry()) {
      TransportCaps c = r.caps();
      c.name = r.name;  // the registered name is the one users type
      table.push_back(std::move(c));
    }
    std::sort(table.begin(), table.end(), [](const TransportCaps& a, const TransportCaps& b) {
      return a.preference != b.preference ? a.preference < b.preference : a.name < b.name;
    });
  }
  return table;
}

std::unique_ptr<Transport> make_transport(const std::string& name, int rank, int size,
                                          const Options& opts) {
  if (size < 1 || rank < 0 || rank >= size)
    throw CommError("hetccl: bad rank " + std::to_string(rank) + " for size " + std::to_string(size));
  for (auto& r : registry())
    if (r.name == name) return r.make(rank, size, opts);
  std::string known;
  for (auto& n : transport_names()) known += (known.empty() ? "" : ", ") + n;
  throw CommError("hetccl: unknown transport '" + name + "' (this build has: " + known + ")");
}

// ------------------------------------------------------------------ logging
void log_warn(const char* subsystem, const std::string& msg) {
  std::string line = std::string("hetccl WARN ") + subsystem + ": " + msg + "\n";
  // One write() so that lines of concurrent ranks do not interleave.
  ssize_t r = ::write(2, line.data(), line.size());
  (void)r;
}

std::string errno_str(int err) {
  char buf[128];
  return std::string(strerror_r(err, buf, sizeof buf));
}

// ------------------------------------------------------------------ futex
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ms) {
  struct timespec ts, *tsp = nullptr;
  if (timeout_ms >= 0) {
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = (timeout_ms % 1000) * 1000000;
    tsp = &ts;
  }
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, tsp, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

// ------------------------------------------------------------------ sha256 (FIPS 180-4)
namespace {
const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
void sha256_block(uint32_t h[8], const unsigned char* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}
}  // namespace

std::string sha256(const std::string& data) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string m = data;
  uint64_t bits = uint64_t(data.size()) * 8;
  m.push_back(char(0x80));
  while (m.size() % 64 != 56) m.push_back('\0');
  for (int i = 7; i >= 0; --i) m.push_back(char((bits >> (8 * i)) & 0xff));
  for (size_t off = 0; off < m.size(); off += 64)
    sha256_block(h, reinterpret_cast<const unsigned char*>(m.data()) + off);
  std::string out(32, '\0');
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = char((h[i] >> (24 - 8 * j)) & 0xff);
  return out;
}

std::string to_hex(const std::string& raw) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(raw.size() * 2);
  for (unsigned char c : raw) {
    s.push_back(d[c >> 4]);
    s.push_back(d[c & 15]);
  }
  return s;
}

std::string random_bytes(size_t n) {
  std::string s(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(&s[got], n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw CommError("hetccl: getrandom failed: " + errno_str(errno));
    }
    got += size_t(r);
  }
  return s;
}

// ------------------------------------------------------------------ options and checks
int64_t opt_int(const Options& o, const char* key, int64_t dflt, int64_t lo, int64_t hi) {
  auto it = o.find(key);
  if (it == o.end() || it->second.empty()) return dflt;
  size_t pos = 0;
  int64_t v;
  try {
    v = std::stoll(it->second, &pos, 0);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos == 0 || pos != it->second.size())
    throw CommError(std::string("hetccl: option ") + key + "='" + it->second + "' is not an integer");
  if (v < lo || v > hi)
    throw CommError(std::string("hetccl: option ") + key + "=" + it->second + " is out of range [" +
                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

std::string opt_str(const Options& o, const char* key, const std::string& dflt) {
  auto it = o.find(key);
  return it == o.end() || it->second.empty() ? dflt : it->second;
}

void check_tag(uint64_t tag) {
  if (tag >= kMaxTag)
    throw CommError("hetccl: tag " + std::to_string(tag) + " is too large (user tags must be < 2^48)");
}

void check_peer(int peer, int rank, int size) {
  if (peer < 0 || peer >= size || peer == rank)
    throw CommError("hetccl: bad peer rank " + std::to_string(peer) + " (this is rank " +
                    std::to_string(rank) + " of " + std::to_string(size) + ")");
}

RequestPtr failed_request(int peer, uint64_t tag, size_t nbytes, Request::ErrorKind kind,
                          const std::string& msg) {
  auto r = std::make_shared<Request>(peer, tag, nbytes);
  r->fail(kind, msg);
  return r;
}

}  // namespace hetccl
