// hetccl C API settings: the one place the C faces read the environment (comm.h: Settings).
// The torch face reads the same names in hetccl/config.py, which documents every one of them.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../common.h"
#include "../device_ops.h"
#include "comm.h"

namespace hetccl {
namespace api {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

int64_t env_int(const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  std::string v = env(name);
  if (v.empty()) return dflt;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (*end || x < lo || x > hi)
    throw CommError(std::string("hetccl: ") + name + "=" + v + " is not an integer in [" +
                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

bool env_bool(const char* name, bool dflt) {
  std::string v = env(name);
  if (v.empty()) return dflt;
  if (v == "1" || v == "on" || v == "true" || v == "yes" || v == "full" || v == "async") return true;
  if (v == "0" || v == "off" || v == "false" || v == "no") return false;
  throw CommError(std::string("hetccl: ") + name + "=" + v + " is not one of on/off/1/0");
}

constexpr uint64_t KiB = 1 << 10, MiB = 1 << 20, INF = (uint64_t(1) << 63) - 1;

}  // namespace

Settings read_settings() {
  Settings s;
  s.timeout_ms = env_int("HETCCL_TIMEOUT_S", 300, 1, 86400 * 7) * 1000;
  s.tcp_nconn = int(env_int("HETCCL_TCP_NCONN", 4, 1, 64));
  s.ifname = env("HETCCL_SOCKET_IFNAME");
  s.shm_slot_bytes = size_t(env_int("HETCCL_SHM_SLOT_BYTES", 0, 0, int64_t(1) << 32));
  s.shm_nslots = int(env_int("HETCCL_SHM_NSLOTS", 8, 2, 1024));
  s.shm_budget_bytes = size_t(env_int("HETCCL_SHM_BUDGET_BYTES", 0, 0, int64_t(1) << 40));  // 0: comm.cc decides
  s.reduce_threads = int(env_int("HETCCL_REDUCE_THREADS", 0, 0, 1024));
  s.check_args = env_bool("HETCCL_CHECK_ARGS", true);
  s.shm = env_bool("HETCCL_CAPI_SHM", true);
  s.vendor = env("HETCCL_VENDOR");
  s.vendor_split = env("HETCCL_VENDOR_SPLIT");
  s.crash_backtrace = env_bool("HETCCL_CRASH_BACKTRACE", false);
  s.algo = env("HETCCL_CAPI_ALGO");
  if (s.algo.empty()) s.algo = "auto";
  if (s.algo != "auto" && s.algo != "ring" && s.algo != "rd" && s.algo != "hier")
    throw CommError("hetccl: HETCCL_CAPI_ALGO=" + s.algo + " is not one of auto, ring, rd, hier");
  // validated by the device registry when the first stream call opens it (device_ops.h)
  s.device_runtime = env("HETCCL_CAPI_DEVICE");
  if (s.device_runtime.empty()) s.device_runtime = default_device_runtime();
  s.device_library = env("HETCCL_CAPI_DEVICE_LIBRARY");
  s.stream_chunk_bytes = size_t(env_int("HETCCL_STREAM_CHUNK_BYTES", 0, 0, int64_t(1) << 40));
  s.device_chunk_bytes = size_t(env_int("HETCCL_CAPI_DEVICE_CHUNK_BYTES", 0, 0, int64_t(1) << 32));
  if (env("HETCCL_STREAM_DEVICE_BYTES") == "off")
    s.stream_device_bytes = SIZE_MAX;
  else
    s.stream_device_bytes = size_t(env_int("HETCCL_STREAM_DEVICE_BYTES", int64_t(s.stream_device_bytes), 0, int64_t(1) << 50));
  {
    std::string l = env("HETCCL_CAPI_ROUTE_LAUNCH");
    if (!l.empty() && l != "streams" && l != "kernel")
      throw CommError("hetccl: HETCCL_CAPI_ROUTE_LAUNCH=" + l + " is not one of streams, kernel");
    s.route_program = l == "kernel";
  }
  s.program_blocks = uint32_t(env_int("HETCCL_CAPI_PROGRAM_BLOCKS", 4, 1, 16));
  // hetccl/tuning.py HOST, MESSAGE and DEVICE (see its docstring for how the rows were chosen)
  s.host_chunks = {{256 * KiB, 256 * KiB}, {INF, 128 * KiB}};
  s.msg_chunks = {{1 * MiB, 1 * MiB}, {INF, 4 * MiB}};
  s.device_chunks = {{512 * KiB, 512 * KiB}, {4 * MiB, 512 * KiB}, {32 * MiB, 2 * MiB}, {INF, 4 * MiB}};
  return s;
}

std::string split_label(const std::string& split, int rank) {
  // hetccl/launch.py vendor_labels: blocks of consecutive ranks are v0, v1, ...; the rank is
  // RANK's (the launcher's) when set, as hetccl/vendor.py detect_vendor
  std::string r = env("RANK");
  if (!r.empty()) rank = int(env_int("RANK", 0, 0, 1 << 30));
  int block = 0, end = 0;
  size_t a = 0;
  while (a <= split.size()) {
    size_t b = split.find('+', a);
    if (b == std::string::npos) b = split.size();
    int n = std::atoi(split.substr(a, b - a).c_str());
    if (n < 1) throw CommError("hetccl: HETCCL_VENDOR_SPLIT=" + split + " is not ranks per vendor joined by '+'");
    end += n;
    if (rank < end) return "v" + std::to_string(block);
    ++block;
    a = b + 1;
  }
  throw CommError("hetccl: HETCCL_VENDOR_SPLIT=" + split + " covers " + std::to_string(end) +
                  " ranks, but this is rank " + std::to_string(rank));
}

std::string iface_addr(const std::string& ifname) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) throw CommError("hetccl: getifaddrs failed");
  std::string found;
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || ifname != i->ifa_name) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    found = buf;
    break;
  }
  freeifaddrs(ifs);
  if (found.empty())
    throw CommError("hetccl: HETCCL_SOCKET_IFNAME=" + ifname + ": no IPv4 address on that interface");
  return found;
}

}  // namespace api
}  // namespace hetccl
