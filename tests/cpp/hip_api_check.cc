// Compiled by tests/test_hip_api.py against ROCm's own HIP headers (no GPU, no HIP library
// needed: nothing is linked or run beyond main's count): every declaration of
// csrc/device/hip_api.h must be exactly what the header declares, or this fails to compile.
//   * constants: the value of the HIP identifier each one names;
//   * opaque types: the size, alignment and kind (enum / pointer) of the HIP type;
//   * functions: the table's function type over the real HIP types is the header's prototype
//     (std::is_same on the function types: parameter and return types, in order), and hetccl's
//     opaque instantiation has the same size and kind parameter for parameter.
// Prints how many declarations it checked.
#include <hip/hip_runtime_api.h>

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
static_assert(same_abi<hetccl::hip::OpaqueTypes::Error, hipError_t>(), "hipError_t");
static_assert(same_abi<hetccl::hip::OpaqueTypes::Stream, hipStream_t>(), "hipStream_t");
static_assert(same_abi<hetccl::hip::OpaqueTypes::Event, hipEvent_t>(), "hipEvent_t");
static_assert(same_abi<hetccl::hip::OpaqueTypes::MemcpyKind, hipMemcpyKind>(), "hipMemcpyKind");
static_assert(same_abi<hetccl::hip::OpaqueTypes::DeviceAttr, hipDeviceAttribute_t>(),
              "hipDeviceAttribute_t");
static_assert(same_abi<hetccl::hip::OpaqueTypes::CaptureStatus, hipStreamCaptureStatus>(),
              "hipStreamCaptureStatus");
constexpr int kTypes = 6;

// Parameter-by-parameter ABI equality of the opaque and the real function types.
template <class F, class G> struct SameAbiFn : std::false_type {};
template <class R1, class... A1, class R2, class... A2>
struct SameAbiFn<R1(A1...), R2(A2...)>
    : std::integral_constant<bool, sizeof...(A1) == sizeof...(A2) && same_abi<R1, R2>() &&
                                       (same_abi<A1, A2>() && ...)> {};

constexpr int kConstants = 0
#define CHECK_CONSTANT(hip_name, name, value) +1
    HETCCL_HIP_CONSTANTS(CHECK_CONSTANT)
#undef CHECK_CONSTANT
    ;
#define CHECK_CONSTANT(hip_name, name, value)                                  \
  static_assert(hetccl::hip::name == static_cast<long long>(hip_name),        \
                "hetccl's " #name " is not " #hip_name " of the HIP headers");
HETCCL_HIP_CONSTANTS(CHECK_CONSTANT)
#undef CHECK_CONSTANT

constexpr int kFunctions = 0
#define COUNT_FUNCTION(hip_name, type) +1
    HETCCL_HIP_FUNCTIONS(COUNT_FUNCTION)
#undef COUNT_FUNCTION
    ;
#define CHECK_FUNCTION(hip_name, type)                                                   \
  static_assert(std::is_same<Real::type, decltype(::hip_name)>::value,                   \
                "hetccl's " #type " is not the prototype of " #hip_name " in the headers"); \
  static_assert(SameAbiFn<Opaque::type, Real::type>::value,                              \
                "hetccl's opaque " #type " differs in ABI from " #hip_name);
HETCCL_HIP_FUNCTIONS(CHECK_FUNCTION)
#undef CHECK_FUNCTION
}  // namespace

int main() {
  std::printf("checked %d constants %d types %d functions against HIP %d.%d\n", kConstants, kTypes,
              kFunctions, HIP_VERSION_MAJOR, HIP_VERSION_MINOR);
  return 0;
}
