// shm transport: peers on the same host, through POSIX shared memory.
//
// Layout. One segment per direction and peer pair, created by the sender in connect():
//   [header page(s): geometry, pids, flags, ring counters, slot headers]
//   [tagged ring: nslots x slot_bytes]   carries isend/irecv traffic
//   [zero-copy ring: nslots x slot_bytes] the zc_* API (page-aligned, for cudaHostRegister)
// slot_bytes is rounded up to a page multiple so every slot is page-aligned.
//
// Tagged ring protocol. The sender owns `head`, the receiver owns `tail` (free-running uint32
// slot counters; slot i lives at i % nslots). A message of n bytes travels as ceil(n/slot_bytes)
// consecutive chunks (one empty chunk for n == 0); each slot header carries {tag, total, offset,
// len}. One sender thread per peer writes whole messages in order (isend writes a message of up
// to 64 KiB itself when that thread is idle and a slot is free, saving a thread hand-off), so
// chunks of a message are contiguous in the ring and FIFO matching per (peer, tag) is ring order. The receiver thread
// matches a message to the earliest posted receive of that tag when its first chunk arrives
// (csrc/match.h, key: the tag); if none is posted it is copied to a heap buffer (unexpected
// message, parked there); a receive posted while
// such a message is still arriving takes it over (what has arrived is copied once, the rest goes
// straight to the user buffer). irecv_reduce reduces straight out of the slot.
//
// Waiting. A waiter spins briefly, then sets a "waiting" flag and sleeps on the counter with a
// shared (non-private) futex; the other side wakes it only when the flag is set (seq_cst on both
// sides, Dekker style, so a wake cannot be lost). Sleeps time out every kCheckMs to check the
// peer: its `closed` flag, and whether its pid still names the same live process (kill(pid, 0),
// zombie state and start time from /proc, so a reused pid is not mistaken for the peer). The
// check's clock is per peer, shared by all its waiters (so many short waits check as often as
// one long one), and a peer found gone stays gone for every waiter. A peer
// in another pid namespace cannot be checked that way; then only the closed flag and the
// caller's timeouts apply.
//
// Security and cleanup. Segment names are "/hetccl-" + 32 hex digits of
// sha256(secret, sender nonce, ranks): unpredictable to anyone who lacks the random per-process
// nonce published through the store. Segments are created O_EXCL with mode 0600 (same user only)
// and the receiver unlinks each one as soon as it has mapped it, so after connect() nothing is
// left in /dev/shm: a crash then leaks nothing (only a crash inside connect() can leave a
// segment, which close() or the creator's exception path removes otherwise). The header stores
// sha256 of the secret; a receiver refuses a segment whose hash differs.
// Space is reserved with posix_fallocate so a full /dev/shm is an error at connect(), not a
// SIGBUS in the middle of a copy.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <new>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common.h"
#include "match.h"
#include "transport.h"

namespace hetccl {
namespace {

constexpr uint64_t kMagic = 0x314d485343544548ull;  // "HETCSHM1"
constexpr uint32_t kVersion = 1;
constexpr int64_t kSpinNs = 20000;  // poll this long before sleeping (a slot copy takes ~100 us)
constexpr int64_t kCheckMs = 100;   // liveness check period while sleeping
constexpr size_t kPage = 4096;
constexpr size_t kInlineBytes = 64 << 10;  // isend copies messages up to this size itself

struct alignas(64) Word {
  std::atomic<uint32_t> v;
};

struct SlotHdr {
  uint64_t tag, total, offset, len;
};
struct ZcHdr {
  uint64_t nbytes, tag;
};

// Lives at the start of each segment. Written by the creator (sender) before `magic`.
struct SegHeader {
  std::atomic<uint64_t> magic;
  uint32_t version, nslots;
  uint64_t slot_bytes, seg_bytes;
  int32_t src_rank, dst_rank, src_pid, pad0;
  char secret_hash[32];
  Word attached;    // receiver has mapped (and unlinked) the segment
  Word dst_pid;
  Word src_closed;  // sender closed its transport
  Word dst_closed;  // receiver closed its transport
  Word head, head_waiting, tail, tail_waiting;      // tagged ring
  Word zhead, zhead_waiting, ztail, ztail_waiting;  // zero-copy ring
  // followed by SlotHdr[nslots] and ZcHdr[nslots]
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t header_bytes(uint32_t nslots) {
  return round_up(sizeof(SegHeader) + nslots * (sizeof(SlotHdr) + sizeof(ZcHdr)), kPage);
}

struct Channel {
  SegHeader* h = nullptr;
  char* base = nullptr;
  size_t bytes = 0;
  SlotHdr* slots = nullptr;
  ZcHdr* zslots = nullptr;
  char* data = nullptr;   // tagged ring
  char* zdata = nullptr;  // zero-copy ring
  uint32_t nslots = 0;
  size_t slot_bytes = 0;
  std::string name;
  bool need_unlink = false;  // we created it and the receiver has not unlinked it yet

