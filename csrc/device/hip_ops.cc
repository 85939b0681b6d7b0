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
//
// The device route (device_ops.h; what ROCm documents for each call):
//   * kernels: reduce_kernels.cu's text (reduce_kernels_gen.h: reduce_kernels_source()) compiled
//     by hiprtc, HIP's runtime compiler, once per device and process, loaded with
//     hipModuleLoadData and looked up with hipModuleGetFunction (the sequence of ROCm's "HIP
//     runtime compiler" guide). The target: hiprtc takes --offload-arch= (or nvcc's
//     --gpu-architecture=, which it rewrites); the guide says the option "is compulsory if
//     compilation is done on a system without AMD GPUs supported by HIP runtime. Otherwise,
//     HIPRTC will load the hip runtime and gather the current device and its architecture info
//     and use it as option" -- hiprtc's source (RTCProgram::findIsa) dlopens libamdhip64.so(.N),
//     calls hipGetDevice and hipGetDeviceProperties and takes gcnArchName (with its feature
//     flags, e.g. gfx90a:sramecc+:xnack-). No option is passed here: the name is then read by
//     the hiprtc of the same ROCm release, whose hipDeviceProp_t layout it was built with (that
//     layout changed in 6.0, hipGetDevicePropertiesR0600), and the attributes that once carried
//     it (hipDeviceAttributeGcnArch / GcnArchName, 10003 / 10004 in 5.x) are unused slots in
//     7.x. prepare_kernels runs with the caller's device current on the calling thread, so
//     "the current device" is the one the kernels are for. Should hiprtc reach a different copy
//     of the HIP runtime (another device current there), the code object may be for another
//     target, which hipModuleLoadData is expected to refuse (no binary for the device): the
//     route stays off. Should hiprtc find no HIP runtime at all, it fails the compile ("Please
//     provide architecture"), which throws with its log: the route stays off;
//   * hiprtc's library: its own (libhiprtc.so.N) since ROCm 6.0, and the only home of its
//     symbols since 7.0 ("HIP API 7.0 changes": removed from libamdhip64); before 6.0 only
//     libamdhip64 exported it. Opened when the kernels are first prepared, so a ROCm without it
//     still opens this module (prepare_kernels then throws and the C API stays staged);
//   * launches: hipModuleLaunchKernel with the arguments in `extra` (HIP_LAUNCH_PARAM_BUFFER_
//     POINTER / _SIZE / _END, each argument naturally aligned): documented in both checked
//     generations, where ROCm 5.2's header still warns "kernelParams argument is not yet
//     implemented in HIP. Please use extra instead";
//   * streams: hipStreamCreateWithFlags(hipStreamNonBlocking): "does not implicitly synchronize
//     with null stream";
//   * scratch: hipMallocAsync / hipFreeAsync ("the allocation comes from the memory pool
//     associated with the stream's device"; beta in 5.2), on devices reporting
//     hipDeviceAttributeMemoryPoolsSupported; never a size of 0 (5.6 changed what it returns)
//     nor a free of NULL (an error before 7.0).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "errors.h"
#include "hip_api.h"
#include "kernels/reduce_kernels_gen.h"
#include "program.h"
#include "runtime.h"

namespace hetccl {
namespace device {
namespace {

using Api = hip::Api<hip::OpaqueTypes>;

// The kernels' argument blocks, as the kernels declare them (reduce_kernels.cu): every member
// 8 bytes, so the layout is the naturally aligned one HIP requires of `extra`.
struct ReduceArgs {
  void* d;
  const void* s;
  unsigned long long n;
};
struct DivArgs {
  void* d;
  unsigned long long n;
  long long by;
};
struct MulArgs {
  void* d;
  unsigned long long n;
  const void* sp;
  unsigned long long imm;
};
static_assert(sizeof(ReduceArgs) == 24 && sizeof(DivArgs) == 24 && sizeof(MulArgs) == 32,
              "kernel arguments are packed 8-byte members");

class HipOps final : public DeviceOps {
  using Res = Api::Error;
  using RtcRes = Api::RtcResult;

