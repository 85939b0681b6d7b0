// hetccl C API: stream-ordered collectives (a call with a stream). The host collective of
// comm.h runs on this communicator's executor thread on pinned staging memory, and the caller's
// stream is ordered around it with the device runtime's stream memory operations
// (device_ops.h), so the issuing thread returns after enqueueing and never waits:
//
//   caller's stream:  copies device -> staging | write ready=seq | wait done>=seq | copies staging -> device | write freed=seq
//   executor thread:                  wait ready>=seq -> the host collective on staging -> write done=seq
//
// Contracts:
//  * Jobs run on the executor in issue order, and every host call of the communicator (stream
//    NULL) also runs there once the path exists, so tags and ring positions keep the order
//    every rank issues in.
//  * Each job has one staging buffer; its copies in are (device pointer, offset, bytes) into it
//    and its copies out the reverse, so a collective is one buffer and a group of sends and
//    receives is one job with one buffer.
//  * Staging buffers come from a pool of page-locked buffers (capacity: a power of two), reused
//    once the stream has written the job's freed word (its copies out are done).
//  * A job that fails (a peer's refusal, a dead peer, a timeout) breaks the communicator with
//    its code (hetcclCommGetAsyncError) and still writes its done word, as does every later job,
//    so no stream stays blocked; the data of failed jobs is left as it was.
//  * At most kSlots jobs are in flight; the issuing thread waits for the oldest one's stream
//    beyond that (back-pressure, bounded by the communicator's timeout).
//  * A chunked job (StreamJob::chunk, all_reduce with HETCCL_STREAM_CHUNK_BYTES set) takes one
//    sequence number per chunk: the stream enqueues every chunk's copies in, each followed by
//    its ready word, then per chunk: wait for its done word, its copies out, its freed word.
//    The executor runs the host part chunk by chunk as each chunk's ready word arrives, so the
//    copies in of later chunks overlap the host collective of earlier ones, and the copies out
//    of earlier chunks the collective of later ones (a three-stage pipeline on one stream).
//    Every rank must chunk alike (the setting equal on every rank, as NCCL's own variables);
//    ranks that differ are refused by each chunk's argument check (the counts differ).
// Trade-off: the data makes one extra pass (device -> host -> device) beside the host collective;
// an unchunked job's copies in finish before its host collective starts; the issue cost is a
// few runtime calls per chunk (no host wait).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../device_ops.h"
#include "device_program.h"
#include "device_route.h"

namespace hetccl {
namespace api {

class Comm;

struct StreamCopy {
  void* dev;     // the caller's memory (device, or any memory its stream's copies reach)
  size_t off;    // offset in the staging buffer
  size_t bytes;
};

struct StreamJob {
  void* stream = nullptr;
  std::vector<void*> others;  // further streams of a group: joined before, released after
  size_t bytes = 0;           // staging bytes
  std::vector<StreamCopy> in, out;
  std::function<void(Comm&, char*)> host;  // the host collective on the staging buffer
  // Chunked (optional): chunk_host(comm, staging, off, bytes) runs the host part on the staging
  // bytes [off, off + bytes) alone, chunk by chunk of `chunk` bytes (the last one shorter); it
  // replaces `host` when the job is larger than one chunk. The caller makes `chunk` a multiple
  // of its element size.
  size_t chunk = 0;
  std::function<void(Comm&, char*, size_t, size_t)> chunk_host;
  // The device route (device_route.h), when the caller chose it for this call (then bytes, in,
  // out and host are ignored): run by the executor with the route's streams current; it
  // returns once it has enqueued the call on the route's main stream (or run it staged there:
  // staged_on), and the path then enqueues the job's done word on main. The caller's stream
  // only writes ready and waits for done.
  std::function<void(Comm&, DeviceRoute&)> device;
};

class StreamPath {
 public:
  StreamPath(Comm& c, const std::string& runtime, const std::string& library);
  ~StreamPath();
  StreamPath(const StreamPath&) = delete;
  StreamPath& operator=(const StreamPath&) = delete;