  void layout() {
    slots = reinterpret_cast<SlotHdr*>(base + sizeof(SegHeader));
    zslots = reinterpret_cast<ZcHdr*>(slots + nslots);
    data = base + header_bytes(nslots);
    zdata = data + size_t(nslots) * slot_bytes;
  }
  void unmap() {
    if (need_unlink) shm_unlink(name.c_str());
    need_unlink = false;
    if (base) munmap(base, bytes);
    base = nullptr;
    h = nullptr;
  }
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  return out;
}

// A message that arrived before its receive was posted.
struct Unexpected {
  uint64_t tag = 0;
  size_t total = 0;
  std::unique_ptr<char[]> buf;
  size_t received = 0;
  bool complete = false;
  bool matched = false;  // a receive took it over while it was still arriving
  RecvOp op;
};

struct SendOp {
  RequestPtr req;
  const char* buf;
  size_t nbytes;
  uint64_t tag;
};

class ShmTransport;

struct Peer {
  int rank = -1;
  pid_t pid = 0;
  std::string start;  // process start time, "" when the pid is not visible to us
  Channel out, in;
  std::thread send_thread, recv_thread;

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::deque<SendOp> sendq;
  // receives waiting for their message and messages (unexpected) waiting for their receive,
  // by tag (csrc/match.h: the one matching rule)
  MatchQueues<uint64_t, RecvOp, std::shared_ptr<Unexpected>> match;
  std::string failed;  // non-empty once the peer has failed
  Request::ErrorKind failed_kind = Request::ErrorKind::Peer;
  // The send the send thread is copying from its caller's buffer right now: a failure leaves
  // it to that thread, which fails it once it stopped reading the buffer (the caller may free
  // the buffer as soon as the send fails). failed_flag: `failed` is set (read while copying).
  RequestPtr sending;
  std::atomic<bool> failed_flag{false};

  uint32_t send_head = 0;  // tagged ring slots published; written by the send thread, or by
                           // isend inline while the send queue is empty (both under the rules
                           // of send_loop/isend)

  std::mutex zmu;  // zero-copy ring counters (one caller at a time, but be safe)
  uint32_t zs_acq = 0, zs_commit = 0, zr_acq = 0, zr_rel = 0;

  // Liveness, shared by every wait on this peer (send/recv threads, zero-copy callers), so that
  // many short waits check it as often as one long wait: when it was last checked, and, once a
  // check found the peer gone, why (sticky; gone_state 2 publishes gone_why).
  std::atomic<int64_t> checked_ms{0};
  std::atomic<int> gone_state{0};  // 0 alive, 1 being recorded, 2 recorded
  std::string gone_why;
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(int rank, int size, const Options& opts) : rank_(rank), size_(size) {
    secret_ = opt_str(opts, "secret", "");
    slot_bytes_ = round_up(size_t(opt_int(opts, "slot_bytes", 1 << 20, 1, int64_t(1) << 30)), kPage);
    nslots_ = uint32_t(opt_int(opts, "nslots", 8, 1, 4096));
    fit_budget(size_t(opt_int(opts, "seg_budget", 0, 0, int64_t(1) << 40)));
    nonce_ = to_hex(random_bytes(16));
    bool z = false;
    start_ = proc_start(getpid(), &z);
    peers_.resize(size);
  }
  ~ShmTransport() override { close(); }

  // Bounded memory (option seg_budget > 0: bytes one outgoing segment may take, header
  // included; the bridge passes a rank's budget over its shared-memory peers, the same on
  // every rank of a host, so both segments of a pair get one geometry): first fewer slots
  // (down to 2, the least that overlaps the two ends' copies), then smaller slots (page
  // multiples, down to one page). slot_bytes/nslots are the caps. Trade-off: fewer slots
  // pipeline less; slots smaller than the engine's chunk cut it smaller (engine_plan.cc clamps
  // chunks to the slot).
  void fit_budget(size_t budget) {
    if (!budget) return;
    auto seg = [](uint32_t n, size_t s) { return header_bytes(n) + 2 * size_t(n) * s; };
    while (nslots_ > 2 && seg(nslots_, slot_bytes_) > budget) --nslots_;
    if (seg(nslots_, slot_bytes_) > budget) {
      size_t room = budget > header_bytes(nslots_) ? budget - header_bytes(nslots_) : 0;
      slot_bytes_ = std::max(kPage, room / (2 * size_t(nslots_)) / kPage * kPage);
    }
  }

  std::string name() const override { return "shm"; }
  // geometry in force and the shared memory this rank created (outgoing) and mapped (incoming)
  std::map<std::string, std::string> info() override {
    size_t out = 0, in = 0, n = 0;
    for (auto& p : peers_)
      if (p) {
        ++n;
        out += p->out.bytes;
        in += p->in.bytes;
      }
    return {{"slot_bytes", std::to_string(slot_bytes_)}, {"nslots", std::to_string(nslots_)},
            {"segment_bytes", std::to_string(header_bytes(nslots_) + 2 * size_t(nslots_) * slot_bytes_)},
            {"peers", std::to_string(n)}, {"created_bytes", std::to_string(out)},
            {"mapped_bytes", std::to_string(in)}};
  }

  std::string address() override {
    return "shm1|" + host_id() + "|" + std::to_string(getpid()) + "|" + start_ + "|" + nonce_;
  }

