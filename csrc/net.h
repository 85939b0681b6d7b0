// hetccl bridge core: small header-only socket helpers (byte order, socket options, address
// parsing and printing) for socket-based transports.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace hetccl {
namespace net {

inline void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
}
inline void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
}
inline uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline bool set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}
inline void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// "host:port" / "[v6]:port" of a socket address.
inline std::string sockaddr_str(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "?";
}

// Parses "host:port" or "[v6]:port" (numeric hosts only) into ss; false if malformed.
inline bool parse_hostport(const std::string& s, sockaddr_storage* ss, socklen_t* len) {
  std::string host, port;
  if (!s.empty() && s[0] == '[') {
    size_t e = s.find("]:");
    if (e == std::string::npos) return false;
    host = s.substr(1, e - 1);
    port = s.substr(e + 2);
  } else {
    size_t c = s.rfind(':');
    if (c == std::string::npos) return false;
    host = s.substr(0, c);
    port = s.substr(c + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end || p <= 0 || p > 65535) return false;
  std::memset(ss, 0, sizeof *ss);
  auto* a4 = reinterpret_cast<sockaddr_in*>(ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(ss);
  if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(uint16_t(p));
    *len = sizeof(sockaddr_in);
    return true;
  }
  if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(uint16_t(p));
    *len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

// First non-loopback IPv4 address of an up interface, else 127.0.0.1 (what tcp advertises for
// "0.0.0.0", and the C API bootstrap root's default address).
inline std::string default_host() {
  struct ifaddrs* ifa = nullptr;
  std::string best = "127.0.0.1";
  if (getifaddrs(&ifa) == 0) {
    for (auto* i = ifa; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      char h[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, h, sizeof h);
      best = h;
      break;
    }
    freeifaddrs(ifa);
  }
  return best;
}

}  // namespace net
}  // namespace hetccl
