// tcp transport: peers anywhere, over nconn TCP connections per peer.
//
// Setup. The constructor opens a listener on options["bind_addr"] (default: all interfaces) on
// an ephemeral port; address() is "host:port". In connect(), each rank dials every peer of LOWER
// rank nconn times; connections from higher ranks arrive at the listener. An acceptor thread owns
// the listener for the transport's whole life (strangers may knock at any time) and runs each
// handshake with a deadline (handshake_timeout_ms), without blocking anything else:
//   acceptor -> dialer : magic "HETCTCP1", version, acceptor rank, 16-byte random nonce_a
//   dialer -> acceptor : magic, version, dialer rank, connection index, nconn, world size,
//                        nonce_c, proof_c = sha256(secret|"dial"|nonce_a|nonce_c|ranks|index)
//   acceptor -> dialer : magic, status, proof_a = sha256(secret|"accept"|nonce_a|nonce_c|...)
// Both sides prove knowledge of the group secret without sending it, and fresh nonces make a
// recorded handshake useless for a later connection. The trade-off: a plain hash, not an HMAC.
// Length extension does not apply (each side hashes a fixed-format string it builds itself), but
// a recorded handshake allows offline guessing of the secret, so this is sound only because the
// secret is random per group (the Python side draws it), never a password. The data itself is
// NOT encrypted or authenticated after the handshake (an on-path attacker can read or alter
// tensors; use a trusted network, as with NCCL and Gloo).
// A connection that sends garbage, the wrong secret or nothing before the deadline is closed and
// logged ("hetccl WARN tcp: ...") and never reaches the job.
//
// Data. A message travels as frames: a 40-byte header {kind, len, tag, seq, total, offset} and
// `len` payload bytes. Messages up to chunk_bytes are one frame; larger ones are striped: each
// connection, when its socket is writable, pulls the next chunk of the peer's send queue, so fast
// connections carry more. `seq` numbers the messages of one (peer, tag) pair in send order and
// the k-th receive posted for (peer, tag) takes seq k: FIFO matching per (peer, tag) holds even
// though frames arrive out of order across connections (csrc/match.h, key (tag, seq)). Frames
// of a matched message are read straight into the user buffer at their offset (irecv_reduce:
// into a per-connection staging buffer, then reduced into place while it is in cache). Frames
// of a message whose receive is not posted yet go to a heap buffer; a receive posted later
// copies what arrived once and takes the remaining frames directly.
//
// Progress. A few threads (progress_threads, default min(nconn, 2)) each own a share of the
// connections (connection i of every peer goes to thread i % threads) and run an edge-triggered
// epoll loop over non-blocking sockets; sends post to the peer queue and wake them through an
// eventfd. Requests complete on these threads.
//
// Failure. A reset, a write error, a connection closed in the middle of a frame, a protocol
// violation, or all connections of a peer closed fail every pending request of that peer with
// PeerFailure naming its rank and address; later posts to it fail at once. A stopped (not dead)
// peer is not detected here: callers' wait timeouts catch it.
#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <map>
#include <new>
#include <set>
#include <thread>
#include <unordered_map>

#include "common.h"
#include "match.h"
#include "net.h"
#include "transport.h"

