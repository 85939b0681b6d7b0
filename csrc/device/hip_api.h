// Every HIP declaration hetccl relies on, in one place, without including a HIP header (the
// runtime is opened with dlopen: no build- or link-time dependency on ROCm). Each constant names
// the HIP identifier it stands for, and each function type is written over a type set, so one
// table serves twice:
//   * hip_ops.cc instantiates it over OpaqueTypes (int for hipError_t and the enums, void* for
//     handles) and resolves the functions by name with dlsym;
//   * tests/hip_api_check.cc instantiates it over the real HIP types with
//     <hip/hip_runtime_api.h> and <hip/hiprtc.h> included, and static_asserts that every function
//     type is exactly the header's prototype, every constant the header's value, and every opaque
//     type the size and kind of the real one (tests/test_hip_api.py compiles it against the ROCm
//     headers and compares the same table, exported by hetccl._C.runtime_api("hip"), with the
//     generated bindings of a current ROCm: cyhip.pxd for HIP, cyhiprtc.pxd for hiprtc).
// Four tables: HIP's constants and functions (libamdhip64; the device route's functions are
// optional, so that a HIP runtime without them still opens), and hiprtc's (HIP's runtime
// compiler, its own library since ROCm 6.0 and the only home of its symbols since 7.0).
// Values are from ROCm's hip_runtime_api.h and hiprtc.h; both checked generations (5.2 headers,
// 7.x bindings) agree on every one of them, and on every prototype but the two that ROCm 7.0
// changed (Strings below; docs/gpu.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hetccl {
namespace hip {

// constant name in HIP, hetccl's name, value. HIP_LAUNCH_PARAM_* are pointer-valued macros in
// the headers ((void*)0x01 ...): the values here are those pointers' integers.
#define HETCCL_HIP_CONSTANTS(X)                                                              \
  X(hipSuccess, kSuccess, 0)                                                                 \
  X(hipErrorHostMemoryAlreadyRegistered, kErrorHostMemoryAlreadyRegistered, 712)             \
  X(hipDeviceAttributeCanUseStreamWaitValue, kAttrCanUseStreamWaitValue, 10013)              \
  X(hipStreamWaitValueGte, kStreamWaitValueGte, 0x0)                                         \
  X(hipHostRegisterPortable, kHostRegisterPortable, 0x1)                                     \
  X(hipHostRegisterMapped, kHostRegisterMapped, 0x2)                                         \
  X(hipEventDisableTiming, kEventDisableTiming, 0x2)                                         \
  X(hipMemcpyDefault, kMemcpyDefault, 4)                                                     \
  X(hipMallocSignalMemory, kMallocSignalMemory, 0x2)                                         \
  X(hipStreamNonBlocking, kStreamNonBlocking, 0x1)                                           \
  X(hipDeviceAttributeMemoryPoolsSupported, kAttrMemoryPoolsSupported, 88)                   \
  X(HIP_LAUNCH_PARAM_BUFFER_POINTER, kLaunchParamBufferPointer, 0x1)                         \
  X(HIP_LAUNCH_PARAM_BUFFER_SIZE, kLaunchParamBufferSize, 0x2)                               \
  X(HIP_LAUNCH_PARAM_END, kLaunchParamEnd, 0x3)

// hiprtc's constants (hip/hiprtc.h)
#define HETCCL_HIPRTC_CONSTANTS(X) \
  X(HIPRTC_SUCCESS, kRtcSuccess, 0)

#define HETCCL_HIP_DECLARE_CONSTANT(hip_name, name, value) constexpr long long name = value;
HETCCL_HIP_CONSTANTS(HETCCL_HIP_DECLARE_CONSTANT)
HETCCL_HIPRTC_CONSTANTS(HETCCL_HIP_DECLARE_CONSTANT)
#undef HETCCL_HIP_DECLARE_CONSTANT

// The types hetccl uses in place of HIP's: sizes and kinds must match (checked).
struct OpaqueTypes {
  using Error = int;        // hipError_t (an enum)
  using Stream = void*;     // hipStream_t (ihipStream_t*)
  using Event = void*;      // hipEvent_t (ihipEvent_t*)
  using MemcpyKind = int;   // hipMemcpyKind (an enum)
  using DeviceAttr = int;   // hipDeviceAttribute_t (an enum)
  using CaptureStatus = int;  // hipStreamCaptureStatus (an enum: 0 none, 1 active, 2 invalidated)
  using Size = size_t;      // size_t (a type of its own here only so the table can spell it)
  using Module = void*;     // hipModule_t (ihipModule_t*)
  using Function = void*;   // hipFunction_t (ihipModuleSymbol_t*)
  using RtcResult = int;    // hiprtcResult (an enum)
  using RtcProgram = void*; // hiprtcProgram (_hiprtcProgram*)
  // The arrays of strings hiprtc takes (options, headers, include names): const char** until
  // ROCm 7.0, const char* const* since ("HIP API 7.0 changes": the same ABI, a pointer to
  // pointers to char; hetccl passes arrays that are valid for either).
  using Strings = const char* const*;
};

// function name in HIP, hetccl's type name (required: the module does not open without them)
#define HETCCL_HIP_FUNCTIONS(X)                         \
  X(hipSetDevice, SetDevice)                            \
  X(hipDeviceGetAttribute, DeviceGetAttribute)          \
  X(hipStreamWaitValue64, StreamWaitValue64)            \
  X(hipStreamWriteValue64, StreamWriteValue64)          \
  X(hipMemcpyAsync, MemcpyAsync)                        \
  X(hipStreamSynchronize, StreamSynchronize)            \
  X(hipEventCreateWithFlags, EventCreateWithFlags)      \
  X(hipEventRecord, EventRecord)                        \
  X(hipStreamWaitEvent, StreamWaitEvent)                \
  X(hipEventDestroy, EventDestroy)                      \
  X(hipHostRegister, HostRegister)                      \
  X(hipHostUnregister, HostUnregister)                  \
  X(hipHostGetDevicePointer, HostGetDevicePointer)      \
  X(hipExtMallocWithFlags, ExtMallocWithFlags)          \
  X(hipFree, Free)                                      \
  X(hipGetErrorString, GetErrorString)                  \
  X(hipStreamIsCapturing, StreamIsCapturing)

// The device route's HIP functions (device_ops.h): resolved if present; a runtime that lacks one
// has no device route (calls stay staged through host memory).
#define HETCCL_HIP_ROUTE_FUNCTIONS(X)                   \
  X(hipGetDevice, GetDevice)                            \
  X(hipStreamCreateWithFlags, StreamCreateWithFlags)    \
  X(hipStreamDestroy, StreamDestroy)                    \
  X(hipMallocAsync, MallocAsync)                        \
  X(hipFreeAsync, FreeAsync)                            \
  X(hipModuleLoadData, ModuleLoadData)                  \
  X(hipModuleGetFunction, ModuleGetFunction)            \
  X(hipModuleLaunchKernel, ModuleLaunchKernel)          \
  X(hipModuleUnload, ModuleUnload)

// hiprtc's functions (libhiprtc; in libamdhip64 too before ROCm 7.0), resolved when the kernels
// are first prepared.
#define HETCCL_HIPRTC_FUNCTIONS(X)                      \
  X(hiprtcCreateProgram, RtcCreateProgram)              \
  X(hiprtcCompileProgram, RtcCompileProgram)            \
  X(hiprtcGetProgramLogSize, RtcGetProgramLogSize)      \
  X(hiprtcGetProgramLog, RtcGetProgramLog)              \
  X(hiprtcGetCodeSize, RtcGetCodeSize)                  \
  X(hiprtcGetCode, RtcGetCode)                          \
  X(hiprtcDestroyProgram, RtcDestroyProgram)            \
  X(hiprtcGetErrorString, RtcGetErrorString)

template <class T>
struct Api {
  using Error = typename T::Error;
  using Stream = typename T::Stream;
  using Event = typename T::Event;
  using Size = typename T::Size;
  using SetDevice = Error(int);
  using DeviceGetAttribute = Error(int*, typename T::DeviceAttr, int);
  using StreamWaitValue64 = Error(Stream, void*, uint64_t, unsigned int, uint64_t);
  using StreamWriteValue64 = Error(Stream, void*, uint64_t, unsigned int);
  using MemcpyAsync = Error(void*, const void*, Size, typename T::MemcpyKind, Stream);
  using StreamSynchronize = Error(Stream);
  using EventCreateWithFlags = Error(Event*, unsigned);
  using EventRecord = Error(Event, Stream);
  using StreamWaitEvent = Error(Stream, Event, unsigned int);
  using EventDestroy = Error(Event);
  using HostRegister = Error(void*, Size, unsigned int);
  using HostUnregister = Error(void*);
  using HostGetDevicePointer = Error(void**, void*, unsigned int);
  using ExtMallocWithFlags = Error(void**, Size, unsigned int);
  using Free = Error(void*);
  using GetErrorString = const char*(Error);
  using StreamIsCapturing = Error(Stream, typename T::CaptureStatus*);
  // the device route
  using Module = typename T::Module;
  using Function = typename T::Function;
  using GetDevice = Error(int*);
  using StreamCreateWithFlags = Error(Stream*, unsigned int);
  using StreamDestroy = Error(Stream);
  using MallocAsync = Error(void**, Size, Stream);
  using FreeAsync = Error(void*, Stream);
  using ModuleLoadData = Error(Module*, const void*);
  using ModuleGetFunction = Error(Function*, Module, const char*);
  using ModuleUnload = Error(Module);
  using ModuleLaunchKernel = Error(Function, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, Stream, void**, void**);
  // hiprtc
  using RtcResult = typename T::RtcResult;
  using RtcProgram = typename T::RtcProgram;
  using Strings = typename T::Strings;
  using RtcCreateProgram = RtcResult(RtcProgram*, const char*, const char*, int, Strings, Strings);
  using RtcCompileProgram = RtcResult(RtcProgram, int, Strings);
  using RtcGetProgramLogSize = RtcResult(RtcProgram, Size*);
  using RtcGetProgramLog = RtcResult(RtcProgram, char*);
  using RtcGetCodeSize = RtcResult(RtcProgram, Size*);
  using RtcGetCode = RtcResult(RtcProgram, char*);
  using RtcDestroyProgram = RtcResult(RtcProgram*);
  using RtcGetErrorString = const char*(RtcResult);
};

}  // namespace hip
}  // namespace hetccl

#include <map>
#include <string>
#include <vector>

namespace hetccl {
namespace hip {
// The tables above as data (hetccl._C.runtime_api("hip"), for tests/test_hip_api.py): constant
// name -> value; function name -> [return type, parameter types...] in hetccl's spelling
// ("Error", "Stream", "Event", "MemcpyKind", "DeviceAttr", "CaptureStatus", "Module", "Function",
// "RtcResult", "RtcProgram", C types otherwise). hiprtc's names start with "hiprtc" / "HIPRTC",
// as ROCm names them.
std::map<std::string, long long> constants();
std::map<std::string, std::vector<std::string>> functions();
}  // namespace hip
}  // namespace hetccl
