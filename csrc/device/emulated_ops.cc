// The host-emulated runtime module: a device whose "streams" are host threads executing their
// queued operations in order -- waits spin on the word, copies are memcpy, writes are stores. It
// runs the engine's device protocol (positions, flag words, ring wrap-around, fork/join of the
// two streams, failure release) on a machine without a GPU, for tests; it is never chosen for
// real tensors. It follows one of the two comparison rules of device_ops.h, chosen when opened:
//   "cuda" (default): 32-bit waits and writes on the low half of the counter, wait passes when
//                     (int32_t)(low - value) >= 0 (what cuStreamWaitValue32 GEQ documents);
//   "hip":            64-bit waits (*word >= counter, unsigned, as hipStreamWaitValueGte) and
//                     writes, and the words streams wait on allocated apart from the flag page
//                     (as HIP's signal memory), so the engine's separate-word path runs too.
//
// Lifetime check: host memory registered with host_register is what real streams reach by DMA.
// An operation enqueued on such memory that runs after it was unregistered (a use after
// unregister: on a GPU an MMU fault or a write into memory malloc handed out again) is not
// run; it is reported on stderr (the first one), and with
// HETCCL_EMULATED_STRICT=1 the process aborts, so a test that covers the path fails.
#include <sched.h>
#include <stdio.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <new>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "program.h"
#include "runtime.h"

namespace hetccl {
namespace device {
namespace {

std::atomic<uint64_t> g_violations{0};

bool strict_lifetime() {
  const char* v = getenv("HETCCL_EMULATED_STRICT");  // tests only (hetccl/config.py)
  if (!v) return false;
  std::string s(v);
  return s == "1" || s == "on" || s == "true" || s == "yes";
}

void report_violation(const char* what, const void* addr) {
  const bool strict = strict_lifetime();
  if (g_violations.fetch_add(1) == 0 || strict)
    fprintf(stderr,
            "hetccl emulated device: a stream operation (%s) enqueued on registered host memory at %p "
            "ran after that memory was unregistered: not run (use after unregister)\n",
            what, addr);
  if (strict) abort();
}

class EmulatedOps final : public DeviceOps {
  struct Stream {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> q;
    bool stop = false;
    uint64_t queued = 0;
    std::atomic<uint64_t> done{0};
    std::thread th;
  };
  struct Event {
    std::atomic<uint64_t> fired{0};
    uint64_t recorded = 0;
  };

 public:
  explicit EmulatedOps(bool hip_rule) : hip_(hip_rule) {}
  ~EmulatedOps() override {
    for (auto* s : streams_) {
      {
        std::lock_guard<std::mutex> g(s->mu);
        s->stop = true;
      }
      s->cv.notify_all();
      s->th.join();
      delete s;
    }
  }
  std::string name() const override { return "emulated"; }
  std::string memory_type() const override { return "host"; }
  void set_device(int) override {}
  bool stream_mem_ops(int) override { return true; }
  void* create_stream() {
    auto* s = new Stream();
    s->th = std::thread([s] {
      for (;;) {
        std::function<void()> op;
        {
          std::unique_lock<std::mutex> g(s->mu);
          s->cv.wait(g, [&] { return s->stop || !s->q.empty(); });
          if (s->q.empty()) return;
          op = std::move(s->q.front());
          s->q.pop_front();
        }
        op();
        s->done.fetch_add(1);
      }
    });
    std::lock_guard<std::mutex> g(mu_);
    streams_.push_back(s);
    return s;
  }
  void* default_stream() override {
    std::call_once(default_once_, [this] { default_ = create_stream(); });
    return default_;
  }
  void wait_geq(void* stream, uint64_t word, uint64_t counter) override {
    auto* w = reinterpret_cast<uint64_t*>(uintptr_t(word));
    uint64_t r = reg_of(w);
    if (hip_) {
      enqueue(stream, [this, w, counter, r] {
        int spins = 0;
        while (__atomic_load_n(w, __ATOMIC_ACQUIRE) < counter) {
          if (!live(r, "wait", w)) return;
          if (++spins > 64) sched_yield();
        }
      });
    } else {
      auto* low = reinterpret_cast<uint32_t*>(w);  // little-endian: the low half comes first
      uint32_t value = uint32_t(counter);
      enqueue(stream, [this, low, value, r] {
        int spins = 0;
        while (int32_t(__atomic_load_n(low, __ATOMIC_ACQUIRE) - value) < 0) {
          if (!live(r, "wait", low)) return;
          if (++spins > 64) sched_yield();
        }
      });
    }
  }
  void write(void* stream, uint64_t word, uint64_t counter) override {
    auto* w = reinterpret_cast<uint64_t*>(uintptr_t(word));
    uint64_t r = reg_of(w);
    if (hip_) {
      enqueue(stream, [this, w, counter, r] {
        if (live(r, "write", w)) __atomic_store_n(w, counter, __ATOMIC_RELEASE);
      });
    } else {
      auto* low = reinterpret_cast<uint32_t*>(w);
      uint32_t value = uint32_t(counter);
      enqueue(stream, [this, low, value, r] {
        if (live(r, "write", low)) __atomic_store_n(low, value, __ATOMIC_RELEASE);
      });
    }
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    uint64_t rd = nbytes ? reg_of(dst) : 0, rs = nbytes ? reg_of(src) : 0;
    enqueue(stream, [this, dst, src, nbytes, rd, rs] {
      if (live(rd, "copy to", dst) && live(rs, "copy from", src)) std::memcpy(dst, src, nbytes);
    });
  }
  void sync(void* stream) override {
    auto* s = static_cast<Stream*>(stream);
    uint64_t target;
    {
      std::lock_guard<std::mutex> g(s->mu);
      target = s->queued;
    }
    while (s->done.load() < target) sched_yield();
  }
  void* event_create() override { return new Event(); }
  void event_record(void* event, void* stream) override {
    auto* e = static_cast<Event*>(event);
    uint64_t gen = ++e->recorded;
    enqueue(stream, [e, gen] { e->fired.store(gen); });
  }
  void stream_wait_event(void* stream, void* event) override {
    auto* e = static_cast<Event*>(event);
    uint64_t gen = e->recorded;
    enqueue(stream, [e, gen] {
      while (e->fired.load() < gen) sched_yield();
    });
  }
  void event_destroy(void* event) override { delete static_cast<Event*>(event); }
  bool host_register(void* p, size_t n) override {
    std::lock_guard<std::mutex> g(reg_mu_);
    uint64_t id = ++next_reg_;
    regs_[reinterpret_cast<uintptr_t>(p)] = {n, id};
    live_.insert(id);
    return true;
  }
  void host_unregister(void* p) override {
    std::lock_guard<std::mutex> g(reg_mu_);
    auto it = regs_.find(reinterpret_cast<uintptr_t>(p));
    if (it == regs_.end()) return;
    live_.erase(it->second.id);
    regs_.erase(it);
  }
  uint64_t device_address(void* host) override { return uint64_t(reinterpret_cast<uintptr_t>(host)); }
  void* wait_word_alloc() override {
    if (!hip_) return nullptr;
    return new uint64_t(0);
  }
  uint64_t wait_word_address(void* w) override { return uint64_t(reinterpret_cast<uintptr_t>(w)); }
  void wait_word_free(void* w) override { delete static_cast<uint64_t*>(w); }

