// hetccl engine: the one seam for vendor device runtimes (CUDA driver API, HIP runtime).
//
// The engine moves device data between vendors through pinned host memory with operations it
// enqueues on the caller's streams at issue time. Those operations are the only vendor calls in
// the C++ core, and they live behind this table, one implementation per vendor (device_ops.cc):
//   * stream memory operations: a stream waits until a 32-bit word in pinned host memory reaches
//     a value (wait_geq), or writes a word after the work queued before it (write) -- the
//     engine's proxy thread reads and writes the same words from the host, so the proxy never
//     calls the vendor runtime itself (no lock shared with kernel launches or lazy module
//     loading; the stream is what waits, never a host thread);
//   * asynchronous copies on a stream (device <-> pinned host, unified addressing);
//   * events (record / stream waits on them) to fork and join the engine's copy streams;
//   * page-locking existing host memory (the shared-memory rings, the engine's flag words) and
//     the device address of pinned host memory.
// The library is the one the framework already loaded (Python finds its path: libcuda for CUDA,
// libamdhip64 for ROCm/HIP), opened with dlopen, so there is no link-time dependency and no
// second copy of a runtime. Every failing call throws CommError naming the call and the
// runtime's error string. Handles (streams, events) are opaque pointers as the runtime gives
// them (torch's stream.cuda_stream is the same handle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace hetccl {

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual std::string name() const = 0;  // "cuda" or "hip"
  // Makes device `index` current on the calling thread (the thread that enqueues).
  virtual void set_device(int index) = 0;
  // Whether stream memory operations work on this device; false means the engine drives device
  // plans from the issuing thread instead (slower, host-blocking, same protocol).
  virtual bool stream_mem_ops(int index) = 0;
  // Stream waits until (int32_t)(*word - value) >= 0 (CUDA) / *word >= value (HIP). `word` is a
  // device address of pinned host memory (device_address()).
  virtual void wait_geq(void* stream, uint64_t word, uint32_t value) = 0;
  // Stream writes value to the word once the work queued before it is done (with a memory
  // barrier: the data it wrote before is visible first).
  virtual void write(void* stream, uint64_t word, uint32_t value) = 0;
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
};

// Opens the vendor runtime at `library` ("cuda": a libcuda path; "hip": a libamdhip64 path).
// Throws CommError when the library or a required symbol is missing. "emulated" (tests only)
// is a device whose streams are host threads running their operations in order, so the
// engine's device protocol runs on machines without a GPU; emulated_stream() makes a stream.
std::shared_ptr<DeviceOps> make_device_ops(const std::string& vendor, const std::string& library);
void* emulated_stream(DeviceOps& ops);

}  // namespace hetccl
