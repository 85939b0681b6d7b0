// Vendor runtimes behind DeviceOps (device_ops.h): the CUDA driver API and the HIP runtime,
// resolved with dlsym from the library the framework already loaded. Nothing here is compiled
// against a vendor header: the few types and constants used are spelled out below, from the
// vendors' public headers (cuda.h, hip_runtime_api.h).
#include "device_ops.h"

#include <dlfcn.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"

namespace hetccl {
namespace {

void* must_sym(void* lib, const std::string& libname, const char* sym) {
  void* f = dlsym(lib, sym);
  if (!f) throw CommError(std::string("hetccl: ") + libname + " lacks " + sym);
  return f;
}

void* open_lib(const std::string& library) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!lib) lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw CommError("hetccl: cannot open the device runtime " + library + ": " + dlerror());
  return lib;
}

// ----------------------------------------------------------------------------- CUDA driver API
class CudaOps final : public DeviceOps {
  using Res = int;  // CUresult
  using Ptr = unsigned long long;  // CUdeviceptr
  static constexpr unsigned kWaitGeq = 0x0;           // CU_STREAM_WAIT_VALUE_GEQ
  static constexpr unsigned kWriteDefault = 0x0;      // CU_STREAM_WRITE_VALUE_DEFAULT
  static constexpr unsigned kRegPortableMapped = 0x3; // CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
  static constexpr unsigned kEventNoTiming = 0x2;     // CU_EVENT_DISABLE_TIMING
  static constexpr int kAttrMemOps = 92;              // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
  static constexpr Res kAlreadyRegistered = 712;      // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED

 public:
  explicit CudaOps(const std::string& library) : lib_name_(library) {
    void* lib = open_lib(library);
    auto S = [&](const char* s) { return must_sym(lib, lib_name_, s); };
    init_ = reinterpret_cast<Res (*)(unsigned)>(S("cuInit"));
    device_get_ = reinterpret_cast<Res (*)(int*, int)>(S("cuDeviceGet"));
    primary_retain_ = reinterpret_cast<Res (*)(void**, int)>(S("cuDevicePrimaryCtxRetain"));
    ctx_set_ = reinterpret_cast<Res (*)(void*)>(S("cuCtxSetCurrent"));
    ctx_get_ = reinterpret_cast<Res (*)(void**)>(S("cuCtxGetCurrent"));
    attr_ = reinterpret_cast<Res (*)(int*, int, int)>(S("cuDeviceGetAttribute"));
    wait_ = reinterpret_cast<Res (*)(void*, Ptr, uint32_t, unsigned)>(S("cuStreamWaitValue32_v2"));
    write_ = reinterpret_cast<Res (*)(void*, Ptr, uint32_t, unsigned)>(S("cuStreamWriteValue32_v2"));
    memcpy_ = reinterpret_cast<Res (*)(Ptr, Ptr, size_t, void*)>(S("cuMemcpyAsync"));
    sync_ = reinterpret_cast<Res (*)(void*)>(S("cuStreamSynchronize"));
    ev_create_ = reinterpret_cast<Res (*)(void**, unsigned)>(S("cuEventCreate"));
    ev_record_ = reinterpret_cast<Res (*)(void*, void*)>(S("cuEventRecord"));
    ev_wait_ = reinterpret_cast<Res (*)(void*, void*, unsigned)>(S("cuStreamWaitEvent"));
    ev_destroy_ = reinterpret_cast<Res (*)(void*)>(S("cuEventDestroy_v2"));
    reg_ = reinterpret_cast<Res (*)(void*, size_t, unsigned)>(S("cuMemHostRegister_v2"));
    unreg_ = reinterpret_cast<Res (*)(void*)>(S("cuMemHostUnregister"));
    devptr_ = reinterpret_cast<Res (*)(Ptr*, void*, unsigned)>(S("cuMemHostGetDevicePointer_v2"));
    errstr_ = reinterpret_cast<Res (*)(Res, const char**)>(S("cuGetErrorString"));
    check("cuInit", init_(0));
  }
  std::string name() const override { return "cuda"; }

