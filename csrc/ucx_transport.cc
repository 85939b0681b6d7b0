// UCX transport: UCP tagged messages over whatever transports UCX selects (here: tcp, posix/sysv
// shared memory, cma, self; on clusters a system UCX adds RDMA and GPU memory).
//
// Design (see the UCX section of docs/transports.md):
//  * One ucp_context + `lanes` ucp_workers per Transport instance (options["lanes"], default 1).
//    Workers are in SERIALIZED mode: every UCP call (posting from caller threads, progress from
//    our thread) holds mu_.
//  * Addressing: address() is text, "hetccl-ucx3 <rank> <pid> <start> <host id> <nonce hex>
//    <max message> <worker address hex>,..." (one per lane; <start>: the process start time from
//    /proc, "-" if unknown; <max message>: this rank's message_limit bound, below). connect()
//    creates one endpoint per lane to every peer with a non-empty address (UCX wires up lazily;
//    there is no listener).
//  * Tags: UCP tag = device bit (63) | source rank (bits 48..62) | user tag (< 2^48). Receives match
//    the full tag, so matching is per (peer, tag); UCP keeps same-tag messages from one endpoint
//    in order (FIFO). Source-rank field 0x7FFF is reserved for the handshake and the goodbye that
//    close() sends (so that peers notice a graceful close even where UCX cannot), so ranks must
//    be < 32767.
//  * Lanes: the k-th message of a (peer, tag) travels on lane (tag + k) % lanes on both ends
//    (next_lane_locked), so each lane keeps FIFO and one tag's stream uses every lane's
//    connections (UCX's tcp has one connection per endpoint and device).
//  * Device memory (isend_device/irecv_device): the device bit's tag space, never drained into
//    the stash (it could not be copied into device memory here); UCX moves device memory itself
//    (cuda_copy / rocm_copy, GPUDirect RDMA). A device send completes once the peer posted the
//    receive (transport.h).
//  * Device memory handles (prepare_device, option device_prepare, default on): UCX 1.22's
//    cuda_copy calls cuCtxSetFlags(CU_CTX_SYNC_MEMOPS) -- which takes the CUDA context's write
//    lock -- on every memory query of a device buffer (uct_cuda_copy_md_mem_query; UCX PR 11705,
//    "set once per context", is not in 1.22.0), and UCP queries device buffers per operation
//    even when their memory type is declared (ucp_datatype_iter_detect_mem_info shortcuts only
//    host memory). The engine posts device messages from its proxy thread; an application
//    thread blocked inside a driver call behind the collective's stream (`x.cpu()` right after
//    the all-reduce: a pageable copy waits for the stream holding the lock) then deadlocks with
//    it. So the issuing thread maps each direct buffer range once (ucp_mem_map: the query runs
//    there, where no application CUDA call waits on the stream), and posts carry the handle
//    (UCP_OP_ATTR_FIELD_MEMH), which makes UCP take the memory info from it instead of querying.
//    Handles are cached per range (at most kMemhMax; unmapped only while no device operation is
//    pending) and used only where no RDMA transport registers (pins) device memory: with
//    cuda_copy/rocm_copy and tcp a handle describes the memory (type, device) and pins nothing,
//    so a range freed and reallocated by the framework's caching allocator stays correctly
//    described; an RDMA registration of freed memory would not be, so with RDMA UCX's own
//    registration cache decides (posts without a handle).
//  * Configuration applied before the context exists: options["ucx_config"] (tuning,
//    "KEY=VALUE;..."), options["exclude_tls"] (transports removed from the UCX_TLS in force:
//    restrict_tls()); info() reports what UCX reads back.
//  * Authentication: each side's first message to a peer, on the reserved tag, carries its rank and
//    a proof sha256(secret | receiver's nonce | sender rank | receiver rank) of the group secret
//    (options["secret"]); the secret itself never goes on the wire. connect() returns only when
//    every peer presented a valid proof; a wrong one is rejected with CommError ("wrong group
//    secret"). Limit: UCP tagged messages carry no sender identity, so this proves that every peer
//    we connect to knows the secret; it does not stop a third process that learned our worker
//    address (published in the store) from injecting tagged messages.
//  * Unexpected messages: a UCP send larger than UCX's rendezvous threshold completes only once the
//    receiver has matched it, but the contract wants a send to complete without a posted receive.
//    So the progress thread drains every unexpected message (ucp_tag_probe_nb with an empty mask,
//    then ucp_tag_msg_recv_nbx) into a heap buffer (the "stash", per full tag, FIFO). A receive
//    first takes the oldest stashed message of its (peer, tag), else it is posted to UCP; stashed
//    messages are always older than any UCP still holds, so FIFO per (peer, tag) holds. A receive
//    posted before its message arrives gets it zero-copy (rendezvous straight into the buffer).
//  * irecv_reduce (option reduce_unpack, default on): a receive posted to UCP uses a generic
//    datatype whose unpack() reduces each piece UCX delivers into dst on the progress thread
//    (reduce_unpack below), chunk by chunk as the tcp/shm transports do. A message taken from the
//    stash, and every one with reduce_unpack off, is reduced whole from its buffer (the stash's,
//    or a pooled bounce buffer) by the copy thread.
//  * Peer failure: endpoints are created with UCP_ERR_HANDLING_MODE_PEER; the error callback fails
//    every pending request naming that peer (PeerFailure) and the endpoint is force-closed. A
//    failed operation (e.g. a cma read from a vanished process) does the same. UCX's
//    shared-memory transports (posix, sysv) do not support PEER mode: when UCX cannot build a
//    PEER-mode endpoint (e.g. UCX_TLS=posix,sysv,cma,self) we fall back to an endpoint without
//    error handling. UCX then cannot tell that a peer died, so the progress thread checks every
//    kLivenessMs that each peer on this host is still the same live process (kill(pid, 0) and its
//    /proc start time, as the shm transport does). A peer it cannot check (another pid
//    namespace) and a hung one are noticed only through the caller's timeout.
//    With UCX_TLS unset (all transports), PEER mode makes UCX pick tcp even between processes on
//    one host, because posix/sysv cannot carry a PEER-mode lane.
//  * Progress: a thread that progresses the worker, spins for ~spin_us (option, default kSpinUs
//    = 50 us; HETCCL_UCX_SPIN_US) after the last event, then arms the worker (ucp_worker_arm)
//    and sleeps in poll() on its event fd. Trade-off: a longer spin saves the wake-up of a
//    message that follows soon (and of every lane's part when striped) and costs a core while
//    it spins -- where cores are scarce (the 2-core machines) it takes them from the peer. Posting
//    threads wake it with ucp_worker_signal when it sleeps. Finished host receives that still
//    need a copy (from the stash) or a reduction (irecv_reduce) go to a second thread, the copy
//    thread (option copy_thread, default on; off: the progress thread runs them), so that UCX
//    keeps reading and sending while they run; it touches no UCX object and takes no mu_.
//  * Configuration: UCX reads its own UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...).
//    options["bind_addr"]: a loopback address (a job on one host; Python's default there) sets
//    UCX's NET_DEVICES to the loopback interface through ucp_config_modify, overriding
//    UCX_NET_DEVICES, so that UCX's tcp stays on loopback (by default it also uses eth0).
//    Shared-memory devices are not affected. Any other bind_addr is only checked, not applied:
//    NET_DEVICES also selects RDMA devices, and pinning it to one Ethernet interface would turn
//    RDMA off on a cluster; set UCX_NET_DEVICES (e.g. "mlx5_0:1,eth0") to choose devices there.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <ucs/config/global_opts.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <deque>
#include <csignal>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common.h"
#include "match.h"
#include "transport.h"

namespace hetccl {
namespace {

// UCP tag: [63] device tag space | [62..48] source rank | [47..0] user tag.
constexpr int kTagShift = 48;
static_assert(kMaxTag == uint64_t(1) << kTagShift, "user tags must leave the top 16 bits free");
constexpr uint64_t kSrcMask = 0x7FFF;               // 15-bit source-rank field
constexpr uint64_t kDeviceBit = uint64_t(1) << 63;  // isend_device/irecv_device: never stashed
constexpr uint64_t kHandshakeSrc = 0x7FFF;  // reserved source-rank field
constexpr uint64_t kByeBit = uint64_t(1) << 47;  // with kHandshakeSrc: "sender closed its transport"
constexpr uint64_t kFullMask = ~uint64_t(0);
constexpr const char* kAddrMagic = "hetccl-ucx3";
constexpr int kMaxLanes = 16;
constexpr char kHelloMagic[8] = {'H', 'C', 'C', 'L', 'H', 'L', 'O', '1'};
constexpr size_t kNonceBytes = 16;
constexpr size_t kHelloBytes = sizeof kHelloMagic + 4 + 32;  // magic | rank | proof
constexpr size_t kHelloMax = 256;                            // receive buffer (longer: rejected)
constexpr int kSpinUs = 50;                    // busy progress after the last event (option spin_us)
constexpr int kPollMs = 100;                   // sleep bound while armed
constexpr size_t kPoolMaxBytes = size_t(256) << 20;  // bounce buffers kept for reuse
constexpr int64_t kCloseFlushMs = 2000;        // graceful flush at close, when nothing is pending
constexpr int64_t kLivenessMs = 200;           // pid checks of peers on this host
constexpr size_t kMemhMax = 512;               // cached device memory handles (prepare_device)

uint64_t make_tag(uint64_t src, uint64_t tag, bool device = false) {
  return (device ? kDeviceBit : 0) | (src << kTagShift) | tag;
}

std::string status_str(ucs_status_t s) { return ucs_status_string(s); }

void check(ucs_status_t s, const char* what) {
  if (s != UCS_OK) throw CommError(std::string("hetccl ucx: ") + what + ": " + status_str(s));
}

bool from_hex(const std::string& h, std::string* out) {
  if (h.size() % 2) return false;
  out->clear();
  for (size_t i = 0; i < h.size(); i += 2) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      char c = h[i + k];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    out->push_back(char(v));
  }
  return true;
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(p[i])) << (8 * i);
  return v;
}

std::string proof(const std::string& secret, const std::string& receiver_nonce, int src, int dst) {
  return sha256(secret + "|hetccl-ucx|" + receiver_nonce + "|" + std::to_string(src) + "|" +
                std::to_string(dst));
}

bool equal_const_time(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) diff |= (unsigned char)(a[i] ^ b[i]);
  return diff == 0;
}

// True for 127.0.0.0/8 and ::1; throws CommError if `addr` is not an IP address.
bool is_loopback(const std::string& addr) {
  in_addr a4{};
  in6_addr a6{};
  if (inet_pton(AF_INET, addr.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, addr.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  throw CommError("hetccl ucx: bind_addr '" + addr + "' is not an IP address");
}

// Name of the interface that owns `addr` (IPv4 or IPv6 literal); throws if none does.
std::string ifname_for_address(const std::string& addr) {
  in6_addr a6{};
  in_addr a4{};
  bool v4 = inet_pton(AF_INET, addr.c_str(), &a4) == 1;
  bool v6 = !v4 && inet_pton(AF_INET6, addr.c_str(), &a6) == 1;
  if (!v4 && !v6) throw CommError("hetccl ucx: bind_addr '" + addr + "' is not an IP address");
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw CommError("hetccl ucx: getifaddrs failed");
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    if (v4 && i->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == a4.s_addr)
      found = i->ifa_name;
    if (v6 && i->ifa_addr->sa_family == AF_INET6 &&
        std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, &a6, sizeof a6) == 0)
      found = i->ifa_name;
  }
  freeifaddrs(list);
  if (found.empty()) throw CommError("hetccl ucx: no interface has bind_addr " + addr);
  return found;
}

// Text UCX prints for a config or context (ucp_config_print, ucp_context_print_info).
template <class F>
std::string ucx_print(F print) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (!f) return "";
  print(f);
  fclose(f);
  std::string text(buf ? buf : "", len);
  free(buf);
  return text;
}