  // The device route: its "device memory" is host memory, its kernels reduce.cc's host kernels
  // (one thread: a stream is one thread), run in stream order like every other operation.
  bool device_route() override { return true; }
  void prepare_kernels() override {}
  int current_device() override { return 0; }
  void* stream_create() override { return create_stream(); }
  void stream_destroy(void*) override {}  // streams live as long as the module
  void* mem_alloc_async(size_t nbytes, void*) override {
    void* p = nullptr;
    if (posix_memalign(&p, 64, nbytes ? nbytes : 1) != 0) throw std::bad_alloc();
    return p;
  }
  void mem_free_async(void* p, void* stream) override { enqueue(stream, [p] { std::free(p); }); }
  void reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) override {
    enqueue(stream, [=] { reduce_into(op, dt, dst, src, count, 1); });
  }
  void scale_div(void* p, size_t count, DType dt, int64_t n, void* stream) override {
    enqueue(stream, [=] { hetccl::scale_div(dt, p, count, n, 1); });
  }
  void scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                 void* stream) override {
    uint64_t imm = 0;
    if (!scalar_dev) std::memcpy(&imm, scalar_host, dtype_size(dt));
    enqueue(stream, [=] { hetccl::scale_mul(dt, p, count, scalar_dev ? scalar_dev : &imm, 1); });
  }
  // Device programs: the "kernel" is program_host.cc's interpreter, run in stream order.
  bool program_route() override { return true; }
  void launch_program(void* stream, void* slot, uint64_t, void*, uint32_t) override {  // one thread a group
    auto* s = static_cast<program::Slot*>(slot);
    enqueue(stream, [s] { program::run_on_host(s); });
  }
  bool wide_words() const override { return hip_; }

 private:
  // The registration holding address a (its id), or 0 (not registered memory).
  uint64_t reg_of(const void* a) {
    auto x = reinterpret_cast<uintptr_t>(a);
    std::lock_guard<std::mutex> g(reg_mu_);
    auto it = regs_.upper_bound(x);
    if (it == regs_.begin()) return 0;
    --it;
    return x < it->first + it->second.n ? it->second.id : 0;
  }
  // Whether registration r (0: none) is still live when the operation runs; reports if not.
  bool live(uint64_t r, const char* what, const void* addr) {
    if (!r) return true;
    {
      std::lock_guard<std::mutex> g(reg_mu_);
      if (live_.count(r)) return true;
    }
    report_violation(what, addr);
    return false;
  }
  void enqueue(void* stream, std::function<void()> op) {
    auto* s = static_cast<Stream*>(stream);
    {
      std::lock_guard<std::mutex> g(s->mu);
      s->q.push_back(std::move(op));
      ++s->queued;
    }
    s->cv.notify_one();
  }
  const bool hip_;
  std::once_flag default_once_;
  void* default_ = nullptr;
  std::mutex mu_;
  std::vector<Stream*> streams_;
  struct Reg {
    size_t n;
    uint64_t id;
  };
  std::mutex reg_mu_;
  std::map<uintptr_t, Reg> regs_;  // registered host ranges by start
  std::set<uint64_t> live_;        // ids of the registrations still in force
  uint64_t next_reg_ = 0;
};

}  // namespace

std::shared_ptr<DeviceOps> make_emulated_ops(const std::string& rule) {
  if (rule.empty() || rule == "cuda") return std::make_shared<EmulatedOps>(false);
  if (rule == "hip") return std::make_shared<EmulatedOps>(true);
  throw CommError("hetccl: the emulated device follows the 'cuda' or 'hip' rule, not '" + rule + "'");
}

void* emulated_stream(DeviceOps& ops) {
  auto* e = dynamic_cast<EmulatedOps*>(&ops);
  if (!e) throw CommError("hetccl: streams can be created only on the emulated device");
  return e->create_stream();
}

}  // namespace device
}  // namespace hetccl
