// hetccl C API: the device route's program mode (HETCCL_CAPI_ROUTE_LAUNCH=kernel). Each
// device-route call is one kernel launch on the caller's stream, made by the issuing thread,
// whose instructions the executor writes while it runs the call's turn (device/program.h has
// the format and the kernel's contract):
//
//   caller's stream:  [program kernel: waits for the previous program, runs its two rings,
//                      writes the call's freed word]                       (then the caller's work)
//   issuing thread:   takes a slot, launches, hands the call to the executor, returns
//   executor thread:  argument check -> the plans and kernels, recorded into the slot's rings
//                     instead of enqueued on the route's streams -> END
//
// ProgramOps is the device runtime the route and the engine see in this mode: it forwards
// everything to the real runtime but for the route's two streams (main and side, made by
// stream_create), whose operations it records as instructions of the call bound to them.
//
// Contracts:
//  * Programs run one after another in issue order: each begins by waiting for the previous
//    program's fin word, so the links' positions are used in order as on the route's streams
//    (calls on different caller streams included). A kernel therefore never waits for device
//    work enqueued after it, only for host threads (the executor's instructions, the proxy's
//    words) and for earlier kernels.
//  * An event recorded on one route stream and waited on by the other within a call becomes
//    SIGNAL / AWAIT; a wait on an event of an earlier call is dropped (that call has ended
//    before this program starts).
//  * Scratch (mem_alloc_async on a route stream) comes from the real runtime's pool on a stream
//    of ProgramOps' own, waited for there (the kernel's stream is not ordered after it), and is
//    given back only once the program that used it has ended (its slot's `ended`), never in
//    between: into a cache the next calls take their scratch from (device_program.h's cache_).
//  * sync on a route stream, inside a call, records a write of a word of ProgramOps' own and
//    waits for it (the staged fallback's copies); outside a call it waits until every launched
//    program has ended. Every wait here is bounded by the communicator's timeout and ends at
//    abort.
//  * abort_all() makes every program in flight end (its waits pass: the engine's failure
//    release does the same for its words), so no kernel outlives the communicator.
//  * The kernel addresses pinned host memory by its host pointer: ProgramOps is made only
//    where the runtime maps registered memory at the same address (checked on its first slot);
//    elsewhere the route keeps its streams.
// Trade-off: the kernel's blocks (HETCCL_CAPI_PROGRAM_BLOCKS per group) move and reduce the
// data, with no copy engine: across the bus that is SM loads and stores of pinned host memory,
// slower than the stream operations' copies at 4-32 MiB (2.5-2.9x the time on an H100,
// docs/benchmarks.md); the issue is one launch whatever the size.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../device/program.h"
#include "../device_ops.h"

namespace hetccl {
namespace api {

class ProgramOps final : public DeviceOps {
 public:
  static constexpr uint32_t kSlots = 32;  // programs in flight at most
  static constexpr size_t kBarBytes = kSlots * 64 * sizeof(uint32_t);  // the group barriers
  // Throws CommError where the runtime cannot run programs at host addresses (see above).
  // blocks: per group (HETCCL_CAPI_PROGRAM_BLOCKS, 1 .. program::kMaxBlocks)
  ProgramOps(std::shared_ptr<DeviceOps> real, int64_t timeout_ms, uint32_t blocks);
  ~ProgramOps() override;

  // ---- issuing thread
  // Waits for a free slot (the oldest program ended), then launches the program of call `seq`
  // on `stream`; the kernel writes fin_value to fin_addr (a device address) when it ends.
  void launch(void* stream, uint64_t seq, uint64_t fin_addr, uint64_t fin_value);
  // ---- executor thread, in issue order
  void bind(uint64_t seq);  // the route's streams now record into call seq's program
  void unbind();            // END on both groups, published
  // ---- any thread
  void abort_all();
  uint64_t launched() const { return launched_; }
  uint64_t instructions() const { return instructions_; }
  uint64_t scratch_allocs() const { return scratch_allocs_.load(); }  // new allocations
  uint64_t scratch_reuses() const { return scratch_reuses_.load(); }  // taken from the cache