namespace hetccl {
namespace {

constexpr char kMagic[9] = "HETCTCP1";
constexpr uint32_t kVersion = 1;
constexpr size_t kA1 = 32, kC1 = 80, kA2 = 48;  // handshake message sizes
constexpr size_t kHdr = 40;                      // frame header
constexpr uint32_t kFrameData = 1;
constexpr size_t kMaxFrame = size_t(256) << 20;  // sanity bound on a received frame
constexpr size_t kBudget = size_t(4) << 20;      // bytes per connection per turn (fairness)
constexpr int kMaxPendingHandshakes = 64;


// The threads using a request's buffer right now, and a failure that waits for them (under the
// peer's mu): the request fails only once none uses its buffer, since the caller may free the
// buffer as soon as the request fails.
struct Holds {
  int n = 0;
  bool pending = false;
  Request::ErrorKind kind = Request::ErrorKind::Generic;
  std::string msg;
  void hold() { ++n; }
  // fails req now, or when the last holder lets go
  void fail(const RequestPtr& req, Request::ErrorKind k, const std::string& m) {
    if (n == 0) {
      req->fail(k, m);
      return;
    }
    pending = true;
    kind = k;
    msg = m;
  }
  // one holder lets go; true when that let a pending failure through (req has failed)
  bool let_go(const RequestPtr& req) {
    if (--n > 0 || !pending) return false;
    req->fail(kind, msg);
    return true;
  }
};

struct SendMsg {
  RequestPtr req;
  const char* buf;
  size_t total;
  uint64_t tag, seq;
  size_t assigned = 0;  // bytes handed to connections
  bool assigned_all = false;
  size_t done = 0;      // bytes fully written
  Holds holds;  // connections whose current frame reads from buf
};

// One incoming message, known from its receive being posted and/or its first frame arriving.
struct InMsg {
  bool have_total = false;
  size_t total = 0, received = 0;
  bool has_op = false, op_failed = false;
  RecvOp op;
  std::unique_ptr<char[]> heap;  // frames that arrived before the receive was posted
  std::vector<std::pair<size_t, size_t>> heap_ranges;
  int heap_inflight = 0;  // frames being read into heap right now
  bool migrating = false; // heap contents being copied to the user buffer
  // connections whose current frame writes into the receive's buffer (Direct, Stage), and a
  // migrate in progress
  Holds holds;
  bool complete() const { return have_total && received == total && !migrating && heap_inflight == 0; }
};

using MsgKey = std::pair<uint64_t, uint64_t>;  // (tag, seq)

struct Peer;

struct Conn {
  int fd = -1;
  int idx = 0;
  Peer* peer = nullptr;
  bool readable = true, writable = true;
  bool eof = false;
  std::atomic<bool> dead{false};
  // receive side
  unsigned char hdr[kHdr];
  size_t hdr_got = 0;
  bool in_payload = false;
  uint64_t f_tag = 0, f_seq = 0, f_total = 0, f_off = 0;
  size_t f_len = 0, f_got = 0;
  enum class Mode { Direct, Heap, Stage, Discard } mode = Mode::Direct;
  char* dst = nullptr;
  std::shared_ptr<InMsg> msg;
  std::vector<char> stage;
  // send side
  std::shared_ptr<SendMsg> tx;
  unsigned char txhdr[kHdr];
  size_t tx_off = 0, tx_len = 0, tx_sent = 0;
};

struct Peer {
  int rank = -1;
  std::string addr;
  std::vector<std::unique_ptr<Conn>> conns;
  std::mutex mu;  // guards everything below
  std::deque<std::shared_ptr<SendMsg>> sendq;  // not yet fully assigned to connections
  std::set<std::shared_ptr<SendMsg>> active;   // posted, not yet complete
  std::unordered_map<uint64_t, uint64_t> send_seq, recv_seq;
  // Matching (csrc/match.h), key (tag, seq): receives waiting for their message's first frame
  // and messages whose frames arrive before their receive (on the heap). Once both met, the
  // message is `arriving` until its last frame is in (every frame looks it up).
  MatchQueues<MsgKey, std::shared_ptr<InMsg>, std::shared_ptr<InMsg>> match;
  std::map<MsgKey, std::shared_ptr<InMsg>> arriving;
  int eof_conns = 0;
  // lazy mode (connections made on first use): who makes this peer's connections. dialing:
  // this rank dials (or has dialed) them; accepting: the peer's dial was accepted, its
  // connections arrive at the acceptor. Both are set when two ranks dialed each other at once
  // (the higher rank, turned away, then takes the lower rank's set). Under mu.
  bool dialing = false, accepting = false;
  std::atomic<bool> registered{false};  // lazy mode: connect() gave this rank an address
  std::set<int> accepted_idx;  // connection indices accepted from this peer (duplicates refused)
  std::string failed;
  Request::ErrorKind failed_kind = Request::ErrorKind::Peer;
};

struct Worker {
  int epfd = -1, evfd = -1;
  std::vector<Conn*> conns;  // the worker thread's own list
  std::mutex add_mu;
  std::vector<Conn*> adds;   // connections handed over by add_conn, taken in by the worker
  std::atomic<bool> has_adds{false};  // adds is non-empty (the loop tests it without the lock)
  std::thread th;
};

struct Handshake {
  int fd;
  std::string from;
  int64_t deadline;
  std::string nonce_a;
  unsigned char buf[kC1];
  size_t got = 0;
};

std::string proof(const std::string& secret, const char* role, const std::string& na,
                  const std::string& nc, int dialer, int acceptor, int idx) {
  return sha256(secret + "|" + role + "|" + na + "|" + nc + "|" + std::to_string(dialer) + "|" +
                std::to_string(acceptor) + "|" + std::to_string(idx));
}

// Blocking helpers on a non-blocking fd with a deadline (connect() and the dialer's handshake).
bool wait_fd(int fd, short ev, const Deadline& d) {
  for (;;) {
    int64_t left = d.left_ms();
    if (left <= 0) return false;
    pollfd p{fd, ev, 0};
    int r = poll(&p, 1, int(std::min<int64_t>(left, 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}
// 1: done, 0: timeout, -1: error or EOF (errno 0 for EOF)
int read_full(int fd, void* buf, size_t n, const Deadline& d) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, static_cast<char*>(buf) + got, n - got, 0);
    if (r > 0) {
      got += size_t(r);
    } else if (r == 0) {
      errno = 0;
      return -1;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(fd, POLLIN, d)) return 0;
    } else if (errno != EINTR) {
      return -1;
    }
  }
  return 1;
}
int write_full(int fd, const void* buf, size_t n, const Deadline& d) {
  size_t put = 0;
  while (put < n) {
    ssize_t r = ::send(fd, static_cast<const char*>(buf) + put, n - put, MSG_NOSIGNAL);
    if (r > 0) {
      put += size_t(r);
    } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd, POLLOUT, d)) return 0;
    } else if (r < 0 && errno != EINTR) {
      return -1;
    }
  }
  return 1;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int size, const Options& opts);
  ~TcpTransport() override {
    close();
    // the workers' epoll and event descriptors stay open until now: an isend racing close()
    // may still wake the (stopped) workers, which must not write into a descriptor number
    // that close() released and something else reused
    for (auto& w : workers_) {
      ::close(w->epfd);
      ::close(w->evfd);
    }
  }
  std::string name() const override { return "tcp"; }
  std::string address() override { return address_; }
  void connect(const std::vector<std::string>& addresses, int64_t timeout_ms) override;
  RequestPtr isend(int peer, const void* buf, size_t nbytes, uint64_t tag) override;
  RequestPtr irecv(int peer, void* buf, size_t nbytes, uint64_t tag) override {
    return post_recv(peer, RecvOp::copying(buf, nbytes), tag);
  }
  RequestPtr irecv_reduce(int peer, void* dst, size_t nbytes, uint64_t tag, ReduceOp rop,
                          DType dtype) override {
    return post_recv(peer, RecvOp::reducing("hetccl tcp", dst, nbytes, rop, dtype), tag);
  }
  void close() override;
  bool cancel(const RequestPtr& req, bool unpost = false) override;
  // connections in force: with lazy=1 only the peers this rank has exchanged data with
  std::map<std::string, std::string> info() override {
    size_t peers = 0, conns = 0;
    for (auto& p : peers_)
      if (p) {
        std::lock_guard<std::mutex> g(p->mu);
        conns += p->conns.size();
        peers += p->conns.empty() ? 0 : 1;
      }
    return {{"nconn", std::to_string(nconn_)}, {"lazy", lazy_ ? "1" : "0"},
            {"connected_peers", std::to_string(peers)}, {"connections", std::to_string(conns)}};
  }

 private:
  Peer& peer_ref(int peer) {
    check_peer(peer, rank_, size_);
    Peer* p = peers_.empty() ? nullptr : peers_[peer].get();
    if (!p || (lazy_ && !p->registered.load()))
      throw CommError("hetccl tcp: rank " + std::to_string(peer) +
                      " is not a peer of this transport (empty address at connect(), or connect() "
                      "not called)");
    return *p;
  }
  std::string who(const Peer& p) const {
    return "peer rank " + std::to_string(p.rank) + " (" + p.addr + ")";
  }
  RequestPtr post_recv(int peer, RecvOp op, uint64_t tag);
  void acceptor_loop();
  void handshake_step(Handshake& h, bool* drop, std::string* why);
  int dial(int peer, const std::string& addr, int idx, const Deadline& d, std::string* err);
  void worker_loop(Worker* w);
  bool do_read(Conn& c);   // false: connection finished (EOF/error) or would block
  int do_write(Conn& c);   // 0: would block, 1: no work, 2: budget used (more to do), -1: error
  bool begin_frame(Conn& c, std::string* err);
  void end_frame(Conn& c);
  void migrate(Peer& p, std::shared_ptr<InMsg> m, std::unique_lock<std::mutex>& g);
  void fail_peer(Peer& p, const std::string& msg);
  // A connection the worker stops serving (dead): what its current frames held is let go.
  void abandon(Conn& c);
  // keep_delivered: an orderly close by the peer (every connection at EOF between messages):
  // messages that arrived whole and were not received yet stay deliverable (post_recv)
  void fail_locked(Peer& p, Request::ErrorKind kind, const std::string& msg,
                   bool keep_delivered = false);
  void wake_workers();

  const int rank_, size_;
  std::string secret_, bind_addr_, address_;
  int nconn_, nthreads_;
  size_t chunk_;
  int64_t hs_timeout_ms_;
  int listen_fd_ = -1, accept_wake_ = -1;
  std::thread acceptor_;

  std::mutex acc_mu_;  // accepted connections, handed from the acceptor thread to connect()
  std::condition_variable acc_cv_;
  std::map<int, std::map<int, int>> accepted_;  // rank -> idx -> fd
  bool connect_done_ = false;

  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<bool> stop_{false};
  // lazy mode (option lazy=1): connect() only records the addresses; a peer's nconn connections
  // are made by the first isend to it, from the rank that sends first (isend, dial_peer).
  bool lazy_ = false;
  int64_t dial_timeout_ms_ = 30000;
  void make_workers();
  void start_workers();
  void add_conn(Peer& p, int fd, int idx);  // p.mu held
  void dial_peer(Peer& p, const std::string& addr);
  // decides on a lazy dial from `rank`: 0 accept, 1 crossed (this rank dials it), -1 refuse
  int lazy_accept(int rank, int idx, std::string* why);
  std::mutex close_mu_;
  bool closed_ = false, connected_ = false;
};