 public:
  explicit HipOps(const std::string& library) : lib_name_(library) {
    lib_ = open_library(library);
#define HETCCL_HIP_RESOLVE(hip_name, type) \
  hip_name##_ = reinterpret_cast<Api::type*>(must_symbol(lib_, lib_name_, #hip_name));
    HETCCL_HIP_FUNCTIONS(HETCCL_HIP_RESOLVE)
#undef HETCCL_HIP_RESOLVE
    // the device route's: optional (device_route() answers whether all are there)
#define HETCCL_HIP_RESOLVE_OPTIONAL(hip_name, type) \
  hip_name##_ = reinterpret_cast<Api::type*>(symbol_or_null(lib_, #hip_name));
    HETCCL_HIP_ROUTE_FUNCTIONS(HETCCL_HIP_RESOLVE_OPTIONAL)
#undef HETCCL_HIP_RESOLVE_OPTIONAL
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

  // ---- the device route (the calls and what ROCm documents for them: top of this file)
  bool device_route() override {
    bool all = true;
#define HETCCL_HIP_PRESENT(hip_name, type) all = all && hip_name##_ != nullptr;
    HETCCL_HIP_ROUTE_FUNCTIONS(HETCCL_HIP_PRESENT)
#undef HETCCL_HIP_PRESENT
    return all;
  }
  int current_device() override {
    int dev = 0;
    check("hipGetDevice", hipGetDevice_(&dev));
    return dev;
  }
  void prepare_kernels() override {
    if (!device_route())
      unsupported("device route (a HIP runtime without stream-ordered allocation or module launches)");
    int dev = current_device();
    std::lock_guard<std::mutex> g(modules_mu());
    if (modules().count(dev)) return;
    int pools = 0;
    if (hipDeviceGetAttribute_(&pools, int(hip::kAttrMemoryPoolsSupported), dev) != int(hip::kSuccess) || !pools)
      throw CommError("hetccl: HIP device " + std::to_string(dev) +
                      " has no stream-ordered memory pools (hipDeviceAttributeMemoryPoolsSupported): the device "
                      "route's scratch needs hipMallocAsync");
    open_hiprtc();
    Module m;
    m.code = compile_kernels(dev);
    check("hipModuleLoadData (hetccl's reduction kernels)", hipModuleLoadData_(&m.module, m.code.data()));
    try {
      auto fn = [&](const std::string& name) {
        void* f = nullptr;
        check(("hipModuleGetFunction " + name).c_str(), hipModuleGetFunction_(&f, m.module, name.c_str()));
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
      warm_up(m);
    } catch (...) {
      hipModuleUnload_(m.module);
      throw;
    }
    modules()[dev] = std::move(m);  // the code object's buffer moves with it (HIP may keep using it)
  }
  void* stream_create() override {
    void* s = nullptr;
    check("hipStreamCreateWithFlags(hipStreamNonBlocking)",
          hipStreamCreateWithFlags_(&s, unsigned(hip::kStreamNonBlocking)));
    return s;
  }
  void stream_destroy(void* stream) override { hipStreamDestroy_(stream); }
  void* mem_alloc_async(size_t nbytes, void* stream) override {
    void* p = nullptr;
    check("hipMallocAsync", hipMallocAsync_(&p, nbytes ? nbytes : 1, stream));
    return p;
  }
  void mem_free_async(void* p, void* stream) override {
    if (p) check("hipFreeAsync", hipFreeAsync_(p, stream));
  }
  void reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) override {
    require_kernel_dtype(dt);
    if (!count) return;
    int o = op == ReduceOp::AVG ? 0 : int(op);  // AVG reduces as SUM (reduce.h)
    ReduceArgs a{dst, src, count};
    launch(kernels().reduce[int(dt)][o], count, &a, sizeof a, stream);
  }
  void scale_div(void* p, size_t count, DType dt, int64_t by, void* stream) override {
    require_kernel_dtype(dt);
    if (!count || by == 1) return;
    DivArgs a{p, count, by};
    launch(kernels().div[int(dt)], count, &a, sizeof a, stream);
  }
  void scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                 void* stream) override {
    require_kernel_dtype(dt);
    if (!count) return;
    MulArgs a{p, count, scalar_dev, 0};
    if (!scalar_dev) std::memcpy(&a.imm, scalar_host, dtype_size(dt));
    launch(kernels().mul[int(dt)], count, &a, sizeof a, stream);
  }
  bool program_route() override { return device_route(); }
  void launch_program(void* stream, void*, uint64_t slot_dev, void* bar, uint32_t blocks) override {
    launch_program_fn(kernels().program, stream, slot_dev, bar, blocks);
  }
  bool wide_words() const override { return true; }  // 64-bit counters (device_ops.h)

