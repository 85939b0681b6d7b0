// hetccl C API: stream-ordered collectives (contracts in stream_path.h).
#include "stream_path.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "../common.h"
#include "comm.h"

namespace hetccl {
namespace api {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

size_t round_cap(size_t n) {
  size_t c = 4096;
  while (c < n) c <<= 1;
  return c;
}

// Backs off from spinning to short sleeps while a word has not moved.
void pause(int& spins) {
  if (++spins < 200) return;
  if (spins < 2000) {
    sched_yield();
    return;
  }
  usleep(20);
}

}  // namespace

StreamPath::StreamPath(Comm& c, const std::string& runtime, const std::string& library) : c_(c) {
  ops_ = make_device_ops(runtime, library);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, 2 * kSlots * sizeof(uint64_t)) != 0) throw std::bad_alloc();
  page_ = static_cast<uint64_t*>(p);
  std::memset(page_, 0, 2 * kSlots * sizeof(uint64_t));
  if (!ops_->host_register(page_, 2 * kSlots * sizeof(uint64_t)))
    throw CommError("hetccl: the device runtime refused to page-lock the stream path's flag words");
  page_dev_ = ops_->device_address(page_);  // the page's words at fixed offsets from it
  done_words_.resize(kSlots, nullptr);
  done_addr_.resize(kSlots);
  done_host_.resize(kSlots);
  // done words: where the runtime wants the words streams wait on (HIP: signal memory), else one
  // more registered page
  void* w0 = ops_->wait_word_alloc();
  if (w0) {
    done_words_[0] = w0;
    for (uint32_t i = 1; i < kSlots; ++i) done_words_[i] = ops_->wait_word_alloc();
    for (uint32_t i = 0; i < kSlots; ++i) {
      done_host_[i] = static_cast<uint64_t*>(done_words_[i]);
      *done_host_[i] = 0;
      done_addr_[i] = ops_->wait_word_address(done_words_[i]);
    }
  } else {
    void* d = nullptr;
    if (posix_memalign(&d, 4096, kSlots * sizeof(uint64_t)) != 0) throw std::bad_alloc();
    std::memset(d, 0, kSlots * sizeof(uint64_t));
    if (!ops_->host_register(d, kSlots * sizeof(uint64_t)))
      throw CommError("hetccl: the device runtime refused to page-lock the stream path's flag words");
    uint64_t base = ops_->device_address(d);
    for (uint32_t i = 0; i < kSlots; ++i) {
      done_host_[i] = static_cast<uint64_t*>(d) + i;
      done_addr_[i] = base + i * sizeof(uint64_t);
    }
    all_.emplace_back(static_cast<char*>(d), 0);  // freed with the buffers (cap 0: flag page)
  }
  // The device route (device_route.h) where the runtime has one: made here, on the issuing
  // thread of the first stream call, so the kernels load before this communicator's first wait
  // is on a stream. A route that cannot be made (kernels refused by an old driver) leaves every
  // call on the host route.
  if (ops_->device_route() && c_.settings.stream_device_bytes != SIZE_MAX) {
    if (c_.settings.route_program && ops_->program_route()) {
      try {
        programs_ = std::make_shared<ProgramOps>(ops_, c_.settings.timeout_ms, c_.settings.program_blocks);
      } catch (const std::exception& e) {
        log_warn("capi", std::string("device programs are off for this communicator: ") + e.what());
      }
    }
    try {
      route_ = std::make_unique<DeviceRoute>(programs_ ? static_cast<DeviceOps&>(*programs_) : *ops_);
      if (programs_) c_.attach_device(programs_, route_->device);
      else c_.attach_device(ops_, route_->device);
    } catch (const std::exception& e) {
      route_.reset();
      programs_.reset();
      log_warn("capi", std::string("the device route is off for this communicator: ") + e.what());
    }
  }
  th_ = std::thread([this] { loop(); });
}

