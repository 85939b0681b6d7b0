// The emulated runtime's device-program "kernel" (program.h's contract): one host thread per
// group executes the group's ring in order, with reduce.cc's arithmetic and the same word
// rules as the emulated streams (device_ops.h). It is what the CPU tests run the device
// route's program mode on; reduce_kernels.cu's hetccl_program is the GPU's.
#include <sched.h>

#include <cstring>
#include <thread>

#include "../reduce.h"
#include "program.h"

namespace hetccl {
namespace program {
namespace {

uint64_t ld(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void st(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

bool reached(uint64_t addr, uint64_t v, bool wide) {
  if (wide) return __atomic_load_n(reinterpret_cast<uint64_t*>(addr), __ATOMIC_ACQUIRE) >= v;
  uint32_t lo = __atomic_load_n(reinterpret_cast<uint32_t*>(addr), __ATOMIC_ACQUIRE);
  return int32_t(lo - uint32_t(v)) >= 0;
}

void pause(int& spins) {
  if (++spins > 64) sched_yield();
}

void run_group(Slot* s, uint32_t g) {
  const bool wide = s->wide != 0;
  uint64_t pos = 0;
  bool end = false;
  while (!end) {
    uint64_t L;
    int spins = 0;
    while ((L = ld(&s->len[g])) <= pos && ld(&s->abort) == 0) pause(spins);
    if (L <= pos) break;  // aborted with nothing more published
    while (pos < L && !end) {
      const Ins I = s->ring[g][pos % kRing];
      // one thread plays every block of the group: each block's count says so
      for (uint64_t b = 0; b < s->blocks && b < kMaxBlocks; ++b) st(&s->taken[g][b], pos + 1);
      spins = 0;
      switch (I.op) {
        case END:
          end = true;
          break;
        case WAIT:
          while (!reached(I.a[0], I.a[1], wide) && ld(&s->abort) == 0) pause(spins);
          break;
        case AWAIT:
          while (ld(&s->ev[I.a[0]]) < I.a[1] && ld(&s->abort) == 0) pause(spins);
          break;
        case WRITE:
          if (wide) __atomic_store_n(reinterpret_cast<uint64_t*>(I.a[0]), I.a[1], __ATOMIC_RELEASE);
          else __atomic_store_n(reinterpret_cast<uint32_t*>(I.a[0]), uint32_t(I.a[1]), __ATOMIC_RELEASE);
          break;
        case SIGNAL:
          st(&s->ev[I.a[0]], I.a[1]);
          break;
        case COPY:
          std::memmove(reinterpret_cast<void*>(I.a[0]), reinterpret_cast<const void*>(I.a[1]), I.a[2]);
          break;
        case REDUCE:
          reduce_into(ReduceOp(int(I.a[4])), DType(int(I.a[3])), reinterpret_cast<void*>(I.a[0]),
                      reinterpret_cast<const void*>(I.a[1]), I.a[2], 1);
          break;
        case DIV:
          scale_div(DType(int(I.a[2])), reinterpret_cast<void*>(I.a[0]), I.a[1], int64_t(I.a[3]), 1);
          break;
        case MUL: {
          uint64_t imm = I.a[4];
          const void* sc = I.a[3] ? reinterpret_cast<const void*>(I.a[3]) : &imm;
          scale_mul(DType(int(I.a[2])), reinterpret_cast<void*>(I.a[0]), I.a[1], sc, 1);
          break;
        }
      }
      ++pos;
    }
  }
  // both groups ended: whichever sees the other's mark writes fin (both may: the same values)
  const uint64_t seq = ld(&s->seq);
  __atomic_store_n(&s->gend[g], seq, __ATOMIC_SEQ_CST);
  bool last = true;
  for (uint32_t o = 0; o < kGroups; ++o)
    if (o != g && __atomic_load_n(&s->gend[o], __ATOMIC_SEQ_CST) != seq) last = false;
  if (last) {
    if (wide) __atomic_store_n(reinterpret_cast<uint64_t*>(s->fin_addr), s->fin_value, __ATOMIC_RELEASE);
    else __atomic_store_n(reinterpret_cast<uint32_t*>(s->fin_addr), uint32_t(s->fin_value), __ATOMIC_RELEASE);
    st(&s->ended, seq);
  }
  st(&s->left[g], seq);  // the group's last access to the slot
}

}  // namespace

void run_on_host(Slot* slot) {
  std::thread side([slot] { run_group(slot, 1); });
  run_group(slot, 0);
  side.join();
}

}  // namespace program
}  // namespace hetccl
