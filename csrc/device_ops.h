// hetccl engine: the one seam for vendor device runtimes. One module per runtime, each holding
// everything vendor-specific about it (csrc/device/):
//   cuda_ops.cc      the CUDA driver API (NVIDIA), libcuda
//   hip_ops.cc       the HIP runtime (AMD, ROCm), libamdhip64, and hiprtc for the device route's
//                    kernels; declarations in hip_api.h, checked against ROCm's own headers and
//                    bindings (tests/test_hip_api.py)
//   emulated_ops.cc  host threads as streams (tests: the engine's device protocol without a GPU,
//                    with CUDA's or HIP's comparison rules)
//   registry.cc      make_device_ops: runtime name -> module
// Nothing else in the C++ core names a vendor.
//
// The engine moves device data between vendors through pinned host memory with operations it
// enqueues on the caller's streams at issue time. Those operations are the only vendor calls in
// the C++ core:
//   * stream memory operations: a stream waits until a flag word reaches a position (wait_geq),
//     or writes a word after the work queued before it (write) -- the engine's proxy thread
//     reads and writes the same words from the host, so the proxy never calls the vendor
//     runtime itself (no lock shared with kernel launches or lazy module loading; the stream is
//     what waits, never a host thread);
//   * asynchronous copies on a stream (device <-> pinned host, unified addressing);
//   * events (record / stream waits on them) to fork and join the engine's copy streams;
//   * page-locking existing host memory (the shared-memory rings, the engine's flag pages) and
//     the device address of pinned host memory;
//   * memory for the words streams wait on, where the runtime documents its own kind of memory
//     for them (HIP: signal memory).
// The library is the one the framework already loaded (Python's device seam finds its path),
// opened with dlopen, so there is no link-time dependency and no second copy of a runtime.
// Every failing call throws CommError naming the call and the runtime's error string. Handles
// (streams, events) are opaque pointers as the runtime gives them (torch's stream handle is the
// same pointer).
//
// Flag words and positions (the contract every runtime implements alike). A flag word is a
// 64-bit counter in host memory, 8-byte aligned, whose low 32 bits are the engine's free-running
// 32-bit position; the engine extends a position to the counter value nearest the word's current
// counter (engine_internal.h: Word::counter), so counter and position agree as long as the two are within
// 2^31 positions of each other (the engine keeps far fewer in flight). Comparisons:
//   CUDA: cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_GEQ on the low 32 bits, which the CUDA
//         driver API documents as (int32_t)(*addr - value) >= 0: wrap-aware; writes are 32-bit
//         (cuStreamWriteValue32) to the low half.
//   HIP:  hipStreamWaitValue64 with hipStreamWaitValueGte on the whole counter (HIP documents
//         *ptr & mask >= value, unsigned, not wrap-aware, so the 32-bit form would break when
//         positions cross 2^32; a 64-bit counter does not wrap); writes are 64-bit.
//   emulated: either rule, chosen when opened ("cuda" or "hip").
// All three therefore implement "the word's position has reached value, wrap-aware".
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"
#include "reduce.h"

