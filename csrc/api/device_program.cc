// hetccl C API: the device route's program mode (contracts in device_program.h).
#include "device_program.h"

#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "../common.h"
#include "../errors.h"
#include "../reduce.h"

namespace hetccl {
namespace api {

using program::Ins;
using program::Slot;

namespace {
uint64_t ld(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void st(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
void pause(int& spins) {
  if (++spins > 64) sched_yield();
}
Ins ins(uint64_t op, uint64_t a0 = 0, uint64_t a1 = 0, uint64_t a2 = 0, uint64_t a3 = 0, uint64_t a4 = 0) {
  Ins i{};
  i.op = op;
  i.a[0] = a0;
  i.a[1] = a1;
  i.a[2] = a2;
  i.a[3] = a3;
  i.a[4] = a4;
  return i;
}
uint64_t addr(const void* p) { return uint64_t(reinterpret_cast<uintptr_t>(p)); }
}  // namespace

ProgramOps::ProgramOps(std::shared_ptr<DeviceOps> real, int64_t timeout_ms, uint32_t blocks)
    : real_(std::move(real)), timeout_ms_(timeout_ms), blocks_(blocks) {
  if (blocks_ < 1 || blocks_ > program::kMaxBlocks)
    throw CommError("hetccl: HETCCL_CAPI_PROGRAM_BLOCKS=" + std::to_string(blocks_) + " is not in 1.." +
                    std::to_string(program::kMaxBlocks));
  // the slots, then a page for the sync word, then zeroed pages (the barriers' first value)
  const size_t bytes = sizeof(Slot) * kSlots + 4096 + kBarBytes;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) throw CommError("hetccl: out of memory for the device programs");
  std::memset(p, 0, bytes);
  if (!real_->host_register(p, bytes)) {
    std::free(p);
    throw CommError("hetccl: the device runtime refused to page-lock the device programs' slots");
  }
  slots_ = static_cast<Slot*>(p);
  slots_dev_ = real_->device_address(p);
  if (slots_dev_ != addr(p)) {
    real_->host_unregister(p);
    std::free(p);
    slots_ = nullptr;
    throw CommError("hetccl: the device runtime maps page-locked memory at another address than the host's; "
                    "device programs need the same address (the route keeps its streams)");
  }
  sync_word_ = reinterpret_cast<uint64_t*>(static_cast<char*>(p) + sizeof(Slot) * kSlots);
  sync_word_dev_ = addr(sync_word_);
  alloc_stream_ = real_->stream_create();
  bar_ = real_->mem_alloc_async(kBarBytes, alloc_stream_);
  real_->memcpy_async(bar_, static_cast<char*>(p) + sizeof(Slot) * kSlots + 4096, kBarBytes, alloc_stream_);
  real_->sync(alloc_stream_);
}

ProgramOps::~ProgramOps() {
  // A kernel that has not ended (its caller's stream blocked by other work) still reads its
  // slot and may write its fin word: then the slots stay allocated (leaked), never freed under
  // a kernel, as the stream path does with its staging (stream_path.cc).
  constexpr int64_t kDrainMs = 5000;
  if (!wait_all_ended(kDrainMs)) {
    log_warn("capi", "device programs did not end within 5 s of the communicator's end: their slots are left "
                     "allocated");
    for (VEvent* e : events_) delete e;
    return;
  }
  try {
    give_back_ended();
    if (alloc_stream_) {
      for (void* q : leftovers_) real_->mem_free_async(q, alloc_stream_);
      for (auto& kv : cache_) real_->mem_free_async(kv.first, alloc_stream_);
      cache_.clear();
      if (bar_) real_->mem_free_async(bar_, alloc_stream_);
      real_->sync(alloc_stream_);
      real_->stream_destroy(alloc_stream_);
    }
  } catch (const std::exception& e) {
    log_warn("capi", std::string("closing the device programs: ") + e.what());
  }
  for (VEvent* e : events_) delete e;
  if (slots_) {
    real_->host_unregister(slots_);
    std::free(slots_);
  }
}

// ---------------------------------------------------------------------------- issuing thread
void ProgramOps::launch(void* stream, uint64_t seq, uint64_t fin_addr, uint64_t fin_value) {
  if (aborted_.load()) throw CommError("hetccl: the communicator was aborted");
  const uint32_t idx = uint32_t(launched_ % kSlots);
  Slot* s = &slots_[idx];
  const int64_t deadline = now_ms() + timeout_ms_;
  int spins = 0;
  while (!ended(idx)) {
    if (ld(&s->abort)) break;  // aborted: the kernel ends without more instructions
    if (now_ms() > deadline)
      throw CommTimeout("hetccl: Timed out: the device program of call " + std::to_string(state_[idx].seq) +
                        " did not end (its kernel waits on the caller's stream)");
    pause(spins);
  }
  if (ld(&s->abort) && state_[idx].seq && !ended(idx))
    throw CommError("hetccl: the communicator was aborted");
  give_back_ended();
  {
    std::lock_guard<std::mutex> g(mu_);
    state_[idx].seq = seq;
  }
  s->seq = seq;
  s->fin_addr = fin_addr;
  s->fin_value = fin_value;
  s->wide = real_->wide_words() ? 1 : 0;
  s->blocks = blocks_;
  for (uint32_t k = 0; k < program::kGroups; ++k) {
    s->len[k] = 0;
    for (uint32_t b = 0; b < program::kMaxBlocks; ++b) s->taken[k][b] = 0;
  }
  st(&s->abort, 0);
  real_->launch_program(stream, s, addr(s), static_cast<uint32_t*>(bar_) + idx * 64, blocks_);
  std::lock_guard<std::mutex> g(mu_);
  pending_.push_back({seq, idx});
  ++launched_;
}

bool ProgramOps::ended(uint32_t idx) const {
  // ended, and both groups have left the slot (program.h): its header may be rewritten
  const uint64_t seq = state_[idx].seq;
  if (seq == 0) return true;
  const Slot& s = slots_[idx];
  if (ld(&s.ended) != seq) return false;
  for (uint32_t g = 0; g < program::kGroups; ++g)
    if (ld(&s.left[g]) != seq) return false;
  return true;
}

void ProgramOps::give_back_ended() {
  std::lock_guard<std::mutex> g(mu_);
  for (uint32_t i = 0; i < kSlots; ++i) {
    if (state_[i].scratch.empty() || !ended(i)) continue;
    for (void* p : state_[i].scratch) {
      const size_t bytes = sizes_[p];
      cache_.push_back({p, bytes});
      cached_bytes_ += bytes;
    }
    state_[i].scratch.clear();
  }
  while (cached_bytes_ > kCacheBytes && !cache_.empty()) {  // the least recently freed go
    real_->mem_free_async(cache_.front().first, alloc_stream_);
    cached_bytes_ -= cache_.front().second;
    sizes_.erase(cache_.front().first);
    cache_.erase(cache_.begin());
  }
}

bool ProgramOps::wait_all_ended(int64_t within_ms) {
  // aborted programs end too (their waits pass), so this waits for them as well: their kernels
  // read the slots until they end
  const int64_t deadline = now_ms() + within_ms;
  for (uint32_t i = 0; i < kSlots; ++i) {
    int spins = 0;
    while (!ended(i)) {
      if (now_ms() > deadline) return false;
      pause(spins);
    }
  }
  return true;
}

void ProgramOps::abort_all() {
  aborted_.store(true);
  for (uint32_t i = 0; i < kSlots; ++i) st(&slots_[i].abort, 1);
}

// ---------------------------------------------------------------------------- executor thread
void ProgramOps::bind(uint64_t seq) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (pending_.empty() || pending_.front().first != seq)
      throw CommError("hetccl: internal: device program " + std::to_string(seq) + " was not launched");
    cur_idx_ = pending_.front().second;
    pending_.pop_front();
  }
  cur_ = &slots_[cur_idx_];
  cur_seq_ = seq;
  for (auto& l : cur_len_) l = 0;
  cur_signals_ = 0;
  // programs one after another: the previous one has written its fin word
  if (prev_fin_addr_) append(0, ins(program::WAIT, prev_fin_addr_, prev_fin_value_));
  prev_fin_addr_ = cur_->fin_addr;
  prev_fin_value_ = cur_->fin_value;
  give_back_ended();
}

void ProgramOps::unbind() {
  if (!cur_) return;
  for (uint32_t g = 0; g < program::kGroups; ++g) append(g, ins(program::END));
  cur_ = nullptr;
}

void ProgramOps::append(uint32_t g, const Ins& i) {
  if (!cur_) unbound("an operation on a route stream");
  const uint64_t pos = cur_len_[g];
  const int64_t deadline = now_ms() + timeout_ms_;
  int spins = 0;
  while (taken(g) + program::kRing <= pos) {  // the ring is full: the kernel reads on
    if (ld(&cur_->abort)) throw CommError("hetccl: the communicator was aborted");
    if (now_ms() > deadline)
      throw CommTimeout("hetccl: Timed out: the device program of call " + std::to_string(cur_seq_) +
                        " stopped reading its instructions");
    pause(spins);
  }
  cur_->ring[g][pos % program::kRing] = i;
  cur_len_[g] = pos + 1;
  st(&cur_->len[g], pos + 1);
  ++instructions_;
}

uint64_t ProgramOps::taken(uint32_t g) const {
  uint64_t least = ld(&cur_->taken[g][0]);
  for (uint32_t b = 1; b < blocks_; ++b) least = std::min(least, ld(&cur_->taken[g][b]));
  return least;
}

[[noreturn]] void ProgramOps::unbound(const char* what) const {
  throw CommError(std::string("hetccl: internal: ") + what + " outside a device program");
}

int ProgramOps::group_of(void* stream) const {
  for (uint32_t g = 0; g < program::kGroups; ++g)
    if (stream == &streams_[g]) return int(g);
  return -1;
}

void* ProgramOps::stream_create() {
  if (made_streams_ >= int(program::kGroups)) return real_->stream_create();
  return &streams_[made_streams_++];
}

void ProgramOps::wait_geq(void* stream, uint64_t word, uint64_t counter) {
  int g = group_of(stream);
  if (g < 0) return real_->wait_geq(stream, word, counter);
  append(uint32_t(g), ins(program::WAIT, word, counter));
}

void ProgramOps::write(void* stream, uint64_t word, uint64_t counter) {
  int g = group_of(stream);
  if (g < 0) return real_->write(stream, word, counter);
  append(uint32_t(g), ins(program::WRITE, word, counter));
}

void ProgramOps::memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->memcpy_async(dst, src, nbytes, stream);
  if (nbytes) append(uint32_t(g), ins(program::COPY, addr(dst), addr(src), nbytes));
}