  void connect(const std::vector<std::string>& addresses, int64_t timeout_ms) override;
  RequestPtr isend(int peer, const void* buf, size_t nbytes, uint64_t tag) override;
  RequestPtr irecv(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    return post_recv(peer, RecvOp::copying(buf, nbytes), tag);
  }
  RequestPtr irecv_reduce(int peer, void* dst, size_t nbytes, uint64_t tag, ReduceOp rop,
                          DType dtype) override {
    return post_recv(peer, RecvOp::reducing("hetccl shm", dst, nbytes, rop, dtype), tag);
  }
  void close() override;
  // a withdrawn receive's message goes to the next receive of (peer, tag): unpost or not
  bool cancel(const RequestPtr& req, bool unpost = false) override;

  bool zc_supported() const override { return true; }
  std::vector<std::pair<void*, size_t>> zc_regions() override;
  void zc_send_commit(int peer, size_t nbytes, uint64_t tag) override;
  void zc_recv_release(int peer) override;
  std::pair<void*, size_t> zc_send_try(int peer) override;
  std::tuple<void*, size_t, uint64_t> zc_recv_try(int peer) override;
  std::pair<uint32_t, uint32_t> zc_send_counts(int peer) override;
  uint32_t zc_depth(int peer) override { return peer_ref(peer).out.nslots; }
  size_t zc_slot_bytes(int peer) override { return peer_ref(peer).out.slot_bytes; }
  uint32_t zc_recv_pos(int peer) override {
    Peer& p = peer_ref(peer);
    std::lock_guard<std::mutex> g(p.zmu);
    return p.zr_acq;
  }
  void* zc_slot(int peer, bool outgoing, uint32_t pos) override {
    Channel& c = outgoing ? peer_ref(peer).out : peer_ref(peer).in;
    if (!c.zdata) throw CommError("hetccl shm: transport closed");
    return c.zdata + size_t(pos % c.nslots) * c.slot_bytes;
  }
  void zc_wait(int peer, int64_t timeout_ms) override;

 private:
  std::string seg_name(const std::string& src_nonce, int src, int dst) const {
    return "/hetccl-" + to_hex(sha256(secret_ + "|" + src_nonce + "|" + std::to_string(src) + "|" +
                                      std::to_string(dst)))
                            .substr(0, 32);
  }
  Peer& peer_ref(int peer) {
    check_peer(peer, rank_, size_);
    Peer* p = peers_[peer].get();
    if (!p)
      throw CommError("hetccl shm: rank " + std::to_string(peer) +
                      " is not a peer of this transport (empty address at connect(), or connect() "
                      "not called)");
    return *p;
  }
  std::string who(const Peer& p) const {
    return "peer rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid) + ")";
  }
  // "" while the peer looks alive; else why it is not. as_sender: we wait on its reading.
  std::string check_peer_alive(Peer& p, bool as_sender) {
    if (as_sender ? p.out.h->dst_closed.v.load() : p.in.h->src_closed.v.load())
      return "hetccl shm: " + who(p) + " closed its transport";
    if (!p.start.empty()) {
      bool zombie = false;
      bool gone = kill(p.pid, 0) != 0 && errno == ESRCH;
      if (!gone) {
        std::string st = proc_start(p.pid, &zombie);
        gone = zombie || st != p.start;
      }
      if (gone) return "hetccl shm: " + who(p) + " died";
    }
    return "";
  }
  // "" while the peer looks alive; else why not. Checks at most every kCheckMs per peer (any
  // caller's check counts); a peer found gone stays gone.
  std::string liveness(Peer& p, bool as_sender) {
    if (p.gone_state.load(std::memory_order_acquire) == 2) return p.gone_why;
    const int64_t t = now_ms();
    if (t - p.checked_ms.load() < kCheckMs) return "";
    p.checked_ms.store(t);
    std::string why = check_peer_alive(p, as_sender);
    int alive = 0;
    if (!why.empty() && p.gone_state.compare_exchange_strong(alive, 1)) {
      p.gone_why = why;
      p.gone_state.store(2, std::memory_order_release);
    }
    return why;
  }
  // Zero-copy ring slots, under p.zmu: whether the next one is free / filled, and taking it.
  bool zc_send_free(Peer& p) {
    return p.zs_acq - p.out.h->ztail.v.load(std::memory_order_acquire) < p.out.nslots;
  }
  bool zc_recv_filled(Peer& p) {
    return p.in.h->zhead.v.load(std::memory_order_acquire) != p.zr_acq;
  }
  std::pair<void*, size_t> zc_take_send(Peer& p) {
    uint32_t slot = p.zs_acq++ % p.out.nslots;
    return {p.out.zdata + size_t(slot) * p.out.slot_bytes, p.out.slot_bytes};
  }
  std::tuple<void*, size_t, uint64_t> zc_take_recv(Peer& p) {
    uint32_t slot = p.zr_acq++ % p.in.nslots;
    ZcHdr zh = p.in.zslots[slot];
    if (zh.nbytes > p.in.slot_bytes)
      throw PeerFailure("hetccl shm: " + who(p) + " committed a corrupt zero-copy slot");
    return {p.in.zdata + size_t(slot) * p.in.slot_bytes, size_t(zh.nbytes), zh.tag};
  }
  void fail_peer(Peer& p, Request::ErrorKind kind, const std::string& msg);
  // keep_delivered: the receiver thread found the peer gone after reading everything it had
  // written: messages that arrived whole and were not received yet stay deliverable (post_recv)
  void fail_all_locked(Peer& p, Request::ErrorKind kind, const std::string& msg,
                       bool keep_delivered = false);
  RequestPtr post_recv(int peer, RecvOp op, uint64_t tag);
  void send_loop(Peer* p);
  void recv_loop(Peer* p);
  // Waits until pred() or failure; returns "" or the failure message. Spins, then futex-sleeps
  // on `word` (with `waiting` flag), checking the peer's liveness when due (liveness()), also
  // once the deadline has passed.
  template <typename Pred>
  std::string wait_on(Peer& p, bool as_sender, Word& word, Word& waiting, Pred pred,
                      const Deadline* deadline);