// Value of UCX setting UCX_<name> in `config` as UCX itself prints it (so tests and the doctor
// read back what is in force, not what we meant to set); "" if UCX does not print it.
std::string config_value(const ucp_config_t* config, const std::string& name) {
  std::string text = ucx_print([&](FILE* f) { ucp_config_print(config, f, nullptr, UCS_CONFIG_PRINT_CONFIG); });
  const std::string key = "UCX_" + name + "=";
  for (size_t pos = 0; (pos = text.find(key, pos)) != std::string::npos; pos += key.size())
    if (pos == 0 || text[pos - 1] == '\n') {
      size_t end = text.find('\n', pos);
      return text.substr(pos + key.size(), end == std::string::npos ? std::string::npos : end - pos - key.size());
    }
  return "";
}

// The transports (tl names, e.g. "tcp", "posix", "cuda_copy") a UCP context has resources of.
std::vector<std::string> context_transports(ucp_context_h ctx) {
  std::string text = ucx_print([&](FILE* f) { ucp_context_print_info(ctx, f); });
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    size_t r = line.find("resource");
    size_t d = line.find("-- ");
    if (r == std::string::npos || d == std::string::npos) continue;
    std::string tl = line.substr(d + 3);
    tl = tl.substr(0, tl.find('/'));
    while (!tl.empty() && (tl.back() == ' ' || tl.back() == '\r')) tl.pop_back();
    if (!tl.empty() && std::find(out.begin(), out.end(), tl) == out.end()) out.push_back(tl);
  }
  return out;
}

std::vector<std::string> split_list(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) {
    while (!cur.empty() && cur.front() == ' ') cur.erase(cur.begin());
    while (!cur.empty() && cur.back() == ' ') cur.pop_back();
    if (!cur.empty()) out.push_back(cur);
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// UCX_TLS with the transports in `exclude` taken out, keeping everything else of `current`
// (the user's value, as UCX parsed it):
//   "all" / ""          -> "^<exclude>"            (everything except them)
//   "^a,b" (deny list)  -> "^a,b,<exclude>"
//   "a,b,c" (allow)     -> the same list without them; an alias that covers one of them
//                          (cuda = cuda_copy,cuda_ipc,gdr_copy; rocm = rocm_copy,rocm_ipc,rocm_gdr;
//                          sm/shm = posix,sysv,xpmem,cma,knem; mm = posix,sysv,xpmem) is
//                          replaced by its remaining members.
// Throws CommError when an allow list keeps nothing but "self" (nothing could reach a peer).
std::string restrict_tls(const std::string& current, const std::vector<std::string>& exclude) {
  if (exclude.empty()) return current;
  static const std::map<std::string, std::vector<std::string>> aliases = {
      {"cuda", {"cuda_copy", "cuda_ipc", "gdr_copy"}},
      {"rocm", {"rocm_copy", "rocm_ipc", "rocm_gdr"}},
      {"sm", {"posix", "sysv", "xpmem", "cma", "knem"}},
      {"shm", {"posix", "sysv", "xpmem", "cma", "knem"}},
      {"mm", {"posix", "sysv", "xpmem"}}};
  auto excluded = [&](const std::string& t) {
    return std::find(exclude.begin(), exclude.end(), t) != exclude.end();
  };
  std::string cur = current;
  if (cur.empty() || cur == "all") return "^" + join(exclude);
  if (cur[0] == '^') {
    std::vector<std::string> deny = split_list(cur.substr(1));
    for (auto& e : exclude)
      if (std::find(deny.begin(), deny.end(), e) == deny.end()) deny.push_back(e);
    return "^" + join(deny);
  }
  std::vector<std::string> keep;
  for (auto& t : split_list(cur)) {
    std::string base = t.substr(0, t.find(':'));  // "tcp:aux" style qualifiers
    if (base == "all") return "^" + join(exclude);
    if (excluded(base)) continue;
    auto a = aliases.find(base);
    if (a == aliases.end()) {
      keep.push_back(t);
      continue;
    }
    std::vector<std::string> rest;
    for (auto& m : a->second)
      if (!excluded(m)) rest.push_back(m);
    if (rest.size() == a->second.size()) {
      keep.push_back(t);
    } else {
      for (auto& m : rest)
        if (std::find(keep.begin(), keep.end(), m) == keep.end()) keep.push_back(m);
    }
  }
  bool usable = false;
  for (auto& t : keep) usable = usable || t != "self";
  if (!usable)
    throw CommError("hetccl ucx: UCX_TLS=" + current + " leaves no transport to reach a peer once " +
                    join(exclude) + " are removed (hetccl removes device-to-device paths, and shared "
                    "memory when hosts are emulated, between vendor groups on one host); add tcp or "
                    "another network transport to UCX_TLS");
  return join(keep);
}

// Receive buffers for irecv_reduce, reused across calls (bounded cache).
class BouncePool {
 public:
  struct Buf {
    std::unique_ptr<char[]> p;
    size_t cap = 0;
  };
  Buf get(size_t n) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.lower_bound(n);
      if (it != free_.end() && it->first <= 2 * n + 4096) {
        Buf b = std::move(it->second);
        cached_ -= b.cap;
        free_.erase(it);
        return b;
      }
    }
    Buf b;
    b.cap = n ? n : 1;
    b.p.reset(new char[b.cap]);
    return b;
  }
  void put(Buf b) {
    if (!b.p) return;
    std::lock_guard<std::mutex> g(mu_);
    while (cached_ + b.cap > kPoolMaxBytes && !free_.empty()) {  // drop the smallest first
      cached_ -= free_.begin()->first;
      free_.erase(free_.begin());
    }
    if (b.cap > kPoolMaxBytes) return;
    cached_ += b.cap;
    free_.emplace(b.cap, std::move(b));
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, Buf> free_;
  size_t cached_ = 0;
};

class UcxTransport;

// A device memory range mapped by prepare_device (start: the key of UcxTransport::memh_).
struct MemhEntry {
  uintptr_t end = 0;
  ucp_mem_h memh = nullptr;
};

// Send, Recv, RecvReduce: a user operation. Stash: the receive of an unexpected message into
// a heap buffer (no Request; it belongs to the transport until a user receive takes it).
enum class OpKind { Send, Recv, RecvReduce, Stash };

// One operation. Owned by the transport from posting until it is finished (completion callback,
// delivery from the stash, or close()).
struct Op {
  UcxTransport* t = nullptr;
  RequestPtr req;  // null for Stash
  int peer = -1;
  uint64_t tag = 0;   // user tag
  OpKind kind = OpKind::Send;
  int lane = 0;       // worker the operation is posted on
  bool device = false;  // device tag space (prepare_device's handles stay mapped while pending)
  size_t nbytes = 0;  // posted size (Stash: message size)
  void* ucp_req = nullptr;  // set once posting returned a request handle
  void* buf = nullptr;      // Recv: the user's buffer
  // RecvReduce
  void* dst = nullptr;
  ReduceOp rop = ReduceOp::SUM;
  DType dtype = DType::FLOAT32;
  BouncePool::Buf bounce;  // RecvReduce: landing buffer; Stash: the message
  // RecvReduce posted with the reducing datatype (option reduce_unpack): UCX hands the message
  // to unpack() piece by piece; an element split between pieces waits here until complete.
  bool streamed = false;
  std::map<size_t, std::pair<std::array<char, 16>, size_t>> partial;  // element -> bytes, count
  uint64_t pieces = 0, splits = 0;  // pieces unpacked, elements split between pieces (info())
  // Stash
  uint64_t key = 0;        // full UCP tag
  bool ready = false;      // message complete in `bounce`
  bool bye = false;        // the peer's goodbye (not stashed; fails the peer once received)
  Op* waiter = nullptr;    // user receive that took this message while it was still arriving
};

// A finished receive whose data must still be copied or reduced (progress thread, no lock):
// user op `op` from `src` (a Stash op, or null: op->bounce holds the message).
struct Work {
  Op* op;
  Op* src;
  size_t len;
};

struct Peer {
  UcxTransport* t = nullptr;
  int rank = -1;
  bool is_peer = false;     // connect() got an address for this rank
  std::string where;        // "pid P on host H", for error messages
  std::string nonce;        // its handshake nonce
  pid_t pid = 0;
  std::string start;        // its /proc start time if it is on this host and checkable, else ""
  size_t max_message = 0;   // its published message bound (option max_message; 0: none)
  std::vector<ucp_ep_h> eps;  // one per lane; null again once closed after a failure
  bool peer_mode = false;  // endpoint created with UCP_ERR_HANDLING_MODE_PEER
  bool failed = false;
  bool close_pending = false;  // failed; endpoint to be force-closed by the progress thread
  std::string reason;
  std::string hello_out;
  std::vector<char> hello_in;
};

// The reducing receive datatype (option reduce_unpack). A UCP generic datatype's unpack()
// receives the message in pieces at their offsets as the protocol delivers them (eager
// fragments, rendezvous fragments; a piece may end inside an element, and pieces of one message
// may come out of order), so each piece is reduced into dst straight from UCX's receive buffer
// while it is in cache, instead of landing whole in a bounce buffer and being read again.
// Runs wherever UCX progresses the worker or matches the receive (the progress thread, or a
// posting thread inside ucp_tag_recv_nbx); always with mu_ held. Contract: the state is the Op
// (passed as the receive's buffer); a message of another length than the receive fails the
// request after the pieces within it were reduced (irecv_reduce requires the exact length;
// a failed collective's output is undefined). Once the request has failed (peer failure,
// close()) while UCX still delivers, a piece returns an error instead of writing dst: the
// caller may already have reused that memory.
// Alignment: a piece starts wherever UCX's receive buffer puts it (tcp's AM headers are 5
// bytes), so pieces not aligned to their element are first copied, 64 KiB at a time, into
// an aligned buffer (cheap: the piece is in cache) -- reduce_into reads typed pointers.
void* reduce_start_pack(void*, const void*, size_t) { return nullptr; }  // receive-only type
void* reduce_start_unpack(void*, void* buffer, size_t) { return buffer; }
size_t reduce_packed_size(void* state) { return static_cast<Op*>(state)->nbytes; }
size_t reduce_pack(void*, size_t, void*, size_t) { return 0; }
void reduce_finish(void*) {}
ucs_status_t reduce_unpack(void* state, size_t offset, const void* src, size_t length) {
  Op* op = static_cast<Op*>(state);
  if (offset > op->nbytes || length > op->nbytes - offset) return UCS_ERR_MESSAGE_TRUNCATED;
  if (op->req && op->req->test_nothrow()) return UCS_ERR_CANCELED;  // failed: dst not ours
  ++op->pieces;
  const size_t es = dtype_size(op->dtype);
  char* dst = static_cast<char*>(op->dst);
  const char* in = static_cast<const char*>(src);
  // bytes [a, e) of an element that straddles a piece boundary: gathered, reduced once whole
  auto part = [&](size_t a, size_t e) {
    if (a == e) return;
    auto& pe = op->partial[a / es];
    if (pe.second == 0) ++op->splits;
    std::memcpy(pe.first.data() + a % es, in + (a - offset), e - a);
    pe.second += e - a;
    if (pe.second == es) {
      reduce_into(op->rop, op->dtype, dst + (a / es) * es, pe.first.data(), 1, 1);
      op->partial.erase(a / es);
    }
  };
  size_t end = offset + length;
  size_t first = (offset + es - 1) / es * es, last = end / es * es;  // whole elements: [first, last)
  if (first >= last) {
    if (offset < end) {
      size_t cut = std::min(end, first);  // at most two elements' bytes
      part(offset, cut);
      if (cut < end) part(cut, end);
    }
    return UCS_OK;
  }
  if (offset < first) part(offset, first);
  const char* whole = in + (first - offset);
  if (reinterpret_cast<uintptr_t>(whole) % es == 0) {
    reduce_into(op->rop, op->dtype, dst + first, whole, (last - first) / es, 1);
  } else {
    alignas(64) static thread_local char aligned[64 << 10];
    for (size_t at = 0; at < last - first; at += sizeof aligned) {
      size_t n = std::min(sizeof aligned, last - first - at);  // a multiple of es (<= 8)
      std::memcpy(aligned, whole + at, n);
      reduce_into(op->rop, op->dtype, dst + first + at, aligned, n / es, 1);
    }
  }
  if (last < end) part(last, end);
  return UCS_OK;
}
ucp_generic_dt_ops_t reduce_dt_ops() {
  ucp_generic_dt_ops_t o{};
  o.start_pack = reduce_start_pack;
  o.start_unpack = reduce_start_unpack;
  o.packed_size = reduce_packed_size;
  o.pack = reduce_pack;
  o.unpack = reduce_unpack;
  o.finish = reduce_finish;
  return o;
}

