// hip_api.h's declarations as data, spelled from the compiled types themselves (not retyped), so
// the comparison with ROCm's bindings checks what hip_ops.cc uses.
#include <cstddef>
#include <cstdint>

#include "hip_api.h"

namespace hetccl {
namespace hip {
namespace {

// Distinct tags for the opaque types, so the spelling says which HIP type each stands for even
// where two are the same C type (Error and MemcpyKind are both int).
struct ErrorT {};
struct StreamT {};
struct EventT {};
struct KindT {};
struct AttrT {};
struct SizeT {};
struct CaptureT {};
struct ModuleT {};
struct FunctionT {};
struct RtcResultT {};
struct RtcProgramT {};
struct Tagged {
  using Error = ErrorT;
  using Stream = StreamT;
  using Event = EventT;
  using MemcpyKind = KindT;
  using DeviceAttr = AttrT;
  using Size = SizeT;
  using CaptureStatus = CaptureT;
  using Module = ModuleT;
  using Function = FunctionT;
  using RtcResult = RtcResultT;
  using RtcProgram = RtcProgramT;
  using Strings = const char* const*;  // a C type: spelled as such
};

template <class T> struct Name;
#define HETCCL_NAME(T, s) \
  template <> struct Name<T> { static std::string get() { return s; } };
HETCCL_NAME(ErrorT, "Error")
HETCCL_NAME(StreamT, "Stream")
HETCCL_NAME(EventT, "Event")
HETCCL_NAME(KindT, "MemcpyKind")
HETCCL_NAME(CaptureT, "CaptureStatus")
HETCCL_NAME(AttrT, "DeviceAttr")
HETCCL_NAME(int, "int")
HETCCL_NAME(unsigned int, "unsigned int")
HETCCL_NAME(uint64_t, "uint64_t")
HETCCL_NAME(SizeT, "size_t")
HETCCL_NAME(void*, "void*")
HETCCL_NAME(const void*, "const void*")
HETCCL_NAME(void**, "void**")
HETCCL_NAME(int*, "int*")
HETCCL_NAME(const char*, "const char*")
HETCCL_NAME(char*, "char*")
HETCCL_NAME(const char* const*, "const char* const*")
HETCCL_NAME(ModuleT, "Module")
HETCCL_NAME(FunctionT, "Function")
HETCCL_NAME(RtcResultT, "RtcResult")
HETCCL_NAME(RtcProgramT, "RtcProgram")
#undef HETCCL_NAME
template <class T> struct Name<T*> { static std::string get() { return Name<T>::get() + "*"; } };

template <class F> struct Spell;
template <class R, class... A>
struct Spell<R(A...)> {
  static std::vector<std::string> get() { return {Name<R>::get(), Name<A>::get()...}; }
};

// Tagged and Opaque instantiations have the same shape: the tags replace exactly the opaque
// types, parameter for parameter (a type outside the tags fails to compile above).
}  // namespace

std::map<std::string, long long> constants() {
  std::map<std::string, long long> m;
#define HETCCL_HIP_CONSTANT_ENTRY(hip_name, name, value) m[#hip_name] = name;
  HETCCL_HIP_CONSTANTS(HETCCL_HIP_CONSTANT_ENTRY)
  HETCCL_HIPRTC_CONSTANTS(HETCCL_HIP_CONSTANT_ENTRY)
#undef HETCCL_HIP_CONSTANT_ENTRY
  return m;
}

std::map<std::string, std::vector<std::string>> functions() {
  std::map<std::string, std::vector<std::string>> m;
#define HETCCL_HIP_FUNCTION_ENTRY(hip_name, type) \
  m[#hip_name] = Spell<Api<Tagged>::type>::get();
  HETCCL_HIP_FUNCTIONS(HETCCL_HIP_FUNCTION_ENTRY)
  HETCCL_HIP_ROUTE_FUNCTIONS(HETCCL_HIP_FUNCTION_ENTRY)
  HETCCL_HIPRTC_FUNCTIONS(HETCCL_HIP_FUNCTION_ENTRY)
#undef HETCCL_HIP_FUNCTION_ENTRY
  return m;
}

}  // namespace hip
}  // namespace hetccl
