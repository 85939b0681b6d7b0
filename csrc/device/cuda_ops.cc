// The CUDA runtime module (NVIDIA): the CUDA driver API behind DeviceOps (device_ops.h),
// resolved with dlsym from the libcuda the framework already loaded. Nothing here is compiled
// against a vendor header: the few types and constants used are spelled out below, from cuda.h.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "errors.h"
#include "kernels/reduce_kernels_gen.h"
#include "program.h"
#include "runtime.h"

namespace hetccl {
namespace device {
namespace {

class CudaOps final : public DeviceOps {
  using Res = int;  // CUresult
  using Ptr = unsigned long long;  // CUdeviceptr
  static constexpr unsigned kWaitGeq = 0x0;           // CU_STREAM_WAIT_VALUE_GEQ
  static constexpr unsigned kWriteDefault = 0x0;      // CU_STREAM_WRITE_VALUE_DEFAULT
  static constexpr unsigned kRegPortableMapped = 0x3; // CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
  static constexpr unsigned kEventNoTiming = 0x2;     // CU_EVENT_DISABLE_TIMING
  static constexpr Res kAlreadyRegistered = 712;      // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
  static constexpr unsigned kStreamNonBlocking = 0x1; // CU_STREAM_NON_BLOCKING

 public:
  explicit CudaOps(const std::string& library) : lib_name_(library) {
    void* lib = open_library(library);
    auto S = [&](const char* s) { return must_symbol(lib, lib_name_, s); };
    init_ = reinterpret_cast<Res (*)(unsigned)>(S("cuInit"));
    device_get_ = reinterpret_cast<Res (*)(int*, int)>(S("cuDeviceGet"));
    primary_retain_ = reinterpret_cast<Res (*)(void**, int)>(S("cuDevicePrimaryCtxRetain"));
    ctx_set_ = reinterpret_cast<Res (*)(void*)>(S("cuCtxSetCurrent"));
    ctx_get_ = reinterpret_cast<Res (*)(void**)>(S("cuCtxGetCurrent"));
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
    capturing_ = reinterpret_cast<Res (*)(void*, int*)>(S("cuStreamIsCapturing"));
    check("cuInit", init_(0));
    // The device route's calls: optional, so that a driver without them still runs the rest
    // (device_route() then answers false and the C API stages through host memory).
    auto O = [&](const char* s) { return symbol_or_null(lib, s); };
    ctx_device_ = reinterpret_cast<Res (*)(int*)>(O("cuCtxGetDevice"));
    stream_create_ = reinterpret_cast<Res (*)(void**, unsigned)>(O("cuStreamCreate"));
    stream_destroy_ = reinterpret_cast<Res (*)(void*)>(O("cuStreamDestroy_v2"));
    alloc_async_ = reinterpret_cast<Res (*)(Ptr*, size_t, void*)>(O("cuMemAllocAsync"));
    free_async_ = reinterpret_cast<Res (*)(Ptr, void*)>(O("cuMemFreeAsync"));
    module_load_ = reinterpret_cast<Res (*)(void**, const void*)>(O("cuModuleLoadData"));
    module_fn_ = reinterpret_cast<Res (*)(void**, void*, const char*)>(O("cuModuleGetFunction"));
    launch_ = reinterpret_cast<Res (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                       unsigned, void*, void**, void**)>(O("cuLaunchKernel"));
  }
  std::string name() const override { return "cuda"; }
  std::string memory_type() const override { return "cuda"; }

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
    // The _v2 entry points work on current drivers even where the V1 attribute
    // (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1) reads 0 (seen on the H200 box, driver
    // 580); their presence was checked when the library was opened. A driver that refuses them
    // fails the first wait with a clear error.
    (void)index;
    return true;
  }
  // 32-bit operations on the low half of the counter: GEQ is documented wrap-aware,
  // (int32_t)(*addr - value) >= 0 (device_ops.h).
  void wait_geq(void* stream, uint64_t word, uint64_t counter) override {
    check("cuStreamWaitValue32_v2", wait_(stream, Ptr(word), uint32_t(counter), kWaitGeq));
  }
  void write(void* stream, uint64_t word, uint64_t counter) override {
    check("cuStreamWriteValue32_v2", write_(stream, Ptr(word), uint32_t(counter), kWriteDefault));
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    if (nbytes)
      check("cuMemcpyAsync", memcpy_(Ptr(reinterpret_cast<uintptr_t>(dst)),
                                     Ptr(reinterpret_cast<uintptr_t>(src)), nbytes, stream));
  }
  bool capturing(void* stream) override {
    int status = 0;  // CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
    check("cuStreamIsCapturing", capturing_(stream, &status));
    return status != 0;
  }
  void* default_stream() override { return reinterpret_cast<void*>(uintptr_t(0x1)); }  // CU_STREAM_LEGACY
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

