// hetccl device programs: the device route's work for one call as one kernel launch on the
// caller's stream (docs/capi.md, "The device route's issue cost").
//
// Why. The device route's plans wait on flag words that the proxy moves; a stream that waits
// on a word blocks its hardware queue, so no stream of ours may wait for work enqueued after
// the wait (device_route.h). Enqueued as stream operations, a call's work therefore has to be
// on a stream before the caller's stream waits for it, and the issuing thread waits for the
// executor's argument check and its O(chunks) stream operations. As a program, the call is one
// launch on the caller's stream, made at issue: the kernel then takes its instructions from
// pinned host memory as the executor writes them (its check first, then the plans), so its
// progress depends only on host threads and the peers, never on device work enqueued later,
// and the issuing thread returns after the launch (NCCL's design: one kernel per call that
// polls words the proxy moves).
//
// What a program is. The executor's turn for the call records what it would have enqueued on
// the route's two streams (main and side: csrc/api/device_program.h) as two instruction
// rings, one per group; the kernel runs one block per group, each block executing its ring in
// order with all its threads (or B blocks per group, HETCCL_CAPI_PROGRAM_BLOCKS: the data
// instructions spread over the group's threads, a barrier of the group's blocks in device
// memory after each of them and before each write). Instructions (8 words: op, a[0..6]):
//   END                         the group is done
//   WAIT   a0 word, a1 counter  until the word's position reached the counter (the runtime's
//                               rule, device_ops.h: wide = 64-bit unsigned, else the low 32
//                               bits wrap-aware); passes at once once the slot is aborted
//   WRITE  a0 word, a1 counter  after every earlier instruction of the group (its data visible
//                               system-wide first): 64 bits if wide, else the low 32
//   COPY   a0 dst, a1 src, a2 bytes                      (device or pinned host addresses)
//   REDUCE a0 dst, a1 src, a2 count, a3 dtype, a4 op     dst = dst op src (reduce.h: AVG as SUM)
//   DIV    a0 p, a1 count, a2 dtype, a3 by               p /= by
//   MUL    a0 p, a1 count, a2 dtype, a3 scalar address (0: none), a4 the scalar's bits
//   SIGNAL a0 event, a1 value   after every earlier instruction: ev[a0] = value
//   AWAIT  a0 event, a1 value   until ev[a0] >= value (the other group's SIGNAL)
// The arithmetic is reduce_kernels.cu's (reduce.cc's), the data instructions use every thread
// of the block.
//
// A slot (pinned host memory, device-mapped): a header of 64 words, then the two rings. The
// issuing thread fills the header and launches; the executor appends instructions at
// ring[g][len % kRing] and publishes len[g] (release); each block reads what is published and
// reports taken[g][b] (instructions it has read), and the executor reuses a ring entry only once
// every block's taken says so. When both groups ended, the kernel writes fin_value to
// fin_addr (the call's freed word: the caller's stream has passed the call) and then
// ended = seq; each group's last write is left[g] = seq, and the issuing thread reuses a slot
// only once ended and both left say so (two groups that end at once may both write fin, the
// same values, before leaving). Aborted (abort
// nonzero): every wait passes and a group with nothing more published ends, so no kernel
// outlives its communicator (the engine's release of its own words, engine_failure.cc, does
// the same for streams).
//
// The layout below is the kernel's too (reduce_kernels.cu, hetccl_program: word indices
// written there as numbers; tests/test_device_kernels.py compares them).
#pragma once

#include <cstdint>

namespace hetccl {
namespace program {

constexpr uint32_t kGroups = 2;        // main, side
constexpr uint32_t kRing = 256;        // instructions per group ring
constexpr uint32_t kEvents = 16;       // event words per slot
constexpr uint32_t kThreads = 512;     // threads per block
constexpr uint32_t kMaxBlocks = 16;    // blocks per group at most (HETCCL_CAPI_PROGRAM_BLOCKS)

enum Op : uint64_t { END = 0, WAIT = 1, WRITE = 2, COPY = 3, REDUCE = 4, DIV = 5, MUL = 6, SIGNAL = 7, AWAIT = 8 };

struct Ins {
  uint64_t op;
  uint64_t a[7];
};
static_assert(sizeof(Ins) == 64, "an instruction is 8 words");

struct Slot {
  uint64_t seq;                // 0  the call (its first sequence number on the stream path)
  uint64_t abort;              // 1  host: nonzero ends the program (waits pass)
  uint64_t fin_addr;           // 2  device address written when the program ended
  uint64_t fin_value;          // 3
  uint64_t ended;              // 4  device: seq once both groups ended and fin was written
  uint64_t wide;               // 5  1: 64-bit words (HIP's rule), 0: the low 32 bits (CUDA's)
  uint64_t blocks;             // 6  blocks per group (host, before launch)
  uint64_t spare;              // 7  (the runtimes' warm-up launch writes its fin here)
  uint64_t len[kGroups];       // 8, 9    host: instructions published per group
  uint64_t pad1[2];            // 10, 11
  uint64_t gend[kGroups];      // 12, 13  device: seq once the group ended
  uint64_t left[kGroups];      // 14, 15  device: seq once the group touches the slot no more
  uint64_t ev[kEvents];        // 16..31  device: events between the groups
  uint64_t taken[kGroups][kMaxBlocks];  // 32..63  device: instructions read, per block
  Ins ring[kGroups][kRing];    // from word 64
};
static_assert(sizeof(Slot) == 512 + kGroups * kRing * 64, "the slot's layout is the kernel's");

// The emulated runtime's "kernel": the same program executed by host threads, one per group
// (csrc/device/program_host.cc), with reduce.cc's arithmetic. `slot` is host memory.
void run_on_host(Slot* slot);

}  // namespace program
}  // namespace hetccl