StreamPath::~StreamPath() {
  finish(true);
  route_.reset();  // waits for the route's streams (their plans ended or were released)
  // The callers' streams run the calls' copies out of staging and their flag writes once
  // finish released them, possibly after this point (an abort with calls queued behind a hung
  // one): what they touch is freed only once every call's freed word is written. A stream that
  // does not get there in time (blocked by other work) leaves it all allocated and registered:
  // leaked, never freed under a stream (tests/test_capi.py
  // test_abort_keeps_memory_queued_stream_work_uses).
  constexpr int64_t kDrainMs = 5000;
  if (!drained(kDrainMs)) {
    log_warn("capi", "the streams of calls issued on this communicator did not finish within " +
                         std::to_string(kDrainMs / 1000) + " s of its end: its staging memory (" +
                         std::to_string(pooled_ >> 20) + " MiB) and flag words are left allocated");
    return;
  }
  for (auto& b : all_) {
    ops_->host_unregister(b.first);
    std::free(b.first);
  }
  if (event_) ops_->event_destroy(event_);
  for (void* w : done_words_)
    if (w) ops_->wait_word_free(w);
  if (page_) {
    ops_->host_unregister(page_);
    std::free(page_);
  }
}

bool StreamPath::reached(const uint64_t* word, uint64_t seq) const {
  // The stream writes 32 bits (CUDA) or the whole counter (HIP): compare the low halves,
  // wrap-aware (device_ops.h).
  uint32_t low = __atomic_load_n(reinterpret_cast<const uint32_t*>(word), __ATOMIC_ACQUIRE);
  return int32_t(low - uint32_t(seq)) >= 0;
}

void StreamPath::wait_slot_free(uint64_t seq) {
  if (seq <= kSlots) return;
  uint64_t prev = seq - kSlots;  // the last job that used this slot
  const uint64_t* freed = page_ + kSlots + prev % kSlots;
  int64_t deadline = now_ms() + c_.settings.timeout_ms;
  int spins = 0;
  while (!reached(freed, prev)) {
    if (abort_.load()) return;
    if (now_ms() > deadline)
      throw CommTimeout("hetccl: Timed out: " + std::to_string(kSlots) +
                        " stream-ordered calls are in flight and the oldest one's stream has not "
                        "finished in " + std::to_string(c_.settings.timeout_ms / 1000) + " s");
    ++waits_;
    pause(spins);
  }
}

bool StreamPath::drained(int64_t within_ms) {
  uint64_t last;
  {
    std::lock_guard<std::mutex> g(mu_);
    last = issued_;
  }
  // calls older than the last kSlots ones wrote theirs before their slot was reused
  uint64_t first = last > kSlots ? last - kSlots + 1 : 1;
  int64_t deadline = now_ms() + within_ms;
  int spins = 0;
  for (uint64_t q = first; q <= last; ++q) {
    while (!reached(page_ + kSlots + q % kSlots, q)) {
      if (now_ms() > deadline) return false;
      pause(spins);
    }
  }
  return true;
}

void StreamPath::reclaim_locked() {
  for (size_t i = 0; i < in_use_.size();) {
    if (reached(page_ + kSlots + in_use_[i].seq % kSlots, in_use_[i].seq) &&
        executed_.load() >= in_use_[i].seq) {
      free_[in_use_[i].cap].push_back(in_use_[i].p);
      in_use_[i] = in_use_.back();
      in_use_.pop_back();
    } else {
      ++i;
    }
  }
}