  // ---- the device route: the kernels of reduce_kernels.cu as embedded PTX, which the driver
  // compiles for this GPU when the module is loaded (once per device, in prepare_kernels).
  bool device_route() override {
    return ctx_device_ && stream_create_ && stream_destroy_ && alloc_async_ && free_async_ && module_load_ &&
           module_fn_ && launch_;
  }
  int current_device() override {
    int dev = 0;
    check("cuCtxGetDevice", ctx_device_(&dev));
    return dev;
  }
  void prepare_kernels() override {
    if (!device_route()) unsupported("device route (a driver older than CUDA 11.2)");
    int dev = current_device();
    std::lock_guard<std::mutex> g(modules_mu());
    if (modules().count(dev)) return;
    Module m;
    check("cuModuleLoadData (hetccl's reduction kernels)", module_load_(&m.module, device::reduce_kernels_ptx()));
    auto fn = [&](const std::string& name) {
      void* f = nullptr;
      check(("cuModuleGetFunction " + name).c_str(), module_fn_(&f, m.module, name.c_str()));
      return f;
    };
    static const char* ops[] = {"sum", "prod", "min", "max"};
    for (int t = 0; t < kDtypes; ++t) {
      std::string dn = dtype_name(DType(t));
      for (int o = 0; o < 4; ++o) m.reduce[t][o] = fn("hetccl_reduce_" + dn + "_" + ops[o]);
      m.div[t] = fn("hetccl_div_" + dn);
      m.mul[t] = fn("hetccl_mul_" + dn);
    }
    m.program = fn("hetccl_program");
    // One launch of each on an idle stream of our own, so that lazy loading (the driver's
    // default) finishes here and never behind a stream that waits on an engine word.
    void* s = nullptr;
    check("cuStreamCreate", stream_create_(&s, kStreamNonBlocking));
    unsigned long long zero = 0;
    long long one = 1;
    void* null = nullptr;
    for (int t = 0; t < kDtypes; ++t) {
      for (int o = 0; o < 4; ++o) {
        void* args[] = {&null, &null, &zero};
        launch(m.reduce[t][o], 1, args, s);
      }
      void* dargs[] = {&null, &zero, &one};
      launch(m.div[t], 1, dargs, s);
      void* margs[] = {&null, &zero, &null, &zero};
      launch(m.mul[t], 1, margs, s);
    }
    // the program kernel on an aborted, empty slot (it ends at once and writes its fin word)
    void* page = nullptr;
    if (posix_memalign(&page, 4096, sizeof(program::Slot)) != 0) throw CommError("hetccl: out of memory");
    std::memset(page, 0, sizeof(program::Slot));
    auto* slot = static_cast<program::Slot*>(page);
    try {
      check("cuMemHostRegister", reg_(page, sizeof(program::Slot), kRegPortableMapped));
      uint64_t dev_slot = device_address(page);
      slot->abort = 1;
      slot->fin_addr = dev_slot + offsetof(program::Slot, spare);
      launch_program_fn(m.program, s, dev_slot, nullptr, 1);
      check("cuStreamSynchronize", sync_(s));
      unreg_(page);
    } catch (...) {
      unreg_(page);  // (an error if it was not registered: nothing to undo)
      std::free(page);
      stream_destroy_(s);
      throw;
    }
    std::free(page);
    stream_destroy_(s);
    modules()[dev] = m;
  }
  bool program_route() override { return device_route(); }
  void launch_program(void* stream, void*, uint64_t slot_dev, void* bar, uint32_t blocks) override {
    launch_program_fn(kernels().program, stream, slot_dev, bar, blocks);
  }
  void* stream_create() override {
    void* s = nullptr;
    check("cuStreamCreate", stream_create_(&s, kStreamNonBlocking));
    return s;
  }
  void stream_destroy(void* stream) override { stream_destroy_(stream); }
  void* mem_alloc_async(size_t nbytes, void* stream) override {
    Ptr p = 0;
    check("cuMemAllocAsync", alloc_async_(&p, nbytes ? nbytes : 1, stream));
    return reinterpret_cast<void*>(uintptr_t(p));
  }
  void mem_free_async(void* p, void* stream) override {
    check("cuMemFreeAsync", free_async_(Ptr(reinterpret_cast<uintptr_t>(p)), stream));
  }
  void reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) override {
    require_kernel_dtype(dt);
    if (!count) return;
    int o = op == ReduceOp::AVG ? 0 : int(op);  // AVG reduces as SUM (reduce.h)
    unsigned long long n = count;
    void* args[] = {&dst, const_cast<void**>(&src), &n};
    launch(kernels().reduce[int(dt)][o], count, args, stream);
  }
  void scale_div(void* p, size_t count, DType dt, int64_t by, void* stream) override {
    require_kernel_dtype(dt);
    if (!count || by == 1) return;
    unsigned long long n = count;
    long long b = by;
    void* args[] = {&p, &n, &b};
    launch(kernels().div[int(dt)], count, args, stream);
  }
  void scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                 void* stream) override {
    require_kernel_dtype(dt);
    if (!count) return;
    unsigned long long n = count, imm = 0;
    if (!scalar_dev) std::memcpy(&imm, scalar_host, dtype_size(dt));
    void* args[] = {&p, &n, const_cast<void**>(&scalar_dev), &imm};
    launch(kernels().mul[int(dt)], count, args, stream);
  }