void ProgramOps::sync(void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->sync(stream);
  if (!cur_) {  // outside a call: every program launched so far has ended
    const bool aborted = aborted_.load();
    if (!wait_all_ended(aborted ? 5000 : timeout_ms_)) {
      if (aborted) return;  // ~ProgramOps leaves the slots allocated
      throw CommTimeout("hetccl: Timed out waiting for the device programs of this communicator to end");
    }
    give_back_ended();
    return;
  }
  const uint64_t v = ++sync_count_;
  append(uint32_t(g), ins(program::WRITE, sync_word_dev_, v));
  const int64_t deadline = now_ms() + timeout_ms_;
  int spins = 0;
  for (;;) {
    uint64_t now = ld(sync_word_);
    bool done = real_->wide_words() ? now >= v : int32_t(uint32_t(now) - uint32_t(v)) >= 0;
    if (done) return;
    if (ld(&cur_->abort)) throw CommError("hetccl: the communicator was aborted");
    if (now_ms() > deadline)
      throw CommTimeout("hetccl: Timed out waiting for the device program of call " + std::to_string(cur_seq_));
    pause(spins);
  }
}

void* ProgramOps::event_create() {
  if (events_.size() >= program::kEvents) return real_->event_create();
  auto* e = new VEvent();
  e->index = uint32_t(events_.size());
  events_.push_back(e);
  return e;
}

