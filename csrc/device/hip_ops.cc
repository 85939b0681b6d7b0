// The HIP runtime module (AMD, ROCm): the HIP runtime behind DeviceOps (device_ops.h), resolved
// with dlsym from the libamdhip64 the framework already loaded. Every declaration used is in
// hip_api.h, checked against ROCm's own headers and bindings (tests/test_hip_api.py). Compiled
// and checked here; never executed on AMD hardware (docs/gpu.md says what that leaves open).
//
// What HIP documents and this module follows:
//   * hipStreamWaitValue32/64: "ptr: pointer to memory object allocated using the
//     hipMallocSignalMemory flag" -- the words streams wait on come from
//     hipExtMallocWithFlags(&p, 8, hipMallocSignalMemory) (wait_word_alloc), not from registered
//     host pages; the words streams only write (hipStreamWriteValue64: "a GPU accessible memory
//     object") stay in the engine's registered flag page;
//   * hipStreamWaitValueGte is "*ptr & mask >= value", unsigned: waits use the 64-bit form on the
//     engine's 64-bit counters, which do not wrap (device_ops.h);
//   * support for the wait/write value operations is the device attribute
//     hipDeviceAttributeCanUseStreamWaitValue (not hipDeviceAttributeCooperativeLaunch = 10,
//     which an earlier version of this code queried).
// Assumption not verifiable without the hardware: the host reads and writes signal memory with
// plain atomic loads and stores (the proxy does so), as ROCr keeps a signal's value in
// host-coherent system memory.
#include <string>

#include "errors.h"
#include "hip_api.h"
#include "runtime.h"

namespace hetccl {
namespace device {
namespace {

using Api = hip::Api<hip::OpaqueTypes>;

class HipOps final : public DeviceOps {
  using Res = Api::Error;

 public:
  explicit HipOps(const std::string& library) : lib_name_(library) {
    void* lib = open_library(library);
#define HETCCL_HIP_RESOLVE(hip_name, type) \
  hip_name##_ = reinterpret_cast<Api::type*>(must_symbol(lib, lib_name_, #hip_name));
    HETCCL_HIP_FUNCTIONS(HETCCL_HIP_RESOLVE)
#undef HETCCL_HIP_RESOLVE
  }
  std::string name() const override { return "hip"; }
  std::string memory_type() const override { return "rocm"; }
  void set_device(int index) override { check("hipSetDevice", hipSetDevice_(index)); }
  bool stream_mem_ops(int index) override {
    int v = 0;
    return hipDeviceGetAttribute_(&v, int(hip::kAttrCanUseStreamWaitValue), index) ==
               int(hip::kSuccess) &&
           v != 0;
  }
  bool capturing(void* stream) override {
    int status = 0;  // hipStreamCaptureStatus
    check("hipStreamIsCapturing", hipStreamIsCapturing_(stream, &status));
    return status != 0;
  }
  void wait_geq(void* stream, uint64_t word, uint64_t counter) override {
    check("hipStreamWaitValue64",
          hipStreamWaitValue64_(stream, reinterpret_cast<void*>(uintptr_t(word)), counter,
                                unsigned(hip::kStreamWaitValueGte), ~uint64_t(0)));
  }
  void write(void* stream, uint64_t word, uint64_t counter) override {
    check("hipStreamWriteValue64",
          hipStreamWriteValue64_(stream, reinterpret_cast<void*>(uintptr_t(word)), counter, 0));
  }
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override {
    if (nbytes)
      check("hipMemcpyAsync",
            hipMemcpyAsync_(dst, src, nbytes, int(hip::kMemcpyDefault), stream));
  }
  void sync(void* stream) override { check("hipStreamSynchronize", hipStreamSynchronize_(stream)); }
  void* event_create() override {
    void* ev = nullptr;
    check("hipEventCreateWithFlags",
          hipEventCreateWithFlags_(&ev, unsigned(hip::kEventDisableTiming)));
    return ev;
  }
  void event_record(void* event, void* stream) override {
    check("hipEventRecord", hipEventRecord_(event, stream));
  }
  void stream_wait_event(void* stream, void* event) override {
    check("hipStreamWaitEvent", hipStreamWaitEvent_(stream, event, 0));
  }
  void event_destroy(void* event) override { hipEventDestroy_(event); }
  bool host_register(void* p, size_t nbytes) override {
    Res r = hipHostRegister_(p, nbytes,
                             unsigned(hip::kHostRegisterPortable | hip::kHostRegisterMapped));
    return r == int(hip::kSuccess) || r == int(hip::kErrorHostMemoryAlreadyRegistered);
  }
  void host_unregister(void* p) override { hipHostUnregister_(p); }
  uint64_t device_address(void* host) override {
    void* d = nullptr;
    check("hipHostGetDevicePointer", hipHostGetDevicePointer_(&d, host, 0));
    return uint64_t(reinterpret_cast<uintptr_t>(d));
  }
  void* wait_word_alloc() override {
    void* p = nullptr;
    check("hipExtMallocWithFlags(hipMallocSignalMemory)",
          hipExtMallocWithFlags_(&p, 8, unsigned(hip::kMallocSignalMemory)));
    return p;
  }
  // Signal memory is addressed by the pointer HIP returned, on the host and in stream operations.
  uint64_t wait_word_address(void* w) override { return uint64_t(reinterpret_cast<uintptr_t>(w)); }
  void wait_word_free(void* w) override { hipFree_(w); }

 private:
  void check(const char* what, Res r) {
    if (r == int(hip::kSuccess)) return;
    const char* s = hipGetErrorString_ ? hipGetErrorString_(r) : nullptr;
    throw CommError(std::string("hetccl: ") + what + " failed: error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }
  std::string lib_name_;
#define HETCCL_HIP_MEMBER(hip_name, type) Api::type* hip_name##_ = nullptr;
  HETCCL_HIP_FUNCTIONS(HETCCL_HIP_MEMBER)
#undef HETCCL_HIP_MEMBER
};

}  // namespace

std::shared_ptr<DeviceOps> make_hip_ops(const std::string& library) {
  return std::make_shared<HipOps>(library);
}

}  // namespace device
}  // namespace hetccl