TcpTransport::TcpTransport(int rank, int size, const Options& opts) : rank_(rank), size_(size) {
  secret_ = opt_str(opts, "secret", "");
  bind_addr_ = opt_str(opts, "bind_addr", "0.0.0.0");
  nconn_ = int(opt_int(opts, "nconn", 4, 1, 64));
  nthreads_ = int(opt_int(opts, "progress_threads", std::min(nconn_, 2), 1, 64));
  nthreads_ = std::min(nthreads_, nconn_);
  chunk_ = size_t(opt_int(opts, "chunk_bytes", 512 << 10, 4096, int64_t(kMaxFrame)));
  hs_timeout_ms_ = opt_int(opts, "handshake_timeout_ms", 5000, 1, 3600000);
  lazy_ = opt_int(opts, "lazy", 0, 0, 1) != 0;
  dial_timeout_ms_ = opt_int(opts, "dial_timeout_ms", 30000, 1, 3600000);

  sockaddr_storage ss;
  socklen_t len = 0;
  bool v6 = bind_addr_.find(':') != std::string::npos;
  std::string hp = v6 ? "[" + bind_addr_ + "]:1" : bind_addr_ + ":1";
  if (!net::parse_hostport(hp, &ss, &len))
    throw CommError("hetccl tcp: bind_addr '" + bind_addr_ + "' is not a numeric IPv4/IPv6 address");
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = 0;
  else reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = 0;
  listen_fd_ = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) throw CommError("hetccl tcp: socket() failed: " + errno_str(errno));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(listen_fd_, 256) != 0) {
    int e = errno;
    ::close(listen_fd_);
    throw CommError("hetccl tcp: cannot listen on " + bind_addr_ + ": " + errno_str(e));
  }
  sockaddr_storage bound;
  socklen_t blen = sizeof bound;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &blen);
  int port = bound.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                                        : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  std::string host = bind_addr_;
  if (host == "0.0.0.0") host = net::default_host();
  else if (host == "::") host = "::1";
  address_ = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  accept_wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (lazy_) {
    // every rank's Peer exists from the start: a peer may dial before connect() is called here
    peers_.resize(size_);
    for (int r = 0; r < size_; ++r)
      if (r != rank_) {
        peers_[r] = std::make_unique<Peer>();
        peers_[r]->rank = r;
      }
    start_workers();
  }
  acceptor_ = std::thread([this] { acceptor_loop(); });
}

void TcpTransport::start_workers() {
  make_workers();
  for (auto& w : workers_) w->th = std::thread([this, wp = w.get()] { worker_loop(wp); });
}

// The progress threads' epoll sets and wake-up eventfds (threads not started yet).
void TcpTransport::make_workers() {
  for (int i = 0; i < nthreads_; ++i) {
    auto w = std::make_unique<Worker>();
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    w->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;
    epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->evfd, &ev);
    workers_.push_back(std::move(w));
  }
}