char* StreamPath::take(size_t cap) {
  auto it = free_.find(cap);
  if (it != free_.end() && !it->second.empty()) {
    char* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void* p = nullptr;
  if (posix_memalign(&p, 4096, cap) != 0) throw std::bad_alloc();
  if (!ops_->host_register(p, cap)) {
    std::free(p);
    throw CommError("hetccl: the device runtime refused to page-lock " + std::to_string(cap) +
                    " bytes of staging memory");
  }
  all_.emplace_back(static_cast<char*>(p), cap);
  pooled_ += cap;
  return static_cast<char*>(p);
}

bool StreamPath::drop_free_locked() {
  for (auto& kv : free_) {
    if (kv.second.empty()) continue;
    char* p = kv.second.back();
    kv.second.pop_back();
    for (size_t i = 0; i < all_.size(); ++i)
      if (all_[i].first == p) {
        all_[i] = all_.back();
        all_.pop_back();
        break;
      }
    ops_->host_unregister(p);
    std::free(p);
    pooled_ -= kv.first;
    return true;
  }
  return false;
}

void StreamPath::issue(StreamJob j) {
  struct Timed {  // counted however issue() returns
    StreamPath& p;
    int64_t t0 = now_ns();
    ~Timed() {
      p.issue_ns_ += uint64_t(now_ns() - t0);
      ++p.issue_calls_;
    }
  } timed{*this};
  ticket_ = 0;
  if (ops_->capturing(j.stream))
    throw UsageRefusal("hetccl: a call across vendors cannot be captured in a graph (its host part "
                       "would not replay); run it outside the capture");
  const bool defer = defer_ && j.device && !programs_;
  if (!defer) join_deferred(j.stream);
  std::unique_lock<std::mutex> g(mu_);
  uint64_t seq = issued_ + 1;
  g.unlock();
  // chunked (contract in stream_path.h): sequence numbers seq .. seq + m - 1, one per chunk
  uint32_t m = 1;
  size_t chunk = 0;
  if (j.chunk && j.chunk_host && j.bytes > j.chunk) {
    chunk = j.chunk;
    while ((j.bytes + chunk - 1) / chunk > kMaxChunks) chunk *= 2;
    m = uint32_t((j.bytes + chunk - 1) / chunk);
  }
  // only this (issuing) thread advances issued_: NCCL's one-thread rule
  for (uint32_t k = 0; k < m; ++k) wait_slot_free(seq + k);
  if (j.device && programs_) {
    // Program mode (device_program.h): the call is one kernel on the caller's stream, which
    // writes the call's freed word when it ends; the executor writes its instructions.
    if (abort_.load()) throw CommError("hetccl: the communicator was aborted");
    programs_->launch(j.stream, seq, page_dev_ + (kSlots + seq % kSlots) * sizeof(uint64_t), seq);
    g.lock();
    Job job;
    job.seq = seq;
    job.issued_ns = now_ns();
    ++jobs_;
    ++device_jobs_;
    ++program_jobs_;
    job.j = std::move(j);
    issued_ = seq;
    q_.push_back(std::move(job));
    g.unlock();
    cv_.notify_one();
    return;
  }
  g.lock();
  reclaim_locked();
  Job job;
  job.seq = seq;
  if (j.device) {
    // Device route: the caller's stream signals that its data is ready and waits until the
    // route has written the call's results (no staging, no copies on this stream). The wait is
    // enqueued only once the executor has enqueued the route's work (or refused the call), so
    // in submission order every work a wait of ours depends on comes first (device_route.h).
    void* s = j.stream;
    ops_->write(s, page_dev_ + (seq % kSlots) * sizeof(uint64_t), seq);
    ++jobs_;
    ++device_jobs_;
    job.j = std::move(j);
    const int64_t t0 = now_ns();
    job.issued_ns = t0;
    issued_ = seq;
    if (defer) {  // the caller joins later (join()); the route writes the freed word
      job.deferred = true;
      ++deferred_jobs_;
      q_.push_back(std::move(job));
      g.unlock();
      cv_.notify_one();
      ticket_ = last_deferred_ = seq;
      return;
    }
    q_.push_back(std::move(job));
    g.unlock();
    cv_.notify_one();
    bool aborted;
    {
      std::unique_lock<std::mutex> w(mu_);
      route_cv_.wait(w, [&] { return route_enqueued_ >= seq || abort_.load(); });
      aborted = route_enqueued_ < seq;
    }
    route_issue_wait_ns_ += uint64_t(now_ns() - t0);
    // Aborted: the wait and the freed word are enqueued all the same (finish() writes the
    // done word of every call the executor did not run, and one it ran writes its own on the
    // route's stream, enqueued before), so the caller's stream stays ordered after the route's
    // use of its buffers and the path sees the call drained before it frees its flag words.
    ops_->wait_geq(s, done_addr_[seq % kSlots], seq);
    ops_->write(s, page_dev_ + (kSlots + seq % kSlots) * sizeof(uint64_t), seq);
    if (aborted) throw CommError("hetccl: the communicator was aborted");
    return;
  }
  job.cap = round_cap(j.bytes);
  // Pinned memory is bounded (kPoolBytes): beyond it, unused buffers of other sizes are freed,
  // then the call waits for the streams of earlier calls to give theirs back.
  int64_t deadline = now_ms() + c_.settings.timeout_ms;
  int spins = 0;
  while (pooled_ + job.cap > kPoolBytes && !(free_.count(job.cap) && !free_[job.cap].empty())) {
    if (drop_free_locked()) continue;
    if (in_use_.empty()) break;  // one call larger than the bound: it gets its buffer
    if (now_ms() > deadline)
      throw CommTimeout("hetccl: Timed out: the pinned staging memory of the stream path (" +
                        std::to_string(kPoolBytes >> 20) + " MiB) stayed in use by earlier calls");
    g.unlock();
    pause(spins);
    g.lock();
    reclaim_locked();
  }
  job.staging = take(job.cap);
  void* s = j.stream;
  // The group's other streams: their earlier work first. One event, re-recorded: a stream wait
  // takes the event's state when it is enqueued (device_ops.h).
  if (!j.others.empty() && !event_) event_ = ops_->event_create();
  for (void* o : j.others) {
    ops_->event_record(event_, o);
    ops_->stream_wait_event(s, event_);
  }
  // One call is m chunks (m = 1 unchunked): chunk k's copies in, then its ready word; then, per
  // chunk, the wait for its done word, its copies out and its freed word.
  if (m == 1) chunk = j.bytes;
  job.chunks = m;
  job.chunk = chunk;
  in_use_.push_back({seq + m - 1, job.staging, job.cap});
  // the copies (device pointer, staging offset, bytes) that fall in [lo, hi) of the staging
  auto copies = [&](const std::vector<StreamCopy>& v, size_t lo, size_t hi, bool in) {
    for (auto& cp : v) {
      size_t a = std::max(lo, cp.off), b = std::min(hi, cp.off + cp.bytes);
      if (a >= b) continue;
      char* dev = static_cast<char*>(cp.dev) + (a - cp.off);
      if (in) ops_->memcpy_async(job.staging + a, dev, b - a, s);
      else ops_->memcpy_async(dev, job.staging + a, b - a, s);
    }
  };
  for (uint32_t k = 0; k < m; ++k) {
    uint64_t q = seq + k;
    copies(j.in, k * chunk, std::min(j.bytes, (k + 1) * chunk), true);
    ops_->write(s, page_dev_ + (q % kSlots) * sizeof(uint64_t), q);
  }
  for (uint32_t k = 0; k < m; ++k) {
    uint64_t q = seq + k;
    ops_->wait_geq(s, done_addr_[q % kSlots], q);
    copies(j.out, k * chunk, std::min(j.bytes, (k + 1) * chunk), false);
    ops_->write(s, page_dev_ + (kSlots + q % kSlots) * sizeof(uint64_t), q);
  }
  if (m > 1) {
    ++chunked_jobs_;
    chunks_ += m;
  }
  if (!j.others.empty()) ops_->event_record(event_, s);
  for (void* o : j.others) ops_->stream_wait_event(o, event_);
  for (auto& cp : j.in) staged_bytes_ += cp.bytes;
  ++jobs_;
  job.j = std::move(j);
  issued_ = seq + job.chunks - 1;
  q_.push_back(std::move(job));
  g.unlock();
  cv_.notify_one();
}

void StreamPath::run_host(const std::function<void(Comm&)>& fn) {
  std::exception_ptr err;
  bool done = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    Job job;
    job.host_only = true;
    job.host_fn = fn;
    job.error = &err;
    job.done = &done;
    q_.push_back(std::move(job));
  }
  cv_.notify_one();
  std::unique_lock<std::mutex> g(mu_);
  host_cv_.wait(g, [&] { return done; });
  if (err) std::rethrow_exception(err);
}