 private:
  void check(const char* what, Res r) {
    if (r == 0) return;
    const char* s = nullptr;
    errstr_(r, &s);
    throw CommError(std::string("hetccl: ") + what + " failed: error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }
  static constexpr int kDtypes = kKernelDtypes;  // device_ops.h
  struct Module {
    void* module = nullptr;
    void* reduce[kDtypes][4] = {};
    void* div[kDtypes] = {};
    void* mul[kDtypes] = {};
    void* program = nullptr;
  };
  // Loaded once per device and process, whichever module instance asks first: every later
  // communicator finds them, so no module is ever loaded while a stream of an earlier one is
  // blocked on an engine word (prepare_kernels' contract).
  static std::map<int, Module>& modules() {
    static std::map<int, Module> m;
    return m;
  }
  static std::mutex& modules_mu() {
    static std::mutex m;
    return m;
  }
  const Module& kernels() {
    int dev = current_device();
    std::lock_guard<std::mutex> g(modules_mu());
    auto it = modules().find(dev);
    if (it == modules().end())
      throw CommError("hetccl: the reduction kernels are not loaded on device " + std::to_string(dev) +
                      " (prepare_kernels was not called there)");
    return it->second;
  }
  void launch_program_fn(void* f, void* stream, uint64_t slot_dev, void* bar, uint32_t blocks) {
    unsigned long long a = slot_dev;
    unsigned long long b = blocks;
    void* args[] = {&a, &bar, &b};
    check("cuLaunchKernel (hetccl_program)",
          launch_(f, program::kGroups * blocks, 1, 1, program::kThreads, 1, 1, 0, stream, args, nullptr));
  }
  // Grid-stride kernels: 256 threads a block, at most 4096 blocks (enough to fill any GPU).
  void launch(void* f, size_t count, void** args, void* stream) {
    unsigned blocks = unsigned(std::min<size_t>(4096, std::max<size_t>(1, (count + 1023) / 1024)));
    check("cuLaunchKernel", launch_(f, blocks, 1, 1, 256, 1, 1, 0, stream, args, nullptr));
  }
  std::string lib_name_;
  std::mutex mu_;
  std::vector<void*> ctx_;
  Res (*init_)(unsigned);
  Res (*device_get_)(int*, int);
  Res (*primary_retain_)(void**, int);
  Res (*ctx_set_)(void*);
  Res (*ctx_get_)(void**);
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
  Res (*capturing_)(void*, int*);
  Res (*ctx_device_)(int*) = nullptr;
  Res (*stream_create_)(void**, unsigned) = nullptr;
  Res (*stream_destroy_)(void*) = nullptr;
  Res (*alloc_async_)(Ptr*, size_t, void*) = nullptr;
  Res (*free_async_)(Ptr, void*) = nullptr;
  Res (*module_load_)(void**, const void*) = nullptr;
  Res (*module_fn_)(void**, void*, const char*) = nullptr;
  Res (*launch_)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                 void**) = nullptr;
};

}  // namespace

std::shared_ptr<DeviceOps> make_cuda_ops(const std::string& library) {
  return std::make_shared<CudaOps>(library);
}

}  // namespace device
}  // namespace hetccl