// A new connection of peer p (p.mu held): registered with its worker's epoll set and handed to
// that worker, which takes it into its own list (only the worker thread touches Worker::conns).
void TcpTransport::add_conn(Peer& p, int fd, int idx) {
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->idx = idx;
  c->peer = &p;
  Worker& w = *workers_[p.conns.size() % workers_.size()];
  {
    std::lock_guard<std::mutex> g(w.add_mu);
    w.adds.push_back(c.get());
    w.has_adds.store(true, std::memory_order_release);
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.ptr = c.get();
  epoll_ctl(w.epfd, EPOLL_CTL_ADD, fd, &ev);
  p.conns.push_back(std::move(c));
  uint64_t one = 1;
  ssize_t r = ::write(w.evfd, &one, sizeof one);
  (void)r;
}

// Lazy mode, the acceptor's verdict on connection `idx` from `rank` (its secret proved): 0 take
// it, 1 crossed (both ranks dialed each other: the lower rank's connections win, so a higher
// rank's dial is turned away while this rank dials it), -1 refuse (*why says why).
int TcpTransport::lazy_accept(int rank, int idx, std::string* why) {
  Peer& p = *peers_[rank];
  bool done;
  {
    std::lock_guard<std::mutex> g(acc_mu_);
    done = connect_done_;
  }
  std::lock_guard<std::mutex> g(p.mu);
  if (done && !p.registered.load()) {
    *why = "rank " + std::to_string(rank) + " is not a peer of this transport";
    return -1;
  }
  if (!p.failed.empty()) {
    *why = "rank " + std::to_string(rank) + " already failed: " + p.failed;
    return -1;
  }
  if (p.accepted_idx.count(idx)) {
    *why = "duplicate connection " + std::to_string(idx) + " from rank " + std::to_string(rank);
    return -1;
  }
  if (p.dialing && rank > rank_ && p.accepted_idx.empty()) return 1;
  p.accepting = true;
  p.accepted_idx.insert(idx);
  return 0;
}

// Lazy mode, the first send to a peer (isend decided it and set p.dialing): dial its nconn
// connections here (blocking for the handshakes: about a round trip each). Trade-off: the first
// send to a peer pays the set-up; a rank that only ever receives from a peer never dials it (the
// sender's connections carry both directions).
void TcpTransport::dial_peer(Peer& p, const std::string& addr) {
  Deadline d(dial_timeout_ms_);
  for (int i = 0; i < nconn_; ++i) {
    std::string err;
    int fd = dial(p.rank, addr, i, d, &err);
    if (fd == -2) return;  // crossed: the peer's connections arrive at the acceptor
    if (fd < 0) {
      fail_peer(p, "hetccl tcp: cannot connect to " + who(p) + ": " + err);
      return;
    }
    std::lock_guard<std::mutex> g(p.mu);
    if (stop_.load() || !p.failed.empty()) {
      ::close(fd);
      return;
    }
    add_conn(p, fd, i);
  }
}

// ---------------------------------------------------------------- acceptor
void TcpTransport::acceptor_loop() {
  std::vector<std::unique_ptr<Handshake>> hs;
  while (!stop_.load()) {
    std::vector<pollfd> pf;
    pf.push_back({accept_wake_, POLLIN, 0});
    pf.push_back({listen_fd_, POLLIN, 0});
    int64_t now = now_ms(), next = now + 1000;
    for (auto& h : hs) {
      pf.push_back({h->fd, POLLIN, 0});
      next = std::min(next, h->deadline);
    }
    int r = poll(pf.data(), pf.size(), int(std::max<int64_t>(0, next - now)));
    if (r < 0 && errno != EINTR) break;
    if (stop_.load()) break;
    if (pf[1].revents & POLLIN) {
      for (;;) {
        sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        std::string from = net::sockaddr_str(ss);
        if (int(hs.size()) >= kMaxPendingHandshakes) {
          log_warn("tcp", "dropped connection from " + from + ": too many pending handshakes");
          ::close(fd);
          continue;
        }
        net::set_nodelay(fd);
        auto h = std::make_unique<Handshake>();
        h->fd = fd;
        h->from = from;
        h->deadline = now_ms() + hs_timeout_ms_;
        h->nonce_a = random_bytes(16);
        std::string a1(kMagic, 8);
        net::put_u32(a1, kVersion);
        net::put_u32(a1, uint32_t(rank_));
        a1 += h->nonce_a;
        if (::send(fd, a1.data(), a1.size(), MSG_NOSIGNAL) != ssize_t(a1.size())) {
          ::close(fd);
          continue;
        }
        hs.push_back(std::move(h));
      }
    }
    // Progress handshakes (pf index 2 + i corresponds to hs[i] before this round's accepts).
    size_t npolled = pf.size() - 2;
    now = now_ms();
    for (size_t i = 0; i < hs.size();) {
      Handshake& h = *hs[i];
      bool drop = false;
      std::string why;
      if (i < npolled && (pf[2 + i].revents & (POLLIN | POLLHUP | POLLERR))) handshake_step(h, &drop, &why);
      if (!drop && h.fd >= 0 && now >= h.deadline) {
        drop = true;
        why = "no complete handshake within " + std::to_string(hs_timeout_ms_) + " ms";
      }
      if (drop) {
        log_warn("tcp", "dropped connection from " + h.from + ": " + why);
        ::close(h.fd);
        h.fd = -1;
      }
      if (h.fd < 0) {
        hs.erase(hs.begin() + long(i));
        if (i < npolled) {
          pf.erase(pf.begin() + long(2 + i));
          --npolled;
        }
      } else {
        ++i;
      }
    }
  }
  for (auto& h : hs)
    if (h->fd >= 0) ::close(h->fd);
}

// Reads what is there of the dialer's hello; on a complete valid one replies, hands the fd to
// connect() (h.fd = -1 afterwards) and returns. Sets *drop with a reason otherwise.
void TcpTransport::handshake_step(Handshake& h, bool* drop, std::string* why) {
  ssize_t r = ::recv(h.fd, h.buf + h.got, kC1 - h.got, 0);
  if (r == 0) {
    *drop = true;
    *why = h.got ? "closed in the middle of the handshake" : "closed without a handshake";
    return;
  }
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
    *drop = true;
    *why = errno_str(errno);
    return;
  }
  h.got += size_t(r);
  // Reject garbage as soon as the magic is wrong.
  if (std::memcmp(h.buf, kMagic, std::min<size_t>(h.got, 8)) != 0) {
    *drop = true;
    *why = "bad magic (not a hetccl peer)";
    return;
  }
  if (h.got < kC1) return;
  const unsigned char* b = h.buf;
  uint32_t ver = net::get_u32(b + 8);
  int rank = int(net::get_u32(b + 12));
  int idx = int(net::get_u32(b + 16));
  int nconn = int(net::get_u32(b + 20));
  int size = int(net::get_u32(b + 24));
  std::string nonce_c(reinterpret_cast<const char*>(b + 32), 16);
  std::string pc(reinterpret_cast<const char*>(b + 48), 32);
  if (ver != kVersion) {
    *drop = true;
    *why = "protocol version " + std::to_string(ver) + ", this build speaks " + std::to_string(kVersion);
  } else if (size != size_ || (lazy_ ? rank == rank_ || rank < 0 : rank <= rank_) || rank >= size_ ||
             nconn != nconn_ || idx < 0 || idx >= nconn_) {
    *drop = true;
    *why = "inconsistent hello (rank " + std::to_string(rank) + ", connection " + std::to_string(idx) +
           "/" + std::to_string(nconn) + ", world " + std::to_string(size) + "; expected a rank above " +
           std::to_string(rank_) + ", nconn " + std::to_string(nconn_) + ", world " + std::to_string(size_) + ")";
  } else if (pc != proof(secret_, "dial", h.nonce_a, nonce_c, rank, rank_, idx)) {
    *drop = true;
    *why = "wrong group secret (claimed rank " + std::to_string(rank) + ")";
  }
  if (*drop) return;
  if (lazy_) {
    int verdict = lazy_accept(rank, idx, why);
    if (verdict < 0) {
      *drop = true;
      return;
    }
    std::string a2(kMagic, 8);
    net::put_u32(a2, uint32_t(verdict));  // 0: accepted; 1: crossed, this rank dials you
    net::put_u32(a2, 0);
    a2 += proof(secret_, verdict ? "crossed" : "accept", h.nonce_a, nonce_c, rank, rank_, idx);
    bool sent = ::send(h.fd, a2.data(), a2.size(), MSG_NOSIGNAL) == ssize_t(a2.size());
    if (verdict == 1 || !sent) {
      ::close(h.fd);  // crossed: the dialer stops and waits for this rank's connections
      h.fd = -1;
      if (!sent && verdict == 0) fail_peer(*peers_[rank], "hetccl tcp: " + who(*peers_[rank]) +
                                                               ": handshake reply failed");
      return;
    }
    Peer& pr = *peers_[rank];
    std::lock_guard<std::mutex> g(pr.mu);
    if (stop_.load()) {
      ::close(h.fd);
    } else {
      add_conn(pr, h.fd, idx);
    }
    h.fd = -1;
    return;
  }
  {
    std::lock_guard<std::mutex> g(acc_mu_);
    if (connect_done_) {
      *drop = true;
      *why = "rank " + std::to_string(rank) + " connected after connect() finished";
      return;
    }
    if (accepted_[rank].count(idx)) {
      *drop = true;
      *why = "duplicate connection " + std::to_string(idx) + " from rank " + std::to_string(rank);
      return;
    }
  }
  std::string a2(kMagic, 8);
  net::put_u32(a2, 0);
  net::put_u32(a2, 0);
  a2 += proof(secret_, "accept", h.nonce_a, nonce_c, rank, rank_, idx);
  if (::send(h.fd, a2.data(), a2.size(), MSG_NOSIGNAL) != ssize_t(a2.size())) {
    *drop = true;
    *why = "reply failed";
    return;
  }
  {
    std::lock_guard<std::mutex> g(acc_mu_);
    accepted_[rank][idx] = h.fd;
  }
  acc_cv_.notify_all();
  h.fd = -1;
}

