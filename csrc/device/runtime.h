// Internal to the runtime modules (csrc/device/): opening the vendor library, and each module's
// factory, which registry.cc maps from a runtime name.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "device_ops.h"

namespace hetccl {
namespace device {

// dlopen of the library the framework already loaded (RTLD_NOLOAD first, so the same copy is
// used); throws CommError naming the library when it cannot be opened.
void* open_library(const std::string& library);
// dlsym that throws CommError "<library> lacks <symbol>".
void* must_symbol(void* lib, const std::string& library, const char* symbol);
// dlsym, nullptr when missing (calls a module can do without).
void* symbol_or_null(void* lib, const char* symbol);
// For libraries a module can do without (opened when first needed): the first of `names` that is
// already loaded in the process (RTLD_NOLOAD), or nullptr; the first that dlopen can load, or
// nullptr with each name and dlerror's reason appended to *why.
void* loaded_library(const std::vector<std::string>& names);
void* load_first_library(const std::vector<std::string>& names, std::string* why);
// The folder of the file a dlopen handle was loaded from ("" if unknown), so that a companion
// library can be looked for beside it.
std::string library_dir(void* lib);

std::shared_ptr<DeviceOps> make_cuda_ops(const std::string& library);
std::shared_ptr<DeviceOps> make_hip_ops(const std::string& library);
std::shared_ptr<DeviceOps> make_emulated_ops(const std::string& rule);
void* emulated_stream(DeviceOps& ops);

}  // namespace device
}  // namespace hetccl