  // ---- DeviceOps: recorded on the route's streams, forwarded otherwise
  std::string name() const override { return real_->name(); }
  std::string memory_type() const override { return real_->memory_type(); }
  void set_device(int index) override { real_->set_device(index); }
  bool stream_mem_ops(int) override { return true; }
  void wait_geq(void* stream, uint64_t word, uint64_t counter) override;
  void write(void* stream, uint64_t word, uint64_t counter) override;
  void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) override;
  void sync(void* stream) override;
  void* event_create() override;
  void event_record(void* event, void* stream) override;
  void stream_wait_event(void* stream, void* event) override;
  void event_destroy(void* event) override;
  bool host_register(void* p, size_t nbytes) override { return real_->host_register(p, nbytes); }
  void host_unregister(void* p) override { real_->host_unregister(p); }
  uint64_t device_address(void* host) override { return real_->device_address(host); }
  void* wait_word_alloc() override { return real_->wait_word_alloc(); }
  uint64_t wait_word_address(void* w) override { return real_->wait_word_address(w); }
  void wait_word_free(void* w) override { real_->wait_word_free(w); }
  void* default_stream() override { return real_->default_stream(); }
  bool capturing(void* stream) override { return real_->capturing(stream); }
  bool device_route() override { return true; }
  void prepare_kernels() override { real_->prepare_kernels(); }
  int current_device() override { return real_->current_device(); }
  void* stream_create() override;  // main, then side
  void stream_destroy(void*) override {}
  void* mem_alloc_async(size_t nbytes, void* stream) override;
  void mem_free_async(void* p, void* stream) override;
  void reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) override;
  void scale_div(void* p, size_t count, DType dt, int64_t n, void* stream) override;
  void scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                 void* stream) override;
  bool wide_words() const override { return real_->wide_words(); }

 private:
  struct VStream {
    uint32_t group;
  };
  struct VEvent {
    uint32_t index;
    uint64_t seq = 0;  // the call that recorded it last
    uint64_t value = 0;
  };
  struct SlotState {
    uint64_t seq = 0;             // the call it holds (0: none yet)
    std::vector<void*> scratch;   // given back once that call's program ended
  };
  // the group of a route stream, or -1 for any other stream
  int group_of(void* stream) const;
  void append(uint32_t group, const program::Ins& ins);
  uint64_t taken(uint32_t group) const;  // the least of the bound slot's blocks' counts
  bool ended(uint32_t idx) const;  // the slot's program ended (or never launched)
  void give_back_ended();          // scratch of ended programs into the cache (cache_)
  bool wait_all_ended(int64_t within_ms);  // false: not all within the bound
  [[noreturn]] void unbound(const char* what) const;

  std::shared_ptr<DeviceOps> real_;
  const int64_t timeout_ms_;
  const uint32_t blocks_;
  void* bar_ = nullptr;  // device memory: kSlots x the group barriers (64 uint32 a slot), zeroed
  program::Slot* slots_ = nullptr;  // kSlots, page-aligned, registered
  uint64_t slots_dev_ = 0;
  SlotState state_[kSlots];
  std::deque<std::pair<uint64_t, uint32_t>> pending_;  // launched, not yet bound: (seq, slot)
  std::atomic<bool> aborted_{false};
  std::mutex mu_;  // pending_, state_[].scratch, leftovers_, cache_, sizes_
  uint64_t launched_ = 0, instructions_ = 0;
  // the call bound now (executor)
  program::Slot* cur_ = nullptr;
  uint32_t cur_idx_ = 0;
  uint64_t cur_seq_ = 0;
  uint64_t cur_len_[program::kGroups] = {};
  uint64_t cur_signals_ = 0;
  uint64_t prev_fin_addr_ = 0, prev_fin_value_ = 0;  // the previous program's fin
  VStream streams_[program::kGroups] = {{0}, {1}};
  int made_streams_ = 0;
  std::vector<VEvent*> events_;
  void* alloc_stream_ = nullptr;       // the real runtime's stream for scratch
  std::vector<void*> leftovers_;       // scratch given back outside a call
  // Scratch whose program ended, kept for the next calls (mu_): the runtime's pool gives its
  // free memory back at every synchronization, and a new allocation here synchronizes, so
  // without the cache each call would map its scratch anew (~1 ms a call on an H100). A call
  // takes the smallest cached buffer of its size up to twice it; beyond kCacheBytes the
  // least recently freed are freed.
  static constexpr size_t kCacheBytes = size_t(256) << 20;
  std::vector<std::pair<void*, size_t>> cache_;  // (scratch, bytes), least recently freed first
  size_t cached_bytes_ = 0;
  std::atomic<uint64_t> scratch_allocs_{0}, scratch_reuses_{0};
  std::unordered_map<void*, size_t> sizes_;  // every scratch allocated here -> its bytes
  uint64_t* sync_word_ = nullptr;      // sync inside a call: the kernel writes it
  uint64_t sync_word_dev_ = 0;
  uint64_t sync_count_ = 0;
};

}  // namespace api
}  // namespace hetccl