// Dials peer `peer` (connection idx) and runs the dialer side of the handshake. Returns the fd,
// or -1 with *err set (refused/unreachable until the deadline, or rejected).
int TcpTransport::dial(int peer, const std::string& addr, int idx, const Deadline& d, std::string* err) {
  sockaddr_storage ss;
  socklen_t sl;
  if (!net::parse_hostport(addr, &ss, &sl)) {
    *err = "bad address '" + addr + "'";
    return -1;
  }
  for (;;) {
    int fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      *err = "socket(): " + errno_str(errno);
      return -1;
    }
    net::set_nodelay(fd);
    int r = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), sl);
    int e = r == 0 ? 0 : errno;
    if (e == EINPROGRESS) {
      if (!wait_fd(fd, POLLOUT, d)) {
        ::close(fd);
        *err = "connection to " + addr + " timed out";
        return -1;
      }
      socklen_t el = sizeof e;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
    }
    if (e != 0) {
      ::close(fd);
      *err = "connect to " + addr + ": " + errno_str(e);
      if (d.expired()) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // listener not up yet: retry
      continue;
    }
    unsigned char a1[kA1];
    int rr = read_full(fd, a1, kA1, d);
    if (rr != 1 || std::memcmp(a1, kMagic, 8) != 0 || net::get_u32(a1 + 8) != kVersion ||
        int(net::get_u32(a1 + 12)) != peer) {
      ::close(fd);
      *err = rr == 0 ? "no handshake from " + addr + " (not a hetccl listener?)"
                     : addr + " is not rank " + std::to_string(peer) + " of this hetccl group";
      return -1;
    }
    std::string nonce_a(reinterpret_cast<char*>(a1 + 16), 16), nonce_c = random_bytes(16);
    std::string c1(kMagic, 8);
    net::put_u32(c1, kVersion);
    net::put_u32(c1, uint32_t(rank_));
    net::put_u32(c1, uint32_t(idx));
    net::put_u32(c1, uint32_t(nconn_));
    net::put_u32(c1, uint32_t(size_));
    net::put_u32(c1, 0);
    c1 += nonce_c;
    c1 += proof(secret_, "dial", nonce_a, nonce_c, rank_, peer, idx);
    unsigned char a2[kA2];
    if (write_full(fd, c1.data(), c1.size(), d) != 1 || (rr = read_full(fd, a2, kA2, d)) != 1) {
      ::close(fd);
      *err = "rank " + std::to_string(peer) + " at " + addr +
             " refused the handshake (different group secret or nconn?)";
      return -1;
    }
    std::string pa(reinterpret_cast<char*>(a2 + 16), 32);
    if (lazy_ && std::memcmp(a2, kMagic, 8) == 0 && net::get_u32(a2 + 8) == 1 &&
        pa == proof(secret_, "crossed", nonce_a, nonce_c, rank_, peer, idx)) {
      ::close(fd);
      return -2;  // crossed: the peer is dialing this rank; its connections will arrive
    }
    if (std::memcmp(a2, kMagic, 8) != 0 || net::get_u32(a2 + 8) != 0 ||
        pa != proof(secret_, "accept", nonce_a, nonce_c, rank_, peer, idx)) {
      ::close(fd);
      *err = addr + " failed to prove the group secret";
      return -1;
    }
    return fd;
  }
}

void TcpTransport::connect(const std::vector<std::string>& addresses, int64_t timeout_ms) {
  if (connected_) throw CommError("hetccl tcp: connect() called twice");
  if (closed_) throw CommError("hetccl tcp: transport closed");
  if (int(addresses.size()) != size_)
    throw CommError("hetccl tcp: connect() got " + std::to_string(addresses.size()) +
                    " addresses for a world of " + std::to_string(size_));
  if (lazy_) {
    // Only the addresses: connections are made on first use (isend, dial_peer, lazy_accept).
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || addresses[r].empty()) continue;
      Peer& p = *peers_[r];
      std::lock_guard<std::mutex> g(p.mu);
      p.addr = addresses[r];
      p.registered.store(true);
    }
    {
      std::lock_guard<std::mutex> g(acc_mu_);
      connect_done_ = true;
    }
    connected_ = true;
    return;
  }
  Deadline d(timeout_ms);
  std::vector<std::vector<int>> fds(size_);
  std::map<int, std::string> errors;
  auto close_all = [&] {
    for (auto& v : fds)
      for (int fd : v)
        if (fd >= 0) ::close(fd);
  };
  // 1. Dial lower ranks.
  for (int r = 0; r < rank_; ++r) {
    if (addresses[r].empty()) continue;
    fds[r].assign(nconn_, -1);
    for (int i = 0; i < nconn_; ++i) {
      std::string err;
      fds[r][i] = dial(r, addresses[r], i, d, &err);
      if (fds[r][i] < 0) {
        errors[r] = err;
        break;
      }
    }
  }
  // 2. Wait for higher ranks to dial us.
  {
    std::unique_lock<std::mutex> g(acc_mu_);
    auto all_in = [&] {
      for (int r = rank_ + 1; r < size_; ++r)
        if (!addresses[r].empty() && int(accepted_[r].size()) < nconn_) return false;
      return true;
    };
    while (!all_in() && !d.expired())
      acc_cv_.wait_for(g, std::chrono::milliseconds(std::min<int64_t>(d.left_ms(), 200)));
    connect_done_ = true;
    for (auto& kv : accepted_) {
      int r = kv.first;
      bool want = r > rank_ && r < size_ && !addresses[r].empty();
      if (want) {
        fds[r].assign(nconn_, -1);
        for (auto& kc : kv.second) fds[r][kc.first] = kc.second;
        if (int(kv.second.size()) < nconn_)
          errors[r] = std::to_string(kv.second.size()) + " of " + std::to_string(nconn_) +
                      " connections arrived";
      } else {
        for (auto& kc : kv.second) ::close(kc.second);
        log_warn("tcp", "closed connections from rank " + std::to_string(r) +
                            ", which is not a peer of this transport");
      }
    }
    accepted_.clear();
    for (int r = rank_ + 1; r < size_; ++r)
      if (!addresses[r].empty() && fds[r].empty()) errors[r] = "never connected";
  }
  if (!errors.empty()) {
    close_all();
    std::string ranks, detail;
    for (auto& kv : errors) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(kv.first);
      detail += "; rank " + std::to_string(kv.first) + ": " + kv.second;
    }
    std::string msg = "hetccl tcp: connect() failed within " + std::to_string(timeout_ms) +
                      " ms: ranks [" + ranks + "] did not connect" + detail;
    if (d.expired()) throw CommTimeout(msg);
    throw CommError(msg);
  }
  // 3. Build peers and start the progress threads.
  peers_.resize(size_);
  make_workers();
  for (int r = 0; r < size_; ++r) {
    if (fds[r].empty()) continue;
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->addr = addresses[r];
    std::lock_guard<std::mutex> g(p->mu);
    for (int i = 0; i < nconn_; ++i) add_conn(*p, fds[r][i], i);  // connection i: worker i % n
    peers_[r] = std::move(p);
  }
  connected_ = true;
  for (auto& w : workers_) w->th = std::thread([this, wp = w.get()] { worker_loop(wp); });
}

// ---------------------------------------------------------------- posting
void TcpTransport::wake_workers() {
  uint64_t one = 1;
  for (auto& w : workers_) {
    ssize_t r = ::write(w->evfd, &one, sizeof one);
    (void)r;
  }
}

