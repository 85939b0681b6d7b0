// hetccl C API bootstrap (contract in bootstrap.h).
//
// Wire: a joiner sends  magic "hetcBOOT" | secret (16) | u32 rank | u32 nranks | u32 len | entry
//                       | u32 len | its tree listener's "host:port"
// and reads          u32 status | u64 len | body
// where status 0 means body is the table (u32 n, then per rank u32 len | entry, then per rank
// u32 len | tree listener), status 1 an error text, and status 2 (empty body) that the table
// comes from its parent in the tree. The root sends the table to rank 0 alone; every rank that
// has it forwards it to its children in a binomial tree rooted at rank 0 (rank r's parent is
// r - lowbit(r), its children r + 2^j for 2^j < lowbit(r)), connecting to their listeners and
// sending  magic "hetcTREE" | secret (16) | u64 len | body.  No rank sends more than
// ceil(log2 n) copies of the table, the root one: the root's O(n^2) bytes became O(n).
#include "bootstrap.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "../common.h"
#include "../net.h"
#include "ring.h"

namespace hetccl {
namespace api {
namespace {

constexpr char kIdMagic[8] = {'h', 'e', 't', 'c', 'c', 'l', 'I', 'D'};
constexpr char kJoinMagic[8] = {'h', 'e', 't', 'c', 'B', 'O', 'O', 'T'};
constexpr size_t kSecretBytes = 16;
constexpr uint32_t kMaxEntry = 1 << 20;
// unique id: magic (8) | secret (16) | u32 root timeout in s | root "host:port", NUL-padded
constexpr size_t kRootAt = 8 + kSecretBytes + 4;

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Waits until fd is readable/writable or the deadline passes (false).
bool wait_fd(int fd, short events, const Deadline& d) {
  for (;;) {
    pollfd p{fd, events, 0};
    int64_t left = d.left_ms();
    int r = ::poll(&p, 1, int(std::min<int64_t>(left, 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
    if (d.expired()) return false;
  }
}

void write_all(int fd, const void* buf, size_t n, const Deadline& d, const char* who) {
  const char* p = static_cast<const char*>(buf);
  while (n) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd, POLLOUT, d))
        throw CommTimeout(std::string("hetccl bootstrap: timed out sending to ") + who);
      continue;
    }
    throw CommError(std::string("hetccl bootstrap: send to ") + who + " failed: " + strerror(errno));
  }
}

void read_all(int fd, void* buf, size_t n, const Deadline& d, const char* who) {
  char* p = static_cast<char*>(buf);
  while (n) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
    if (r == 0)
      throw CommError(std::string("hetccl bootstrap: ") + who + " closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(fd, POLLIN, d))
        throw CommTimeout(std::string("hetccl bootstrap: timed out waiting for ") + who);
      continue;
    }
    throw CommError(std::string("hetccl bootstrap: receive from ") + who + " failed: " +
                    strerror(errno));
  }
}

std::string reply(uint32_t status, const std::string& body) {
  std::string s;
  net::put_u32(s, status);
  net::put_u64(s, body.size());
  return s + body;
}

// The root's thread: one communicator's table (see bootstrap.h).
void serve(int listen_fd, std::string secret, int64_t timeout_ms) {
  Fd lfd(listen_fd);
  Deadline d(timeout_ms);
  int nranks = -1;
  struct Joined {
    std::shared_ptr<Fd> conn;
    std::string entry, listener;
  };
  std::map<int, Joined> joined;
  auto refuse = [&](int fd, const std::string& why) {
    try {
      std::string r = reply(1, why);
      write_all(fd, r.data(), r.size(), Deadline(2000), "a joining rank");
    } catch (const std::exception&) {
    }
  };
  while (nranks < 0 || int(joined.size()) < nranks) {
    if (!wait_fd(lfd.fd, POLLIN, d)) break;
    int c = ::accept4(lfd.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    auto conn = std::make_shared<Fd>(c);
    try {
      // A joiner that connects and then says nothing holds the root for at most this long.
      Deadline hd(std::min<int64_t>(d.left_ms(), 10000));
      char head[8 + kSecretBytes + 12];
      read_all(c, head, sizeof head, hd, "a joining rank");
      if (std::memcmp(head, kJoinMagic, 8) != 0) continue;  // not ours: drop it
      if (std::string(head + 8, kSecretBytes) != secret) {
        refuse(c, "hetccl bootstrap: the unique id's secret does not match this root's");
        continue;
      }
      auto* u = reinterpret_cast<const unsigned char*>(head + 8 + kSecretBytes);
      int rank = int(net::get_u32(u)), n = int(net::get_u32(u + 4));
      uint32_t len = net::get_u32(u + 8);
      if (len > kMaxEntry) {
        refuse(c, "hetccl bootstrap: entry of " + std::to_string(len) + " bytes is too large");
        continue;
      }
      std::string entry(len, '\0');
      read_all(c, entry.data(), len, hd, "a joining rank");
      unsigned char lb[4];
      read_all(c, lb, 4, hd, "a joining rank");
      uint32_t llen = net::get_u32(lb);
      if (llen > 256) {
        refuse(c, "hetccl bootstrap: listener address of " + std::to_string(llen) + " bytes");
        continue;
      }
      std::string listener(llen, '\0');
      read_all(c, listener.data(), llen, hd, "a joining rank");
      if (n <= 0 || (nranks > 0 && n != nranks)) {
        refuse(c, "hetccl bootstrap: rank " + std::to_string(rank) + " says nranks=" +
                      std::to_string(n) + ", the ranks before it said " + std::to_string(nranks));
        continue;
      }
      if (rank < 0 || rank >= n) {
        refuse(c, "hetccl bootstrap: rank " + std::to_string(rank) + " is out of range for nranks=" +
                      std::to_string(n));
        continue;
      }
      if (joined.count(rank)) {
        refuse(c, "hetccl bootstrap: rank " + std::to_string(rank) +
                      " joined twice (two processes were given the same rank)");
        continue;
      }
      nranks = n;
      joined[rank] = Joined{conn, std::move(entry), std::move(listener)};
    } catch (const std::exception&) {
      continue;  // a joiner that vanished mid-hello: it will retry or time out on its own
    }
  }
  if (nranks < 0) return;  // nobody came
  if (int(joined.size()) < nranks) {
    std::string missing;
    int shown = 0;
    for (int r = 0; r < nranks && shown < 16; ++r)
      if (!joined.count(r)) {
        missing += (shown++ ? ", " : "") + std::to_string(r);
      }
    std::string why = "hetccl bootstrap: " + std::to_string(nranks - int(joined.size())) + " of " +
                      std::to_string(nranks) + " ranks did not join within " +
                      std::to_string(timeout_ms / 1000) + " s (missing: " + missing +
                      (nranks - int(joined.size()) > shown ? ", ..." : "") + ")";
    for (auto& kv : joined) refuse(kv.second.conn->fd, why);
    return;
  }
  std::string table;
  net::put_u32(table, uint32_t(nranks));
  for (auto& kv : joined) {
    net::put_u32(table, uint32_t(kv.second.entry.size()));
    table += kv.second.entry;
  }
  for (auto& kv : joined) {
    net::put_u32(table, uint32_t(kv.second.listener.size()));
    table += kv.second.listener;
  }
  std::string msg = reply(0, table), later = reply(2, "");
  Deadline sd(std::max<int64_t>(d.left_ms(), 30000));
  for (auto& kv : joined) {
    try {
      const std::string& m = kv.first == 0 ? msg : later;
      write_all(kv.second.conn->fd, m.data(), m.size(), sd, "a joined rank");
    } catch (const std::exception&) {
      // that rank died after joining: its peers find out through their transports (rank 0:
      // its children time out waiting for the table, naming it)
    }
  }
}

// The table body as the root builds it: entries and tree listeners, n of each.
void parse_body(const std::string& body, int nranks, const std::string& who,
                std::vector<std::string>* entries, std::vector<std::string>* listeners) {
  size_t at = 0;
  auto u32 = [&] {
    if (at + 4 > body.size()) throw CommError("hetccl bootstrap: malformed table from " + who);
    uint32_t v = net::get_u32(reinterpret_cast<const unsigned char*>(body.data()) + at);
    at += 4;
    return v;
  };
  uint32_t n = u32();
  if (int(n) != nranks) throw CommError("hetccl bootstrap: table of " + std::to_string(n) + " ranks, expected " + std::to_string(nranks));
  for (auto* out : {entries, listeners})
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t l = u32();
      if (at + l > body.size()) throw CommError("hetccl bootstrap: malformed table from " + who);
      out->emplace_back(body.substr(at, l));
      at += l;
    }
}

// A listener on `host` (port chosen by the kernel) and its "host:port".
Fd listen_on(const std::string& host, std::string* addr, int backlog = 64) {
  std::string hp = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":1";
  sockaddr_storage ss;
  socklen_t len;
  if (!net::parse_hostport(hp, &ss, &len))
    throw CommError("hetccl bootstrap: '" + host + "' is not a numeric IPv4/IPv6 address");
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = 0;
  else reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = 0;
  Fd l(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (l.fd < 0 || ::bind(l.fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(l.fd, backlog) != 0)
    throw CommError("hetccl bootstrap: cannot listen on " + host + ": " + strerror(errno));
  sockaddr_storage bound;
  socklen_t blen = sizeof bound;
  getsockname(l.fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  *addr = net::sockaddr_str(bound);
  return l;
}

constexpr char kTreeMagic[8] = {'h', 'e', 't', 'c', 'T', 'R', 'E', 'E'};

// Waits on the tree listener for the parent's copy of the table (anything without the magic
// and the secret is dropped) and returns its body.
std::string receive_from_parent(int lfd, const std::string& secret, int rank, const Deadline& d) {
  int parent = binomial_parent(rank);
  std::string who = "rank " + std::to_string(parent) + " (rank " + std::to_string(rank) +
                    "'s parent in the bootstrap's tree)";
  for (;;) {
    if (!wait_fd(lfd, POLLIN, d))
      throw CommTimeout("hetccl bootstrap: rank " + std::to_string(rank) + " timed out waiting for the table from " + who);
    Fd c(::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC));
    if (c.fd < 0) continue;
    try {
      char head[8 + kSecretBytes + 8];
      read_all(c.fd, head, sizeof head, d, who.c_str());
      if (std::memcmp(head, kTreeMagic, 8) != 0 || std::string(head + 8, kSecretBytes) != secret) continue;
      uint64_t blen = net::get_u64(reinterpret_cast<const unsigned char*>(head) + 8 + kSecretBytes);
      if (blen > (uint64_t(1) << 34)) continue;
      std::string body(blen, '\0');
      read_all(c.fd, body.data(), blen, d, who.c_str());
      return body;
    } catch (const CommTimeout&) {
      throw;
    } catch (const std::exception&) {
      continue;  // a connection that broke mid-message: the parent would have to retry
    }
  }
}

// Sends the table to rank's children in the tree, the largest subtree first. A child that
// cannot be reached is skipped: it times out naming this rank, and its peers see it dead.
void forward_to_children(int rank, int nranks, const std::string& secret, const std::string& body,
                         const std::vector<std::string>& listeners, const Deadline& d) {
  const int top = binomial_span(rank, nranks);
  std::string head(kTreeMagic, 8);
  head += secret;
  net::put_u64(head, body.size());
  for (int j = top >> 1; j >= 1; j >>= 1) {
    int child = rank + j;
    if (child >= nranks) continue;
    sockaddr_storage ss;
    socklen_t len;
    if (!net::parse_hostport(listeners[size_t(child)], &ss, &len)) continue;
    Fd s(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd < 0 || ::connect(s.fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) continue;
    std::string who = "rank " + std::to_string(child) + " (bootstrap tree)";
    try {
      write_all(s.fd, head.data(), head.size(), d, who.c_str());
      write_all(s.fd, body.data(), body.size(), d, who.c_str());
    } catch (const std::exception&) {
    }
  }
}

}  // namespace

std::string encode_kv(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::string s;
  net::put_u32(s, uint32_t(kv.size()));
  for (auto& p : kv) {
    net::put_u32(s, uint32_t(p.first.size()));
    s += p.first;
    net::put_u32(s, uint32_t(p.second.size()));
    s += p.second;
  }
  return s;
}

std::vector<std::pair<std::string, std::string>> decode_kv(const std::string& s) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = 0;
  auto take = [&](size_t n) {
    if (at + n > s.size()) throw CommError("hetccl bootstrap: malformed table entry");
    std::string v = s.substr(at, n);
    at += n;
    return v;
  };
  auto u32 = [&] {
    std::string b = take(4);
    return net::get_u32(reinterpret_cast<const unsigned char*>(b.data()));
  };
  uint32_t n = u32();
  for (uint32_t i = 0; i < n; ++i) {
    std::string k = take(u32());
    std::string v = take(u32());
    out.emplace_back(std::move(k), std::move(v));
  }
  return out;
}

std::string default_root_host() { return net::default_host(); }

std::string local_addr_towards(const std::string& hostport) {
  sockaddr_storage ss;
  socklen_t len;
  if (!net::parse_hostport(hostport, &ss, &len)) return "127.0.0.1";
  Fd s(::socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (s.fd < 0 || ::connect(s.fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) return "127.0.0.1";
  sockaddr_storage me;
  socklen_t mlen = sizeof me;
  if (getsockname(s.fd, reinterpret_cast<sockaddr*>(&me), &mlen) != 0) return "127.0.0.1";
  std::string hp = net::sockaddr_str(me);
  if (hp.empty() || hp == "?") return "127.0.0.1";
  if (hp[0] == '[') return hp.substr(1, hp.find(']') - 1);
  return hp.substr(0, hp.rfind(':'));
}

UniqueIdData decode_id(const hetcclUniqueId& id) {
  if (std::memcmp(id.internal, kIdMagic, 8) != 0)
    throw CommError("hetccl: the unique id was not made by hetcclGetUniqueId (wrong magic)");
  UniqueIdData d;
  d.secret.assign(id.internal + 8, kSecretBytes);
  d.root_timeout_ms = int64_t(net::get_u32(reinterpret_cast<const unsigned char*>(id.internal) + 8 + kSecretBytes)) * 1000;
  const char* hp = id.internal + kRootAt;
  size_t n = strnlen(hp, HETCCL_UNIQUE_ID_BYTES - kRootAt);
  d.root.assign(hp, n);
  return d;
}

hetcclUniqueId make_root(const std::string& bind_host, int64_t timeout_ms) {
  std::string root;
  Fd l = listen_on(bind_host, &root, 1024);
  std::string secret = random_bytes(kSecretBytes);
  hetcclUniqueId id;
  std::memset(&id, 0, sizeof id);
  std::memcpy(id.internal, kIdMagic, 8);
  std::memcpy(id.internal + 8, secret.data(), kSecretBytes);
  if (root.size() >= HETCCL_UNIQUE_ID_BYTES - kRootAt)
    throw CommError("hetccl bootstrap: root address too long for the unique id: " + root);
  std::string t;
  net::put_u32(t, uint32_t((timeout_ms + 999) / 1000));
  std::memcpy(id.internal + 8 + kSecretBytes, t.data(), 4);
  std::memcpy(id.internal + kRootAt, root.data(), root.size());
  int fd = l.fd;
  l.fd = -1;
  std::thread([fd, secret, timeout_ms] { serve(fd, secret, timeout_ms); }).detach();
  return id;
}

std::vector<std::string> join(const UniqueIdData& id, int rank, int nranks,
                              const std::string& entry, const std::string& bind_host,
                              int64_t timeout_ms, int* keep_listener,
                              std::vector<std::string>* listeners_out) {
  Deadline d(timeout_ms);
  std::string tree_addr;
  Fd tree = listen_on(bind_host, &tree_addr);
  sockaddr_storage ss;
  socklen_t len;
  if (!net::parse_hostport(id.root, &ss, &len))
    throw CommError("hetccl: the unique id names no root address ('" + id.root + "')");
  std::string who = "the bootstrap root " + id.root;
  for (int attempt = 0;; ++attempt) {
    Fd s(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd < 0) throw CommError(std::string("hetccl bootstrap: socket: ") + strerror(errno));
    if (::connect(s.fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
      int e = errno;
      if (d.expired())
        throw CommTimeout("hetccl bootstrap: rank " + std::to_string(rank) + " could not reach " +
                          who + " within " + std::to_string(timeout_ms / 1000) + " s (" +
                          strerror(e) + ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, 5 + attempt * 5)));
      continue;
    }
    net::set_nodelay(s.fd);
    std::string hello(kJoinMagic, 8);
    hello += id.secret;
    net::put_u32(hello, uint32_t(rank));
    net::put_u32(hello, uint32_t(nranks));
    net::put_u32(hello, uint32_t(entry.size()));
    hello += entry;
    net::put_u32(hello, uint32_t(tree_addr.size()));
    hello += tree_addr;
    write_all(s.fd, hello.data(), hello.size(), d, who.c_str());
    // the table comes once every rank has joined: wait as long as the root waits for them
    Deadline td(std::max<int64_t>(d.left_ms(), id.root_timeout_ms + 10000));
    unsigned char head[12];
    read_all(s.fd, head, sizeof head, td, who.c_str());
    uint32_t status = net::get_u32(head);
    uint64_t blen = net::get_u64(head + 4);
    if (blen > (uint64_t(1) << 34)) throw CommError("hetccl bootstrap: malformed reply from " + who);
    std::string body(blen, '\0');
    read_all(s.fd, body.data(), blen, td, who.c_str());
    if (status == 1) throw CommError(body);
    // the parent had the table when the root answered: this rank's own timeout from now
    if (status == 2) body = receive_from_parent(tree.fd, id.secret, rank, Deadline(timeout_ms));
    else if (status != 0) throw CommError("hetccl bootstrap: malformed reply from " + who);
    std::vector<std::string> table, listeners;
    parse_body(body, nranks, status == 0 ? who : "the bootstrap tree", &table, &listeners);
    forward_to_children(rank, nranks, id.secret, body, listeners, Deadline(std::max<int64_t>(td.left_ms(), 30000)));
    if (listeners_out) *listeners_out = listeners;
    if (keep_listener) {
      *keep_listener = tree.fd;
      tree.fd = -1;
    }
    return table;
  }
}

// ------------------------------------------------------------------ mailbox (bootstrap.h)
namespace {
constexpr char kMailMagic[8] = {'h', 'e', 't', 'c', 'M', 'A', 'I', 'L'};
constexpr uint32_t kMaxMail = 4096;
}  // namespace

struct Mailbox::State {
  int lfd = -1;
  int wake[2] = {-1, -1};  // a pipe: the destructor writes a byte to stop the thread
  std::string secret;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::string> box;
  std::thread th;
};

Mailbox::Mailbox(int listen_fd, std::string secret) : st_(new State) {
  st_->lfd = listen_fd;
  st_->secret = std::move(secret);
  if (::pipe2(st_->wake, O_CLOEXEC) != 0) {
    ::close(listen_fd);
    throw CommError(std::string("hetccl: mailbox: pipe: ") + strerror(errno));
  }
  st_->th = std::thread([this] { loop(); });
}

Mailbox::~Mailbox() {
  char b = 1;
  ssize_t w = ::write(st_->wake[1], &b, 1);
  (void)w;
  if (st_->th.joinable()) st_->th.join();
  ::close(st_->wake[0]);
  ::close(st_->wake[1]);
  ::close(st_->lfd);
}

void Mailbox::loop() {
  for (;;) {
    pollfd p[2] = {{st_->lfd, POLLIN, 0}, {st_->wake[0], POLLIN, 0}};
    int r = ::poll(p, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || (p[1].revents & POLLIN)) return;
    if (!(p[0].revents & POLLIN)) continue;
    Fd c(::accept4(st_->lfd, nullptr, nullptr, SOCK_CLOEXEC));
    if (c.fd < 0) continue;
    try {
      // a sender that connects and says nothing holds this thread for at most 5 s
      Deadline d(5000);
      char head[8 + kSecretBytes + 12];
      read_all(c.fd, head, sizeof head, d, "a mailbox sender");
      if (std::memcmp(head, kMailMagic, 8) != 0 || std::string(head + 8, kSecretBytes) != st_->secret) continue;
      auto* u = reinterpret_cast<const unsigned char*>(head + 8 + kSecretBytes);
      uint64_t key = net::get_u64(u);
      uint32_t len = net::get_u32(u + 8);
      if (len > kMaxMail) continue;
      std::string payload(len, '\0');
      read_all(c.fd, payload.data(), len, d, "a mailbox sender");
      char ack = 1;
      write_all(c.fd, &ack, 1, d, "a mailbox sender");
      std::lock_guard<std::mutex> g(st_->mu);
      st_->box[key] = std::move(payload);
      st_->cv.notify_all();
    } catch (const std::exception&) {
      continue;  // a sender that vanished mid-message: it reports its own failure
    }
  }
}

std::string Mailbox::wait(uint64_t key, int64_t timeout_ms, const std::string& who) {
  std::unique_lock<std::mutex> g(st_->mu);
  bool got = st_->cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return st_->box.count(key) > 0; });
  if (!got)
    throw CommTimeout("hetccl: Timed out after " + std::to_string(timeout_ms / 1000) + " s waiting for " + who);
  std::string v = std::move(st_->box[key]);
  st_->box.erase(key);
  return v;
}

void mail(const std::string& listener, const std::string& secret, uint64_t key,
          const std::string& payload, int64_t timeout_ms, const std::string& who) {
  Deadline d(timeout_ms);
  sockaddr_storage ss;
  socklen_t len;
  if (!net::parse_hostport(listener, &ss, &len))
    throw CommError("hetccl: " + who + " has no bootstrap listener address ('" + listener + "')");
  for (int attempt = 0;; ++attempt) {
    Fd s(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd < 0) throw CommError(std::string("hetccl: socket: ") + strerror(errno));
    if (::connect(s.fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
      int e = errno;
      if (d.expired() || e == ECONNREFUSED)
        throw CommError("hetccl: cannot reach " + who + " at " + listener + " (" + strerror(e) + ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, 5 + attempt * 5)));
      continue;
    }
    std::string m(kMailMagic, 8);
    m += secret;
    net::put_u64(m, key);
    net::put_u32(m, uint32_t(payload.size()));
    m += payload;
    write_all(s.fd, m.data(), m.size(), d, who.c_str());
    char ack = 0;
    read_all(s.fd, &ack, 1, d, who.c_str());  // stored: the receiver's wait() will see it
    return;
  }
}

}  // namespace api
}  // namespace hetccl
