// Internals shared by the engine's files (engine.cc lists them: engine_plan.cc, engine_check.cc,
// engine_device.cc, engine_ring.cc, engine_link.cc, engine_failure.cc, engine_proxy.cc,
// engine_messages.cc): plans, links and their chunks, flag words. Not part of the engine's
// interface (engine.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "engine.h"

namespace hetccl {
namespace engine_detail {

enum Kind { kGeneric = 0, kTimeout = 1, kPeer = 2, kArg = 3 };

[[noreturn]] inline void throw_kind(int kind, const std::string& msg) {
  switch (kind) {
    case kTimeout: throw CommTimeout(msg);
    case kPeer: throw PeerFailure(msg);
    case kArg: throw ArgMismatch(msg);
    default: throw CommError(msg);
  }
}

// Wrap-aware "a >= b" for free-running 32-bit positions.
inline bool geq(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// A flag word (csrc/device_ops.h: "Flag words and positions"): a 64-bit counter whose low 32
// bits are the position. Positions are free-running 32-bit numbers; a position is extended to
// the counter value nearest the word's counter, so the counter never wraps (HIP compares it
// unsigned) while its low half is the position (CUDA compares that wrap-aware). Exact while the
// word and the position are within 2^31 positions of each other. Each word has one writer at a
// time (the proxy, or a stream, or the issuing thread playing the stream).
struct Word {
  std::atomic<uint64_t> v{0};
  uint32_t pos() const { return uint32_t(v.load(std::memory_order_acquire)); }
  uint64_t counter(uint32_t p) const {
    uint64_t c = v.load(std::memory_order_acquire);
    int64_t d = int32_t(p - uint32_t(c));
    // a position before the counter's origin (the first ring slots of a link) is reached
    if (d < 0 && uint64_t(-d) > c) return 0;
    return c + uint64_t(d);
  }
  void set(uint32_t p) { v.store(counter(p), std::memory_order_release); }
  void start(uint32_t p) { v.store(p, std::memory_order_release); }  // a link's first position
};
static_assert(sizeof(Word) == 8, "a flag word is the 8 bytes a stream operation addresses");

inline int64_t to_ms_left(int64_t deadline_ms) {
  return deadline_ms < 0 ? -1 : std::max<int64_t>(0, deadline_ms - now_ms());
}

// One cache line per word: the GPU writes three of them, the proxy the other two. The two words
// streams wait on (freed, avail) live here unless the runtime requires its own memory for them
// (DeviceOps::wait_word_alloc: HIP's signal memory); `freed` / `avail` point at them.
struct Flags {
  alignas(64) Word sent;  // stream: data of position p is in the outgoing slot  -> p + 1
                          //   (direct links: the device data of position p is ready to send)
  alignas(64) Word freed_here;  // proxy: the peer released our outgoing slots up to -> count
                                //   (message links: the send of position p completed -> p + 1)
  alignas(64) Word avail_here;  // proxy: incoming slot of position p is ready         -> p + 1
                                //   (direct links: the data of position p has landed in device
                                //   memory)
  alignas(64) Word consumed;  // stream: incoming slot of position p has been copied -> p + 1
                              //   (direct links: the stream is past position p)
  alignas(64) Word ready;  // stream, direct links only: the stream reached receive position p, so
                           //   its destination may be written                   -> p + 1
  Word* freed = &freed_here;
  Word* avail = &avail_here;
};
static_assert(sizeof(Flags) <= 4096, "flags fit one page");

// A host receive may touch its memory once every send of its plan that reads it has left.
inline bool sends_left(const std::vector<uint8_t>& send_done, const std::vector<uint32_t>& after) {
  for (uint32_t i : after)
    if (!send_done[i]) return false;
  return true;
}

}  // namespace engine_detail

struct Engine::Plan {
  uint64_t id = 0;
  PlanSpec spec;
  enum State { Pending, Done, Failed } state = Pending;
  std::string error;
  int error_kind = engine_detail::kGeneric;
  int64_t deadline_ms = -1;
  int pending = 0;          // chunks still to finish
  bool started = false;
  bool gate = true;         // data may move (headers matched or not checked)
  bool headers_done = true;
  // an async-checked device plan's position on the verdict word (0: none; Engine::verdict_)
  uint32_t verdict_pos = 0;
  std::vector<char> my_hdr;
  struct HdrIn {
    int peer;
    std::vector<char> buf;
    RequestPtr req;
  };
  std::vector<HdrIn> hdr_in;
  std::vector<RequestPtr> hdr_out;
  std::vector<uint8_t> send_done;  // per send chunk
  std::vector<uint8_t> recv_done;  // per host receive chunk (reducing plans: recv-after-recv)
  size_t nbytes_moved = 0;
};

// ----------------------------------------------------------------------------- data structures
struct Engine::SendChunk {
  std::shared_ptr<Plan> plan;
  const char* src;
  size_t len;
  uint64_t tag;
  uint32_t pos;  // ring position (zero-copy links; device staging on message links)
  uint32_t idx;  // index among the plan's send chunks (reduce-after-send ordering)
  bool device;
  bool direct = false;  // device data handed to the transport (isend_device)
  bool issued = false;
  RequestPtr req;
  char* slot = nullptr;  // round trip: the slot to copy the sum back from
};

struct Engine::RecvChunk {
  std::shared_ptr<Plan> plan;
  char* dst;
  size_t len;
  uint64_t tag;
  uint32_t pos;
  bool device;
  bool direct = false;  // received straight into device memory (irecv_device)
  std::vector<uint32_t> after;  // send chunks (idx) that read this memory: they go first
  // Reducing plans: index among the plan's receive chunks, and the earlier receive chunks
  // (ridx) that reduce into memory this one does: they finish first (engine_plan.cc)
  uint32_t ridx = 0;
  std::vector<uint32_t> after_recv;
  bool issued = false;
  RequestPtr req;
};

struct Engine::Link {
  int peer;
  std::shared_ptr<Transport> t;
  bool zc;
  bool direct = false;  // message link whose device data goes to the transport directly
  int bound_device = -1;  // device index the transport was bound to (Transport::bind_device)
  uint32_t out_depth = 0;  // zero-copy: outgoing ring slots; message links: staging slots
  size_t slot_bytes = 0;
  size_t msg_limit = 0;  // message links: Transport::message_limit (host chunks are capped at it)
  uint32_t send_pos = 0, recv_pos = 0;  // next positions to assign (post order)
  std::deque<SendChunk> sq;
  std::deque<RecvChunk> rq;
  std::deque<SendChunk> back;   // round-trip sends committed, waiting for the peer's sums
  std::deque<RecvChunk> held;   // device receives handed to the stream, waiting for `consumed`
  std::deque<SendChunk> inflight_dev;  // message links: device sends issued, in order
  engine_detail::Flags* flags = nullptr;
  uint64_t flags_dev = 0;  // device address of *flags
  uint64_t freed_dev = 0, avail_dev = 0;  // device addresses of *flags->freed, *flags->avail
  bool rings_registered = false;
  std::vector<char*> stage_out, stage_in;  // message links: staging slots for device data
  uint32_t freed_seen = 0;
  int64_t checked_ms = 0;
};

// A point-to-point message's flag words and the message itself (engine_messages.cc).
struct Engine::MessageSlot {
  engine_detail::Word* wait = nullptr;  // proxy -> stream: the data of generation `gen` is in staging (recv)
  engine_detail::Word* sig = nullptr;   // stream -> proxy: the stream's copy of generation `gen` is done
  uint64_t wait_dev = 0, sig_dev = 0;
  uint32_t gen = 0;
};

struct Engine::Message {
  std::shared_ptr<Plan> plan;
  int peer = -1;
  bool send = false;
  char* device = nullptr;  // the caller's device memory
  char* staging = nullptr;
  size_t len = 0, cap = 0;
  uint64_t tag = 0;
  uint32_t slot = 0, gen = 0;
  int state = 0;  // send: 0 stream copying, 1 isend posted; recv: 0 irecv posted, 1 stream copying
  RequestPtr req;
};

}  // namespace hetccl