  // Issuing thread: enqueues the job's stream operations and hands it to the executor.
  void issue(StreamJob job);
  // Deferred joins (hetcclCommDeferJoin; the torch face, whose Work orders a stream when it is
  // waited for, as torch's NCCL process group): a device-route call then returns once its job
  // is handed over, without waiting for the executor to enqueue the route's work, and without
  // enqueueing the caller's wait for its done word; its ticket (its sequence number; 0 for a
  // call that needs no join) is in ticket_word(). join(t, stream) waits on the host until the
  // route has enqueued call t, then enqueues on `stream` the wait for its done word: the stream
  // is then ordered after call t and every earlier one (the route runs calls in order; done
  // words only grow, so a slot reused by a later call still satisfies the wait). The route's
  // main stream writes a deferred call's freed word itself, so unjoined calls never hold their
  // slot. Any other call issued after a deferred one is ordered after it on its own stream
  // first (a join by issue()), so calls on one communicator see each other's results in issue
  // order whatever the caller joined, as NCCL's stream semantics give. Issuing thread only.
  void defer_joins(bool on) { defer_ = on; }
  const uint64_t* ticket_word() const { return &ticket_; }
  void join(uint64_t ticket, void* stream);
  // A host call (stream NULL): runs fn on the executor after every job issued before it and
  // waits for it; rethrows its exception.
  void run_host(const std::function<void(Comm&)>& fn);
  // Waits until every issued job has run (bounded by the communicator's timeout); abort: runs
  // none of them (their streams are released). Joins the executor.
  void finish(bool abort);
  // Abort from another thread: jobs not yet run are skipped (their streams released at finish).
  // (an issuing thread waiting for the executor then returns with an error)
  void request_abort();
  // The runtime's default stream (HETCCL_STREAM_DEFAULT).
  void* default_stream() { return ops_->default_stream(); }
  // The device route, or nullptr where the runtime has none (or HETCCL_STREAM_DEVICE_BYTES=off,
  // or its kernels could not be loaded: then every call stays on the host route).
  DeviceRoute* route() { return route_.get(); }
  // Executor, inside a device job whose ranks did not all take the device route: the host
  // route's job `j` (bytes, in, out, host) run on `stream` -- copies in, a wait for them, the
  // host collective on pooled staging, copies out, a wait for them.
  void staged_on(void* stream, const StreamJob& j);
  // Tests (emulated runtime only): a stream, and waiting for it.
  void* test_stream();
  void test_sync(void* stream);
  std::map<std::string, uint64_t> stats();
  // Where the device route's issue cost goes (hetcclCommInfo, "stream_route_*_ns"), summed over
  // its calls: the executor's argument check (added by the call, c_api.cc), the rest of the
  // executor's turn (enqueueing the plans and kernels), the time a call queued behind earlier
  // ones, and the issuing thread's wait for the executor (device_route.h: the caller's wait for
  // done is enqueued after the route's work).
  std::atomic<uint64_t> route_check_ns{0};

  static constexpr uint32_t kSlots = 256;
  // A chunked job takes at most this many sequence numbers (its chunks grow beyond it).
  static constexpr uint32_t kMaxChunks = 32;
  // Pinned staging memory one communicator keeps at most (beyond it calls wait for earlier
  // calls' buffers; a single larger call still gets its own).
  static constexpr size_t kPoolBytes = size_t(2) << 30;