  const int rank_, size_;
  std::string secret_, nonce_, start_;
  size_t slot_bytes_;
  uint32_t nslots_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::atomic<bool> stop_{false};
  bool connected_ = false, closed_ = false;
  std::mutex close_mu_;
};

template <typename Pred>
std::string ShmTransport::wait_on(Peer& p, bool as_sender, Word& word, Word& waiting, Pred pred,
                                  const Deadline* deadline) {
  const int64_t spin_until = now_ns() + kSpinNs;
  do {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return "";
      cpu_relax();
    }
  } while (now_ns() < spin_until);
  for (;;) {
    if (pred()) return "";
    if (stop_.load()) return "hetccl shm: transport closed";
    std::string why = liveness(p, as_sender);
    if (!why.empty() && !pred()) return why;
    int64_t sleep = kCheckMs;
    if (deadline) {
      if (deadline->expired()) return "timeout";
      sleep = std::min<int64_t>(sleep, std::max<int64_t>(1, deadline->left_ms()));
    }
    uint32_t seen = word.v.load();
    waiting.v.store(1);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // flag store before the re-check load
    if (!pred() && !stop_.load()) futex_wait(&word.v, seen, sleep);
    waiting.v.store(0);
  }
}

void ShmTransport::connect(const std::vector<std::string>& addresses, int64_t timeout_ms) {
  if (connected_) throw CommError("hetccl shm: connect() called twice");
  if (int(addresses.size()) != size_)
    throw CommError("hetccl shm: connect() got " + std::to_string(addresses.size()) +
                    " addresses for a world of " + std::to_string(size_));
  Deadline deadline(timeout_ms);
  const std::string me_host = host_id();
  const std::string secret_hash = sha256(secret_);
  std::vector<std::string> nonces(size_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || addresses[r].empty()) continue;
    auto f = split(addresses[r], '|');
    if (f.size() != 5 || f[0] != "shm1")
      throw CommError("hetccl shm: rank " + std::to_string(r) + " published an address that is not "
                      "an shm address: '" + addresses[r] + "'");
    if (f[1] != me_host)
      throw CommError("hetccl shm: rank " + std::to_string(r) + " is on host '" + f[1] +
                      "', this rank on '" + me_host + "': shm connects only peers on the same host");
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->pid = pid_t(std::stol(f[2]));
    bool zombie = false;
    // Liveness checks only if we see the same process the peer saw as itself.
    p->start = proc_start(p->pid, &zombie) == f[3] && !f[3].empty() ? f[3] : "";
    nonces[r] = f[4];
    peers_[r] = std::move(p);
  }
  const size_t seg_bytes = header_bytes(nslots_) + 2 * size_t(nslots_) * slot_bytes_;

  auto cleanup = [&] {
    for (auto& p : peers_)
      if (p) {
        p->out.unmap();
        p->in.unmap();
      }
    for (auto& p : peers_) p.reset();
  };

  // 1. Create our outgoing segments.
  try {
    for (auto& pp : peers_) {
      if (!pp) continue;
      Channel& c = pp->out;
      c.name = seg_name(nonce_, rank_, pp->rank);
      int fd = shm_open(c.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0)
        throw CommError("hetccl shm: shm_open(" + c.name + ") failed: " + errno_str(errno));
      c.need_unlink = true;
      int err = ftruncate(fd, off_t(seg_bytes)) ? errno : posix_fallocate(fd, 0, off_t(seg_bytes));
      if (err) {
        ::close(fd);
        throw CommError("hetccl shm: cannot reserve " + std::to_string(seg_bytes >> 20) +
                        " MiB in /dev/shm for the ring to rank " + std::to_string(pp->rank) + ": " +
                        errno_str(err) + " (free space in /dev/shm, or lower slot_bytes/nslots; "
                        "containers: --shm-size)");
      }
      void* m = mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      ::close(fd);
      if (m == MAP_FAILED) throw CommError("hetccl shm: mmap failed: " + errno_str(errno));
      c.base = static_cast<char*>(m);
      c.bytes = seg_bytes;
      c.nslots = nslots_;
      c.slot_bytes = slot_bytes_;
      c.h = new (c.base) SegHeader();
      c.layout();
      c.h->version = kVersion;
      c.h->nslots = nslots_;
      c.h->slot_bytes = slot_bytes_;
      c.h->seg_bytes = seg_bytes;
      c.h->src_rank = rank_;
      c.h->dst_rank = pp->rank;
      c.h->src_pid = getpid();
      std::memcpy(c.h->secret_hash, secret_hash.data(), 32);
      c.h->magic.store(kMagic, std::memory_order_release);
    }
  } catch (...) {
    cleanup();
    throw;
  }

