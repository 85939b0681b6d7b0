// Internal to the runtime modules (csrc/device/): opening the vendor library, and each module's
// factory, which registry.cc maps from a runtime name.
#pragma once

#include <memory>
#include <string>

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

std::shared_ptr<DeviceOps> make_cuda_ops(const std::string& library);
std::shared_ptr<DeviceOps> make_hip_ops(const std::string& library);
std::shared_ptr<DeviceOps> make_emulated_ops(const std::string& rule);
void* emulated_stream(DeviceOps& ops);

}  // namespace device
}  // namespace hetccl
