// Standalone two-process smoke test of the UCX transport (no Python): the process forks a
// partner, each side creates a transport, they swap addresses through files in a temp dir.
// Build: tests/cpp/build_ucx_smoke.sh; run: ucx_smoke [case...] (default: all cases).
// Prints one line per case; exit status 0 only if every case passed on both ranks.
#include <execinfo.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <functional>
#include <sstream>
#include <thread>

#include "transport.h"

using namespace hetccl;

static std::string g_dir;

#define CHECK(c)                                                                      \
  do {                                                                                \
    if (!(c)) {                                                                       \
      std::fprintf(stderr, "rank %d: CHECK failed %s:%d: %s\n", rank, __FILE__, __LINE__, #c); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

static std::vector<std::string> exchange(const std::string& name, int rank, const std::string& addr) {
  std::string mine = g_dir + "/" + name + "." + std::to_string(rank);
  {
    std::ofstream f(mine + ".tmp", std::ios::binary);
    f.write(addr.data(), addr.size());
  }
  rename((mine + ".tmp").c_str(), mine.c_str());
  std::vector<std::string> out(2);
  out[rank] = "";
  int other = 1 - rank;
  std::string theirs = g_dir + "/" + name + "." + std::to_string(other);
  for (int i = 0; i < 3000 && access(theirs.c_str(), F_OK) != 0; ++i) usleep(10000);
  std::ifstream f(theirs, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  out[other] = ss.str();
  return out;
}

static std::unique_ptr<Transport> make_pair(const std::string& name, int rank, const std::string& secret) {
  Options o{{"secret", secret}};
  auto t = make_transport("ucx", rank, 2, o);
  t->connect(exchange(name, rank, t->address()), 10000);
  return t;
}

static uint8_t pat(int src, uint64_t tag, size_t i) { return uint8_t(src * 131 + tag * 7 + i * 13 + (i >> 11)); }

static int nthreads() {
  int n = 0;
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("Threads:", 0) == 0) n = std::stoi(line.substr(8));
  return n;
}

static void case_sizes(int rank) {
  int threads0 = nthreads();
  auto t = make_pair("sizes", rank, "s3cret");
  int peer = 1 - rank;
  std::vector<size_t> sizes = {0, 1, 7, 4097, 1 << 20, 64u << 20};
  std::vector<std::vector<uint8_t>> out(sizes.size()), in(sizes.size());
  std::vector<RequestPtr> rr, sr;
  for (size_t k = 0; k < sizes.size(); ++k) {  // receives posted in reverse order
    size_t j = sizes.size() - 1 - k;
    in[j].assign(sizes[j] + 16, 0xEE);
    rr.push_back(t->irecv(peer, in[j].data(), in[j].size(), j));
  }
  std::reverse(rr.begin(), rr.end());
  for (size_t j = 0; j < sizes.size(); ++j) {
    out[j].resize(sizes[j]);
    for (size_t i = 0; i < sizes[j]; ++i) out[j][i] = pat(rank, j, i);
    sr.push_back(t->isend(peer, out[j].data(), sizes[j], j));
  }
  for (size_t j = 0; j < sizes.size(); ++j) {
    CHECK(sr[j]->wait(20000) == sizes[j]);
    CHECK(rr[j]->wait(20000) == sizes[j]);
    for (size_t i = 0; i < sizes[j]; ++i)
      if (in[j][i] != pat(peer, j, i)) { std::fprintf(stderr, "size %zu byte %zu\n", sizes[j], i); CHECK(false); }
    CHECK(in[j][sizes[j]] == 0xEE);
  }
  t->close();
  t->close();  // idempotent
  if (nthreads() != threads0) std::fprintf(stderr, "rank %d: %d threads before, %d after close\n", rank, threads0, nthreads());
  CHECK(nthreads() == threads0);
}

static void case_many(int rank) {
  auto t = make_pair("many", rank, "s3cret");
  int peer = 1 - rank;
  const int n = 2000, ntags = 7;
  std::vector<uint32_t> out(n), in(n, 0xFFFFFFFF);
  std::vector<RequestPtr> rr, sr;
  // receives: tags in descending order, per tag FIFO by posting order
  for (int tg = ntags - 1; tg >= 0; --tg)
    for (int k = tg; k < n; k += ntags) rr.push_back(t->irecv(peer, &in[k], 4, uint64_t(tg) << 40 | tg));
  for (int k = 0; k < n; ++k) {
    out[k] = uint32_t(k * 10 + rank);
    int tg = k % ntags;
    sr.push_back(t->isend(peer, &out[k], 4, uint64_t(tg) << 40 | tg));
  }
  for (auto& r : sr) CHECK(r->wait(20000) == 4);
  for (auto& r : rr) CHECK(r->wait(20000) == 4);
  for (int k = 0; k < n; ++k) CHECK(in[k] == uint32_t(k * 10 + peer));
  // 64 MiB messages in flight on 4 tags, both directions
  const size_t big = 16u << 20;
  std::vector<std::vector<char>> bo(4, std::vector<char>(big, char(rank + 1))), bi(4, std::vector<char>(big));
  rr.clear(); sr.clear();
  for (int k = 0; k < 4; ++k) rr.push_back(t->irecv(peer, bi[k].data(), big, 100 + k));
  for (int k = 3; k >= 0; --k) sr.push_back(t->isend(peer, bo[k].data(), big, 100 + k));
  for (auto& r : sr) CHECK(r->wait(20000) == big);
  for (auto& r : rr) CHECK(r->wait(20000) == big);
  for (int k = 0; k < 4; ++k) CHECK(bi[k][0] == char(peer + 1) && bi[k][big - 1] == char(peer + 1));
}

// A send completes although its receive is posted only afterwards (rendezvous-sized too).
static void case_unexpected(int rank) {
  auto t = make_pair("unexp", rank, "s3cret");
  int peer = 1 - rank;
  const size_t n = 64u << 20;
  std::string flag = g_dir + "/sent";
  if (rank == 1) {
    std::vector<char> a(n, 'u'), b(1000, 'v');
    CHECK(t->isend(peer, a.data(), n, 50)->wait(20000) == n);
    CHECK(t->isend(peer, b.data(), 1000, 50)->wait(20000) == 1000);
    std::ofstream(flag) << "1";
  } else {
    for (int i = 0; i < 3000 && access(flag.c_str(), F_OK) != 0; ++i) usleep(10000);
    std::vector<char> a(n), b(1000);
    CHECK(t->irecv(peer, a.data(), n, 50)->wait(20000) == n);
    CHECK(t->irecv(peer, b.data(), n, 50)->wait(20000) == 1000);  // FIFO within the tag
    CHECK(a[0] == 'u' && a[n - 1] == 'u' && b[999] == 'v');
  }
  char x = 0;  // final sync so that rank 1 does not close before rank 0 got everything
  if (rank == 0) t->isend(peer, &x, 1, 51)->wait(20000); else t->irecv(peer, &x, 1, 51)->wait(20000);
}

// A peer that closes gracefully: a receive pending on it fails with PeerFailure at once (all UCX
// transports, shared memory too), a message it sent before closing can still be received.
static void case_peerclose(int rank) {
  auto t = make_pair("pclose", rank, "s3cret");
  int peer = 1 - rank;
  std::string flag = g_dir + "/posted";
  if (rank == 1) {
    for (int i = 0; i < 3000 && access(flag.c_str(), F_OK) != 0; ++i) usleep(10000);
    char m[3] = {'a', 'b', 'c'};
    CHECK(t->isend(peer, m, 3, 61)->wait(10000) == 3);
    t->close();
    return;
  }
  char x = 0, m[3] = {0, 0, 0};
  auto r = t->irecv(peer, &x, 1, 60);
  std::ofstream(flag) << "1";
  auto t0 = std::chrono::steady_clock::now();
  try { r->wait(5000); CHECK(false); } catch (const PeerFailure& e) {
    std::printf("  after %.0f ms: %s\n",
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), e.what());
  }
  CHECK(t->irecv(peer, m, 3, 61)->wait(5000) == 3 && m[2] == 'c');
}

static void case_reduce(int rank) {
  auto t = make_pair("reduce", rank, "s3cret");
  int peer = 1 - rank;
  for (size_t n : {size_t(0), size_t(1), size_t(1000003), size_t(4) << 20}) {
    std::vector<float> src(n), dst(n, 1.0f);
    for (size_t i = 0; i < n; ++i) src[i] = float(i % 1000) + rank;
    auto r = t->irecv_reduce(peer, dst.data(), n * 4, 9, ReduceOp::SUM, DType::FLOAT32);
    auto s = t->isend(peer, src.data(), n * 4, 9);
    CHECK(s->wait(20000) == n * 4);
    CHECK(r->wait(20000) == n * 4);
    for (size_t i = 0; i < n; ++i) CHECK(dst[i] == 1.0f + float(i % 1000) + peer);
  }
  // irecv_reduce needs exactly the posted length: shorter and longer both fail with MessageTruncated
  std::vector<float> a(10, 0), b(20, 0);
  auto r1 = t->irecv_reduce(peer, a.data(), 40, 10, ReduceOp::SUM, DType::FLOAT32);
  auto r2 = t->irecv_reduce(peer, a.data(), 40, 11, ReduceOp::SUM, DType::FLOAT32);
  t->isend(peer, b.data(), 20, 10);
  t->isend(peer, b.data(), 80, 11);
  try { r1->wait(10000); CHECK(false); } catch (const MessageTruncated&) {}
  try { r2->wait(10000); CHECK(false); } catch (const MessageTruncated&) {}
}

static void case_trunc(int rank) {
  auto t = make_pair("trunc", rank, "s3cret");
  int peer = 1 - rank;
  std::vector<char> s(100, 'x'), small(50), large(200);
  auto r1 = t->irecv(peer, small.data(), small.size(), 77);
  auto r2 = t->irecv(peer, large.data(), large.size(), 78);
  std::vector<char> big(8 << 20, 'y'), bsmall(1 << 20);
  auto r3 = t->irecv(peer, bsmall.data(), bsmall.size(), 79);  // rendezvous-sized truncation
  t->isend(peer, s.data(), s.size(), 77)->wait(10000);
  t->isend(peer, s.data(), s.size(), 78)->wait(10000);
  auto s3 = t->isend(peer, big.data(), big.size(), 79);
  try { r1->wait(10000); CHECK(false); } catch (const MessageTruncated& e) {
    if (rank == 0) std::printf("  truncation message: %s\n", e.what());
  }
  CHECK(r2->wait(10000) == 100);
  try { r3->wait(10000); CHECK(false); } catch (const MessageTruncated&) {}
  try { s3->wait(10000); } catch (const CommError& e) { if (rank == 0) std::printf("  sender of truncated rndv: %s\n", e.what()); }
  // after truncations the pair still works
  char x = 'a' + rank, y = 0;
  auto rr = t->irecv(peer, &y, 1, 80);
  t->isend(peer, &x, 1, 80)->wait(10000);
  CHECK(rr->wait(10000) == 1 && y == 'a' + peer);
  // a receive pending at close fails
  auto pend = t->irecv(peer, &y, 1, 999);
  t->close();
  try { pend->wait(1000); CHECK(false); } catch (const CommTimeout&) { CHECK(false); } catch (const CommError& e) {}
}

static void case_secret(int rank) {
  Options o{{"secret", rank == 0 ? "right" : "wrong"}};
  auto t = make_transport("ucx", rank, 2, o);
  try {
    t->connect(exchange("secret", rank, t->address()), 10000);
    CHECK(false);
  } catch (const CommTimeout& e) {
    std::fprintf(stderr, "rank %d: timeout instead of rejection: %s\n", rank, e.what());
    CHECK(false);
  } catch (const CommError& e) {
    CHECK(std::strstr(e.what(), "wrong group secret"));
    if (rank == 0) std::printf("  rejection: %s\n", e.what());
  }
}

static void case_kill(int rank) {
  const size_t n = 256u << 20;
  std::vector<char> buf(n, 'k');
  auto t = make_pair("kill", rank, "s3cret");
  int peer = 1 - rank;
  if (rank == 1) {
    t->isend(peer, buf.data(), n, 5);
    usleep(30000);
    kill(getpid(), SIGKILL);
  }
  auto r = t->irecv(peer, buf.data(), n, 5);
  auto r2 = t->irecv(peer, buf.data(), 1, 6);  // never sent
  auto t0 = std::chrono::steady_clock::now();
  try {
    r->wait(15000);
    // the whole message may have arrived before the kill (fast shm); the other must fail
    std::printf("  big message completed before the kill\n");
  } catch (const PeerFailure& e) {
    std::printf("  PeerFailure after %.0f ms: %s\n",
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), e.what());
  } catch (const CommTimeout& e) {
    std::printf("  CommTimeout (no peer-failure detection on this UCX transport): %s\n", e.what());
  } catch (const CommError& e) {
    std::fprintf(stderr, "  not a PeerFailure: %s\n", e.what());
    std::exit(1);
  }
  try { r2->wait(3000); CHECK(false); } catch (const PeerFailure&) {} catch (const CommTimeout&) {
    std::printf("  second pending receive: CommTimeout\n");
  }
  // new operations to the dead peer fail at once (tcp) or stay pending (shm)
  auto r3 = t->isend(peer, buf.data(), 1, 7);
  try { r3->wait(1000); } catch (const CommError& e) { std::printf("  post after failure: %s\n", e.what()); }
  t->close();
}

static void on_segv(int sig) {
  void* bt[64];
  int n = backtrace(bt, 64);
  backtrace_symbols_fd(bt, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

// Not in the default set: one-way bandwidth (rank 1 -> rank 0) and 8-byte ping-pong latency,
// plus the progress thread's CPU use while idle.
static void case_bench(int rank) {
  auto t = make_pair("bench", rank, "s3cret");
  int peer = 1 - rank;
  for (size_t n : {size_t(1) << 20, size_t(64) << 20}) {
    std::vector<char> buf(n, 'b');
    int iters = n > (8u << 20) ? 10 : 50;
    char ack = 0;
    for (int w = 0; w < 2; ++w) {  // warm-up pass, then timed pass
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) {
        if (rank == 1) t->isend(peer, buf.data(), n, 1)->wait(30000);
        else t->irecv(peer, buf.data(), n, 1)->wait(30000);
      }
      if (rank == 0) t->isend(peer, &ack, 1, 2)->wait(30000);
      else t->irecv(peer, &ack, 1, 2)->wait(30000);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rank == 0 && w == 1) std::printf("  %8zu bytes: %.2f GB/s\n", n, double(n) * iters / s / 1e9);
    }
  }
  uint64_t v = 0;
  const int n = 2000;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    if (rank == 0) { t->isend(peer, &v, 8, 3)->wait(30000); t->irecv(peer, &v, 8, 3)->wait(30000); }
    else { t->irecv(peer, &v, 8, 3)->wait(30000); t->isend(peer, &v, 8, 3)->wait(30000); }
  }
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) std::printf("  8-byte ping-pong: %.1f us round trip\n", us / n);
  timespec c0, c1;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  usleep(2000000);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
  double cpu = (c1.tv_sec - c0.tv_sec) + (c1.tv_nsec - c0.tv_nsec) / 1e9;
  if (rank == 0) std::printf("  idle CPU: %.1f ms over 2 s\n", cpu * 1e3);
}