namespace hetccl {

// The dtypes the device kernels reduce (reduce_kernels.cu): reduce.h's DType values 0..7. The C
// API keeps UINT32/UINT64 (its unsigned MIN/MAX/AVG) off the device route; a call that reaches a
// kernel with one anyway is refused here rather than indexed out of range (every runtime module
// and the device programs' recorder call it).
constexpr int kKernelDtypes = 8;
inline void require_kernel_dtype(DType dt) {
  if (int(dt) < 0 || int(dt) >= kKernelDtypes)
    throw CommError(std::string("hetccl: no device reduction kernel for ") + dtype_name(dt));
}

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual std::string name() const = 0;  // "cuda", "hip" or "emulated"
  // The memory type a transport declares for this runtime's device buffers ("cuda", "rocm", or
  // "host" for the emulated device: its "device memory" is host memory).
  virtual std::string memory_type() const = 0;
  // Makes device `index` current on the calling thread (the thread that enqueues).
  virtual void set_device(int index) = 0;
  // Whether stream memory operations work on this device; false means the engine drives device
  // plans from the issuing thread instead (slower, host-blocking, same protocol).
  virtual bool stream_mem_ops(int index) = 0;
  // Stream waits until the flag word at device address `word` has reached `counter` (the
  // contract above: wrap-aware on the low 32 bits, or unsigned on the 64-bit counter).
  virtual void wait_geq(void* stream, uint64_t word, uint64_t counter) = 0;
  // Stream writes `counter` to the word once the work queued before it is done (with a memory
  // barrier: the data it wrote before is visible first). 32-bit runtimes write the low half.
  virtual void write(void* stream, uint64_t word, uint64_t counter) = 0;
  virtual void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) = 0;
  virtual void sync(void* stream) = 0;
  virtual void* event_create() = 0;
  virtual void event_record(void* event, void* stream) = 0;
  virtual void stream_wait_event(void* stream, void* event) = 0;
  virtual void event_destroy(void* event) = 0;
  // Page-locks host memory for device copies (portable, device-mapped); false if refused.
  virtual bool host_register(void* p, size_t nbytes) = 0;
  virtual void host_unregister(void* p) = 0;
  virtual uint64_t device_address(void* host) = 0;
  // An 8-byte, 8-aligned word, readable and writable by the host, for a stream to wait on, where
  // the runtime requires its own memory for that (HIP: hipExtMallocWithFlags with
  // hipMallocSignalMemory); nullptr means any registered host memory will do (the engine's flag
  // page). wait_word_address gives the address to pass to wait_geq / write.
  virtual void* wait_word_alloc() { return nullptr; }
  virtual uint64_t wait_word_address(void* w) { return device_address(w); }
  virtual void wait_word_free(void* w) {}
  // The handle of the device's default stream for the calling thread's device (what a NULL
  // stream means to the vendor's runtime API): CUDA's driver API names it CU_STREAM_LEGACY
  // ((CUstream)0x1), HIP takes the null handle itself, the emulated device has one stream of
  // its own.
  virtual void* default_stream() { return nullptr; }
  // Whether the stream is capturing a graph now. Work that a host thread must play its part in
  // (the C API's stream path) cannot be replayed from a graph, so such calls are refused while
  // capturing. CUDA asks the driver (cuStreamIsCapturing), HIP the runtime
  // (hipStreamIsCapturing); the emulated device has no graphs.
  virtual bool capturing(void* stream) { return false; }

  // ---- The device route (csrc/api/device_route.h): collectives of the C API whose data stays
  // in device memory, moved by engine device plans on streams of the route's own and reduced
  // by kernels of this runtime. A module that lacks these answers device_route() false, and
  // the C API then stages such calls through host memory instead (stream_path.h).
  virtual bool device_route() { return false; }
  // Loads what the kernels need on the current device, once, before any stream of this process
  // waits on a word of the engine: a module loaded while a stream is blocked on a stream
  // memory operation can deadlock (lazy loading waits for the device: docs/gpu.md). Called on
  // the thread that issues the first call of a communicator, with the caller's device current.
  virtual void prepare_kernels() { unsupported("prepare_kernels"); }
  // The device whose context is current on the calling thread (the caller's stream's device).
  virtual int current_device() { return 0; }
  // A stream of the current device that does not synchronize with the legacy default stream.
  virtual void* stream_create() { unsupported("stream_create"); }
  virtual void stream_destroy(void* stream) { unsupported("stream_destroy"); }
  // Stream-ordered device memory of the current device: usable by work enqueued on `stream`
  // after the call (the pointer is known at once), given back in stream order (the runtime's
  // pool reuses it without a host synchronisation).
  virtual void* mem_alloc_async(size_t nbytes, void* stream) { unsupported("mem_alloc_async"); }
  virtual void mem_free_async(void* p, void* stream) { unsupported("mem_free_async"); }
  // Kernels on `stream`, reduce.h's contract and arithmetic (reduce_kernels.cu):
  // dst[i] = dst[i] op src[i] (AVG reduces as SUM); p[i] /= n (AVG's last step); p[i] *= scalar
  // (PreMulSum's local step), the scalar read when the stream runs from device-accessible
  // memory at scalar_dev, or, when that is null, its bytes taken now from scalar_host.
  virtual void reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) {
    unsupported("reduce");
  }
  virtual void scale_div(void* p, size_t count, DType dt, int64_t n, void* stream) { unsupported("scale_div"); }
  virtual void scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                         void* stream) {
    unsupported("scale_mul");
  }

  // ---- Device programs (device/program.h): a device-route call as one launch on the caller's
  // stream, whose kernel takes its instructions from a pinned slot as the executor writes them.
  // A module that answers false keeps the route's stream operations (device_route.h).
  virtual bool program_route() { return false; }
  // Launches the program kernel of `slot` (pinned and registered; slot_dev: its device address)
  // on `stream`: `blocks` blocks per group (program::kGroups) of program::kThreads threads;
  // `bar`: the group barriers' zeroed device memory (program::kGroups * 32 uint32), left as
  // found (unused for one block).
  virtual void launch_program(void* stream, void* slot, uint64_t slot_dev, void* bar, uint32_t blocks) {
    unsupported("launch_program");
  }
  // The words' rule (the contract above): true for 64-bit counters (HIP's), false for the low
  // 32 bits, wrap-aware (CUDA's).
  virtual bool wide_words() const { return false; }

 protected:
  [[noreturn]] void unsupported(const char* what) const {
    throw CommError("hetccl: the " + name() + " device runtime module has no " + what);
  }
};

// Opens a runtime by name: "cuda" (library: a libcuda path; "": libcuda.so.1), "hip" (a
// libamdhip64 path; "": libamdhip64.so), "emulated-hip" (the emulated device with HIP's rule), or
// "emulated" (tests only; library "" or "cuda": CUDA's comparison rule, "hip": HIP's, with
// separately allocated wait words as HIP's signal memory) -- a device whose streams are host
// threads running their operations in order, so the engine's device protocol runs on machines
// without a GPU; emulated_stream() makes a stream. Throws CommError when the library or a
// required symbol is missing, or the name is unknown.
std::shared_ptr<DeviceOps> make_device_ops(const std::string& runtime, const std::string& library);
// The runtime a face opens when it is not told which (the C API's HETCCL_CAPI_DEVICE unset):
// CUDA's (the drop-in RCCL sets HETCCL_CAPI_DEVICE for its own).
const char* default_device_runtime();
// Whether this process has already loaded the runtime's library (a GPU process), without
// loading it; false for the emulated device and for unknown names.
bool device_runtime_loaded(const std::string& runtime, const std::string& library);

// The vendor declarations a runtime module uses, as data, for tests that check them against the
// vendor's own definitions (tests/test_hip_api.py): constant name -> value, function name ->
// [return type, parameter types...]. Only "hip" has such a table (the CUDA module's few are
// exercised on the GPU box); CommError for others.
struct RuntimeApi {
  std::map<std::string, long long> constants;
  std::map<std::string, std::vector<std::string>> functions;
};
RuntimeApi runtime_api(const std::string& runtime);
void* emulated_stream(DeviceOps& ops);

}  // namespace hetccl
