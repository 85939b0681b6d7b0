// A stand-in for hiprtc (HIP's runtime compiler), built by tests/test_hip_api.py against ROCm's
// own hiprtc.h (so every function has the header's exact prototype), for running the HIP runtime
// module's kernel preparation (csrc/device/hip_ops.cc) on a machine without ROCm. Built either
// as its own libhiprtc.so (ROCm 7 and later) or into the fake libamdhip64 (ROCm before 7.0).
//
// "Compiling" reads the kernel names out of the source: every extern "C" __global__ function,
// including those that reduce_kernels.cu's HETCCL_KERNELS(name, D) macro stamps out (its body's
// ##name## pasted with each invocation's first argument). The code object is a magic line and
// those names, one a line; fake_hip.cc's hipModuleLoadData accepts only that and its
// hipModuleGetFunction only those names. So a kernel the module asks for but the source lacks
// fails as on ROCm. Every call is logged (fake_hiprtc_log()); fake_hiprtc_source() is the last
// program's source, fake_hiprtc_fail(log) makes the next compiles fail with that log.
#include <hip/hiprtc.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {
std::string g_log, g_source, g_fail_log;
bool g_fail = false;
const char kCodeMagic[] = "FAKE-HIPRTC-CODE\n";  // fake_hip.cc's hipModuleLoadData checks it

struct Program {
  std::string source, name, log, code;
};

void log_call(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_call(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_log += buf;
  g_log += "\n";
}

// The extern "C" kernels the source defines, after HETCCL_KERNELS-style macro pasting.
std::set<std::string> kernel_names(const std::string& src) {
  std::set<std::string> out;
  // one logical line per physical line, backslash continuations joined
  std::string joined;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\\' && i + 1 < src.size() && src[i + 1] == '\n') {
      ++i;
      joined += ' ';
    } else {
      joined += src[i];
    }
  }
  std::istringstream lines(joined);
  const std::regex kernel(R"(extern\s+"C"\s+__global__\s+void\s+([\w#]+)\s*\()");
  const std::regex define(R"(^\s*#\s*define\s+(\w+)\((\w+)\s*,\s*\w+\)(.*)$)");
  std::vector<std::pair<std::string, std::pair<std::string, std::vector<std::string>>>> macros;
  std::vector<std::string> rest;
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, define)) {
      std::vector<std::string> templates;
      std::string body = m[3];
      for (std::sregex_iterator it(body.begin(), body.end(), kernel), end; it != end; ++it)
        templates.push_back((*it)[1]);
      macros.push_back({m[1], {m[2], templates}});
      continue;
    }
    rest.push_back(line);
  }
  for (const auto& line : rest) {
    for (std::sregex_iterator it(line.begin(), line.end(), kernel), end; it != end; ++it)
      if (std::string((*it)[1]).find('#') == std::string::npos) out.insert((*it)[1]);
    for (const auto& mac : macros) {
      std::smatch m;
      if (!std::regex_match(line, m, std::regex("^\\s*" + mac.first + R"(\((\w+)\s*,\s*\w+\)\s*$)")))
        continue;
      for (std::string t : mac.second.second) {
        const std::string param = mac.second.first;
        for (const std::string& pat : {"##" + param + "##", "##" + param, param + "##"}) {
          for (size_t at; (at = t.find(pat)) != std::string::npos;) t.replace(at, pat.size(), m[1]);
        }
        out.insert(t);
      }
    }
  }
  return out;
}
}  // namespace

extern "C" {
const char* fake_hiprtc_log() { return g_log.c_str(); }
const char* fake_hiprtc_source() { return g_source.c_str(); }
void fake_hiprtc_reset() { g_log.clear(); }
void fake_hiprtc_fail(const char* log) {
  g_fail = log != nullptr;
  g_fail_log = log ? log : "";
}
}

const char* hiprtcGetErrorString(hiprtcResult result) {
  return result == HIPRTC_ERROR_COMPILATION ? "HIPRTC_ERROR_COMPILATION (fake)" : "hiprtc error (fake)";
}
hiprtcResult hiprtcCreateProgram(hiprtcProgram* prog, const char* src, const char* name,
                                 int numHeaders, const char** headers, const char** includeNames) {
  log_call("hiprtcCreateProgram name=%s headers=%d bytes=%zu", name ? name : "(null)", numHeaders,
           src ? std::strlen(src) : 0);
  if (!prog || !src) return HIPRTC_ERROR_INVALID_INPUT;
  auto* p = new Program{src, name ? name : "", "", ""};
  g_source = p->source;
  *prog = reinterpret_cast<hiprtcProgram>(p);
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcCompileProgram(hiprtcProgram prog, int numOptions, const char** options) {
  std::string opts;
  for (int i = 0; i < numOptions; ++i) opts += std::string(" ") + options[i];
  log_call("hiprtcCompileProgram options=%d%s", numOptions, opts.c_str());
  auto* p = reinterpret_cast<Program*>(prog);
  if (!p) return HIPRTC_ERROR_INVALID_PROGRAM;
  if (g_fail) {
    p->log = g_fail_log;
    return HIPRTC_ERROR_COMPILATION;
  }
  std::set<std::string> names = kernel_names(p->source);
  if (names.empty()) {
    p->log = p->name + ": error: no extern \"C\" __global__ function (fake hiprtc)";
    return HIPRTC_ERROR_COMPILATION;
  }
  p->code = kCodeMagic;
  for (const auto& n : names) p->code += n + "\n";
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcGetProgramLogSize(hiprtcProgram prog, size_t* logSizeRet) {
  log_call("hiprtcGetProgramLogSize");
  *logSizeRet = reinterpret_cast<Program*>(prog)->log.size() + 1;
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcGetProgramLog(hiprtcProgram prog, char* log) {
  log_call("hiprtcGetProgramLog");
  const std::string& l = reinterpret_cast<Program*>(prog)->log;
  std::memcpy(log, l.c_str(), l.size() + 1);
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcGetCodeSize(hiprtcProgram prog, size_t* codeSizeRet) {
  auto* p = reinterpret_cast<Program*>(prog);
  log_call("hiprtcGetCodeSize -> %zu", p->code.size() + 1);
  if (p->code.empty()) return HIPRTC_ERROR_INVALID_PROGRAM;
  *codeSizeRet = p->code.size() + 1;  // with its NUL: the fake's code object is text
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcGetCode(hiprtcProgram prog, char* code) {
  log_call("hiprtcGetCode");
  const std::string& c = reinterpret_cast<Program*>(prog)->code;
  std::memcpy(code, c.c_str(), c.size() + 1);
  return HIPRTC_SUCCESS;
}
hiprtcResult hiprtcDestroyProgram(hiprtcProgram* prog) {
  log_call("hiprtcDestroyProgram");
  delete reinterpret_cast<Program*>(*prog);
  *prog = nullptr;
  return HIPRTC_SUCCESS;
}