void send_cb(void* request, ucs_status_t status, void* user_data);
void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data);
void ep_err_cb(void* arg, ucp_ep_h ep, ucs_status_t status);

class UcxTransport final : public Transport {
 public:
  UcxTransport(int rank, int size, const Options& opts) : rank_(rank), size_(size) {
    if (size < 1 || rank < 0 || rank >= size)
      throw CommError("hetccl ucx: bad rank " + std::to_string(rank) + " of " + std::to_string(size));
    if (uint64_t(size) >= kHandshakeSrc)
      throw CommError("hetccl ucx: at most 32766 ranks (the tag carries the rank in 15 bits)");
    secret_ = opt_str(opts, "secret", "");
    nonce_ = random_bytes(kNonceBytes);
    peers_.resize(size);
    for (int p = 0; p < size; ++p) {
      peers_[p].t = this;
      peers_[p].rank = p;
    }

    lanes_ = int(opt_int(opts, "lanes", 1, 1, kMaxLanes));
    spin_us_ = int(opt_int(opts, "spin_us", kSpinUs, 0, 1000000));
    max_message_ = size_t(opt_int(opts, "max_message", 0, 0, int64_t(1) << 40));
    {
      std::string ct = opt_str(opts, "copy_thread", "on");
      if (ct != "on" && ct != "off")
        throw CommError("hetccl ucx: copy_thread must be on or off, not '" + ct + "'");
      copy_thread_on_ = ct == "on";
    }
    {
      std::string ru = opt_str(opts, "reduce_unpack", "on");
      if (ru != "on" && ru != "off")
        throw CommError("hetccl ucx: reduce_unpack must be on or off, not '" + ru + "'");
      reduce_unpack_ = ru == "on";
    }
    {
      std::string dp = opt_str(opts, "device_prepare", "on");
      if (dp != "on" && dp != "off")
        throw CommError("hetccl ucx: device_prepare must be on or off, not '" + dp + "'");
      device_prepare_ = dp == "on";
    }
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    try {
      // Tuning: "KEY=VALUE;KEY=VALUE" (UCX names without the UCX_ prefix). Python passes only
      // keys the user did not set in the environment (hetccl/config.py, HETCCL_UCX_TUNING).
      for (auto& kv : split_list(opt_str(opts, "ucx_config", ""), ';')) {
        size_t eq = kv.find('=');
        if (eq == std::string::npos || eq == 0)
          throw CommError("hetccl ucx: ucx_config entry '" + kv + "' is not KEY=VALUE");
        std::string key = kv.substr(0, eq), val = kv.substr(eq + 1);
        if (ucp_config_modify(config, key.c_str(), val.c_str()) != UCS_OK)
          throw CommError("hetccl ucx: UCX rejected the setting " + key + "=" + val +
                          " (HETCCL_UCX_TUNING; see `ucx_info -c` for the names this UCX knows)");
        tuned_.push_back(key + "=" + val);
      }
      std::string bind = opt_str(opts, "bind_addr", "");
      if (!bind.empty() && is_loopback(bind))
        check(ucp_config_modify(config, "NET_DEVICES", ifname_for_address(bind).c_str()),
              "ucp_config_modify(NET_DEVICES)");
      // Paths that must not carry cross-vendor traffic (device IPC between emulated vendors on
      // one host; shared memory when hosts are emulated): removed from whatever UCX_TLS is.
      std::vector<std::string> exclude = split_list(opt_str(opts, "exclude_tls", ""));
      if (!exclude.empty()) {
        std::string tls = restrict_tls(config_value(config, "TLS"), exclude);
        if (ucp_config_modify(config, "TLS", tls.c_str()) != UCS_OK)
          throw CommError("hetccl ucx: UCX rejected UCX_TLS=" + tls);
      }
      tls_ = config_value(config, "TLS");
    } catch (...) {
      ucp_config_release(config);
      throw;
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    check(st, "ucp_init");
    resources_ = context_transports(context_);
    for (auto& t : resources_)
      for (const char* r : {"rc", "dc", "ud", "srd", "gga"})
        if (t.compare(0, std::strlen(r), r) == 0) rdma_ = true;
    // The message bound (message_limit): UCX over tcp moves a host message zero-copy up to a
    // size its segments set (UCX 1.22: 2 x TCP_TX_SEG_SIZE - 32 bytes; larger ones take
    // "fragmented copy-in copy-out", one more copy on each end, and the bimodal speed of
    // docs/benchmarks.md). Python computes it (hetccl/transports.py, HETCCL_UCX_MAX_MESSAGE);
    // with RDMA UCX's rendezvous is zero-copy at any size, so there is no bound. Whole pages,
    // so that a chunk cut at the bound holds whole elements of every dtype.
    max_message_ = rdma_ ? 0 : max_message_ / 4096 * 4096;
    // UCX gives up zero-copy rendezvous for a generic datatype: with RDMA a reducing receive
    // keeps the contiguous bounce buffer (zero-copy into it), until measured there.
    if (reduce_unpack_ && !rdma_) {
      static ucp_generic_dt_ops_t ops = reduce_dt_ops();
      st = ucp_dt_create_generic(&ops, nullptr, &reduce_dt_);
      if (st != UCS_OK) {
        ucp_cleanup(context_);
        context_ = nullptr;
        check(st, "ucp_dt_create_generic");
      }
    }
    ucp_context_attr_t ca{};
    ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context_, &ca) == UCS_OK) memory_types_ = ca.memory_types;

    // One worker per lane: its own tag matching and its own connections to every peer.
    std::vector<std::string> worker_addrs;
    for (int i = 0; i < lanes_; ++i) {
      ucp_worker_params_t wp{};
      wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
      wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
      ucp_worker_h w = nullptr;
      st = ucp_worker_create(context_, &wp, &w);
      int efd = -1;
      ucp_worker_attr_t wa{};
      if (st == UCS_OK) {
        workers_.push_back(w);
        wa.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
        st = ucp_worker_query(w, &wa);
      }
      if (st == UCS_OK) {
        worker_addrs.push_back(to_hex(std::string(reinterpret_cast<const char*>(wa.address), wa.address_length)));
        ucp_worker_release_address(w, wa.address);
        st = ucp_worker_get_efd(w, &efd);
      }
      if (st != UCS_OK) {
        for (ucp_worker_h x : workers_) ucp_worker_destroy(x);
        workers_.clear();
        ucp_cleanup(context_);
        context_ = nullptr;
        if (reduce_dt_) ucp_dt_destroy(reduce_dt_);
        reduce_dt_ = 0;
        check(st, "ucp_worker_create/query/get_efd");
      }
      efds_.push_back(efd);
    }
    std::string start = proc_start(getpid(), nullptr);
    host_ = host_id();
    address_ = std::string(kAddrMagic) + " " + std::to_string(rank_) + " " + std::to_string(getpid()) +
               " " + (start.empty() ? "-" : start) + " " + host_ + " " + to_hex(nonce_) + " " +
               std::to_string(max_message_) + " " + join(worker_addrs);