void ProgramOps::event_record(void* event, void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->event_record(event, stream);
  auto* e = static_cast<VEvent*>(event);
  if (!cur_) unbound("an event record on a route stream");
  e->seq = cur_seq_;
  e->value = (cur_seq_ << 16) | ++cur_signals_;
  append(uint32_t(g), ins(program::SIGNAL, e->index, e->value));
}

void ProgramOps::stream_wait_event(void* stream, void* event) {
  int g = group_of(stream);
  if (g < 0) return real_->stream_wait_event(stream, event);
  auto* e = static_cast<VEvent*>(event);
  if (!cur_) unbound("an event wait on a route stream");
  if (e->seq != cur_seq_ || !e->value) return;  // an earlier call's: ended before this program
  append(uint32_t(g), ins(program::AWAIT, e->index, e->value));
}

void ProgramOps::event_destroy(void* event) {
  for (VEvent* e : events_)
    if (e == event) return;  // ours live as long as ProgramOps
  real_->event_destroy(event);
}

void* ProgramOps::mem_alloc_async(size_t nbytes, void* stream) {
  if (group_of(stream) < 0) return real_->mem_alloc_async(nbytes, stream);
  // Stream-ordered memory is valid on its own stream from the allocation on; the kernel runs
  // on the caller's stream, which is not ordered after it, so the allocation is waited for
  // here (alloc_stream_ holds nothing else: no kernel, no wait on an engine word).
  const size_t want = nbytes ? nbytes : 1;
  give_back_ended();
  {
    std::lock_guard<std::mutex> g(mu_);
    size_t best = cache_.size();
    for (size_t i = 0; i < cache_.size(); ++i)
      if (cache_[i].second >= want && cache_[i].second / 2 <= want &&
          (best == cache_.size() || cache_[i].second < cache_[best].second))
        best = i;
    if (best < cache_.size()) {  // its program ended: nothing on the device uses it any more
      void* p = cache_[best].first;
      cached_bytes_ -= cache_[best].second;
      cache_.erase(cache_.begin() + long(best));
      ++scratch_reuses_;
      return p;
    }
  }
  void* p = real_->mem_alloc_async(want, alloc_stream_);
  real_->sync(alloc_stream_);
  std::lock_guard<std::mutex> g(mu_);
  sizes_[p] = want;
  ++scratch_allocs_;
  return p;
}