void StreamPath::release_done(uint64_t seq) {
  __atomic_store_n(done_host_[seq % kSlots], seq, __ATOMIC_RELEASE);
  executed_.store(seq);
}

void StreamPath::join(uint64_t t, void* stream) {
  if (!t) return;
  {
    std::unique_lock<std::mutex> w(mu_);
    if (t > issued_) throw UsageRefusal("hetccl: join: ticket " + std::to_string(t) + " was never issued");
    // an aborted call's done word is written by finish(): the wait below passes all the same
    route_cv_.wait(w, [&] { return route_enqueued_ >= t || abort_.load(); });
  }
  ops_->wait_geq(stream, done_addr_[t % kSlots], t);
  ++joins_;
  uint64_t& j = joined_[stream];
  if (j < t) j = t;
  if (joined_.size() > 64) joined_.clear();  // streams come and go: at worst a join again
}

void StreamPath::join_deferred(void* stream) {
  if (!last_deferred_) return;
  auto it = joined_.find(stream);
  if (it != joined_.end() && it->second >= last_deferred_) return;
  ++implicit_joins_;
  join(last_deferred_, stream);
}

void StreamPath::run_device_job(Job& job) {
  const uint64_t q = job.seq;
  DeviceRoute& d = *route_;
  if (programs_) {
    // Program mode: the call's stream work is recorded into its program (device_program.h);
    // a call not run (aborted, or the communicator broken) gets an empty one, which ends.
    const int64_t t0 = now_ns();
    route_queue_ns_ += uint64_t(std::max<int64_t>(0, t0 - job.issued_ns));
    const uint64_t check0 = route_check_ns.load();
    bool written = false;
    try {
      programs_->bind(q);
      if (!abort_.load() && c_.broken_code() == hetcclSuccess) {
        ops_->set_device(d.device);
        job.j.device(c_, d);
        d.ops.write(d.main, done_addr_[q % kSlots], q);
        executed_.store(q);
        written = true;
      }
    } catch (...) {
      c_.note_failure(std::current_exception(), true);
    }
    try {
      programs_->unbind();
    } catch (...) {
      c_.note_failure(std::current_exception(), true);
      programs_->abort_all();  // its kernel would wait for instructions that never come
    }
    if (!written) release_done(q);
    route_turn_ns_ += uint64_t(std::max<int64_t>(0, now_ns() - t0 - int64_t(route_check_ns.load() - check0)));
    return;
  }
  bool enqueued = false;
  const int64_t t0 = now_ns();
  route_queue_ns_ += uint64_t(std::max<int64_t>(0, t0 - job.issued_ns));
  const uint64_t check0 = route_check_ns.load();
  if (!abort_.load() && c_.broken_code() == hetcclSuccess) {
    try {
      ops_->set_device(d.device);
      // the route's streams start once the caller's stream has reached the call
      ops_->wait_geq(d.main, page_dev_ + (q % kSlots) * sizeof(uint64_t), q);
      enqueued = true;
      job.j.device(c_, d);
    } catch (...) {
      c_.note_failure(std::current_exception(), true);
    }
  }
  bool written = false;
  if (enqueued) {
    try {
      ops_->write(d.main, done_addr_[q % kSlots], q);
      // deferred: no caller's stream writes the freed word (join() waits on done, which only
      // grows, so the slot may be reused before a late join)
      if (job.deferred) ops_->write(d.main, page_dev_ + (kSlots + q % kSlots) * sizeof(uint64_t), q);
      executed_.store(q);
      written = true;
    } catch (...) {
      c_.note_failure(std::current_exception(), true);
    }
  }
  if (!written) {
    release_done(q);
    if (job.deferred) __atomic_store_n(page_ + kSlots + q % kSlots, q, __ATOMIC_RELEASE);
  }
  route_turn_ns_ += uint64_t(std::max<int64_t>(0, now_ns() - t0 - int64_t(route_check_ns.load() - check0)));
  std::lock_guard<std::mutex> g(mu_);
  route_enqueued_ = q;
  route_cv_.notify_all();
}