RequestPtr TcpTransport::isend(int peer, const void* buf, size_t nbytes, uint64_t tag) {
  check_tag(tag);
  Peer& p = peer_ref(peer);
  auto m = std::make_shared<SendMsg>();
  m->req = std::make_shared<Request>(peer, tag, nbytes);
  m->buf = static_cast<const char*>(buf);
  m->total = nbytes;
  m->tag = tag;
  std::string addr;  // set: this send dials the peer (lazy mode)
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (!p.failed.empty()) {
      m->req->fail(p.failed_kind, p.failed);
      return m->req;
    }
    m->seq = p.send_seq[tag]++;
    p.sendq.push_back(m);
    p.active.insert(m);
    // lazy mode: the first send to a peer with no connections, none coming, dials it
    if (lazy_ && !p.dialing && !p.accepting && p.conns.empty()) {
      p.dialing = true;
      addr = p.addr;
    }
  }
  if (!addr.empty()) dial_peer(p, addr);
  wake_workers();
  return m->req;
}

bool TcpTransport::cancel(const RequestPtr& req, bool unpost) {
  if (!req || req->peer() < 0 || req->peer() >= size_ || req->peer() >= int(peers_.size()) ||
      !peers_[req->peer()])
    return false;
  Peer& p = *peers_[req->peer()];
  {
    std::lock_guard<std::mutex> g(p.mu);
    // A receive is withdrawn only while no frame of its message has begun: begin_frame sets
    // have_total (under p.mu) before any byte is read into the buffer. Without unpost the
    // message keeps its sequence number; its frames are then discarded on arrival (op_failed)
    // and the entry goes once they are all in. With unpost only the latest receive of its tag
    // is withdrawn: its entry goes and the tag's receive sequence steps back, so the message
    // becomes the next receive's (an earlier receive cannot step back: false).
    // (a receive still waiting in `match` has seen no frame: the first one moves it to arriving)
    MsgKey key;
    auto is_req = [&](const std::shared_ptr<InMsg>& m) { return m->op.req == req; };
    std::shared_ptr<InMsg>* w = p.match.find_recv(is_req, &key);
    if (!w) return false;  // not a waiting receive of this transport
    if ((*w)->op_failed || req->test_nothrow()) return false;
    if (unpost) {
      auto rs = p.recv_seq.find(req->tag());
      if (rs == p.recv_seq.end() || rs->second != key.second + 1) return false;
      rs->second -= 1;
      p.match.withdraw_recv(key, is_req);
    } else {
      (*w)->op_failed = true;  // stays, so that its message's frames are dropped on arrival
    }
  }
  req->fail(Request::ErrorKind::Generic, "hetccl tcp: receive from peer rank " +
                                             std::to_string(req->peer()) + " (tag " +
                                             std::to_string(req->tag()) + ") cancelled");
  return true;
}

RequestPtr TcpTransport::post_recv(int peer, RecvOp op, uint64_t tag) {
  check_tag(tag);
  Peer& p = peer_ref(peer);
  op.req = std::make_shared<Request>(peer, tag, op.cap);
  std::unique_lock<std::mutex> g(p.mu);
  if (!p.failed.empty()) {
    // only a message that arrived whole before the peer closed is still deliverable
    const std::shared_ptr<InMsg>* kept = p.match.peek_msg(MsgKey(tag, p.recv_seq[tag]));
    if (!kept || !(*kept)->complete()) {
      op.req->fail(p.failed_kind, p.failed);
      return op.req;
    }
  }
  MsgKey key(tag, p.recv_seq[tag]++);
  std::optional<std::shared_ptr<InMsg>> parked = p.match.take_msg(key);
  if (!parked) {
    auto m = std::make_shared<InMsg>();
    m->has_op = true;
    m->op = op;
    p.match.wait(key, std::move(m));
    return op.req;
  }
  std::shared_ptr<InMsg> m = std::move(*parked);
  m->has_op = true;
  m->op = op;
  auto it = p.arriving.emplace(key, m).first;
  std::string bad = size_mismatch("hetccl tcp", op, m->total, peer, tag);
  if (!bad.empty()) {
    // The message is consumed: frames still arriving are discarded (the heap buffer stays until
    // then: a connection may be reading into it right now).
    m->op_failed = true;
    if (m->complete()) p.arriving.erase(it);
    g.unlock();
    op.req->fail(Request::ErrorKind::Truncated, bad);
    return op.req;
  }
  if (m->heap_inflight == 0) migrate(p, m, g);  // else the thread finishing the last heap frame does
  return op.req;
}

// Copies what arrived on the heap into the user buffer (lock released while copying) and
// completes the receive if the message is then complete. Called with g locked, returns locked.
void TcpTransport::migrate(Peer& p, std::shared_ptr<InMsg> m, std::unique_lock<std::mutex>& g) {
  auto ranges = std::move(m->heap_ranges);
  m->heap_ranges.clear();
  std::unique_ptr<char[]> heap = std::move(m->heap);
  m->migrating = true;
  m->holds.hold();
  g.unlock();
  for (auto& r : ranges) deliver(m->op, r.first, heap.get() + r.first, r.second);
  heap.reset();
  g.lock();
  m->migrating = false;
  if (m->holds.let_go(m->op.req)) return;
  if (m->complete()) {
    for (auto it = p.arriving.begin(); it != p.arriving.end(); ++it)
      if (it->second == m) {
        p.arriving.erase(it);
        break;
      }
    m->op.req->complete(m->total);
  }
}

// ---------------------------------------------------------------- failure
void TcpTransport::fail_locked(Peer& p, Request::ErrorKind kind, const std::string& msg,
                               bool keep_delivered) {
  if (p.failed.empty()) {
    p.failed = msg;
    p.failed_kind = kind;
  }
  for (auto& m : p.active) m->holds.fail(m->req, kind, msg);
  p.active.clear();
  p.sendq.clear();
  // A peer that finished its part of a collective and closed (destroy_process_group) may do so
  // before this rank has posted the receive of its last message: that message is already here
  // whole, and an orderly close must not lose it.
  // Kept: a message here whole, either not yet received (parked, for a later receive), or
  // being copied to its receive's buffer right now (migrate, lock released), which completes it
  // -- failing it here would lose a message that arrived whole (a race with the last
  // connection's EOF). Everything else fails.
  auto whole = [](const InMsg& m) { return m.have_total && m.received == m.total && m.heap_inflight == 0; };
  p.match.drain_recvs([&](const MsgKey&, std::shared_ptr<InMsg>& m) {
    if (!m->op_failed) m->holds.fail(m->op.req, kind, msg);
  });
  p.match.trim_msgs([&](const std::shared_ptr<InMsg>& m) { return keep_delivered && whole(*m); });
  for (auto it = p.arriving.begin(); it != p.arriving.end();) {
    InMsg& m = *it->second;
    if (keep_delivered && whole(m) && m.migrating) {
      ++it;
      continue;
    }
    if (!m.op_failed) m.holds.fail(m.op.req, kind, msg);
    it = p.arriving.erase(it);
  }
  for (auto& c : p.conns) c->dead.store(true);
  wake_workers();  // they let go of the dead connections' frames (abandon)
}