    if (copy_thread_on_) copy_thread_ = std::thread([this] { copy_loop(); });
    thread_ = std::thread([this] { progress_loop(); });
  }

  ~UcxTransport() override { close(); }

  std::string name() const override { return "ucx"; }
  std::string address() override { return address_; }

  void connect(const std::vector<std::string>& addresses, int64_t timeout_ms) override {
    if (int(addresses.size()) != size_)
      throw CommError("hetccl ucx: connect() got " + std::to_string(addresses.size()) +
                      " addresses for a world of " + std::to_string(size_));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    std::vector<std::pair<int, RequestPtr>> hellos;  // receives, then sends
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) throw CommError("hetccl ucx: connect() on a closed transport");
      for (int p = 0; p < size_; ++p) {
        const std::string& a = addresses[p];
        if (p == rank_ || a.empty()) continue;
        if (peers_[p].is_peer) throw CommError("hetccl ucx: connect() called twice");
        std::vector<std::string> f;
        std::istringstream in(a);
        for (std::string w; in >> w;) f.push_back(w);
        Peer& pr = peers_[p];
        std::vector<std::string> workers;
        auto digits = [](const std::string& x) {
          return !x.empty() && x.size() < 19 && x.find_first_not_of("0123456789") == std::string::npos;
        };
        bool ok = f.size() == 8 && f[0] == kAddrMagic && from_hex(f[5], &pr.nonce) &&
                  pr.nonce.size() == kNonceBytes && digits(f[2]) && digits(f[6]);
        for (auto& h : ok ? split_list(f[7]) : std::vector<std::string>{}) {
          std::string w;
          ok = ok && from_hex(h, &w) && !w.empty();
          workers.push_back(w);
        }
        if (!ok)
          throw CommError("hetccl ucx: address of rank " + std::to_string(p) +
                          " is not a hetccl UCX address (transport mismatch or version skew?)");
        if (int(workers.size()) != lanes_)
          throw CommError("hetccl ucx: rank " + std::to_string(p) + " runs " +
                          std::to_string(workers.size()) + " lanes, this rank " +
                          std::to_string(lanes_) + " (set HETCCL_UCX_LANES alike on every rank)");
        if (f[1] != std::to_string(p))
          throw CommError("hetccl ucx: address published for rank " + std::to_string(p) +
                          " belongs to rank " + f[1]);
        pr.pid = pid_t(std::stol(f[2]));
        pr.max_message = size_t(std::stoull(f[6])) / 4096 * 4096;  // whole pages, as ours
        pr.where = "pid " + f[2] + " on host " + f[4].substr(0, f[4].find('/'));
        // Liveness checks only if we see the same process the peer saw as itself.
        pr.start = f[4] == host_ && f[3] != "-" && proc_start(pr.pid, nullptr) == f[3] ? f[3] : "";
        for (int lane = 0; lane < lanes_; ++lane)
          create_ep_locked(pr, lane, reinterpret_cast<const ucp_address_t*>(workers[lane].data()));
        pr.is_peer = true;
      }
      for (int p = 0; p < size_; ++p) {
        Peer& pr = peers_[p];
        if (!pr.is_peer) continue;
        pr.hello_in.assign(kHelloMax, 0);
        auto r = std::make_shared<Request>(p, 0, kHelloMax);
        Op* op = new_op(r, p, OpKind::Recv, kHelloMax);
        op->buf = pr.hello_in.data();
        post_recv_locked(op, make_tag(kHandshakeSrc, p));  // lane 0, outside the lane counters
        hellos.emplace_back(p, r);
      }
      for (int p = 0; p < size_; ++p) {
        Peer& pr = peers_[p];
        if (!pr.is_peer) continue;
        pr.hello_out.assign(kHelloMagic, sizeof kHelloMagic);
        put_u32(pr.hello_out, uint32_t(rank_));
        pr.hello_out += proof(secret_, pr.nonce, rank_, p);
        auto r = std::make_shared<Request>(p, 0, pr.hello_out.size());
        post_send_locked(r, pr, pr.hello_out.data(), pr.hello_out.size(), make_tag(kHandshakeSrc, rank_), 0);
        hellos.emplace_back(p, r);
      }
      wake_locked();
    }
    std::set<int> missing;
    for (size_t i = 0; i < hellos.size(); ++i) {
      auto& [p, r] = hellos[i];
      bool is_recv = i < hellos.size() / 2;
      int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(
                         deadline - std::chrono::steady_clock::now()).count();
      size_t got = 0;
      try {
        got = r->wait(std::max<int64_t>(left, 0));
      } catch (const CommTimeout&) {
        missing.insert(p);
        continue;
      } catch (const CommError& e) {
        throw CommError(std::string("hetccl ucx: connecting to rank ") + std::to_string(p) +
                        " failed: " + e.what());
      }
      if (is_recv) verify_hello(p, got);
    }
    if (!missing.empty()) {
      std::string ranks;
      for (int p : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
      throw CommTimeout("hetccl ucx: connect() failed within " + std::to_string(timeout_ms) +
                        " ms: ranks [" + ranks + "] did not connect (no handshake received)");
    }
  }

  // Lane of the next message of (peer, tag) in one direction. Both ends count the messages of
  // each (peer, tag, tag space) alike -- the k-th send and the k-th receive meet on lane
  // (tag + k) % lanes -- and each lane keeps one endpoint's same-tag messages in order, so
  // FIFO per (peer, tag) holds across lanes while one tag's stream and consecutive tags spread
  // over all of them. A counter that comes back to 0 (mod lanes) is dropped: state is kept only
  // for tags whose count is not a multiple of the lane count (as tcp keeps per-tag sequences).
  int next_lane_locked(std::unordered_map<uint64_t, uint32_t>& seq, int peer, uint64_t tag, bool device) {
    if (lanes_ == 1) return 0;
    const uint64_t key = make_tag(uint64_t(peer), tag, device);
    auto it = seq.find(key);
    uint32_t k = it == seq.end() ? 0 : it->second;
    if (k + 1 == uint32_t(lanes_)) {
      if (it != seq.end()) seq.erase(it);
    } else if (it == seq.end()) {
      seq.emplace(key, 1);
    } else {
      ++it->second;
    }
    return int((tag + k) % uint64_t(lanes_));
  }

  // Posts a receive of `kind` from `peer`; `fill` sets the op's destination fields. A peer
  // that already failed fails the request at once, unless its message is stashed here.
  template <class Fill>
  RequestPtr post_receive(int peer, size_t nbytes, uint64_t tag, OpKind kind, bool device, Fill fill) {
    check_tag(tag);
    auto req = std::make_shared<Request>(peer, tag, nbytes);
    std::lock_guard<std::mutex> g(mu_);
    if (device) check_bound_locked();
    Peer& pr = peer_locked(peer);
    const uint64_t utag = make_tag(uint64_t(peer), tag, device);
    const int lane = next_lane_locked(recv_seq_, peer, tag, device);
    if (pr.failed && (device || !stashed_ready_locked(lane, utag))) {
      req->fail(Request::ErrorKind::Peer, pr.reason);
      return req;
    }
    Op* op = new_op(req, peer, kind, nbytes);
    op->lane = lane;
    fill(op);
    post_recv_locked(op, utag);
    wake_locked();
    return req;
  }

  RequestPtr post_send(int peer, const void* buf, size_t nbytes, uint64_t tag, bool device) {
    check_tag(tag);
    auto req = std::make_shared<Request>(peer, tag, nbytes);
    std::lock_guard<std::mutex> g(mu_);
    if (device) check_bound_locked();
    Peer& pr = peer_locked(peer);
    if (pr.failed) {
      req->fail(Request::ErrorKind::Peer, pr.reason);
      return req;
    }
    const int lane = next_lane_locked(send_seq_, peer, tag, device);
    post_send_locked(req, pr, buf, nbytes, make_tag(uint64_t(rank_), tag, device), lane);
    wake_locked();
    return req;
  }

  RequestPtr isend(int peer, const void* buf, size_t nbytes, uint64_t tag) override {
    return post_send(peer, buf, nbytes, tag, false);
  }

  // Device memory: UCX detects the buffer's memory type (cuda_copy / rocm_copy locally; GPUDirect
  // RDMA or dma-buf where the network transport supports it). Messages of the device tag space
  // are never drained into the host stash, so a device send completes once the peer has posted
  // its irecv_device (transport.h states that weaker contract).
  bool device_direct() const override { return true; }
  RequestPtr isend_device(int peer, const void* buf, size_t nbytes, uint64_t tag) override {
    return post_send(peer, buf, nbytes, tag, true);
  }
  RequestPtr irecv_device(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    return post_receive(peer, nbytes, tag, OpKind::Recv, true, [&](Op* op) { op->buf = buf; });
  }
  // Device posts fail once the progress thread could not make the device context current
  // (bind_device); under mu_.
  void check_bound_locked() const {
    if (!bind_error_.empty())
      throw CommError("hetccl ucx: the progress thread could not make the device context current: " +
                      bind_error_);
  }
  void bind_device(std::function<void()> make_current, const std::string& memory) override {
    ucs_memory_type_t mt = memory == "cuda"   ? UCS_MEMORY_TYPE_CUDA
                           : memory == "rocm" ? UCS_MEMORY_TYPE_ROCM
                           : memory == "host" ? UCS_MEMORY_TYPE_HOST
                                              : UCS_MEMORY_TYPE_UNKNOWN;
    if (mt == UCS_MEMORY_TYPE_UNKNOWN)
      throw CommError("hetccl ucx: unknown device memory type '" + memory + "' (cuda, rocm, host)");
    std::lock_guard<std::mutex> g(mu_);
    device_mem_ = mt;
    make_current_ = std::move(make_current);
    bind_pending_ = true;  // the progress thread runs it before its next call into UCX
    wake_locked();
  }

  // Maps [ptr, ptr + nbytes) once (ucp_mem_map with its memory type: UCX's memory query runs
  // here, on the issuing thread) so that device posts of any sub-range carry the handle instead
  // of making UCX query the buffer on the posting thread (header comment). Not fatal: a range
  // UCX does not map is posted without a handle.
  void prepare_device(const void* ptr, size_t nbytes, const std::string& memory) override {
    if (!device_prepare_ || rdma_ || !nbytes || !ptr) return;
    ucs_memory_type_t mt = memory == "cuda" ? UCS_MEMORY_TYPE_CUDA
                           : memory == "rocm" ? UCS_MEMORY_TYPE_ROCM
                                              : UCS_MEMORY_TYPE_UNKNOWN;
    if (mt == UCS_MEMORY_TYPE_UNKNOWN || !(memory_types_ & (uint64_t(1) << mt))) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> g(mu_);
    if (closed_ || find_memh_locked(a, nbytes)) return;
    if (memh_.size() >= kMemhMax) evict_memh_locked();
    if (memh_.size() >= kMemhMax) return;  // all in use by pending posts: post without one
    auto it = memh_.find(a);
    if (it != memh_.end()) {  // same start, shorter range: replace it if nothing uses it
      if (device_pending_locked()) return;
      ucp_mem_unmap(context_, it->second.memh);
      memh_.erase(it);
    }
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.address = const_cast<void*>(ptr);
    mp.length = nbytes;
    mp.memory_type = mt;
    ucp_mem_h h = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &h);
    if (st != UCS_OK) {
      ++memh_failed_;
      return;
    }
    memh_[a] = MemhEntry{a + nbytes, h};
  }

  // The smaller of this rank's and the peer's published bounds where both have one, else
  // whichever has one: both ends compute the same value from the same two numbers.
  size_t message_limit(int peer) const override {
    if (peer < 0 || peer >= size_ || !peers_[peer].is_peer) return 0;
    size_t a = max_message_, b = peers_[peer].max_message;
    return a && b ? std::min(a, b) : std::max(a, b);
  }

  std::map<std::string, std::string> info() override {
    std::lock_guard<std::mutex> g(mu_);
    std::map<std::string, std::string> m;
    m["tls"] = tls_;
    m["max_message"] = std::to_string(max_message_);
    m["resources"] = join(resources_);
    std::vector<std::string> mem;
    for (int i = 0; i < UCS_MEMORY_TYPE_LAST; ++i)
      if (memory_types_ & (uint64_t(1) << i)) mem.push_back(ucs_memory_type_names[i]);
    m["memory_types"] = join(mem);
    m["lanes"] = std::to_string(lanes_);
    m["tuning"] = join(tuned_, ";");
    m["version"] = ucp_get_version_string();
    std::string modes;
    for (Peer& pr : peers_)
      if (pr.is_peer) modes += (modes.empty() ? "" : ",") + std::to_string(pr.rank) + ":" + (pr.peer_mode ? "peer" : "none");
    m["error_handling"] = modes;
    m["copy_thread"] = copy_thread_.joinable() ? "on" : "off";
    m["spin_us"] = std::to_string(spin_us_);
    m["reduce_unpack"] = !reduce_dt_ ? (reduce_unpack_ ? "off (RDMA: zero-copy kept)" : "off") : "on: " + std::to_string(unpack_msgs_) + " messages in " +
                         std::to_string(unpack_pieces_) + " pieces, " + std::to_string(unpack_splits_) +
                         " elements split between pieces";
    m["device_prepare"] = !device_prepare_ ? "off" : rdma_ ? "off (RDMA: UCX registers)" : "on";
    m["device_handles"] = std::to_string(memh_.size()) + " cached, " + std::to_string(memh_hits_) +
                          " posts with one, " + std::to_string(memh_misses_) + " without, " +
                          std::to_string(memh_failed_) + " map failures";
    return m;
  }

  // A receive posted to UCP and not matched yet is removed from UCX's expected queue by
  // ucp_request_cancel, which completes it at once (recv_cb, UCS_ERR_CANCELED: the request fails
  // and the op is gone); anything else -- a receive waiting for a stashed message still arriving,
  // one UCX has matched (a rendezvous in flight), a send -- is left to finish as before.
  // UCX matches a message arriving after the cancel to a later receive: unpost or not.
  // With several lanes a receive is never withdrawn: the k-th send and the k-th receive of a
  // (peer, tag) meet on lane (tag + k) % lanes, so a withdrawn k-th receive would leave the
  // k-th message unmatched on its lane, where the receive `lanes` posts later would take it
  // instead of its own (wrong data). Refused, the receive stays posted and takes the k-th
  // message (callers then park it, or hand it to the next receive of the tag: backend.py).
  bool cancel(const RequestPtr& req, bool /*unpost*/ = false) override {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_ || !req || lanes_ > 1) return false;
    Op* found = nullptr;
    for (Op* op : pending_)
      if (op->req == req) found = op;
    if (!found || found->kind == OpKind::Send || found->kind == OpKind::Stash || !found->ucp_req)
      return false;
    ucp_request_cancel(workers_[found->lane], found->ucp_req);
    return pending_.count(found) == 0;  // compared, not dereferenced: the callback freed it
  }

  RequestPtr irecv(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    return post_receive(peer, nbytes, tag, OpKind::Recv, false, [&](Op* op) { op->buf = buf; });
  }

  RequestPtr irecv_reduce(int peer, void* dst, size_t nbytes, uint64_t tag, ReduceOp op,
                          DType dtype) override {
    if (nbytes % dtype_size(dtype) != 0)
      throw CommError("hetccl ucx: irecv_reduce of " + std::to_string(nbytes) +
                      " bytes is not a whole number of elements");
    return post_receive(peer, nbytes, tag, OpKind::RecvReduce, false, [&](Op* o) {
      o->dst = dst;
      o->rop = op;
      o->dtype = dtype;
    });
  }

  void close() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) return;
      closed_ = true;
    }
    stop_.store(true);
    ucp_worker_signal(workers_[0]);
    if (thread_.joinable()) thread_.join();
    if (copy_thread_.joinable()) {  // it finishes what the progress thread handed it, then exits
      {
        std::lock_guard<std::mutex> g(copy_mu_);
        copy_stop_ = true;
      }
      copy_cv_.notify_one();
      copy_thread_.join();
    }

    std::lock_guard<std::mutex> g(mu_);
    const std::string msg = "hetccl ucx: transport closed while the operation was pending";
    bool had_pending = !work_q_.empty();
    for (Op* op : pending_) had_pending |= op->kind != OpKind::Stash;
    fail_work_locked(msg);
    // Goodbye to every live peer, so that its pending receives from us fail at once (UCX's
    // shared-memory transports would not tell it). Delivered by the flush below.
    static const char kBye = 0;
    for (Peer& pr : peers_) {
      if (pr.eps.empty() || !pr.eps[0] || pr.failed) continue;
      ucp_request_param_t prm{};
      void* r = ucp_tag_send_nbx(pr.eps[0], &kBye, 1, make_tag(kHandshakeSrc, kByeBit | uint64_t(rank_)), &prm);
      if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);  // released by UCX when done
    }
    // Graceful: when nothing is pending, flush so that eager sends that completed locally
    // reach their peers before the endpoints go away. With pending work (an error path),
    // skip it: a flush could wait on a peer that never answers.
    if (!had_pending) {
      for (ucp_worker_h w : workers_) {
        ucp_request_param_t prm{};
        void* r = ucp_worker_flush_nbx(w, &prm);
        if (r && !UCS_PTR_IS_ERR(r)) wait_ucp_locked(r, kCloseFlushMs);
      }
    }
    std::vector<void*> cancel;  // ucp_request_cancel may run the callback (which edits pending_)
    for (Op* op : pending_) {
      if (op->req) op->req->fail(Request::ErrorKind::Generic, msg);
      if (op->kind != OpKind::Send && op->ucp_req) cancel.push_back(op->ucp_req);
    }
    cancel_locked(cancel);
    for (Peer& pr : peers_) force_close_ep_locked(pr);
    for (void* r : close_reqs_) wait_ucp_locked(r, 1000);
    close_reqs_.clear();
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!pending_.empty() && std::chrono::steady_clock::now() < until) progress_all_locked();
    fail_work_locked(msg);
    for (ucp_worker_h w : workers_) ucp_worker_destroy(w);
    for (auto& kv : memh_) ucp_mem_unmap(context_, kv.second.memh);
    memh_.clear();
    ucp_cleanup(context_);
    workers_.clear();
    context_ = nullptr;
    if (reduce_dt_) ucp_dt_destroy(reduce_dt_);
    reduce_dt_ = 0;
    // Whatever UCX did not complete (the worker is gone, so no buffer is touched any more) and
    // the stashed messages nobody received.
    std::unordered_set<Op*> left(pending_.begin(), pending_.end());
    stash_.for_each_msg([&](const std::pair<int, uint64_t>&, Op* s) { left.insert(s); });
    for (Op* op : left) finish_failed(op, Request::ErrorKind::Generic, msg);
    pending_.clear();
    stash_.clear_msgs();
  }

  // ---- called by UCX callbacks, with mu_ held (callbacks run inside progress or posting) ----
  void on_done(Op* op, void* request, ucs_status_t status, size_t length) {
    pending_.erase(op);
    if (request) ucp_request_free(request);
    finish(op, status, length);
  }

  void on_peer_error(Peer& pr, const std::string& why) {
    if (pr.failed) return;
    pr.failed = true;
    pr.close_pending = true;
    pr.reason = "hetccl ucx: peer rank " + std::to_string(pr.rank) + " (" + pr.where +
                ") failed or closed its end (" + why + ")";
    for (Op* op : pending_)
      if (op->peer == pr.rank && op->req) op->req->fail(Request::ErrorKind::Peer, pr.reason);
    // Cancelling receives and closing the endpoint are done by the progress thread, outside
    // this callback.
  }

 private:
  Peer& peer_locked(int peer) {
    if (closed_) throw CommError("hetccl ucx: transport is closed");
    check_peer(peer, rank_, size_);
    if (!peers_[peer].is_peer)
      throw CommError("hetccl ucx: rank " + std::to_string(peer) +
                      " is not a connected peer of this UCX transport");
    return peers_[peer];
  }

  // Endpoint of `lane` to peer pr (lane i of one rank talks to lane i of the other).
  void create_ep_locked(Peer& pr, int lane, const ucp_address_t* addr) {
    if (pr.eps.empty()) pr.eps.assign(lanes_, nullptr);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_err_cb;
    ep.err_handler.arg = &pr;
    ucs_status_t st = UCS_ERR_UNSUPPORTED;
    if (peer_mode_ok_) {
      // A failed attempt makes UCX log "no peer failure handler" at ERROR level although we
      // handle it below; silence UCX's log for this one call unless the user asked for verbose
      // logs (UCX_LOG_LEVEL=info or higher).
      ucs_log_level_t saved = ucs_global_opts.log_component.log_level;
      if (saved < UCS_LOG_LEVEL_INFO) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
      st = ucp_ep_create(workers_[lane], &ep, &pr.eps[lane]);
      ucs_global_opts.log_component.log_level = saved;
      if (st != UCS_OK) peer_mode_ok_ = false;  // same UCX config for every peer: don't retry
    }
    if (st == UCS_OK) {
      pr.peer_mode = true;
      return;
    }
    // No transport to this peer supports peer-failure handling (shared memory only):
    // connect without it; the caller's timeout is then the only failure detector.
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ucs_status_t st2 = ucp_ep_create(workers_[lane], &ep, &pr.eps[lane]);
    if (st2 != UCS_OK) {
      pr.eps[lane] = nullptr;
      throw CommError("hetccl ucx: cannot create an endpoint to rank " + std::to_string(pr.rank) +
                      ": " + status_str(st2) + " (with peer-failure handling: " + status_str(st) +
                      "); check UCX_TLS / UCX_NET_DEVICES (in force: UCX_TLS=" + tls_ + ")");
    }
    pr.peer_mode = false;
  }

  Op* new_op(const RequestPtr& req, int peer, OpKind kind, size_t nbytes) {
    Op* op = new Op;
    op->t = this;
    op->req = req;
    op->peer = peer;
    op->tag = req ? req->tag() : 0;
    op->kind = kind;
    op->nbytes = nbytes;
    return op;
  }

  // A message that arrived completely before its peer failed can still be received.
  bool stashed_ready_locked(int lane, uint64_t key) const {
    Op* const* s = stash_.peek_msg({lane, key});
    return s && (*s)->ready;
  }

  // A user receive (Recv or RecvReduce) on op->lane: from the stash if a message with this key
  // waits there (never for the device tag space, which is not stashed), else posted to UCP.
  void post_recv_locked(Op* op, uint64_t key) {
    if (std::optional<Op*> parked = stash_.take_msg({op->lane, key})) {
      Op* s = *parked;
      if (s->ready) {
        work_q_.push_back({op, s, s->nbytes});
      } else {
        s->waiter = op;
        pending_.insert(op);  // failed by peer failure / close like any pending receive
      }
      return;
    }
    void* buf = op->buf;
    size_t count = op->nbytes;
    ucp_tag_recv_info_t info{};
    ucp_request_param_t prm = recv_param(op, &info);
    if (op->kind == OpKind::RecvReduce && reduce_dt_) {
      // Reduced piece by piece as UCX delivers it (reduce_unpack): the "buffer" UCX passes to
      // start_unpack is the operation; `count` elements of the generic type are its bytes.
      op->streamed = true;
      buf = op;
      prm.datatype = reduce_dt_;
    } else if (op->kind == OpKind::RecvReduce) {
      op->bounce = pool_.get(op->nbytes);
      buf = op->bounce.p.get();
    }
    if ((key & kDeviceBit) && device_mem_ != UCS_MEMORY_TYPE_UNKNOWN) {
      prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;  // declared by bind_device, not detected
      prm.memory_type = device_mem_;
    }
    if (key & kDeviceBit) {
      op->device = true;
      attach_memh_locked(prm, buf, op->nbytes);
    }
    pending_.insert(op);
    ucs_status_ptr_t r = ucp_tag_recv_nbx(workers_[op->lane], buf, count, key, kFullMask, &prm);
    after_post_locked(op, r, info.length);
  }

  // Parameters of a tagged receive of bytes completing through recv_cb with `op`; *info gets
  // the message's length when it completes at once.
  static ucp_request_param_t recv_param(Op* op, ucp_tag_recv_info_t* info) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_RECV_INFO;
    prm.cb.recv = recv_cb;
    prm.user_data = op;
    prm.datatype = ucp_dt_make_contig(1);
    prm.recv_info.tag_info = info;
    return prm;
  }

  // Moves unexpected messages of the host tag space into the stash (progress thread). The
  // probe's mask selects tags whose device bit is 0: device messages wait in UCX until their
  // irecv_device is posted (UCX copies them into device memory itself).
  void drain_unexpected_locked() {
    for (int lane = 0; lane < lanes_; ++lane) {
      for (int k = 0; k < 256; ++k) {
        ucp_tag_recv_info_t info{};
        ucp_tag_message_h msg = ucp_tag_probe_nb(workers_[lane], 0, kDeviceBit, 1, &info);
        if (!msg) break;
        uint64_t src = (info.sender_tag >> kTagShift) & kSrcMask;
        uint64_t low = info.sender_tag & (kMaxTag - 1);
        bool bye = src == kHandshakeSrc && (low & kByeBit);
        int peer = int(src == kHandshakeSrc ? low & ~kByeBit : src);
        Op* s = new_op(nullptr, peer < size_ ? peer : -1, OpKind::Stash, info.length);
        s->tag = src == kHandshakeSrc ? 0 : low;
        s->key = info.sender_tag;
        s->lane = lane;
        s->bye = bye;
        s->bounce = pool_.get(info.length);
        if (!bye) stash_.park({lane, s->key}, s);
        ucp_tag_recv_info_t info2{};
        ucp_request_param_t prm = recv_param(s, &info2);
        pending_.insert(s);
        ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(workers_[lane], s->bounce.p.get(), info.length, msg, &prm);
        after_post_locked(s, r, info.length);
      }
    }
  }

  void post_send_locked(const RequestPtr& req, Peer& pr, const void* buf, size_t nbytes, uint64_t utag,
                        int lane) {
    Op* op = new Op;
    op->lane = lane;
    op->t = this;
    op->req = req;
    op->peer = pr.rank;
    op->tag = req->tag();
    op->kind = OpKind::Send;
    op->nbytes = nbytes;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    prm.cb.send = send_cb;
    prm.user_data = op;
    prm.datatype = ucp_dt_make_contig(1);
    if ((utag & kDeviceBit) && device_mem_ != UCS_MEMORY_TYPE_UNKNOWN) {
      prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;  // declared by bind_device, not detected
      prm.memory_type = device_mem_;
    }
    if (utag & kDeviceBit) {
      op->device = true;
      attach_memh_locked(prm, buf, nbytes);
    }
    pending_.insert(op);
    ucs_status_ptr_t r = ucp_tag_send_nbx(pr.eps[lane], buf, nbytes, utag, &prm);
    after_post_locked(op, r, nbytes);
  }

  // The cached handle whose range holds [a, a + n), or null.
  const MemhEntry* find_memh_locked(uintptr_t a, size_t n) const {
    auto it = memh_.upper_bound(a);
    if (it == memh_.begin()) return nullptr;
    --it;
    return it->second.end >= a + n ? &it->second : nullptr;
  }

  // A device post carries prepare_device's handle when one covers its buffer.
  void attach_memh_locked(ucp_request_param_t& prm, const void* buf, size_t n) {
    if (!device_prepare_ || rdma_ || !n) return;
    const MemhEntry* e = find_memh_locked(reinterpret_cast<uintptr_t>(buf), n);
    if (!e) {
      ++memh_misses_;
      return;
    }
    ++memh_hits_;
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = e->memh;
  }

  bool device_pending_locked() const {
    for (Op* op : pending_)
      if (op->device) return true;
    return false;
  }

  // Drops every cached handle, unless a device operation (which may use one) is pending.
  void evict_memh_locked() {
    if (device_pending_locked()) return;
    for (auto& kv : memh_) ucp_mem_unmap(context_, kv.second.memh);
    memh_.clear();
  }

  void after_post_locked(Op* op, ucs_status_ptr_t r, size_t imm_len) {
    if (r == nullptr) {  // completed immediately; no callback follows
      pending_.erase(op);
      finish(op, UCS_OK, imm_len);
    } else if (UCS_PTR_IS_ERR(r)) {
      pending_.erase(op);
      finish(op, UCS_PTR_STATUS(r), 0);
    } else if (pending_.count(op)) {
      op->ucp_req = r;
    }  // else: the callback already ran (and freed r)
  }

  // Completes or fails op->req and disposes of op (irecv_reduce: queues the reduction).
  void finish(Op* op, ucs_status_t status, size_t length) {
    if (op->kind == OpKind::Stash) {
      finish_stash(op, status, length);
      return;
    }
    if (status == UCS_OK) {
      if (op->kind == OpKind::RecvReduce) {
        if (length != op->nbytes) {
          finish_failed(op, Request::ErrorKind::Truncated,
                        "hetccl ucx: irecv_reduce from rank " + std::to_string(op->peer) + " (tag " +
                            std::to_string(op->tag) + ") expected exactly " +
                            std::to_string(op->nbytes) + " bytes, got " + std::to_string(length));
          return;
        }
        if (op->streamed) {  // already reduced into dst by reduce_unpack
          unpack_pieces_ += op->pieces;
          unpack_splits_ += op->splits;
          ++unpack_msgs_;
          op->req->complete(op->nbytes);
          delete op;
          return;
        }
        work_q_.push_back({op, nullptr, length});
        return;
      }
      op->req->complete(op->kind == OpKind::Send ? op->nbytes : length);
      delete op;
      return;
    }
    Peer& pr = peers_[op->peer];
    if (status == UCS_ERR_MESSAGE_TRUNCATED) {
      finish_failed(op, Request::ErrorKind::Truncated, truncated_msg(op, length));
    } else if (pr.failed) {
      finish_failed(op, Request::ErrorKind::Peer, pr.reason);
    } else if (status == UCS_ERR_CANCELED) {
      finish_failed(op, Request::ErrorKind::Generic, "hetccl ucx: operation cancelled");
    } else {
      // A transport error on one operation (reset connection, a cma read from a process that is
      // gone: "Input/output error") means the peer is unusable, even when no error callback
      // came (endpoints without peer-failure handling): fail everything pending with it.
      std::string why = std::string(op->kind == OpKind::Send ? "send to" : "receive from") +
                        " it failed: " + status_str(status);
      on_peer_error(pr, why);
      finish_failed(op, Request::ErrorKind::Peer, pr.reason);
    }
  }

  std::string truncated_msg(const Op* op, size_t length) const {
    std::string what = length > op->nbytes ? std::to_string(length) + "-byte message" : "message";
    return "hetccl ucx: " + what + " from rank " + std::to_string(op->peer) + " (tag " +
           std::to_string(op->tag) + ") does not fit the " + std::to_string(op->nbytes) + "-byte " +
           (op->kind == OpKind::RecvReduce ? "irecv_reduce (exact length required)" : "receive buffer");
  }

  // The receive of an unexpected message finished (into the stash).
  void finish_stash(Op* s, ucs_status_t status, size_t length) {
    if (s->bye) {
      if (status == UCS_OK && s->peer >= 0 && peers_[s->peer].is_peer)
        on_peer_error(peers_[s->peer], "it closed its transport");
      pool_.put(std::move(s->bounce));
      delete s;
      return;
    }
    if (status == UCS_OK) {
      s->ready = true;
      s->nbytes = length;
      if (s->waiter) {
        pending_.erase(s->waiter);
        work_q_.push_back({s->waiter, s, length});
      }
      return;  // else it waits in stash_ for its receive
    }
    std::string why;
    Request::ErrorKind kind = Request::ErrorKind::Peer;
    if (s->peer >= 0 && peers_[s->peer].failed) {
      why = peers_[s->peer].reason;
    } else if (status == UCS_ERR_CANCELED) {
      why = "hetccl ucx: operation cancelled";
      kind = Request::ErrorKind::Generic;
    } else {
      why = "hetccl ucx: receive from peer rank " + std::to_string(s->peer) + " failed (" +
            status_str(status) + ")";
      if (s->peer >= 0) on_peer_error(peers_[s->peer], "receive from it failed: " + status_str(status));
    }
    if (s->waiter) {
      pending_.erase(s->waiter);
      finish_failed(s->waiter, kind, why);
    } else {  // still in stash_: remove it
      stash_.remove_msg({s->lane, s->key}, [s](Op* x) { return x == s; });
    }
    pool_.put(std::move(s->bounce));
    delete s;
  }

  void finish_failed(Op* op, Request::ErrorKind kind, const std::string& msg) {
    if (op->req) op->req->fail(kind, msg);
    pool_.put(std::move(op->bounce));
    delete op;
  }

  void fail_work_locked(const std::string& msg) {
    for (Work& w : work_q_) {
      if (w.src) finish_failed(w.src, Request::ErrorKind::Generic, msg);
      finish_failed(w.op, Request::ErrorKind::Generic, msg);
    }
    work_q_.clear();
  }

  // Copies or reduces a finished receive into the user's buffer (progress thread, mu_ not held).
  void run_work(const Work& w) {
    Op* op = w.op;
    const char* data = w.src ? w.src->bounce.p.get() : op->bounce.p.get();
    bool exact = op->kind == OpKind::RecvReduce;
    if (exact ? w.len != op->nbytes : w.len > op->nbytes) {
      op->req->fail(Request::ErrorKind::Truncated, truncated_msg(op, w.len));
    } else if (op->kind == OpKind::RecvReduce) {
      // One thread, as the tcp/shm transports: reduce.cc's pool is process-wide and persistent,
      // and a transport must leave no thread behind after close().
      reduce_into(op->rop, op->dtype, op->dst, data, op->nbytes / dtype_size(op->dtype), 1);
      op->req->complete(op->nbytes);
    } else {
      if (w.len) std::memcpy(op->buf, data, w.len);
      op->req->complete(w.len);
    }
    if (w.src) {
      pool_.put(std::move(w.src->bounce));
      delete w.src;
    }
    pool_.put(std::move(op->bounce));
    delete op;
  }

  void verify_hello(int p, size_t got) {
    const std::vector<char>& m = peers_[p].hello_in;  // complete: no more writes by UCX
    std::string who = "hetccl ucx: peer rank " + std::to_string(p) + " (" + peers_[p].where + ")";
    if (got != kHelloBytes || std::memcmp(m.data(), kHelloMagic, sizeof kHelloMagic) != 0)
      throw CommError(who + " sent a malformed handshake; rejected");
    uint32_t r = get_u32(m.data() + sizeof kHelloMagic);
    if (r != uint32_t(p))
      throw CommError(who + " claims to be rank " + std::to_string(r) + "; rejected");
    if (!equal_const_time(std::string(m.data() + sizeof kHelloMagic + 4, 32), proof(secret_, nonce_, p, rank_))) {
      std::lock_guard<std::mutex> g(mu_);
      Peer& pr = peers_[p];
      if (!pr.failed) {
        pr.failed = true;
        pr.close_pending = true;
        pr.reason = who + " presented a wrong group secret; rejected";
      }
      throw CommError(who + " presented a wrong group secret; rejected (two jobs sharing one store?)");
    }
  }

  void wake_locked() {
    if (armed_) {
      armed_ = false;
      ucp_worker_signal(workers_[0]);  // the progress thread polls every lane's fd
    }
    dirty_ = true;
  }

  // One progress pass over every lane; the number of events.
  unsigned progress_all_locked() {
    unsigned n = 0;
    for (ucp_worker_h w : workers_) n += ucp_worker_progress(w);
    return n;
  }

  // Cancels UCP receive requests (each op's own worker).
  void cancel_locked(const std::vector<void*>& reqs) {
    std::unordered_map<void*, int> lane_of;
    for (Op* op : pending_)
      if (op->ucp_req) lane_of[op->ucp_req] = op->lane;
    for (void* r : reqs) {
      auto it = lane_of.find(r);
      if (it != lane_of.end()) ucp_request_cancel(workers_[it->second], r);
    }
  }

  // Progress until a UCX request completes or timeout; frees it.
  void wait_ucp_locked(void* r, int64_t ms) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < until)
      progress_all_locked();
    ucp_request_free(r);  // an unfinished request is released when UCX completes it
  }

  // Starts a forced close of pr's endpoints (if any); the close requests join close_reqs_.
  void force_close_ep_locked(Peer& pr) {
    for (ucp_ep_h& ep : pr.eps) {
      if (!ep) continue;
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* r = ucp_ep_close_nbx(ep, &prm);
      ep = nullptr;
      if (r && !UCS_PTR_IS_ERR(r)) close_reqs_.push_back(r);
    }
  }

  // Failed peers: cancel their receives and force-close their endpoint (not allowed inside the
  // error callback itself).
  void reap_failed_peers_locked() {
    for (Peer& pr : peers_) {
      if (!pr.close_pending) continue;
      pr.close_pending = false;
      std::vector<void*> cancel;
      for (Op* op : pending_)
        if (op->peer == pr.rank && op->kind != OpKind::Send && op->ucp_req) cancel.push_back(op->ucp_req);
      cancel_locked(cancel);
      force_close_ep_locked(pr);
    }
    for (size_t i = 0; i < close_reqs_.size();) {
      if (ucp_request_check_status(close_reqs_[i]) != UCS_INPROGRESS) {
        ucp_request_free(close_reqs_[i]);
        close_reqs_[i] = close_reqs_.back();
        close_reqs_.pop_back();
      } else {
        ++i;
      }
    }
  }

  // Peers on this host whose process we can identify: fail them once that process is gone.
  void check_liveness() {
    std::vector<std::pair<int, pid_t>> watch;
    std::vector<std::string> starts;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (Peer& pr : peers_)
        if (pr.is_peer && !pr.failed && !pr.start.empty()) {
          watch.emplace_back(pr.rank, pr.pid);
          starts.push_back(pr.start);
        }
    }
    for (size_t i = 0; i < watch.size(); ++i) {  // /proc reads without the lock
      bool zombie = false;
      bool gone = kill(watch[i].second, 0) != 0 && errno == ESRCH;
      if (!gone) gone = proc_start(watch[i].second, &zombie) != starts[i] || zombie;
      if (gone) {
        std::lock_guard<std::mutex> g(mu_);
        // what it sent before it exited may still wait in UCX's queues: taken first (progress
        // until idle, bounded), so a receive whose message is here is not failed with it
        for (unsigned n, rounds = 0; (n = progress_all_locked()) != 0 && rounds < 4096; ++rounds) {
        }
        drain_unexpected_locked();
        on_peer_error(peers_[watch[i].first], "its process has exited");
      }
    }
  }

  // The copy thread: runs the progress thread's finished receives (memcpy out of the stash,
  // irecv_reduce's reduction) so that UCX keeps progressing -- reading sockets, sending --
  // while a large message is copied or reduced (one thread did both: UCX's host path was half
  // of hetccl's tcp, which reduces on its own threads). Exits once stopped and drained.
  void copy_loop() {
    pthread_setname_np(pthread_self(), "hetccl-ucx-cp");
    std::vector<Work> batch;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(copy_mu_);
        copy_cv_.wait(g, [&] { return copy_stop_ || !copy_q_.empty(); });
        if (copy_q_.empty()) return;  // stopped and drained
        batch.swap(copy_q_);
      }
      for (const Work& w : batch) run_work(w);
      batch.clear();
    }
  }

  void progress_loop() {
    pthread_setname_np(pthread_self(), "hetccl-ucx");  // names the thread in stack dumps
    auto last_event = std::chrono::steady_clock::now();
    auto next_liveness = last_event;
    std::vector<Work> reds;
    while (!stop_.load(std::memory_order_relaxed)) {
      unsigned events = 0;
      {
        std::lock_guard<std::mutex> g(mu_);
        armed_ = false;
        if (bind_pending_) {  // bind_device: this thread's device context, before UCX runs here
          bind_pending_ = false;
          try {
            make_current_();
          } catch (const std::exception& e) {
            bind_error_ = e.what();
          }
        }
        for (unsigned n; (n = progress_all_locked()) != 0 && events < 4096;) events += n;
        drain_unexpected_locked();
        reap_failed_peers_locked();
        reds.swap(work_q_);
        if (dirty_) {
          dirty_ = false;
          ++events;
        }
      }
      if (!reds.empty()) {
        if (copy_thread_.joinable()) {  // copies / reductions beside the progress (header comment)
          {
            std::lock_guard<std::mutex> g(copy_mu_);
            copy_q_.insert(copy_q_.end(), reds.begin(), reds.end());
          }
          copy_cv_.notify_one();
        } else {
          for (const Work& w : reds) run_work(w);
        }
      }
      if (std::chrono::steady_clock::now() >= next_liveness) {
        check_liveness();
        next_liveness = std::chrono::steady_clock::now() + std::chrono::milliseconds(kLivenessMs);
      }
      if (events || !reds.empty()) {
        reds.clear();
        last_event = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last_event < std::chrono::microseconds(spin_us_)) {
        sched_yield();
        continue;
      }
      ucs_status_t st;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (dirty_ || stop_.load()) continue;
        st = UCS_OK;  // every lane must be armed before sleeping; BUSY: events are pending
        for (size_t i = 0; i < workers_.size() && st == UCS_OK; ++i) st = ucp_worker_arm(workers_[i]);
        armed_ = st == UCS_OK;
      }
      if (st == UCS_ERR_BUSY) continue;
      pollfd pfds[kMaxLanes];
      for (size_t i = 0; i < efds_.size(); ++i) pfds[i] = pollfd{efds_[i], POLLIN, 0};
      poll(pfds, nfds_t(efds_.size()), st == UCS_OK ? kPollMs : 1);
      last_event = std::chrono::steady_clock::now() - std::chrono::microseconds(spin_us_ / 2);
    }
  }

  const int rank_, size_;
  std::string secret_, nonce_, host_;
  std::string address_;
  ucp_context_h context_ = nullptr;
  int lanes_ = 1;
  std::vector<ucp_worker_h> workers_;  // one per lane
  std::vector<int> efds_;
  std::string tls_;                     // UCX_TLS in force (read back from UCX)
  // ucx_config settings passed to UCX (component settings such as TCP_* are not printed back by
  // ucp_config_print; UCX rejects unknown keys at ucp_config_modify, bad values at iface open)
  std::vector<std::string> tuned_;
  std::vector<std::string> resources_;  // transports the context has resources of
  uint64_t memory_types_ = 1;           // ucp_context_query: memory types UCX can handle

  std::mutex mu_;  // guards the worker and everything below
  std::vector<Peer> peers_;
  std::unordered_set<Op*> pending_;
  std::vector<Work> work_q_;                     // finished receives to copy/reduce
  // unexpected messages by (lane, full tag), oldest first: the parked side of the one matching
  // rule (csrc/match.h); UCX holds the posted receives itself
  using Stash = MatchQueues<std::pair<int, uint64_t>, Op*, Op*>;
  Stash stash_;
  std::unordered_map<uint64_t, uint32_t> send_seq_, recv_seq_;  // lane counters (next_lane_locked)
  std::vector<void*> close_reqs_;
  bool closed_ = false;
  bool peer_mode_ok_ = true;  // cleared when a PEER-mode endpoint could not be created
  bool armed_ = false;  // progress thread sleeps on efds_ (or is about to)
  bool dirty_ = false;  // something was posted since the last progress pass

  std::atomic<bool> stop_{false};
  std::thread thread_;
  // copy thread (option copy_thread, default on): finished receives to copy / reduce
  bool copy_thread_on_ = true;
  int spin_us_ = kSpinUs;  // option spin_us: busy progress after the last event, then poll()
  size_t max_message_ = 0;  // option max_message (whole pages; 0 with RDMA): message_limit()
  std::mutex copy_mu_;
  std::condition_variable copy_cv_;
  std::vector<Work> copy_q_;
  bool copy_stop_ = false;
  std::thread copy_thread_;
  // bind_device (under mu_): the memory type declared for device-tag-space buffers, the
  // context hook the progress thread still has to run, and its failure (fails device posts).
  ucs_memory_type_t device_mem_ = UCS_MEMORY_TYPE_UNKNOWN;
  std::function<void()> make_current_;
  bool bind_pending_ = false;
  std::string bind_error_;
  // prepare_device's handles by range start (under mu_), and their use (info())
  bool device_prepare_ = true;
  // option reduce_unpack (default on): irecv_reduce posted to UCX reduces as pieces arrive
  bool reduce_unpack_ = true;
  ucp_datatype_t reduce_dt_ = 0;
  uint64_t unpack_msgs_ = 0, unpack_pieces_ = 0, unpack_splits_ = 0;  // under mu_ (info())
  bool rdma_ = false;  // the context has an RDMA transport (handles not cached: header comment)
  std::map<uintptr_t, MemhEntry> memh_;
  uint64_t memh_hits_ = 0, memh_misses_ = 0, memh_failed_ = 0;
  BouncePool pool_;
};