int main(int argc, char** argv) {
  if (getenv("HETCCL_SMOKE_BT")) signal(SIGSEGV, on_segv);
  std::vector<std::pair<std::string, std::function<void(int)>>> cases = {
      {"sizes", case_sizes}, {"many", case_many}, {"unexpected", case_unexpected}, {"peerclose", case_peerclose}, {"reduce", case_reduce},
      {"trunc", case_trunc}, {"secret", case_secret}, {"kill", case_kill}};
  std::vector<std::string> want(argv + 1, argv + argc);
  int failures = 0;
  cases.push_back({"bench", case_bench});
  for (auto& [name, fn] : cases) {
    if (want.empty() ? name == "bench" : std::find(want.begin(), want.end(), name) == want.end()) continue;
    char tmpl[] = "/tmp/ucx_smoke.XXXXXX";
    g_dir = mkdtemp(tmpl);
    auto t0 = std::chrono::steady_clock::now();
    std::fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
      fn(1);
      std::fflush(stdout);
      _exit(0);
    }
    int rank = 0;
    bool ok = true;
    pid_t p0 = fork();  // rank 0 in a child too, so an exit(1) in CHECK does not end the driver
    if (p0 == 0) { fn(0); std::fflush(stdout); _exit(0); }
    int st0 = 0, st1 = 0;
    waitpid(p0, &st0, 0);
    waitpid(child, &st1, 0);
    ok = WIFEXITED(st0) && WEXITSTATUS(st0) == 0 &&
         (name == "kill" ? (WIFSIGNALED(st1) && WTERMSIG(st1) == SIGKILL) : (WIFEXITED(st1) && WEXITSTATUS(st1) == 0));
    (void)rank;
    if (!ok)
      std::printf("  rank 0 status %s %d, rank 1 status %s %d\n", WIFSIGNALED(st0) ? "signal" : "exit",
                  WIFSIGNALED(st0) ? WTERMSIG(st0) : WEXITSTATUS(st0), WIFSIGNALED(st1) ? "signal" : "exit",
                  WIFSIGNALED(st1) ? WTERMSIG(st1) : WEXITSTATUS(st1));
    std::printf("%-10s %s  (%.2f s)\n", name.c_str(), ok ? "PASS" : "FAIL",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
    failures += !ok;
    std::string cmd = "rm -rf " + g_dir;
    if (system(cmd.c_str()) != 0) {}
  }
  return failures ? 1 : 0;
}