void TcpTransport::abandon(Conn& c) {
  if (!c.msg && !c.tx) return;
  Peer& p = *c.peer;
  std::lock_guard<std::mutex> g(p.mu);
  if (c.msg && c.in_payload && (c.mode == Conn::Mode::Direct || c.mode == Conn::Mode::Stage)) {
    c.msg->holds.let_go(c.msg->op.req);
  }
  c.msg.reset();
  c.in_payload = false;
  if (c.tx) {
    c.tx->holds.let_go(c.tx->req);
    c.tx.reset();
  }
}

void TcpTransport::fail_peer(Peer& p, const std::string& msg) {
  std::lock_guard<std::mutex> g(p.mu);
  if (!p.failed.empty()) return;
  fail_locked(p, Request::ErrorKind::Peer, msg);
}

// ---------------------------------------------------------------- progress
void TcpTransport::worker_loop(Worker* w) {
  epoll_event evs[64];
  bool busy = true;
  while (!stop_.load()) {
    int n = epoll_wait(w->epfd, evs, 64, busy ? 0 : 1000);
    if (stop_.load()) break;
    for (int i = 0; i < n; ++i) {
      if (!evs[i].data.ptr) {
        uint64_t v;
        ssize_t r = ::read(w->evfd, &v, sizeof v);
        (void)r;
        continue;
      }
      Conn* c = static_cast<Conn*>(evs[i].data.ptr);
      if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) c->readable = true;
      if (evs[i].events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) c->writable = true;
    }
    busy = false;
    if (w->has_adds.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(w->add_mu);
      w->conns.insert(w->conns.end(), w->adds.begin(), w->adds.end());
      w->adds.clear();
      w->has_adds.store(false, std::memory_order_relaxed);
      busy = true;
    }
    for (Conn* c : w->conns) {
      if (c->dead.load()) {
        abandon(*c);
        continue;
      }
      if (c->readable && !c->eof && do_read(*c)) busy = true;
      if (c->dead.load()) continue;
      if (c->writable) {
        int r = do_write(*c);
        if (r == 2) busy = true;
      }
    }
  }
}

bool TcpTransport::do_read(Conn& c) {
  Peer& p = *c.peer;
  size_t budget = kBudget;
  auto fail = [&](const std::string& why) {
    fail_peer(p, "hetccl tcp: " + who(p) + " " + why + " (connection " + std::to_string(c.idx) + ")");
    c.readable = false;
    return false;
  };
  while (budget > 0) {
    if (c.dead.load()) return false;  // failed meanwhile: the worker abandons its frame
    ssize_t r;
    if (!c.in_payload) {
      r = ::recv(c.fd, c.hdr + c.hdr_got, kHdr - c.hdr_got, 0);
    } else {
      size_t want = std::min(c.f_len - c.f_got, budget);
      char* to = c.mode == Conn::Mode::Direct || c.mode == Conn::Mode::Heap ? c.dst + c.f_got
                                                                              : c.stage.data() + c.f_got;
      r = ::recv(c.fd, to, want, 0);
    }
    if (r == 0) {
      if (c.in_payload || c.hdr_got) return fail("closed the connection in the middle of a message");
      c.eof = true;
      c.readable = false;
      std::lock_guard<std::mutex> g(p.mu);
      // Closed once every one of the peer's nconn connections has ended (the handshake makes
      // nconn agree): a lazily dialled connection the acceptor has not handed over yet may
      // still carry the end of a message the peer sent just before it closed. (A peer that
      // dies mid-dial leaves fewer: its receives then end by their timeouts.)
      if (++p.eof_conns >= std::max(int(p.conns.size()), nconn_) && p.failed.empty())
        fail_locked(p, Request::ErrorKind::Peer, "hetccl tcp: " + who(p) + " closed the connection",
                    /*keep_delivered=*/true);
      return false;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c.readable = false;
        return false;
      }
      return fail(std::string("connection error: ") + errno_str(errno));
    }
    budget -= std::min(budget, size_t(r));
    if (!c.in_payload) {
      c.hdr_got += size_t(r);
      if (c.hdr_got < kHdr) continue;
      c.hdr_got = 0;
      std::string err;
      if (!begin_frame(c, &err)) return fail(err);
      c.in_payload = true;
      c.f_got = 0;
    } else {
      c.f_got += size_t(r);
    }
    if (c.in_payload && c.f_got == c.f_len) {
      c.in_payload = false;
      end_frame(c);
    }
  }
  return true;  // budget used up: more may be waiting
}

bool TcpTransport::begin_frame(Conn& c, std::string* err) {
  Peer& p = *c.peer;
  uint32_t kind = net::get_u32(c.hdr);
  c.f_len = net::get_u32(c.hdr + 4);
  c.f_tag = net::get_u64(c.hdr + 8);
  c.f_seq = net::get_u64(c.hdr + 16);
  c.f_total = net::get_u64(c.hdr + 24);
  c.f_off = net::get_u64(c.hdr + 32);
  if (kind != kFrameData || c.f_len > kMaxFrame || c.f_off > c.f_total || c.f_len > c.f_total - c.f_off ||
      c.f_tag >= kMaxTag) {
    *err = "sent a corrupt frame header (kind " + std::to_string(kind) + ", len " + std::to_string(c.f_len) +
           ", offset " + std::to_string(c.f_off) + ", total " + std::to_string(c.f_total) + ")";
    return false;
  }
  std::lock_guard<std::mutex> g(p.mu);
  if (!p.failed.empty()) {
    c.mode = Conn::Mode::Discard;
  } else {
    // its message: arriving (matched), parked (no receive yet), a receive waiting for it (now
    // matched: arriving), or new (parked until its receive comes)
    MsgKey key(c.f_tag, c.f_seq);
    std::shared_ptr<InMsg> m;
    if (auto a = p.arriving.find(key); a != p.arriving.end()) {
      m = a->second;
    } else if (std::shared_ptr<InMsg>* pm = p.match.peek_msg(key)) {
      m = *pm;
    } else if (std::optional<std::shared_ptr<InMsg>> w = p.match.take_recv(key)) {
      m = std::move(*w);
      p.arriving.emplace(key, m);
    } else {
      auto rs = p.recv_seq.find(c.f_tag);
      if (rs != p.recv_seq.end() && c.f_seq < rs->second) {
        *err = "sent a frame of a message that was already received (tag " + std::to_string(c.f_tag) +
               ", seq " + std::to_string(c.f_seq) + ")";
        return false;
      }
      m = std::make_shared<InMsg>();
      p.match.park(key, m);
    }
    if (!m->have_total) {
      m->have_total = true;
      m->total = c.f_total;
      if (m->has_op) {
        std::string bad = size_mismatch("hetccl tcp", m->op, m->total, p.rank, c.f_tag);
        if (!bad.empty()) {
          m->op_failed = true;
          m->op.req->fail(Request::ErrorKind::Truncated, bad);
        }
      }
    } else if (m->total != c.f_total) {
      *err = "sent frames with different totals for one message (tag " + std::to_string(c.f_tag) + ")";
      return false;
    }
    c.msg = m;
    if (m->op_failed) {
      c.mode = Conn::Mode::Discard;
    } else if (m->has_op) {
      if (m->op.reduce) {
        c.mode = Conn::Mode::Stage;
      } else {
        c.mode = Conn::Mode::Direct;
        c.dst = m->op.buf + c.f_off;
      }
      m->holds.hold();  // let go in end_frame (or abandon)
    } else {
      if (!m->heap) m->heap.reset(new (std::nothrow) char[std::max<size_t>(m->total, 1)]);
      if (!m->heap) {
        *err = "sent a message of " + std::to_string(m->total) + " bytes (tag " + std::to_string(c.f_tag) +
               ") that cannot be buffered before its receive is posted: out of memory";
        return false;
      }
      c.mode = Conn::Mode::Heap;
      c.dst = m->heap.get() + c.f_off;
      ++m->heap_inflight;
    }
  }
  if ((c.mode == Conn::Mode::Stage || c.mode == Conn::Mode::Discard) && c.stage.size() < c.f_len)
    c.stage.resize(c.f_len);
  if (c.mode == Conn::Mode::Discard && !c.msg) c.msg = std::make_shared<InMsg>();
  return true;
}

