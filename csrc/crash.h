// hetccl: the opt-in crash backtrace (HETCCL_CRASH_BACKTRACE=1), shared by both faces: the
// Python module (hetccl/_core.py calls _C.enable_crash_backtrace) and the C API (the
// communicator's settings, csrc/api/settings.cc).
#pragma once

namespace hetccl {
// On SIGSEGV/SIGBUS/SIGFPE print the native frames as "hetccl-frame <object> +<offset>" lines
// on stderr (addr2line -f -C -e <object> <offset> names them), then let the default action run
// (the process still dies with the signal). Only async-signal-safe calls in the handler
// (backtrace() is warmed up here so that no library loads inside it). Idempotent.
void install_crash_backtrace();
}  // namespace hetccl