void StreamPath::staged_on(void* stream, const StreamJob& j) {
  char* st = nullptr;
  size_t cap = round_cap(j.bytes);
  {
    std::lock_guard<std::mutex> g(mu_);
    ++staged_fallbacks_;
    st = take(cap);
  }
  struct Give {  // back to the pool however this ends (the stream has passed it: synced below)
    StreamPath* p;
    char* st;
    size_t cap;
    ~Give() {
      std::lock_guard<std::mutex> g(p->mu_);
      p->free_[cap].push_back(st);
    }
  } give{this, st, cap};
  // the route's runtime: in program mode the route's streams are its program's groups
  DeviceOps& o = route_ ? route_->ops : *ops_;
  for (auto& cp : j.in) o.memcpy_async(st + cp.off, cp.dev, cp.bytes, stream);
  o.sync(stream);
  if (j.host) j.host(c_, st);
  for (auto& cp : j.out) o.memcpy_async(cp.dev, st + cp.off, cp.bytes, stream);
  o.sync(stream);
}

void StreamPath::run_job(Job& job) {
  if (job.j.device) {
    run_device_job(job);
    return;
  }
  if (job.host_only) {
    std::exception_ptr err;
    if (abort_.load()) {
      err = std::make_exception_ptr(CommError("hetccl: the communicator was aborted"));
    } else {
      try {
        job.host_fn(c_);
      } catch (...) {
        err = std::current_exception();
        c_.note_failure(err, false);  // an argument refusal leaves a host call's comm usable
      }
    }
    std::lock_guard<std::mutex> g(mu_);
    *job.error = err;
    *job.done = true;
    host_cv_.notify_all();
    return;
  }
  for (uint32_t k = 0; k < job.chunks; ++k) {
    uint64_t q = job.seq + k;
    bool ok = wait_ready(q);
    if (ok && c_.broken_code() == hetcclSuccess) {
      try {
        if (job.chunks > 1) {
          size_t off = size_t(k) * job.chunk;
          job.j.chunk_host(c_, job.staging, off, std::min(job.j.bytes - off, job.chunk));
        } else if (job.j.host) {
          job.j.host(c_, job.staging);
        }
      } catch (...) {
        c_.note_failure(std::current_exception(), true);
      }
    }
    release_done(q);
  }
}

