// make_device_ops: a runtime's name -> its module (csrc/device/*_ops.cc), and the library
// helpers the modules share.
#include <dlfcn.h>
#include <link.h>

#include "errors.h"
#include "hip_api.h"
#include "runtime.h"

namespace hetccl {
namespace device {

void* open_library(const std::string& library) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!lib) lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw CommError("hetccl: cannot open the device runtime " + library + ": " + dlerror());
  return lib;
}

void* must_symbol(void* lib, const std::string& library, const char* symbol) {
  void* f = dlsym(lib, symbol);
  if (!f) throw CommError(std::string("hetccl: ") + library + " lacks " + symbol);
  return f;
}

void* symbol_or_null(void* lib, const char* symbol) { return dlsym(lib, symbol); }

void* loaded_library(const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (void* lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return lib;
  return nullptr;
}

void* load_first_library(const std::vector<std::string>& names, std::string* why) {
  for (const auto& n : names) {
    if (void* lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return lib;
    const char* e = dlerror();  // names the file itself
    if (why) *why += (why->empty() ? "" : "; ") + (e ? std::string(e) : n + ": not found");
  }
  return nullptr;
}

std::string library_dir(void* lib) {
  link_map* m = nullptr;
  if (!lib || dlinfo(lib, RTLD_DI_LINKMAP, &m) != 0 || !m || !m->l_name) return "";
  std::string path = m->l_name;
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace device

void* emulated_stream(DeviceOps& ops) { return device::emulated_stream(ops); }

RuntimeApi runtime_api(const std::string& runtime) {
  if (runtime == "hip") return {hip::constants(), hip::functions()};
  throw CommError("hetccl: no declaration table for the device runtime '" + runtime + "' (only hip)");
}

const char* default_device_runtime() { return "cuda"; }

bool device_runtime_loaded(const std::string& runtime, const std::string& library) {
  std::string lib = library;
  if (lib.empty() && runtime == "cuda") lib = "libcuda.so.1";
  if (lib.empty() && runtime == "hip") lib = "libamdhip64.so";
  if (lib.empty() || (runtime != "cuda" && runtime != "hip")) return false;
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (h) dlclose(h);  // NOLOAD took a reference of its own
  return h != nullptr;
}

std::shared_ptr<DeviceOps> make_device_ops(const std::string& runtime, const std::string& library) {
  // library "": the runtime's usual name, the one a process that uses it has loaded
  if (runtime == "cuda") return device::make_cuda_ops(library.empty() ? "libcuda.so.1" : library);
  if (runtime == "hip") return device::make_hip_ops(library.empty() ? "libamdhip64.so" : library);
  if (runtime == "emulated") return device::make_emulated_ops(library);
  if (runtime == "emulated-hip") return device::make_emulated_ops("hip");  // HIP's comparison rule
  throw CommError("hetccl: unknown device runtime '" + runtime + "' (known: cuda, hip, emulated, emulated-hip)");
}

}  // namespace hetccl