void TcpTransport::end_frame(Conn& c) {
  Peer& p = *c.peer;
  std::shared_ptr<InMsg> m = std::move(c.msg);
  // (a holder: its receive does not fail before this frame let go, so the buffer is alive)
  if (c.mode == Conn::Mode::Stage) deliver(m->op, c.f_off, c.stage.data(), c.f_len);
  std::unique_lock<std::mutex> g(p.mu);
  if ((c.mode == Conn::Mode::Direct || c.mode == Conn::Mode::Stage) && m->holds.let_go(m->op.req)) return;
  if (!p.failed.empty()) return;
  m->received += c.f_len;
  if (c.mode == Conn::Mode::Heap) {
    --m->heap_inflight;
    if (m->heap) m->heap_ranges.emplace_back(c.f_off, c.f_len);
    if (m->has_op && !m->op_failed && m->heap_inflight == 0) {
      migrate(p, m, g);
      return;
    }
  }
  if (m->complete() && (m->has_op || c.mode == Conn::Mode::Discard)) {
    auto it = p.arriving.find(MsgKey(c.f_tag, c.f_seq));
    if (it != p.arriving.end() && it->second == m) p.arriving.erase(it);
    if (m->has_op && !m->op_failed) {
      g.unlock();
      m->op.req->complete(m->total);
    }
  }
}

int TcpTransport::do_write(Conn& c) {
  Peer& p = *c.peer;
  size_t budget = kBudget;
  while (budget > 0) {
    if (c.dead.load()) return -1;  // failed meanwhile: the worker abandons its frame
    if (!c.tx) {
      std::lock_guard<std::mutex> g(p.mu);
      while (!p.sendq.empty() && p.sendq.front()->assigned_all) p.sendq.pop_front();
      if (p.sendq.empty() || !p.failed.empty()) return 1;
      auto m = p.sendq.front();
      c.tx = m;
      m->holds.hold();  // let go when the frame is written (or abandon)
      c.tx_off = m->assigned;
      c.tx_len = std::min(chunk_, m->total - m->assigned);
      m->assigned += c.tx_len;
      if (m->assigned == m->total) {
        m->assigned_all = true;
        p.sendq.pop_front();
      }
      c.tx_sent = 0;
      std::string h;
      net::put_u32(h, kFrameData);
      net::put_u32(h, uint32_t(c.tx_len));
      net::put_u64(h, m->tag);
      net::put_u64(h, m->seq);
      net::put_u64(h, m->total);
      net::put_u64(h, c.tx_off);
      std::memcpy(c.txhdr, h.data(), kHdr);
    }
    iovec iov[2];
    int niov = 0;
    if (c.tx_sent < kHdr) iov[niov++] = {c.txhdr + c.tx_sent, kHdr - c.tx_sent};
    size_t pdone = c.tx_sent > kHdr ? c.tx_sent - kHdr : 0;
    if (pdone < c.tx_len)
      iov[niov++] = {const_cast<char*>(c.tx->buf) + c.tx_off + pdone, std::min(c.tx_len - pdone, budget)};
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(niov);
    ssize_t r = ::sendmsg(c.fd, &mh, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c.writable = false;
        return 0;
      }
      fail_peer(p, "hetccl tcp: " + who(p) + " connection error: " + errno_str(errno) + " (connection " +
                       std::to_string(c.idx) + ")");
      return -1;
    }
    c.tx_sent += size_t(r);
    budget -= std::min(budget, size_t(r));
    if (c.tx_sent == kHdr + c.tx_len) {
      std::shared_ptr<SendMsg> m = std::move(c.tx);
      bool done;
      {
        std::lock_guard<std::mutex> g(p.mu);
        m->done += c.tx_len;
        if (m->holds.let_go(m->req)) continue;
        done = m->assigned_all && m->done == m->total && p.active.erase(m) > 0;
      }
      if (done) m->req->complete(m->total);
    }
  }
  return 2;
}

void TcpTransport::close() {
  std::lock_guard<std::mutex> cg(close_mu_);
  if (closed_) return;
  closed_ = true;
  stop_.store(true);
  uint64_t one = 1;
  if (accept_wake_ >= 0) {
    ssize_t r = ::write(accept_wake_, &one, sizeof one);
    (void)r;
  }
  wake_workers();
  if (acceptor_.joinable()) acceptor_.join();
  for (auto& w : workers_)
    if (w->th.joinable()) w->th.join();
  for (auto& pp : peers_) {
    if (!pp) continue;
    // the workers are stopped: what their connections' frames held is let go first, so every
    // request fails now
    for (auto& c : pp->conns) abandon(*c);
    std::lock_guard<std::mutex> g(pp->mu);
    fail_locked(*pp, Request::ErrorKind::Generic, "hetccl tcp: transport closed");
    for (auto& c : pp->conns)
      if (c->fd >= 0) {
        ::close(c->fd);
        c->fd = -1;
      }
  }
  {
    std::lock_guard<std::mutex> g(acc_mu_);
    for (auto& kv : accepted_)
      for (auto& kc : kv.second) ::close(kc.second);
    accepted_.clear();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (accept_wake_ >= 0) ::close(accept_wake_);
  listen_fd_ = accept_wake_ = -1;
}

}  // namespace

namespace {
std::unique_ptr<Transport> make_tcp_transport(int rank, int size, const Options& opts) {
  return std::make_unique<TcpTransport>(rank, size, opts);
}

// Anywhere a socket reaches; host memory. Preference 30: after shm, and after UCX when UCX
// brings RDMA or device memory (ucx_transport.cc), before a UCX that only has tcp itself.
TransportCaps tcp_caps() {
  TransportCaps c;
  c.preference = 30;
  c.same_host = true;
  c.other_host = true;
  c.lazy_connect = true;
  c.detail = "nconn TCP connections per peer, large messages striped";
  return c;
}
}  // namespace

HETCCL_REGISTER_TRANSPORT(tcp, tcp_caps, make_tcp_transport);

}  // namespace hetccl