void send_cb(void* request, ucs_status_t status, void* user_data) {
  Op* op = static_cast<Op*>(user_data);
  op->t->on_done(op, request, status, op->nbytes);
}

void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  Op* op = static_cast<Op*>(user_data);
  op->t->on_done(op, request, status, info ? info->length : 0);  // length: also for truncation
}

void ep_err_cb(void* arg, ucp_ep_h, ucs_status_t status) {
  Peer* pr = static_cast<Peer*>(arg);
  pr->t->on_peer_error(*pr, status_str(status));
}

}  // namespace

// Lanes with threads of their own (option lane_threads=on, HETCCL_UCX_LANE_THREADS): each
// lane is a whole single-lane UcxTransport -- its own UCP context, worker, progress thread and
// copy thread -- so the lanes' copies into and out of UCX's segments run on as many cores,
// where the lanes of one UcxTransport share its one progress thread. Messages are spread as
// there: the k-th message of a (peer, tag, tag space) in one direction goes on lane
// (tag + k) % lanes on both ends, and each lane keeps FIFO per (peer, tag). The address is the
// lanes' addresses joined by '|' (an empty one stays empty: no link); a peer with another lane
// count or lane mode is refused at connect(). cancel() refuses, as any multi-lane UCX does
// (see UcxTransport::cancel). Each lane authenticates, watches its peers and fails its own
// requests; info() is lane 0's (the lanes share their options; settings such as spin_us are
// not summed), with lanes, lane_threads and stripe_bytes of the whole.
//
// Striping (option stripe_bytes = S > 0, HETCCL_UCX_STRIPE_BYTES): one large message would
// otherwise keep one lane's threads busy while the others idle (a plan's few large chunks).
// With S > 0 EVERY host message -- whatever its size, so that each lane sees one part of every
// message and the lanes' FIFOs stay in step whatever sizes the two ends post -- goes as one
// part per lane, part i on lane (tag + i) % lanes, each a message of its lane with the same
// tag. The message is cut into k = min(lanes, n / S) nonempty parts of at least S bytes (k = 1
// below 2 S: the message whole in part 0); part i < k is bytes [i p, (i + 1) p) with
// p = ceil(n / k) rounded up to 4 KiB (part k - 1 takes the rest); the other parts are empty.
// Trade-off: a message completes only once every lane has moved its part, empty ones too, so
// each message waits for the slowest lane's threads; on the GPU box that cost more at 1-4 MiB
// than the parallel parts gained (docs/benchmarks.md, session 22), so hetccl's default is off
// (HETCCL_UCX_STRIPE_BYTES 0); on the 2-core machine two striped lanes beat whole messages at
// 4-16 MiB. The striped request finishes when every part has (its buffer is free then). A
// receive buffer larger than the message: the parts land where the receiver's layout puts them
// and are moved to the sender's layout (the arrived lengths say what it was; bytes past the
// message may be overwritten); where a part of the sender's layout exceeds the receiver's part
// (the two sizes cut into different part counts, or p steps up while the buffer is a few bytes
// larger) that part fails with MessageTruncated -- an error, never misplaced bytes.
// irecv_reduce: exact sizes, as always. Device messages are not striped (the lane rule above).
class UcxLaneThreads final : public Transport {
 public:
  UcxLaneThreads(int rank, int size, const Options& opts, int lanes) {
    Options one = opts;
    one["lanes"] = "1";
    one.erase("stripe_bytes");
    stripe_ = size_t(opt_int(opts, "stripe_bytes", 0, 0, int64_t(1) << 40));
    for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<UcxTransport>(rank, size, one));
  }
  ~UcxLaneThreads() override { close(); }

  std::string name() const override { return "ucx"; }
  std::string address() override {
    std::string a;
    for (auto& l : lanes_) a += (a.empty() ? "" : "|") + l->address();
    return a;
  }
  void connect(const std::vector<std::string>& addresses, int64_t timeout_ms) override {
    const size_t n = lanes_.size();
    std::vector<std::vector<std::string>> per(n, std::vector<std::string>(addresses.size()));
    for (size_t p = 0; p < addresses.size(); ++p) {
      if (addresses[p].empty()) continue;
      std::vector<std::string> parts;
      size_t b = 0;
      for (;;) {
        size_t e = addresses[p].find('|', b);
        parts.push_back(addresses[p].substr(b, e == std::string::npos ? e : e - b));
        if (e == std::string::npos) break;
        b = e + 1;
      }
      if (parts.size() != n)
        throw CommError("hetccl ucx: rank " + std::to_string(p) + " runs " +
                        std::to_string(parts.size()) + " UCX lane(s) with threads of their own, "
                        "this rank " + std::to_string(n) + " (set HETCCL_UCX_LANES and "
                        "HETCCL_UCX_LANE_THREADS alike on every rank)");
      for (size_t i = 0; i < n; ++i) per[i][p] = parts[i];
    }
    // lanes connect at once: each waits for its peers' handshakes within the same deadline
    std::vector<std::thread> th;
    std::vector<std::exception_ptr> err(n);
    for (size_t i = 0; i < n; ++i)
      th.emplace_back([&, i] {
        try {
          lanes_[i]->connect(per[i], timeout_ms);
        } catch (...) {
          err[i] = std::current_exception();
        }
      });
    for (auto& t : th) t.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
  }

  RequestPtr isend(int peer, const void* buf, size_t nbytes, uint64_t tag) override {
    if (striped(peer, tag))
      return stripe(peer, tag, nbytes, Kind::Send, [&](UcxTransport& l, size_t off, size_t len) {
        return l.isend(peer, static_cast<const char*>(buf) + off, len, tag);
      }, nullptr);
    return lane(send_seq_, peer, tag, false).isend(peer, buf, nbytes, tag);
  }
  RequestPtr irecv(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    if (striped(peer, tag))
      return stripe(peer, tag, nbytes, Kind::Recv, [&](UcxTransport& l, size_t off, size_t len) {
        return l.irecv(peer, static_cast<char*>(buf) + off, len, tag);
      }, static_cast<char*>(buf));
    return lane(recv_seq_, peer, tag, false).irecv(peer, buf, nbytes, tag);
  }
  RequestPtr irecv_reduce(int peer, void* dst, size_t nbytes, uint64_t tag, ReduceOp op,
                          DType dtype) override {
    if (striped(peer, tag))  // part offsets are multiples of 4 KiB: whole elements of any dtype
      return stripe(peer, tag, nbytes, Kind::Reduce, [&](UcxTransport& l, size_t off, size_t len) {
        return l.irecv_reduce(peer, static_cast<char*>(dst) + off, len, tag, op, dtype);
      }, nullptr);
    return lane(recv_seq_, peer, tag, false).irecv_reduce(peer, dst, nbytes, tag, op, dtype);
  }
  bool device_direct() const override { return true; }
  RequestPtr isend_device(int peer, const void* buf, size_t nbytes, uint64_t tag) override {
    return lane(send_seq_, peer, tag, true).isend_device(peer, buf, nbytes, tag);
  }
  RequestPtr irecv_device(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    return lane(recv_seq_, peer, tag, true).irecv_device(peer, buf, nbytes, tag);
  }
  void bind_device(std::function<void()> make_current, const std::string& memory) override {
    for (auto& l : lanes_) l->bind_device(make_current, memory);
  }
  void prepare_device(const void* ptr, size_t nbytes, const std::string& memory) override {
    for (auto& l : lanes_) l->prepare_device(ptr, nbytes, memory);
  }
  void close() override {
    for (auto& l : lanes_) l->close();
  }
  // Every lane runs with the same options and connects to the same peers.
  size_t message_limit(int peer) const override { return lanes_[0]->message_limit(peer); }
  std::map<std::string, std::string> info() override {
    std::map<std::string, std::string> m = lanes_[0]->info();
    m["lanes"] = std::to_string(lanes_.size());
    m["lane_threads"] = "on";
    m["stripe_bytes"] = std::to_string(stripe_);
    return m;
  }

 private:
  enum class Kind { Send, Recv, Reduce };
  struct Part {
    size_t off, len;
  };
  // The parts of an n-byte message over L lanes with stripe_bytes S (the rule in the class comment).
  static std::vector<Part> layout(size_t n, size_t L, size_t S) {
    const size_t k = n < S ? 1 : std::min(L, n / S);  // nonempty parts, each >= S bytes
    const size_t p = k == 1 ? n : ((n + k - 1) / k + 4095) / 4096 * 4096;
    std::vector<Part> v(L);
    for (size_t i = 0; i < L; ++i) {
      const size_t off = std::min(n, i * p);
      v[i] = {off, i + 1 == k ? n - off : std::min(p, n - off)};
    }
    return v;
  }
  // Whether a lane would take (peer, tag) at all; else lane 0 gets it and refuses, naming why.
  static bool postable(int peer, uint64_t tag) { return peer >= 0 && tag < kMaxTag; }
  bool striped(int peer, uint64_t tag) const { return stripe_ > 0 && postable(peer, tag); }
  // One striped request of kind k: posts part i through post(lane, off, len) and finishes the
  // whole once every part has. `recv_base`: a plain receive's buffer (its parts may need moving).
  template <class Post>
  RequestPtr stripe(int peer, uint64_t tag, size_t nbytes, Kind k, Post&& post, char* recv_base) {
    struct State {
      RequestPtr whole;
      std::vector<RequestPtr> parts;
      std::vector<Part> mine;
      std::atomic<size_t> left{0};
    };
    auto st = std::make_shared<State>();
    st->whole = std::make_shared<Request>(peer, tag, nbytes);
    const size_t L = lanes_.size();
    st->mine = layout(nbytes, L, stripe_);
    st->parts.resize(L);
    st->left = L;
    for (size_t i = 0; i < L; ++i) {
      try {
        st->parts[i] = post(*lanes_[(tag + i) % L], st->mine[i].off, st->mine[i].len);
      } catch (const std::exception& e) {
        // a lane refuses what every lane refuses (unknown peer, closed): part 0 raises it to
        // the caller. After part 0 went out only a close() racing this post can refuse, and
        // close() fails the parts already posted: the whole fails with the first error.
        if (i == 0) throw;
        st->parts[i] = std::make_shared<Request>(peer, tag, st->mine[i].len);
        st->parts[i]->fail(Request::ErrorKind::Generic, e.what());
      }
    }
    const size_t S = stripe_;
    auto finish = [st, k, recv_base, nbytes, S, L] {
      for (size_t i = 0; i < st->parts.size(); ++i) {
        auto [kind, text] = st->parts[i]->error();
        if (kind == Request::ErrorKind::Truncated && k != Kind::Send)
          text += " (part " + std::to_string(i) + " of a message striped over " +
                  std::to_string(L) + " UCX lanes, stripe_bytes " + std::to_string(S) +
                  "; the whole receive is " + std::to_string(nbytes) + " bytes)";
        if (kind != Request::ErrorKind::None) {
          st->whole->fail(kind, text);
          return;
        }
      }
      size_t total = 0;
      bool same = true;
      for (size_t i = 0; i < st->parts.size(); ++i) {
        const size_t got = st->parts[i]->nbytes();
        total += got;
        same = same && got == st->mine[i].len;
      }
      if (same || k == Kind::Send) {
        st->whole->complete(total);
        return;
      }
      // a shorter message than the buffer: arrived in the sender's parts, which must each be
      // the length the sender's layout gives; move them down to the sender's offsets (in
      // ascending order: part i's destination ends before part i + 1's source begins)
      std::vector<Part> theirs = layout(total, L, S);
      bool fits = k == Kind::Recv;
      for (size_t i = 0; fits && i < theirs.size(); ++i) fits = st->parts[i]->nbytes() == theirs[i].len;
      if (!fits) {
        st->whole->fail(Request::ErrorKind::Truncated,
                        "hetccl ucx: a message striped over " + std::to_string(theirs.size()) +
                        " lanes from rank " + std::to_string(st->whole->peer()) + " (tag " +
                        std::to_string(st->whole->tag()) + ") arrived as " + std::to_string(total) +
                        " bytes in parts that do not fit this receive of " + std::to_string(nbytes) +
                        " bytes (stripe_bytes " + std::to_string(S) + "): send and receive sizes differ");
        return;
      }
      for (size_t i = 0; i < theirs.size(); ++i)
        if (theirs[i].len && theirs[i].off != st->mine[i].off)
          std::memmove(recv_base + theirs[i].off, recv_base + st->mine[i].off, theirs[i].len);
      st->whole->complete(total);
    };
    for (auto& r : st->parts)
      r->on_finish([st, finish] {
        if (st->left.fetch_sub(1) == 1) finish();
      });
    return st->whole;
  }

  // The lane of the next message of (peer, tag, space) in one direction (UcxTransport's rule).
  UcxTransport& lane(std::unordered_map<uint64_t, uint32_t>& seq, int peer, uint64_t tag, bool device) {
    const uint64_t n = lanes_.size();
    if (!postable(peer, tag)) return *lanes_[0];
    std::lock_guard<std::mutex> g(mu_);
    const uint64_t key = make_tag(uint64_t(peer), tag, device);
    auto it = seq.find(key);
    uint32_t k = it == seq.end() ? 0 : it->second;
    if (k + 1 == n) {
      if (it != seq.end()) seq.erase(it);
    } else if (it == seq.end()) {
      seq.emplace(key, 1);
    } else {
      ++it->second;
    }
    return *lanes_[(tag + k) % n];
  }

  std::vector<std::unique_ptr<UcxTransport>> lanes_;
  size_t stripe_ = 0;  // option stripe_bytes; 0: messages go whole, one lane each
  std::mutex mu_;
  std::unordered_map<uint64_t, uint32_t> send_seq_, recv_seq_;
};