  // 2. Map the peers' segments to us (unlinking each once mapped) and wait until they have
  //    mapped ours.
  std::string problem;
  for (;;) {
    bool all = true;
    for (auto& pp : peers_) {
      if (!pp) continue;
      Channel& c = pp->in;
      if (!c.base) {
        all = false;
        std::string nm = seg_name(nonces[pp->rank], pp->rank, rank_);
        int fd = shm_open(nm.c_str(), O_RDWR, 0);
        if (fd >= 0) {
          struct stat st;
          void* m = MAP_FAILED;
          size_t sz = 0;
          if (fstat(fd, &st) == 0 && size_t(st.st_size) >= sizeof(SegHeader)) {
            sz = size_t(st.st_size);
            m = mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
          }
          ::close(fd);
          if (m != MAP_FAILED) {
            auto* h = static_cast<SegHeader*>(m);
            if (h->magic.load(std::memory_order_acquire) != kMagic) {
              munmap(m, sz);  // creator still initialising
            } else if (h->version != kVersion || h->seg_bytes != sz || h->src_rank != pp->rank ||
                       h->dst_rank != rank_ || h->src_pid != pp->pid ||
                       std::memcmp(h->secret_hash, secret_hash.data(), 32) != 0 ||
                       h->seg_bytes != header_bytes(h->nslots) + 2 * size_t(h->nslots) * h->slot_bytes) {
              munmap(m, sz);
              cleanup();
              throw CommError("hetccl shm: segment " + nm + " from rank " + std::to_string(pp->rank) +
                              " does not match (different hetccl version or group secret)");
            } else {
              c.base = static_cast<char*>(m);
              c.h = h;
              c.bytes = sz;
              c.name = nm;
              c.nslots = h->nslots;
              c.slot_bytes = h->slot_bytes;
              c.layout();
              h->dst_pid.v.store(uint32_t(getpid()));
              h->attached.v.store(1, std::memory_order_release);
              shm_unlink(nm.c_str());
            }
          }
        }
      }
      if (pp->out.need_unlink) {
        if (pp->out.h->attached.v.load(std::memory_order_acquire))
          pp->out.need_unlink = false;  // the receiver unlinked it
        else
          all = false;
      }
    }
    if (all) break;
    if (deadline.expired()) {
      std::string missing;
      for (auto& pp : peers_) {
        if (!pp || (pp->in.base && !pp->out.need_unlink)) continue;
        bool zombie = false;
        bool dead = !pp->start.empty() && proc_start(pp->pid, &zombie) != pp->start;
        missing += (missing.empty() ? "" : ", ") + std::to_string(pp->rank) + " (pid " +
                   std::to_string(pp->pid) + (dead || zombie ? ", exited" : "") + ")";
      }
      cleanup();
      throw CommTimeout("hetccl shm: connect() timed out after " + std::to_string(timeout_ms) +
                        " ms: ranks [" + missing + "] did not connect");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }

  connected_ = true;
  for (auto& pp : peers_) {
    if (!pp) continue;
    pp->send_thread = std::thread([this, p = pp.get()] { send_loop(p); });
    pp->recv_thread = std::thread([this, p = pp.get()] { recv_loop(p); });
  }
}

void ShmTransport::fail_all_locked(Peer& p, Request::ErrorKind kind, const std::string& msg,
                                   bool keep_delivered) {
  if (p.failed.empty()) {
    p.failed = msg;
    p.failed_kind = kind;
  }
  p.failed_flag.store(true);
  for (auto& s : p.sendq)
    if (s.req != p.sending) s.req->fail(kind, msg);  // the one being copied: send_loop fails it
  p.sendq.clear();
  p.match.drain_recvs([&](uint64_t, RecvOp& r) { r.req->fail(kind, msg); });
  if (!keep_delivered) {
    p.match.clear_msgs();
    return;
  }
  // A peer that finished its part of a collective and closed (destroy_process_group) may do so
  // before this rank has posted the receive of its last message, which is here whole: an
  // orderly close must not lose it. Per tag only the leading whole messages stay (a later one
  // behind a partial one could never be reached in order).
  p.match.trim_msgs([](const std::shared_ptr<Unexpected>& u) { return u->complete && !u->matched; });
}

void ShmTransport::fail_peer(Peer& p, Request::ErrorKind kind, const std::string& msg) {
  std::lock_guard<std::mutex> g(p.mu);
  // the peer is gone: what it had sent whole stays deliverable (see fail_all_locked)
  fail_all_locked(p, kind, msg, /*keep_delivered=*/true);
  p.cv.notify_all();
}

RequestPtr ShmTransport::isend(int peer, const void* buf, size_t nbytes, uint64_t tag) {
  check_tag(tag);
  Peer& p = peer_ref(peer);
  auto req = std::make_shared<Request>(peer, tag, nbytes);
  std::lock_guard<std::mutex> g(p.mu);
  if (!p.failed.empty()) {
    req->fail(p.failed_kind, p.failed);
    return req;
  }
  // Small message, idle send thread, free slot: write it here (saves a thread hand-off, i.e.
  // latency). The send thread only writes while the queue is non-empty, and we hold p.mu.
  SegHeader* h = p.out.h;
  if (p.sendq.empty() && nbytes <= kInlineBytes && nbytes <= p.out.slot_bytes && h &&
      p.send_head - h->tail.v.load(std::memory_order_acquire) < p.out.nslots) {
    uint32_t slot = p.send_head % p.out.nslots;
    if (nbytes) std::memcpy(p.out.data + size_t(slot) * p.out.slot_bytes, buf, nbytes);
    p.out.slots[slot] = SlotHdr{tag, nbytes, 0, nbytes};
    h->head.v.store(++p.send_head, std::memory_order_seq_cst);
    if (h->head_waiting.v.load(std::memory_order_seq_cst)) futex_wake(&h->head.v);
    req->complete(nbytes);
    return req;
  }
  p.sendq.push_back(SendOp{req, static_cast<const char*>(buf), nbytes, tag});
  if (p.sendq.size() == 1) p.cv.notify_all();
  return req;
}

bool ShmTransport::cancel(const RequestPtr& req, bool /*unpost*/) {
  if (!req || req->peer() < 0 || req->peer() >= size_ || !peers_[req->peer()]) return false;
  Peer& p = *peers_[req->peer()];
  {
    std::lock_guard<std::mutex> g(p.mu);
    // waiting and not yet matched: the receiver thread takes a waiting receive (under p.mu)
    // when the first chunk of its message arrives, so one still waiting has seen no byte
    if (!p.match.withdraw_recv(req->tag(), [&](const RecvOp& o) { return o.req == req; })) return false;
  }
  req->fail(Request::ErrorKind::Generic, "hetccl shm: receive from peer rank " +
                                             std::to_string(req->peer()) + " (tag " +
                                             std::to_string(req->tag()) + ") cancelled");
  return true;
}

RequestPtr ShmTransport::post_recv(int peer, RecvOp op, uint64_t tag) {
  check_tag(tag);
  Peer& p = peer_ref(peer);
  op.req = std::make_shared<Request>(peer, tag, op.cap);
  std::shared_ptr<Unexpected> ux;
  {
    std::lock_guard<std::mutex> g(p.mu);
    std::optional<std::shared_ptr<Unexpected>> parked = p.match.take_msg(tag);
    if (!p.failed.empty() && !parked) {
      // only messages that arrived whole before the peer went are still deliverable
      op.req->fail(p.failed_kind, p.failed);
      return op.req;
    }
    if (!parked) {
      p.match.wait(tag, op);
      return op.req;
    }
    ux = std::move(*parked);
    std::string bad = size_mismatch("hetccl shm", op, ux->total, peer, tag);
    if (!bad.empty()) {
      op.req->fail(Request::ErrorKind::Truncated, bad);
      return op.req;  // the message is consumed; the receiver thread drops it when complete
    }
    if (!ux->complete) {
      ux->matched = true;  // the receiver thread moves it over at its next chunk
      ux->op = op;
      return op.req;
    }
  }
  deliver(op, 0, ux->buf.get(), ux->total);
  op.req->complete(ux->total);
  return op.req;
}

void ShmTransport::send_loop(Peer* pp) {
  Peer& p = *pp;
  SegHeader* h = p.out.h;
  const uint32_t n = p.out.nslots;
  const size_t sb = p.out.slot_bytes;
  for (;;) {
    SendOp op;
    uint32_t head;
    {
      std::unique_lock<std::mutex> g(p.mu);
      p.cv.wait(g, [&] { return stop_.load() || !p.sendq.empty(); });
      if (stop_.load()) return;
      op = p.sendq.front();
      head = p.send_head;
      p.sending = op.req;
    }
    size_t off = 0;
    std::string err;
    do {
      err = wait_on(p, true, h->tail, h->tail_waiting,
                    [&] { return head - h->tail.v.load(std::memory_order_acquire) < n; }, nullptr);
      if (!err.empty() || p.failed_flag.load()) break;
      uint32_t slot = head % n;
      size_t len = std::min(sb, op.nbytes - off);
      if (len) std::memcpy(p.out.data + size_t(slot) * sb, op.buf + off, len);
      p.out.slots[slot] = SlotHdr{op.tag, op.nbytes, off, len};
      off += len;
      ++head;
      p.send_head = head;
      h->head.v.store(head, std::memory_order_seq_cst);
      if (h->head_waiting.v.load(std::memory_order_seq_cst)) futex_wake(&h->head.v);
    } while (off < op.nbytes);
    {
      // its buffer is no longer read: a failure that came meanwhile is now its own
      std::lock_guard<std::mutex> g(p.mu);
      p.sending.reset();
      if (!p.failed.empty()) {
        op.req->fail(p.failed_kind, p.failed);
        continue;
      }
    }
    if (!err.empty()) {
      if (stop_.load()) return;
      fail_peer(p, Request::ErrorKind::Peer, err);
      continue;  // later sends fail at once (p.failed); keep serving until close()
    }
    op.req->complete(op.nbytes);
    std::lock_guard<std::mutex> g(p.mu);
    if (!p.sendq.empty() && p.sendq.front().req == op.req) p.sendq.pop_front();
  }
}

void ShmTransport::recv_loop(Peer* pp) {
  Peer& p = *pp;
  SegHeader* h = p.in.h;
  const uint32_t n = p.in.nslots;
  const size_t sb = p.in.slot_bytes;
  uint32_t tail = h->tail.v.load();
  // The message now arriving.
  bool active = false;
  uint64_t tag = 0;
  size_t total = 0, got = 0;
  bool direct = false, discard = false;
  RecvOp op;
  std::shared_ptr<Unexpected> ux;

  // Fails everything pending on this peer, including the receive this thread is filling now
  // (it is in neither queue), then waits for close(): nothing more will come.
  auto give_up = [&](const std::string& err) {
    std::unique_lock<std::mutex> g(p.mu);
    if (active && direct) op.req->fail(Request::ErrorKind::Peer, err);
    if (active && ux && ux->matched) ux->op.req->fail(Request::ErrorKind::Peer, err);
    fail_all_locked(p, Request::ErrorKind::Peer, err, /*keep_delivered=*/true);
    p.cv.notify_all();
    p.cv.wait(g, [&] { return stop_.load(); });
  };

  for (;;) {
    std::string err = wait_on(p, false, h->head, h->head_waiting,
                              [&] { return h->head.v.load(std::memory_order_acquire) != tail; },
                              nullptr);
    if (!err.empty()) {
      if (stop_.load()) {
        // close(): the receive being filled is failed here, the queued ones by close()
        std::lock_guard<std::mutex> g(p.mu);
        if (active && direct) op.req->fail(Request::ErrorKind::Generic, "hetccl shm: transport closed");
        if (active && ux && ux->matched)
          ux->op.req->fail(Request::ErrorKind::Generic, "hetccl shm: transport closed");
        return;
      }
      give_up(err);
      return;
    }
    const uint32_t slot = tail % n;
    const SlotHdr sh = p.in.slots[slot];
    const char* src = p.in.data + size_t(slot) * sb;
    bool bad = sh.len > sb || sh.offset > sh.total || sh.len > sh.total - sh.offset ||
               sh.offset != (active ? got : 0) ||
               (active && (sh.tag != tag || sh.total != total)) ||
               (sh.len == 0 && sh.total != 0);
    if (bad) {
      give_up("hetccl shm: " + who(p) + " wrote a corrupt ring slot (tag " + std::to_string(sh.tag) +
              ", total " + std::to_string(sh.total) + ", offset " + std::to_string(sh.offset) +
              ", len " + std::to_string(sh.len) + ")");
      return;
    }
    if (!active) {
      active = true;
      tag = sh.tag;
      total = sh.total;
      got = 0;
      direct = discard = false;
      ux.reset();
      std::lock_guard<std::mutex> g(p.mu);
      if (std::optional<RecvOp> waiting = p.match.take_recv(tag)) {
        op = std::move(*waiting);
        std::string why = size_mismatch("hetccl shm", op, total, p.rank, tag);
        if (!why.empty()) {
          op.req->fail(Request::ErrorKind::Truncated, why);
          discard = true;
        } else {
          direct = true;
        }
      } else {
        ux = std::make_shared<Unexpected>();
        ux->tag = tag;
        ux->total = total;
        ux->buf.reset(new (std::nothrow) char[std::max<size_t>(total, 1)]);
        if (ux->buf) p.match.park(tag, ux);
      }
    }
    if (ux && !ux->buf) {
      ux.reset();
      give_up("hetccl shm: cannot buffer an unexpected message of " + std::to_string(total) +
              " bytes from " + who(p) + " (tag " + std::to_string(tag) + "): out of memory");
      return;
    }
    if (direct) {
      deliver(op, sh.offset, src, sh.len);
    } else if (ux) {
      if (sh.len) std::memcpy(ux->buf.get() + sh.offset, src, sh.len);
    }
    got += sh.len;
    if (ux) {
      bool take = false;
      {
        std::lock_guard<std::mutex> g(p.mu);
        ux->received = got;
        if (ux->matched) {
          take = true;
          op = ux->op;
        } else if (got == total) {
          ux->complete = true;
        }
      }
      if (take) {  // a receive was posted meanwhile: hand over what arrived, go direct
        deliver(op, 0, ux->buf.get(), got);
        ux.reset();
        direct = true;
      }
    }
    ++tail;
    h->tail.v.store(tail, std::memory_order_seq_cst);
    if (h->tail_waiting.v.load(std::memory_order_seq_cst)) futex_wake(&h->tail.v);
    if (got == total) {
      if (direct) op.req->complete(total);
      active = false;
      op = RecvOp();
      ux.reset();
    }
  }
}

void ShmTransport::close() {
  std::lock_guard<std::mutex> cg(close_mu_);
  if (closed_) return;
  closed_ = true;
  stop_.store(true);
  auto wake_all = [](SegHeader* h) {  // every sleeper on either ring of this segment
    for (Word* w : {&h->head, &h->tail, &h->zhead, &h->ztail}) futex_wake(&w->v);
  };
  for (auto& pp : peers_) {
    if (!pp) continue;
    if (pp->out.h) {
      pp->out.h->src_closed.v.store(1);
      wake_all(pp->out.h);
    }
    if (pp->in.h) {
      pp->in.h->dst_closed.v.store(1);
      wake_all(pp->in.h);
    }
    std::lock_guard<std::mutex> g(pp->mu);
    pp->cv.notify_all();
  }
  for (auto& pp : peers_) {
    if (!pp) continue;
    if (pp->send_thread.joinable()) pp->send_thread.join();
    if (pp->recv_thread.joinable()) pp->recv_thread.join();
    {
      std::lock_guard<std::mutex> g(pp->mu);
      fail_all_locked(*pp, Request::ErrorKind::Generic, "hetccl shm: transport closed");
    }
    std::lock_guard<std::mutex> zg(pp->zmu);
    pp->out.unmap();
    pp->in.unmap();
  }
}

// ---------------------------------------------------------------- zero-copy ring
std::vector<std::pair<void*, size_t>> ShmTransport::zc_regions() {
  std::vector<std::pair<void*, size_t>> v;
  for (auto& pp : peers_) {
    if (!pp) continue;
    for (Channel* c : {&pp->out, &pp->in})
      if (c->base) v.emplace_back(c->zdata, size_t(c->nslots) * c->slot_bytes);
  }
  return v;
}

void ShmTransport::zc_send_commit(int peer, size_t nbytes, uint64_t tag) {
  check_tag(tag);
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.out.h) throw CommError("hetccl shm: transport closed");
  if (p.zs_commit == p.zs_acq)
    throw CommError("hetccl shm: zc_send_commit to peer rank " + std::to_string(peer) +
                    " without an acquired slot");
  if (nbytes > p.out.slot_bytes)
    throw CommError("hetccl shm: zc_send_commit of " + std::to_string(nbytes) +
                    " bytes exceeds the slot capacity " + std::to_string(p.out.slot_bytes));
  SegHeader* h = p.out.h;
  p.out.zslots[p.zs_commit % p.out.nslots] = ZcHdr{nbytes, tag};
  ++p.zs_commit;
  h->zhead.v.store(p.zs_commit, std::memory_order_seq_cst);
  if (h->zhead_waiting.v.load(std::memory_order_seq_cst)) futex_wake(&h->zhead.v);
}