 private:
  struct Job {
    uint64_t seq = 0;    // the first sequence number (of its first chunk)
    int64_t issued_ns = 0;  // device jobs: when the issuing thread handed it over
    uint32_t chunks = 1;  // sequence numbers seq .. seq + chunks - 1
    size_t chunk = 0;     // bytes per chunk when chunks > 1
    bool host_only = false;
    StreamJob j;
    char* staging = nullptr;
    size_t cap = 0;
    std::function<void(Comm&)> host_fn;
    std::exception_ptr* error = nullptr;  // host_only: where the caller waits for it
    bool* done = nullptr;
    bool deferred = false;  // device route, join deferred: the route writes its freed word
  };
  void loop();
  void run_job(Job& job);
  bool reached(const uint64_t* word, uint64_t seq) const;
  bool wait_ready(uint64_t seq);  // executor: the stream's copies in of seq are done (false: abort/timeout)
  void wait_slot_free(uint64_t seq);
  // Whether every issued call's stream has written its freed word (its last use of staging
  // and of the flag page), waiting at most within_ms.
  bool drained(int64_t within_ms);
  void reclaim_locked();
  char* take(size_t cap);
  bool drop_free_locked();  // frees one unused pooled buffer; false if none
  void release_done(uint64_t seq);

  void run_device_job(Job& job);
  // Issuing thread: `stream` ordered after the last deferred call, unless it already is.
  void join_deferred(void* stream);
  Comm& c_;
  std::shared_ptr<DeviceOps> ops_;
  // Program mode (device_program.h; HETCCL_CAPI_ROUTE_LAUNCH=kernel): the route's runtime,
  // recording its streams' work as each call's one kernel; null: the route's own streams.
  // Declared before route_, which refers to it, so it is destroyed after.
  std::shared_ptr<ProgramOps> programs_;
  std::unique_ptr<DeviceRoute> route_;
  uint64_t* page_ = nullptr;  // kSlots ready words, then kSlots freed words (registered)
  uint64_t page_dev_ = 0;     // its device address
  size_t pooled_ = 0;         // bytes of staging buffers held (under mu_)
  void* event_ = nullptr;             // joins a group's streams
  std::vector<void*> done_words_;     // per slot, where the runtime allocates wait words
  std::vector<uint64_t> done_addr_;   // device addresses of the done words
  std::vector<uint64_t*> done_host_;  // host addresses of the done words
  std::mutex mu_;
  std::condition_variable cv_, host_cv_;
  // device jobs: the last sequence number whose route work the executor has enqueued (or which
  // it refused); issue() waits for its own before the caller's stream waits for done
  std::condition_variable route_cv_;
  uint64_t route_enqueued_ = 0;
  std::deque<Job> q_;
  uint64_t issued_ = 0;
  std::atomic<uint64_t> executed_{0};
  std::atomic<bool> abort_{false};
  bool stop_ = false;
  std::thread th_;
  struct InUse {
    uint64_t seq;
    char* p;
    size_t cap;
  };
  std::vector<InUse> in_use_;                       // under mu_
  std::map<size_t, std::vector<char*>> free_;       // capacity -> buffers (under mu_)
  std::vector<std::pair<char*, size_t>> all_;       // every buffer (freed at the end)
  uint64_t jobs_ = 0, staged_bytes_ = 0, waits_ = 0, chunked_jobs_ = 0, chunks_ = 0, device_jobs_ = 0;
  uint64_t staged_fallbacks_ = 0, program_jobs_ = 0;
  std::atomic<uint64_t> route_queue_ns_{0}, route_turn_ns_{0}, route_issue_wait_ns_{0};
  // the issuing thread's time in issue(), every stream call (stats: issue_ns, issue_calls)
  std::atomic<uint64_t> issue_ns_{0}, issue_calls_{0};
  // deferred joins (issuing thread): the setting, the last call's ticket, the last deferred
  // call, and per stream the last call it was joined after (bounded: cleared beyond 64)
  bool defer_ = false;
  uint64_t ticket_ = 0, last_deferred_ = 0;
  std::map<void*, uint64_t> joined_;
  uint64_t deferred_jobs_ = 0, joins_ = 0, implicit_joins_ = 0;
};

}  // namespace api
}  // namespace hetccl
