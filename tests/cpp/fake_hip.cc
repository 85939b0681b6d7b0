// A stand-in for libamdhip64, built by tests/test_hip_api.py against ROCm's own HIP headers (so
// every function has the header's exact prototype), for running the HIP runtime module
// (csrc/device/hip_ops.cc) on a machine without an AMD GPU. It implements only what the module
// calls, on the host: "streams" run their operations at once (a wait evaluates HIP's documented
// condition, *ptr & mask >= value, and records whether it held), copies are memcpy, signal
// memory is host memory. Every call is appended to a log that the test reads back through
// fake_hip_log(), so the test checks what the module asked HIP for (attributes, flags, sizes,
// widths), not only that it ran.
// The device route's calls: streams are tokens, stream-ordered memory is host memory, a module
// is the code object of tests/cpp/fake_hiprtc.cc (the kernel names it found in the source it
// was given), and a launch checks its configuration and decodes the argument block passed in
// `extra` (nothing is executed). Where the test puts fake_hiprtc.cc decides what ROCm is
// simulated: its own libhiprtc.so beside this library (ROCm 7), or built into this library
// (before 7.0, libamdhip64 exported hiprtc), or absent.
#include <hip/hip_runtime_api.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>
#include <sstream>
#include <string>

namespace {
std::string g_log;
int g_wait_value_attr = 1;  // what hipDeviceAttributeCanUseStreamWaitValue reads
int g_pools = 1;            // what hipDeviceAttributeMemoryPoolsSupported reads
thread_local int g_device = 0;  // hipSetDevice / hipGetDevice (per thread, as HIP's)
std::set<void*> g_streams;
const char kCodeMagic[] = "FAKE-HIPRTC-CODE\n";  // fake_hiprtc.cc's code objects begin so
struct FakeModule {
  std::set<std::string> kernels;
};
struct FakeFunction {
  std::string name;
};
std::deque<FakeModule> g_modules;
std::deque<FakeFunction> g_functions;
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
void fake_hip_set_pools(int supported) { g_pools = supported; }
}

hipError_t hipSetDevice(int deviceId) {
  log_call("hipSetDevice %d", deviceId);
  if (deviceId < 0) return hipErrorInvalidDevice;
  g_device = deviceId;
  return hipSuccess;
}
hipError_t hipGetDevice(int* deviceId) {  // a query: not logged (the module asks at every launch)
  *deviceId = g_device;
  return hipSuccess;
}
hipError_t hipDeviceGetAttribute(int* pi, hipDeviceAttribute_t attr, int deviceId) {
  log_call("hipDeviceGetAttribute %d %d", int(attr), deviceId);
  if (attr == hipDeviceAttributeCanUseStreamWaitValue) {
    *pi = g_wait_value_attr;
    return hipSuccess;
  }
  if (attr == hipDeviceAttributeMemoryPoolsSupported) {
    *pi = g_pools;
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
  log_call("hipStreamSynchronize %p", (void*)stream);
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

// ---- the device route
hipError_t hipStreamCreateWithFlags(hipStream_t* stream, unsigned int flags) {
  *stream = reinterpret_cast<hipStream_t>(new int(0));
  g_streams.insert(*stream);
  log_call("hipStreamCreateWithFlags flags=%u -> %p", flags, (void*)*stream);
  return hipSuccess;
}
hipError_t hipStreamDestroy(hipStream_t stream) {
  log_call("hipStreamDestroy %p", (void*)stream);
  if (!g_streams.erase(stream)) return hipErrorInvalidHandle;
  delete reinterpret_cast<int*>(stream);
  return hipSuccess;
}
#ifndef FAKE_HIP_NO_MALLOC_ASYNC  // defined: a HIP runtime without stream-ordered allocation
hipError_t hipMallocAsync(void** dev_ptr, size_t size, hipStream_t stream) {
  *dev_ptr = std::calloc(1, size ? size : 1);
  log_call("hipMallocAsync %zu stream=%p -> %p", size, (void*)stream, *dev_ptr);
  return *dev_ptr ? hipSuccess : hipErrorOutOfMemory;
}
hipError_t hipFreeAsync(void* dev_ptr, hipStream_t stream) {
  log_call("hipFreeAsync %p stream=%p", dev_ptr, (void*)stream);
  if (!dev_ptr) return hipErrorInvalidValue;  // before ROCm 7.0 ("HIP API 7.0 changes")
  std::free(dev_ptr);
  return hipSuccess;
}
#endif
hipError_t hipModuleLoadData(hipModule_t* module, const void* image) {
  const char* text = static_cast<const char*>(image);
  if (!text || std::strncmp(text, kCodeMagic, sizeof kCodeMagic - 1) != 0) {
    log_call("hipModuleLoadData (not a code object of fake_hiprtc)");
    return hipErrorInvalidImage;
  }
  g_modules.emplace_back();
  std::istringstream names(text + sizeof kCodeMagic - 1);
  for (std::string n; std::getline(names, n);)
    if (!n.empty()) g_modules.back().kernels.insert(n);
  *module = reinterpret_cast<hipModule_t>(&g_modules.back());
  log_call("hipModuleLoadData %zu kernels", g_modules.back().kernels.size());
  return hipSuccess;
}
hipError_t hipModuleGetFunction(hipFunction_t* function, hipModule_t module, const char* kname) {
  log_call("hipModuleGetFunction %s", kname);
  auto* m = reinterpret_cast<FakeModule*>(module);
  if (!m || !m->kernels.count(kname)) return hipErrorNotFound;
  g_functions.push_back({kname});
  *function = reinterpret_cast<hipFunction_t>(&g_functions.back());
  return hipSuccess;
}
hipError_t hipModuleUnload(hipModule_t module) {
  log_call("hipModuleUnload");
  return hipSuccess;
}
// Logs "hipModuleLaunchKernel <kernel> grid=X,Y,Z block=X,Y,Z shared=S stream=P args=<bytes>:
// <each 8-byte word>"; refuses what HIP refuses (a zero grid or block dimension, more than 1024
// threads a block) and anything but the documented `extra` form.
hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX,
                                 unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, hipStream_t stream,
                                 void** kernelParams, void** extra) {
  auto* fn = reinterpret_cast<FakeFunction*>(f);
  if (!fn || !gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ ||
      blockDimX * blockDimY * blockDimZ > 1024)
    return hipErrorInvalidValue;
  if (kernelParams || !extra || extra[0] != HIP_LAUNCH_PARAM_BUFFER_POINTER ||
      extra[2] != HIP_LAUNCH_PARAM_BUFFER_SIZE || extra[4] != HIP_LAUNCH_PARAM_END) {
    log_call("hipModuleLaunchKernel %s: arguments not in extra's documented form", fn->name.c_str());
    return hipErrorInvalidValue;
  }
  size_t size = *static_cast<size_t*>(extra[3]);
  std::string words;
  for (size_t i = 0; i + 8 <= size; i += 8) {
    uint64_t w;
    std::memcpy(&w, static_cast<const char*>(extra[1]) + i, 8);
    char buf[32];
    std::snprintf(buf, sizeof buf, " %llx", (unsigned long long)w);
    words += buf;
  }
  log_call("hipModuleLaunchKernel %s grid=%u,%u,%u block=%u,%u,%u shared=%u stream=%p args=%zu:%s",
           fn->name.c_str(), gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
           sharedMemBytes, (void*)stream, size, words.c_str());
  return hipSuccess;
}