std::unique_ptr<Transport> make_ucx_transport(int rank, int size, const Options& opts) {
  const int lanes = int(opt_int(opts, "lanes", 1, 1, kMaxLanes));
  const std::string lt = opt_str(opts, "lane_threads", "off");
  if (lt != "on" && lt != "off")
    throw CommError("hetccl ucx: option lane_threads must be on or off, not '" + lt + "'");
  if (lanes > 1 && lt == "on") return std::make_unique<UcxLaneThreads>(rank, size, opts, lanes);
  return std::make_unique<UcxTransport>(rank, size, opts);
}

// Device memory types for which UCX in this process has GPUDirect RDMA (an RDMA memory domain,
// UCT component "ib", registers the type: rendezvous goes NIC to GPU memory) and a GDRCopy
// memory domain ("gdr_copy" for CUDA, "rocm_gdr" for ROCm: small messages copied through a CPU
// mapping of GPU memory). That is what UCX needs to move device memory without cuda_copy /
// rocm_copy, which call the runtime (cuMemcpyAsync, stream syncs) from UCX's progress thread; an
// application thread blocked in a runtime call behind the collective's stream (a pageable copy)
// holds the context's lock that call needs, and the collective never completes (stacks of the
// stall: docs/transports.md). Only memory domains UCX can open here count (md_open fails without
// the gdrdrv / RDMA device). Not enough alone for TransportCaps::runtime_free: see ucx_caps().
std::vector<std::string> gpudirect_memory() {
  uct_component_h* comps = nullptr;
  unsigned ncomp = 0;
  if (uct_query_components(&comps, &ncomp) != UCS_OK) return {};
  uint64_t rdma_reg = 0;
  bool gdr_cuda = false, gdr_rocm = false;
  for (unsigned i = 0; i < ncomp; ++i) {
    uct_component_attr_t ca{};
    ca.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(comps[i], &ca) != UCS_OK || ca.md_resource_count == 0) continue;
    std::string name = ca.name;
    if (name != "ib" && name != "gdr_copy" && name != "rocm_gdr") continue;
    std::vector<uct_md_resource_desc_t> res(ca.md_resource_count);
    ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    ca.md_resources = res.data();
    if (uct_component_query(comps[i], &ca) != UCS_OK) continue;
    for (auto& r : res) {
      uct_md_config_t* cfg = nullptr;
      if (uct_md_config_read(comps[i], nullptr, nullptr, &cfg) != UCS_OK) continue;
      uct_md_h md = nullptr;
      ucs_status_t st = uct_md_open(comps[i], r.md_name, cfg, &md);
      uct_config_release(cfg);
      if (st != UCS_OK) continue;
      uct_md_attr_t attr{};
      if (uct_md_query(md, &attr) == UCS_OK && name == "ib") rdma_reg |= attr.cap.reg_mem_types;
      if (name == "gdr_copy") gdr_cuda = true;
      if (name == "rocm_gdr") gdr_rocm = true;
      uct_md_close(md);
    }
  }
  uct_release_component_list(comps);
  std::vector<std::string> out;
  if (gdr_cuda && (rdma_reg & (uint64_t(1) << UCS_MEMORY_TYPE_CUDA))) out.push_back("cuda");
  if (gdr_rocm && (rdma_reg & (uint64_t(1) << UCS_MEMORY_TYPE_ROCM))) out.push_back("rocm");
  return out;
}