void ProgramOps::mem_free_async(void* p, void* stream) {
  if (group_of(stream) < 0) return real_->mem_free_async(p, stream);
  std::lock_guard<std::mutex> g(mu_);
  if (cur_) state_[cur_idx_].scratch.push_back(p);
  else leftovers_.push_back(p);  // freed when ProgramOps closes (after every program ended)
}

void ProgramOps::reduce(void* dst, const void* src, size_t count, DType dt, ReduceOp op, void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->reduce(dst, src, count, dt, op, stream);
  require_kernel_dtype(dt);
  if (count) append(uint32_t(g), ins(program::REDUCE, addr(dst), addr(src), count, uint64_t(dt), uint64_t(op)));
}

void ProgramOps::scale_div(void* p, size_t count, DType dt, int64_t n, void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->scale_div(p, count, dt, n, stream);
  require_kernel_dtype(dt);
  if (count && n != 1) append(uint32_t(g), ins(program::DIV, addr(p), count, uint64_t(dt), uint64_t(n)));
}

void ProgramOps::scale_mul(void* p, size_t count, DType dt, const void* scalar_dev, const void* scalar_host,
                           void* stream) {
  int g = group_of(stream);
  if (g < 0) return real_->scale_mul(p, count, dt, scalar_dev, scalar_host, stream);
  require_kernel_dtype(dt);
  uint64_t imm = 0;
  if (!scalar_dev) std::memcpy(&imm, scalar_host, dtype_size(dt));
  if (count) append(uint32_t(g), ins(program::MUL, addr(p), count, uint64_t(dt), addr(scalar_dev), imm));
}

}  // namespace api
}  // namespace hetccl