 private:
  void check(const char* what, Res r) {
    if (r == int(hip::kSuccess)) return;
    const char* s = hipGetErrorString_ ? hipGetErrorString_(r) : nullptr;
    throw CommError(std::string("hetccl: ") + what + " failed: error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }
  void check_rtc(const std::string& what, RtcRes r) {
    if (r == int(hip::kRtcSuccess)) return;
    const char* s = hiprtcGetErrorString_ ? hiprtcGetErrorString_(r) : nullptr;
    throw CommError("hetccl: " + what + " failed: hiprtc error " + std::to_string(r) + " (" +
                    (s ? s : "unknown") + ")");
  }

  // ---- the device route's kernels
  static constexpr int kDtypes = kKernelDtypes;  // device_ops.h
  struct Module {
    std::vector<char> code;  // hiprtc's code object, kept while the module lives
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
      throw CommError("hetccl: the reduction kernels are not loaded on HIP device " + std::to_string(dev) +
                      " (prepare_kernels was not called there)");
    return it->second;
  }
  // hiprtc, looked for in this order: a copy the process already loaded (the framework's); one
  // beside this HIP runtime (same ROCm release: ROCm's lib folder, torch's wheel); this HIP
  // runtime itself (ROCm before 7.0 exports hiprtc from libamdhip64); the loader's search path.
  // Under modules_mu().
  void open_hiprtc() {
    if (rtc_) return;
    static const char* names[] = {"libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5"};
    std::vector<std::string> plain(std::begin(names), std::end(names)), beside;
    std::string dir = library_dir(lib_);
    if (!dir.empty())
      for (const auto& n : plain) beside.push_back(dir + "/" + n);
    std::string why, where = "hiprtc";  // where: the library's name in messages
    void* rtc = loaded_library(plain);
    if (!rtc && !beside.empty()) {
      rtc = load_first_library(beside, &why);
      where = "hiprtc in " + dir;
    }
    if (!rtc && symbol_or_null(lib_, "hiprtcCompileProgram")) {
      rtc = lib_;
      where = lib_name_;
    }
    if (!rtc) {
      rtc = load_first_library(plain, &why);
      where = "hiprtc";
    }
    if (!rtc)
      throw CommError("hetccl: HIP's runtime compiler (hiprtc), which builds the device route's kernels, was "
                      "not found: none loaded, none beside " + lib_name_ + " and none in it (ROCm 7.0 and "
                      "later ship it apart), none on the loader's path (" + why + ")");
#define HETCCL_HIPRTC_RESOLVE(hip_name, type) \
  hip_name##_ = reinterpret_cast<Api::type*>(must_symbol(rtc, where, #hip_name));
    HETCCL_HIPRTC_FUNCTIONS(HETCCL_HIPRTC_RESOLVE)
#undef HETCCL_HIPRTC_RESOLVE
    rtc_ = rtc;
  }
  // reduce_kernels.cu compiled for the current device (no --offload-arch: top of this file).
  std::vector<char> compile_kernels(int dev) {
    Api::RtcProgram prog = nullptr;
    check_rtc("hiprtcCreateProgram", hiprtcCreateProgram_(&prog, device::reduce_kernels_source(),
                                                          "reduce_kernels.cu", 0, nullptr, nullptr));
    struct Destroy {
      HipOps* self;
      Api::RtcProgram* prog;
      ~Destroy() { self->hiprtcDestroyProgram_(prog); }
    } destroy{this, &prog};
    RtcRes r = hiprtcCompileProgram_(prog, 0, nullptr);
    if (r != int(hip::kRtcSuccess)) {
      size_t n = 0;
      std::string log;
      if (hiprtcGetProgramLogSize_(prog, &n) == int(hip::kRtcSuccess) && n) {
        log.assign(n, '\0');
        if (hiprtcGetProgramLog_(prog, &log[0]) != int(hip::kRtcSuccess)) log.clear();
        log.resize(std::strlen(log.c_str()));
      }
      const char* s = hiprtcGetErrorString_(r);
      throw CommError("hetccl: hiprtc could not compile hetccl's reduction kernels (reduce_kernels.cu) for HIP "
                      "device " + std::to_string(dev) + ": hiprtc error " + std::to_string(r) + " (" +
                      (s ? s : "unknown") + "); its log:\n" + (log.empty() ? "(empty)" : log));
    }
    size_t size = 0;
    check_rtc("hiprtcGetCodeSize", hiprtcGetCodeSize_(prog, &size));
    std::vector<char> code(size);
    check_rtc("hiprtcGetCode", hiprtcGetCode_(prog, code.data()));
    return code;
  }
  // One launch of each kernel (n = 0) on an idle stream of our own, synchronized, so that
  // whatever HIP loads lazily is loaded here and never behind a stream that waits on an engine
  // word (prepare_kernels' contract).
  void warm_up(const Module& m) {
    void* s = stream_create();
    try {
      for (int t = 0; t < kDtypes; ++t) {
        ReduceArgs r{nullptr, nullptr, 0};
        for (int o = 0; o < 4; ++o) launch(m.reduce[t][o], 1, &r, sizeof r, s);
        DivArgs d{nullptr, 0, 1};
        launch(m.div[t], 1, &d, sizeof d, s);
        MulArgs x{nullptr, 0, nullptr, 0};
        launch(m.mul[t], 1, &x, sizeof x, s);
      }
      check("hipStreamSynchronize", hipStreamSynchronize_(s));
      // the program kernel on an aborted, empty slot (it ends at once and writes its fin word)
      std::vector<char> page(sizeof(program::Slot) + 4096, 0);
      auto* slot = reinterpret_cast<program::Slot*>((uintptr_t(page.data()) + 4095) & ~uintptr_t(4095));
      if (!host_register(slot, sizeof(program::Slot)))
        throw CommError("hetccl: hipHostRegister refused the device program's warm-up slot");
      try {
        uint64_t dev_slot = device_address(slot);
        slot->abort = 1;
        slot->wide = 1;
        slot->fin_addr = dev_slot + offsetof(program::Slot, spare);
        launch_program_fn(m.program, s, dev_slot, nullptr, 1);
        check("hipStreamSynchronize", hipStreamSynchronize_(s));
      } catch (...) {
        host_unregister(slot);
        throw;
      }
      host_unregister(slot);
    } catch (...) {
      stream_destroy(s);
      throw;
    }
    stream_destroy(s);
  }
  void launch_program_fn(void* f, void* stream, uint64_t slot_dev, void* bar, uint32_t blocks) {
    struct {
      uint64_t slot;
      void* bar;
      uint64_t blocks;
    } a{slot_dev, bar, blocks};  // the kernel's parameters (u64*, u32*, u64), naturally aligned
    size_t nbytes = sizeof a;
    void* extra[] = {reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamBufferPointer)), &a,
                     reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamBufferSize)), &nbytes,
                     reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamEnd))};
    check("hipModuleLaunchKernel (hetccl_program)",
          hipModuleLaunchKernel_(f, program::kGroups * blocks, 1, 1, program::kThreads, 1, 1, 0, stream, nullptr,
                                 extra));
  }
  // Grid-stride kernels: 256 threads a block, at most 4096 blocks (cuda_ops.cc's grid); the
  // arguments as one naturally aligned block in `extra`.
  void launch(void* f, size_t count, void* args, size_t nbytes, void* stream) {
    unsigned blocks = unsigned(std::min<size_t>(4096, std::max<size_t>(1, (count + 1023) / 1024)));
    void* extra[] = {reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamBufferPointer)), args,
                     reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamBufferSize)), &nbytes,
                     reinterpret_cast<void*>(uintptr_t(hip::kLaunchParamEnd))};
    check("hipModuleLaunchKernel", hipModuleLaunchKernel_(f, blocks, 1, 1, 256, 1, 1, 0, stream, nullptr, extra));
  }

  std::string lib_name_;
  void* lib_ = nullptr;
  void* rtc_ = nullptr;  // hiprtc's library, once open_hiprtc found it
#define HETCCL_HIP_MEMBER(hip_name, type) Api::type* hip_name##_ = nullptr;
  HETCCL_HIP_FUNCTIONS(HETCCL_HIP_MEMBER)
  HETCCL_HIP_ROUTE_FUNCTIONS(HETCCL_HIP_MEMBER)
  HETCCL_HIPRTC_FUNCTIONS(HETCCL_HIP_MEMBER)
#undef HETCCL_HIP_MEMBER
};

}  // namespace

std::shared_ptr<DeviceOps> make_hip_ops(const std::string& library) {
  return std::make_shared<HipOps>(library);
}

}  // namespace device
}  // namespace hetccl