// Asks UCX (one UCP context with the user's UCX_* settings) what it can do in this process:
// memory types it handles (ucp_context_query: "cuda" where cuda_copy loaded and a CUDA driver is
// present, "rocm" likewise) and the transports it has resources of. Preference 20 (before hetccl's
// tcp) when UCX brings something tcp cannot -- device memory or an RDMA transport -- else 40
// (after it: on plain Ethernet hetccl's striped tcp is the faster socket path).
TransportCaps ucx_caps() {
  TransportCaps c;
  c.preference = 40;
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) {
    c.detail = "UCX configuration unreadable (check UCX_* variables); not usable";
    return c;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  ucp_context_h ctx = nullptr;
  ucs_status_t st = ucp_init(&params, config, &ctx);
  std::string tls = config_value(config, "TLS");
  ucp_config_release(config);
  if (st != UCS_OK) {
    c.detail = std::string("UCX ") + ucp_get_version_string() + " cannot start: " + status_str(st);
    return c;
  }
  c.same_host = c.other_host = true;
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  uint64_t mem = ucp_context_query(ctx, &attr) == UCS_OK ? attr.memory_types : 1;
  if (mem & (uint64_t(1) << UCS_MEMORY_TYPE_CUDA)) c.memory.push_back("cuda");
  if (mem & (uint64_t(1) << UCS_MEMORY_TYPE_ROCM)) c.memory.push_back("rocm");
  std::vector<std::string> tl = context_transports(ctx);
  ucp_cleanup(ctx);
  bool rdma = false;
  for (auto& t : tl)
    for (const char* p : {"rc", "dc", "ud", "srd", "gga"})
      rdma = rdma || t.compare(0, std::strlen(p), p) == 0;
  c.rdma = rdma;
  // c.runtime_free stays empty: even with GPUDirect RDMA and GDRCopy, the engine's proxy posts
  // device buffers without a prepared handle wherever an RDMA transport registers (prepare_device:
  // a cached registration of memory the framework frees would be stale), and UCP then queries
  // each buffer's memory through cuda_copy (cuCtxSetFlags, the context's lock in UCX 1.22) on
  // the posting thread. Direct-by-default needs registrations prepared on the issuing thread
  // and kept no longer than their operations first; until then the doctor names what UCX offers.
  std::vector<std::string> gpudirect;
  if (c.memory.size() > 1)
    for (auto& m : gpudirect_memory())
      if (std::find(c.memory.begin(), c.memory.end(), m) != c.memory.end()) gpudirect.push_back(m);
  if (rdma || c.memory.size() > 1) c.preference = 20;
  c.detail = std::string("UCX ") + ucp_get_version_string() + "; UCX_TLS=" + tls +
             "; transports " + join(tl) + (rdma ? " (RDMA)" : "") +
             (gpudirect.empty() ? "" : "; GPUDirect RDMA + GDRCopy for " + join(gpudirect) +
                                           " (not used directly yet: posts carry no prepared "
                                           "registration, docs/transports.md)");
  return c;
}

HETCCL_REGISTER_TRANSPORT(ucx, ucx_caps, make_ucx_transport);

}  // namespace hetccl


