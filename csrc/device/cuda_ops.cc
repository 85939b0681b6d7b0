// The CUDA runtime module (NVIDIA): the CUDA driver API behind DeviceOps (device_ops.h),
// resolved with dlsym from the libcuda the framework already loaded. Nothing here is compiled
// against a vendor header: the few types and constants used are spelled out below, from cuda.h.
#include <mutex>
#include <string>
#include <vector>

#include "errors.h"
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
};

}  // namespace

std::shared_ptr<DeviceOps> make_cuda_ops(const std::string& library) {
  return std::make_shared<CudaOps>(library);
}

}  // namespace device
}  // namespace hetccl
