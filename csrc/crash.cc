// hetccl: the opt-in crash backtrace (contract in crash.h).
#include "crash.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <initializer_list>

namespace hetccl {
namespace {

void crash_handler(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  char line[512];
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname) {
      int len = snprintf(line, sizeof line, "hetccl-frame %s +0x%lx\n", info.dli_fname,
                         (unsigned long)((char*)frames[i] - (char*)info.dli_fbase));
      if (len > 0) (void)!write(2, line, size_t(len));
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void install_crash_backtrace() {
  void* warm[2];
  backtrace(warm, 2);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE}) signal(sig, crash_handler);
}

}  // namespace hetccl