void ShmTransport::zc_recv_release(int peer) {
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.in.h) throw CommError("hetccl shm: transport closed");
  if (p.zr_rel == p.zr_acq)
    throw CommError("hetccl shm: zc_recv_release from peer rank " + std::to_string(peer) +
                    " without an acquired slot");
  SegHeader* h = p.in.h;
  ++p.zr_rel;
  h->ztail.v.store(p.zr_rel, std::memory_order_seq_cst);
  if (h->ztail_waiting.v.load(std::memory_order_seq_cst)) futex_wake(&h->ztail.v);
}

std::pair<void*, size_t> ShmTransport::zc_send_try(int peer) {
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.out.h) throw CommError("hetccl shm: transport closed");
  return zc_send_free(p) ? zc_take_send(p) : std::pair<void*, size_t>{nullptr, 0};
}

std::tuple<void*, size_t, uint64_t> ShmTransport::zc_recv_try(int peer) {
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.in.h) throw CommError("hetccl shm: transport closed");
  if (!zc_recv_filled(p)) return {nullptr, 0, 0};
  return zc_take_recv(p);
}

std::pair<uint32_t, uint32_t> ShmTransport::zc_send_counts(int peer) {
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.out.h) throw CommError("hetccl shm: transport closed");
  return {p.zs_acq, p.out.h->ztail.v.load(std::memory_order_acquire)};
}