bool StreamPath::wait_ready(uint64_t seq) {
  // the stream's copies in are done when the ready word reaches the sequence number
  const uint64_t* ready = page_ + seq % kSlots;
  int64_t deadline = now_ms() + c_.settings.timeout_ms;
  int spins = 0;
  while (!reached(ready, seq)) {
    if (abort_.load()) return false;
    if (now_ms() > deadline) {
      c_.note_failure(std::make_exception_ptr(CommTimeout(
          "hetccl: Timed out: the stream of a stream-ordered call did not reach it in " +
          std::to_string(c_.settings.timeout_ms / 1000) + " s")), true);
      return false;
    }
    pause(spins);
  }
  return true;
}

void StreamPath::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      job = std::move(q_.front());
      q_.pop_front();
    }
    run_job(job);
  }
}

void StreamPath::request_abort() {
  abort_.store(true);
  if (programs_) programs_->abort_all();
  std::lock_guard<std::mutex> g(mu_);
  route_cv_.notify_all();
  host_cv_.notify_all();
  cv_.notify_all();
}

void StreamPath::finish(bool abort) {
  if (abort) {
    abort_.store(true);
    if (programs_) programs_->abort_all();
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (th_.joinable()) th_.join();
  // Jobs never run (abort): release their streams (and an issuing thread waiting for one).
  {
    std::lock_guard<std::mutex> g(mu_);
    for (uint64_t s = executed_.load() + 1; s <= issued_; ++s) release_done(s);
    route_enqueued_ = issued_;
    route_cv_.notify_all();
  }
  // The device route's streams: every plan they hold ends (or, on abort, is released by the
  // engine's close) before the communicator frees what they copy from.
  if (route_) {
    try {
      route_->ops.sync(route_->main);
      route_->ops.sync(route_->side);
    } catch (const std::exception& e) {
      log_warn("capi", std::string("waiting for the device route's streams: ") + e.what());
    }
  }
}

void* StreamPath::test_stream() { return emulated_stream(*ops_); }
void StreamPath::test_sync(void* stream) { ops_->sync(stream); }

std::map<std::string, uint64_t> StreamPath::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return {{"jobs", jobs_}, {"staged_bytes", staged_bytes_}, {"pool_bytes", pooled_},
          {"backpressure_polls", waits_}, {"chunked_jobs", chunked_jobs_}, {"chunks", chunks_},
          {"device_jobs", device_jobs_}, {"staged_fallbacks", staged_fallbacks_},
          {"device_route", route_ ? 1u : 0u}, {"route_check_ns", route_check_ns.load()},
          {"route_enqueue_ns", route_turn_ns_.load()}, {"route_queue_ns", route_queue_ns_.load()},
          {"route_issue_wait_ns", route_issue_wait_ns_.load()}, {"program_jobs", program_jobs_},
          {"program_instructions", programs_ ? programs_->instructions() : 0},
          {"program_scratch_allocs", programs_ ? programs_->scratch_allocs() : 0},
          {"program_scratch_reuses", programs_ ? programs_->scratch_reuses() : 0},
          {"issue_ns", issue_ns_.load()}, {"issue_calls", issue_calls_.load()},
          {"deferred_jobs", deferred_jobs_}, {"joins", joins_}, {"implicit_joins", implicit_joins_}};
}

}  // namespace api
}  // namespace hetccl
