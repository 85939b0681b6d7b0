// hetccl C API: the device route's streams (contracts in device_route.h).
#include "device_route.h"

#include <string>

#include "../common.h"

namespace hetccl {
namespace api {

DeviceRoute::DeviceRoute(DeviceOps& o) : ops(o) {
  device = ops.current_device();
  ops.prepare_kernels();
  main = ops.stream_create();
  side = ops.stream_create();
}

DeviceRoute::~DeviceRoute() {
  try {
    ops.set_device(device);
    for (void* s : {main, side})
      if (s) ops.sync(s);
    // nothing on either stream uses a failed call's scratch now
    for (void* p : orphans) ops.mem_free_async(p, main);
    if (!orphans.empty()) ops.sync(main);
  } catch (const std::exception& e) {
    log_warn("capi", std::string("draining the device route's streams: ") + e.what());
  }
  for (void* s : {main, side}) {
    if (!s) continue;
    try {
      ops.stream_destroy(s);
    } catch (const std::exception& e) {
      log_warn("capi", std::string("closing the device route's streams: ") + e.what());
    }
  }
}

}  // namespace api
}  // namespace hetccl