void ShmTransport::zc_wait(int peer, int64_t timeout_ms) {
  Peer& p = peer_ref(peer);
  std::lock_guard<std::mutex> g(p.zmu);
  if (!p.out.h || !p.in.h) throw CommError("hetccl shm: transport closed");
  SegHeader* ho = p.out.h;
  SegHeader* hi = p.in.h;
  // Sleeps on the incoming ring's head (the peer's commits wake us); a release of one of our
  // slots is noticed by the predicate within the sleep slice, kept short for that reason.
  const uint32_t tail0 = ho->ztail.v.load(std::memory_order_acquire);
  Deadline d(std::min<int64_t>(timeout_ms, 2));
  auto ready = [&] {
    return zc_recv_filled(p) || ho->ztail.v.load(std::memory_order_acquire) != tail0;
  };
  std::string err = wait_on(p, true, hi->zhead, hi->zhead_waiting, ready, &d);
  if (err == "timeout" || err.empty()) return;
  if (stop_.load()) throw CommError("hetccl shm: transport closed");
  throw PeerFailure(err);
}

}  // namespace

namespace {
std::unique_ptr<Transport> make_shm_transport(int rank, int size, const Options& opts) {
  return std::make_unique<ShmTransport>(rank, size, opts);
}

// Same host only (one kernel, one /dev/shm); host memory (device data reaches its zero-copy
// ring through the engine's copies); first choice wherever it reaches.
TransportCaps shm_caps() {
  TransportCaps c;
  c.preference = 10;
  c.same_host = true;
  c.zero_copy = true;
  c.detail = "POSIX shared-memory rings, zero-copy ring for the engine";
  return c;
}
}  // namespace

HETCCL_REGISTER_TRANSPORT(shm, shm_caps, make_shm_transport);

}  // namespace hetccl