  void set_device(int index) override {
    // The framework's runtime makes its primary context current on the threads it uses; make
    // sure of it on this thread, for this device, before any driver call.
    std::lock_guard<std::mutex> g(mu_);
    if (index >= int(ctx_.size())) ctx_.resize(index + 1, nullptr);
    if (!ctx_[index]) {
      int dev = 0;
      check("cuDeviceGet", device_get_(&dev, index));
      check("cuDevicePrimaryCtxRetain", primary_retain_(&ctx_[index], dev));
    }
    void* cur = nullptr;
    if (ctx_get_(&cur) != 0 || cur != ctx_[index]) check("cuCtxSetCurrent", ctx_set_(ctx_[index]));
  }
  bool stream_mem_ops(int index) override {
    // The _v2 entry points work on current drivers even where the V1 attribute reads 0 (seen on
    // the H200 box, driver 580); their presence was checked when the library was opened. A
    // driver that refuses them fails the first wait with a clear error.
    (void)index;
    return true;
  }
  void wait_geq(void* stream, uint64_t word, uint32_t value) override {
    check("cuStreamWaitValue32_v2", wait_(stream, Ptr(word), value, kWaitGeq));
  }
  void write(void* stream, uint64_t word, uint32_t value) override {
    check("cuStreamWriteValue32_v2", write_(stream, Ptr(word), value, kWriteDefault));
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    if (nbytes)
      check("cuMemcpyAsync", memcpy_(Ptr(reinterpret_cast<uintptr_t>(dst)),
                                     Ptr(reinterpret_cast<uintptr_t>(src)), nbytes, stream));
  }
  void sync(void* stream) override { check("cuStreamSynchronize", sync_(stream)); }
  void* event_create() override {
    void* ev = nullptr;
    check("cuEventCreate", ev_create_(&ev, kEventNoTiming));
    return ev;
  }
  void event_record(void* event, void* stream) override {
    check("cuEventRecord", ev_record_(event, stream));
  }
  void stream_wait_event(void* stream, void* event) override {
    check("cuStreamWaitEvent", ev_wait_(stream, event, 0));
  }
  void event_destroy(void* event) override { ev_destroy_(event); }
  bool host_register(void* p, size_t nbytes) override {
    Res r = reg_(p, nbytes, kRegPortableMapped);
    return r == 0 || r == kAlreadyRegistered;
  }
  void host_unregister(void* p) override { unreg_(p); }
  uint64_t device_address(void* host) override {
    Ptr d = 0;
    check("cuMemHostGetDevicePointer_v2", devptr_(&d, host, 0));
    return uint64_t(d);
  }

