// A stand-in for libamdhip64, built by tests/test_hip_api.py against ROCm's own HIP headers (so
// every function has the header's exact prototype), for running the HIP runtime module
// (csrc/device/hip_ops.cc) on a machine without an AMD GPU. It implements only what the module
// calls, on the host: "streams" run their operations at once (a wait evaluates HIP's documented
// condition, *ptr & mask >= value, and records whether it held), copies are memcpy, signal
// memory is host memory. Every call is appended to a log that the test reads back through
// fake_hip_log(), so the test checks what the module asked HIP for (attributes, flags, sizes,
// widths), not only that it ran.
#include <hip/hip_runtime_api.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {
std::string g_log;
int g_wait_value_attr = 1;  // what hipDeviceAttributeCanUseStreamWaitValue reads
void log_call(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_call(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_log += buf;
  g_log += "\n";
}
}  // namespace

extern "C" {
const char* fake_hip_log() { return g_log.c_str(); }
void fake_hip_reset(int wait_value_attr) {
  g_log.clear();
  g_wait_value_attr = wait_value_attr;
}
}

hipError_t hipSetDevice(int deviceId) {
  log_call("hipSetDevice %d", deviceId);
  return deviceId < 0 ? hipErrorInvalidDevice : hipSuccess;
}
hipError_t hipDeviceGetAttribute(int* pi, hipDeviceAttribute_t attr, int deviceId) {
  log_call("hipDeviceGetAttribute %d %d", int(attr), deviceId);
  if (attr == hipDeviceAttributeCanUseStreamWaitValue) {
    *pi = g_wait_value_attr;
    return hipSuccess;
  }
  *pi = 0;
  return hipErrorInvalidValue;
}
hipError_t hipStreamWaitValue64(hipStream_t stream, void* ptr, uint64_t value, unsigned int flags,
                                uint64_t mask) {
  uint64_t now = *static_cast<volatile uint64_t*>(ptr);
  bool held = flags == hipStreamWaitValueGte && (now & mask) >= value;
  log_call("hipStreamWaitValue64 %p %llu flags=%u mask=%llx held=%d", ptr,
           (unsigned long long)value, flags, (unsigned long long)mask, int(held));
  return hipSuccess;
}
hipError_t hipStreamWriteValue64(hipStream_t stream, void* ptr, uint64_t value, unsigned int flags) {
  *static_cast<volatile uint64_t*>(ptr) = value;
  log_call("hipStreamWriteValue64 %p %llu", ptr, (unsigned long long)value);
  return hipSuccess;
}
hipError_t hipMemcpyAsync(void* dst, const void* src, size_t sizeBytes, hipMemcpyKind kind,
                          hipStream_t stream) {
  std::memcpy(dst, src, sizeBytes);
  log_call("hipMemcpyAsync %zu kind=%d", sizeBytes, int(kind));
  return hipSuccess;
}
hipError_t hipStreamSynchronize(hipStream_t stream) {
  log_call("hipStreamSynchronize");
  return hipSuccess;
}
hipError_t hipEventCreateWithFlags(hipEvent_t* event, unsigned flags) {
  static int dummy;
  *event = reinterpret_cast<hipEvent_t>(&dummy);
  log_call("hipEventCreateWithFlags flags=%u", flags);
  return hipSuccess;
}
hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
  log_call("hipEventRecord");
  return hipSuccess;
}
hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned int flags) {
  log_call("hipStreamWaitEvent flags=%u", flags);
  return hipSuccess;
}
hipError_t hipEventDestroy(hipEvent_t event) {
  log_call("hipEventDestroy");
  return hipSuccess;
}
hipError_t hipHostRegister(void* hostPtr, size_t sizeBytes, unsigned int flags) {
  log_call("hipHostRegister %zu flags=%u", sizeBytes, flags);
  return hipSuccess;
}
hipError_t hipHostUnregister(void* hostPtr) {
  log_call("hipHostUnregister");
  return hipSuccess;
}
hipError_t hipHostGetDevicePointer(void** devPtr, void* hstPtr, unsigned int flags) {
  *devPtr = hstPtr;  // unified addressing, as on ROCm
  log_call("hipHostGetDevicePointer flags=%u", flags);
  return hipSuccess;
}
hipError_t hipExtMallocWithFlags(void** ptr, size_t sizeBytes, unsigned int flags) {
  log_call("hipExtMallocWithFlags %zu flags=%u", sizeBytes, flags);
  if (flags == hipMallocSignalMemory && sizeBytes != 8) return hipErrorInvalidValue;
  *ptr = std::calloc(1, sizeBytes);
  return *ptr ? hipSuccess : hipErrorOutOfMemory;
}
hipError_t hipFree(void* ptr) {
  log_call("hipFree");
  std::free(ptr);
  return hipSuccess;
}
hipError_t hipStreamIsCapturing(hipStream_t stream, hipStreamCaptureStatus* status) {
  log_call("hipStreamIsCapturing");
  *status = hipStreamCaptureStatusNone;
  return hipSuccess;
}
const char* hipGetErrorString(hipError_t hipError) {
  return hipError == hipErrorInvalidDevice ? "invalid device ordinal (fake)" : "fake error";
}
