// Compiled by tests/test_hip_api.py against ROCm's own HIP headers (no GPU, no HIP library
// needed: nothing is linked or run beyond main's count): every declaration of
// csrc/device/hip_api.h must be exactly what the headers declare, or this fails to compile.
//   * constants: the value of the HIP identifier each one names (for the pointer-valued
//     HIP_LAUNCH_PARAM_* macros, the integer in the macro's own text: a pointer cast is not a
//     constant expression);
//   * opaque types: the size, alignment and kind (enum / pointer) of the HIP type;
//   * functions: the table's function type over the real HIP types is the header's prototype --
//     each function is declared again, extern "C" at global scope, with the table's type: C
//     functions cannot be overloaded, so any difference in parameter or return types is a hard
//     error (std::is_same on decltype(::name) cannot be used: the C++ headers overload some
//     names, e.g. hipMallocAsync with T** templates) -- and hetccl's opaque instantiation has the
//     same size and kind parameter for parameter. hiprtc's from <hip/hiprtc.h> alike.
// Prints how many declarations it checked.
#include <hip/hip_runtime_api.h>
#include <hip/hiprtc.h>

#include <cstdio>
#include <type_traits>

#include "device/hip_api.h"

namespace {
struct RealTypes {
  using Error = hipError_t;
  using Stream = hipStream_t;
  using Event = hipEvent_t;
  using MemcpyKind = hipMemcpyKind;
  using DeviceAttr = hipDeviceAttribute_t;
  using Size = size_t;
  using CaptureStatus = hipStreamCaptureStatus;
  using Module = hipModule_t;
  using Function = hipFunction_t;
  using RtcResult = hiprtcResult;
  using RtcProgram = hiprtcProgram;
  // ROCm 7.0 changed hiprtcCreateProgram's and hiprtcCompileProgram's string arrays from
  // const char** to const char* const* ("HIP API 7.0 changes"): each generation's headers are
  // held to their own spelling (hetccl's opaque type is ABI-checked against both).
#if HIP_VERSION_MAJOR >= 7
  using Strings = const char* const*;
#else
  using Strings = const char**;
#endif
};
using Real = hetccl::hip::Api<RealTypes>;
using Opaque = hetccl::hip::Api<hetccl::hip::OpaqueTypes>;

// An opaque stand-in is ABI-compatible with the HIP type it replaces.
template <class O, class R>
constexpr bool same_abi() {
  return sizeof(O) == sizeof(R) && alignof(O) == alignof(R) &&
         (std::is_enum<R>::value ? std::is_integral<O>::value
          : std::is_pointer<R>::value ? std::is_pointer<O>::value
                                      : std::is_same<O, R>::value);
}
#define CHECK_TYPE(name, real) \
  static_assert(same_abi<hetccl::hip::OpaqueTypes::name, real>(), #real);
#define HETCCL_HIP_TYPES(X)                      \
  X(Error, hipError_t)                           \
  X(Stream, hipStream_t)                         \
  X(Event, hipEvent_t)                           \
  X(MemcpyKind, hipMemcpyKind)                   \
  X(DeviceAttr, hipDeviceAttribute_t)            \
  X(CaptureStatus, hipStreamCaptureStatus)       \
  X(Module, hipModule_t)                         \
  X(Function, hipFunction_t)                     \
  X(RtcResult, hiprtcResult)                     \
  X(RtcProgram, hiprtcProgram)                   \
  X(Strings, RealTypes::Strings)
HETCCL_HIP_TYPES(CHECK_TYPE)
#undef CHECK_TYPE
constexpr int kTypes = 0
#define COUNT_TYPE(name, real) +1
    HETCCL_HIP_TYPES(COUNT_TYPE)
#undef COUNT_TYPE
    ;

// Parameter-by-parameter ABI equality of the opaque and the real function types.
template <class F, class G> struct SameAbiFn : std::false_type {};
template <class R1, class... A1, class R2, class... A2>
struct SameAbiFn<R1(A1...), R2(A2...)>
    : std::integral_constant<bool, sizeof...(A1) == sizeof...(A2) && same_abi<R1, R2>() &&
                                       (same_abi<A1, A2>() && ...)> {};

// The value a constant stands for: an enumerator or integer macro as itself; a pointer-valued
// macro ((void*)0x01) as the integer literal in its expansion, read from the text. Anything
// else reads as -1, which no table value is, so an unexpected form fails the check.
constexpr long long digit(char c) {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}
constexpr long long pointer_literal(const char* s) {
  const char* cast = "((void*)";
  for (int i = 0; cast[i]; ++i)
    if (s[i] != cast[i]) return -1;
  s += 8;
  long long base = 10, v = 0;
  if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) base = 16, s += 2;
  if (digit(*s) < 0 || digit(*s) >= base) return -1;
  for (; digit(*s) >= 0 && digit(*s) < base; ++s) v = v * base + digit(*s);
  return s[0] == ')' && s[1] == 0 ? v : -1;
}
template <class T>
struct ConstantOf {  // an enumerator or an integer
  template <class F>
  static constexpr long long get(F value, const char*) { return static_cast<long long>(value()); }
};
template <class T>
struct ConstantOf<T*> {  // a pointer-valued macro: its text
  template <class F>
  static constexpr long long get(F, const char* text) { return pointer_literal(text); }
};
#define HETCCL_STR2(x) #x
#define HETCCL_STR(x) HETCCL_STR2(x)

constexpr int kConstants = 0
#define COUNT_CONSTANT(hip_name, name, value) +1
    HETCCL_HIP_CONSTANTS(COUNT_CONSTANT) HETCCL_HIPRTC_CONSTANTS(COUNT_CONSTANT)
#undef COUNT_CONSTANT
    ;
#define CHECK_CONSTANT(hip_name, name, value)                                                  \
  static_assert(hetccl::hip::name == ConstantOf<decltype(hip_name)>::get(                        \
                                         [] { return hip_name; }, HETCCL_STR(hip_name)),        \
                "hetccl's " #name " is not " #hip_name " of the HIP headers");
HETCCL_HIP_CONSTANTS(CHECK_CONSTANT)
HETCCL_HIPRTC_CONSTANTS(CHECK_CONSTANT)
#undef CHECK_CONSTANT

constexpr int kFunctions = 0
#define COUNT_FUNCTION(hip_name, type) +1
    HETCCL_HIP_FUNCTIONS(COUNT_FUNCTION) HETCCL_HIP_ROUTE_FUNCTIONS(COUNT_FUNCTION)
    HETCCL_HIPRTC_FUNCTIONS(COUNT_FUNCTION)
#undef COUNT_FUNCTION
    ;
#define CHECK_FUNCTION(hip_name, type)                                                   \
  static_assert(SameAbiFn<Opaque::type, Real::type>::value,                              \
                "hetccl's opaque " #type " differs in ABI from " #hip_name);
HETCCL_HIP_FUNCTIONS(CHECK_FUNCTION)
HETCCL_HIP_ROUTE_FUNCTIONS(CHECK_FUNCTION)
HETCCL_HIPRTC_FUNCTIONS(CHECK_FUNCTION)
#undef CHECK_FUNCTION
}  // namespace

// The headers' prototypes, redeclared with the table's types (a mismatch: "conflicting
// declaration of C function").
#define REDECLARE_FUNCTION(hip_name, type) extern "C" Real::type hip_name;
HETCCL_HIP_FUNCTIONS(REDECLARE_FUNCTION)
HETCCL_HIP_ROUTE_FUNCTIONS(REDECLARE_FUNCTION)
HETCCL_HIPRTC_FUNCTIONS(REDECLARE_FUNCTION)
#undef REDECLARE_FUNCTION

int main() {
  std::printf("checked %d constants %d types %d functions against HIP %d.%d\n", kConstants, kTypes,
              kFunctions, HIP_VERSION_MAJOR, HIP_VERSION_MINOR);
  return 0;
}