 private:
  void check(const char* what, Res r) {
    if (r == 0) return;
    const char* s = nullptr;
    errstr_(r, &s);
    throw CommError(std::string("hetccl: ") + what + " failed: error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }
  std::string lib_name_;
  std::mutex mu_;
  std::vector<void*> ctx_;
  Res (*init_)(unsigned);
  Res (*device_get_)(int*, int);
  Res (*primary_retain_)(void**, int);
  Res (*ctx_set_)(void*);
  Res (*ctx_get_)(void**);
  Res (*attr_)(int*, int, int);
  Res (*wait_)(void*, Ptr, uint32_t, unsigned);
  Res (*write_)(void*, Ptr, uint32_t, unsigned);
  Res (*memcpy_)(Ptr, Ptr, size_t, void*);
  Res (*sync_)(void*);
  Res (*ev_create_)(void**, unsigned);
  Res (*ev_record_)(void*, void*);
  Res (*ev_wait_)(void*, void*, unsigned);
  Res (*ev_destroy_)(void*);
  Res (*reg_)(void*, size_t, unsigned);
  Res (*unreg_)(void*);
  Res (*devptr_)(Ptr*, void*, unsigned);
  Res (*errstr_)(Res, const char**);
};

// ----------------------------------------------------------------------------- HIP runtime
// Written against hip_runtime_api.h (ROCm 6); not executed here (no AMD GPU on our machines).
class HipOps final : public DeviceOps {
  using Res = int;  // hipError_t
  static constexpr unsigned kWaitGte = 0x0;        // hipStreamWaitValueGte
  static constexpr unsigned kRegPortableMapped = 0x3;  // hipHostRegisterPortable | Mapped
  static constexpr unsigned kEventNoTiming = 0x2;  // hipEventDisableTiming
  static constexpr int kMemcpyDefault = 4;         // hipMemcpyDefault
  static constexpr int kAttrMemOps = 10;           // hipDeviceAttributeCanUseStreamWaitValue (ROCm 6)
  static constexpr Res kAlreadyRegistered = 712;   // hipErrorHostMemoryAlreadyRegistered

 public:
  explicit HipOps(const std::string& library) : lib_name_(library) {
    void* lib = open_lib(library);
    auto S = [&](const char* s) { return must_sym(lib, lib_name_, s); };
    set_ = reinterpret_cast<Res (*)(int)>(S("hipSetDevice"));
    wait_ = reinterpret_cast<Res (*)(void*, void*, uint32_t, unsigned, uint32_t)>(S("hipStreamWaitValue32"));
    write_ = reinterpret_cast<Res (*)(void*, void*, uint32_t, unsigned)>(S("hipStreamWriteValue32"));
    memcpy_ = reinterpret_cast<Res (*)(void*, const void*, size_t, int, void*)>(S("hipMemcpyAsync"));
    sync_ = reinterpret_cast<Res (*)(void*)>(S("hipStreamSynchronize"));
    ev_create_ = reinterpret_cast<Res (*)(void**, unsigned)>(S("hipEventCreateWithFlags"));
    ev_record_ = reinterpret_cast<Res (*)(void*, void*)>(S("hipEventRecord"));
    ev_wait_ = reinterpret_cast<Res (*)(void*, void*, unsigned)>(S("hipStreamWaitEvent"));
    ev_destroy_ = reinterpret_cast<Res (*)(void*)>(S("hipEventDestroy"));
    reg_ = reinterpret_cast<Res (*)(void*, size_t, unsigned)>(S("hipHostRegister"));
    unreg_ = reinterpret_cast<Res (*)(void*)>(S("hipHostUnregister"));
    devptr_ = reinterpret_cast<Res (*)(void**, void*, unsigned)>(S("hipHostGetDevicePointer"));
    attr_ = reinterpret_cast<Res (*)(int*, int, int)>(S("hipDeviceGetAttribute"));
    errstr_ = reinterpret_cast<const char* (*)(Res)>(S("hipGetErrorString"));
  }
  std::string name() const override { return "hip"; }
  void set_device(int index) override { check("hipSetDevice", set_(index)); }
  bool stream_mem_ops(int index) override {
    int v = 0;
    return attr_(&v, kAttrMemOps, index) == 0 && v != 0;
  }
  void wait_geq(void* stream, uint64_t word, uint32_t value) override {
    check("hipStreamWaitValue32",
          wait_(stream, reinterpret_cast<void*>(uintptr_t(word)), value, kWaitGte, 0xFFFFFFFFu));
  }
  void write(void* stream, uint64_t word, uint32_t value) override {
    check("hipStreamWriteValue32", write_(stream, reinterpret_cast<void*>(uintptr_t(word)), value, 0));
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    if (nbytes) check("hipMemcpyAsync", memcpy_(dst, src, nbytes, kMemcpyDefault, stream));
  }
  void sync(void* stream) override { check("hipStreamSynchronize", sync_(stream)); }
  void* event_create() override {
    void* ev = nullptr;
    check("hipEventCreateWithFlags", ev_create_(&ev, kEventNoTiming));
    return ev;
  }
  void event_record(void* event, void* stream) override { check("hipEventRecord", ev_record_(event, stream)); }
  void stream_wait_event(void* stream, void* event) override {
    check("hipStreamWaitEvent", ev_wait_(stream, event, 0));
  }
  void event_destroy(void* event) override { ev_destroy_(event); }
  bool host_register(void* p, size_t nbytes) override {
    Res r = reg_(p, nbytes, kRegPortableMapped);
    return r == 0 || r == kAlreadyRegistered;
  }
  void host_unregister(void* p) override { unreg_(p); }
  uint64_t device_address(void* host) override {
    void* d = nullptr;
    check("hipHostGetDevicePointer", devptr_(&d, host, 0));
    return uint64_t(reinterpret_cast<uintptr_t>(d));
  }

 private:
  void check(const char* what, Res r) {
    if (r == 0) return;
    const char* s = errstr_ ? errstr_(r) : nullptr;
    throw CommError(std::string("hetccl: ") + what + " failed: error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }
  std::string lib_name_;
  Res (*set_)(int);
  Res (*wait_)(void*, void*, uint32_t, unsigned, uint32_t);
  Res (*write_)(void*, void*, uint32_t, unsigned);
  Res (*memcpy_)(void*, const void*, size_t, int, void*);
  Res (*sync_)(void*);
  Res (*ev_create_)(void**, unsigned);
  Res (*ev_record_)(void*, void*);
  Res (*ev_wait_)(void*, void*, unsigned);
  Res (*ev_destroy_)(void*);
  Res (*reg_)(void*, size_t, unsigned);
  Res (*unreg_)(void*);
  Res (*devptr_)(void**, void*, unsigned);
  Res (*attr_)(int*, int, int);
  const char* (*errstr_)(Res);
};


// ----------------------------------------------------------------------------- emulated device
// A device whose "streams" are host threads executing their queued operations in order: waits
// spin on the word, copies are memcpy, writes are stores. It runs the engine's device protocol
// (positions, flag words, ring wrap-around, fork/join of the two streams, failure release) on a
// machine without a GPU, for tests; it is never chosen for real tensors.
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
  void wait_geq(void* stream, uint64_t word, uint32_t value) override {
    auto* w = reinterpret_cast<std::atomic<uint32_t>*>(uintptr_t(word));
    enqueue(stream, [w, value] {
      int spins = 0;
      while (int32_t(w->load(std::memory_order_acquire) - value) < 0)
        if (++spins > 64) sched_yield();
    });
  }
  void write(void* stream, uint64_t word, uint32_t value) override {
    auto* w = reinterpret_cast<std::atomic<uint32_t>*>(uintptr_t(word));
    enqueue(stream, [w, value] { w->store(value, std::memory_order_release); });
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    enqueue(stream, [dst, src, nbytes] { std::memcpy(dst, src, nbytes); });
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
  bool host_register(void*, size_t) override { return true; }
  void host_unregister(void*) override {}
  uint64_t device_address(void* host) override { return uint64_t(reinterpret_cast<uintptr_t>(host)); }

 private:
  void enqueue(void* stream, std::function<void()> op) {
    auto* s = static_cast<Stream*>(stream);
    {
      std::lock_guard<std::mutex> g(s->mu);
      s->q.push_back(std::move(op));
      ++s->queued;
    }
    s->cv.notify_one();
  }
  std::mutex mu_;
  std::vector<Stream*> streams_;
};

}  // namespace

void* emulated_stream(DeviceOps& ops) {
  auto* e = dynamic_cast<EmulatedOps*>(&ops);
  if (!e) throw CommError("hetccl: streams can be created only on the emulated device");
  return e->create_stream();
}

std::shared_ptr<DeviceOps> make_device_ops(const std::string& vendor, const std::string& library) {
  if (vendor == "cuda") return std::make_shared<CudaOps>(library);
  if (vendor == "hip") return std::make_shared<HipOps>(library);
  if (vendor == "emulated") return std::make_shared<EmulatedOps>();
  throw CommError("hetccl: unknown device runtime '" + vendor + "' (known: cuda, hip, emulated)");
}

}  // namespace hetccl
