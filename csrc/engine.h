// hetccl engine: the one progress engine behind every cross-vendor collective.
//
// Layering (docs/architecture.md): Python algorithms decide *what* crosses vendors (which ranges
// go to which peer, reduced or copied); they hand each cross-vendor step to the engine as one
// Plan. The engine moves the bytes over the Transport interface (transport.h) -- it never
// includes a transport's file -- for host memory and for device memory alike, with no Python
// per chunk and no GIL held:
//
//  * Host plans run on whichever thread waits for them (wait() drives progress itself, so a
//    synchronous collective has no thread hand-off), or on the engine's proxy thread.
//  * Device plans are enqueued on the caller's streams when they are posted (device_ops.h:
//    copies between device memory and pinned ring slots, stream waits on and writes to flag
//    words in pinned host memory); the proxy thread plays the host side of the protocol by
//    reading and writing those words. Posting returns in microseconds; the stream is what waits.
//
// Channels. Each cross-vendor peer is one Link over that peer's transport:
//  * zero-copy links (transports with a zc ring: shm) carry data through the ring's slots: host
//    data is copied (or reduced) in and out of the slots by the engine, device data is copied by
//    the device's copy engines straight into and out of the slots (registered as pinned memory);
//  * message links (every other transport: tcp, ucx) carry host data straight from and into the
//    caller's memory with isend/irecv(_reduce), and device data through engine-owned pinned
//    staging slots -- or, on links the caller marks direct (EngineOptions::device_direct_peers:
//    the transport takes this device's memory itself, e.g. UCX with cuda_copy), straight from and
//    into device memory with isend_device/irecv_device, the stream only signalling when the data
//    is ready and waiting until it has arrived (engine_device.cc, engine_link.cc: "direct device path").
// Ring positions are assigned in post order, so plans of one engine (host or device) use each
// link's slots strictly in the order every rank posts them; both ends cut a peer's data into
// chunks of the plan's chunk_bytes in the order the items are listed, so chunk k of a plan has
// the same position, length and tag on both sides (tag = tag_base | k mod 2^index_bits).
//
// Argument checks ride on the plan: when spec.check is set, the plan sends its CheckHeader (the
// collective's code, element count, dtype, op, root and device type, plus an error text when
// this rank already knows the call is wrong) to every cross-vendor peer of the engine, on the
// transport's tagged path, and expects theirs. With wait_check the posting thread waits for all
// headers and compares them before any data moves: a difference throws ArgMismatch with the
// same text on every rank and leaves every ring untouched (the group stays usable). Without
// wait_check (device plans whose arguments were already checked once) the proxy compares them
// as they arrive and holds the plan's data back until they match; a difference then breaks the
// engine (the streams already hold the plan's copies).
//
// Failure. A timeout, a dead peer or a protocol error fails the plan and breaks the engine:
// every pending and later plan fails with the first error (message includes "Timed out" for
// timeouts, as torch's backends word them), and the flag words are released so that no stream
// stays blocked on them. close() does the same and joins the proxy thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device_ops.h"
#include "reduce.h"
#include "transport.h"

namespace hetccl {

// Raised when ranks disagree on a collective's arguments (headers differ). Python maps it to
// ValueError: the verdict is the same on every rank.
struct ArgMismatch : CommError {
  using CommError::CommError;
};

struct CheckHeader {
  static constexpr int kFields = 6;  // collective, numel, dtype, op, root, device type
  int64_t f[kFields] = {0, 0, 0, 0, 0, 0};
};

struct PlanItem {
  int peer;
  bool send;      // true: send [ptr, ptr+nbytes) to peer; false: receive into it
  uintptr_t ptr;
  size_t nbytes;
};

struct PlanSpec {
  std::vector<PlanItem> items;  // per peer, in the order both ends list them
  uint64_t tag_base = 0;        // the collective's tag bits; chunk index goes in the low bits
  uint32_t index_bits = 13;
  // Host receives: reduce into the buffer instead of copying (AVG reduces as SUM). Device plans
  // never reduce: their receives land in scratch buffers the caller reduces on its stream.
  bool reduce = false;
  ReduceOp op = ReduceOp::SUM;
  DType dtype = DType::UINT8;
  // Round trip (host, zero-copy links, two ranks): items are {peer, send, give} and
  // {peer, recv, keep}; the peer reduces our give chunks in its slots and writes the sums back,
  // which we copy out over give; we do the same with its chunks into keep (exchange contract of
  // docs/algorithms.md: three passes over memory per byte instead of four).
  bool roundtrip = false;
  size_t chunk_bytes = 0;  // > 0: this chunk size (round trips); 0: the engine's tables
  int64_t timeout_ms = -1;
  // argument check (see the file comment)
  bool check = false;
  CheckHeader header;
  uint32_t compare_mask = 0x3F;  // which header fields must agree
  std::string error;             // non-empty: this rank already knows the call is wrong
  bool header_for_group = false; // the header holds for this rank's whole vendor group (checked)
  uint64_t header_tag = 0;
  std::string what;              // collective name for messages ("all_reduce #12")
  // device plans: data on device `device`; `stream` runs the receives (H2D) and is what later
  // work waits on; `side_stream` runs the sends (D2H) so both copy directions overlap.
  bool device = false;
  int device_index = 0;
  uintptr_t stream = 0;
  uintptr_t side_stream = 0;
  // Point-to-point message (engine_messages.cc): exactly one item, device data, moved whole as
  // ONE tagged message with tag tag_base (no chunks, no ring positions), so it is wire-identical
  // to a Transport::isend/irecv of that tag: it matches the peer's message of the same tag FIFO,
  // however the peer posted it, and it is independent of the order of collectives on the link.
  bool message = false;
};

struct EngineOptions {
  int rank = 0;
  int threads = 1;                 // host reduction threads
  std::vector<int> check_peers;    // every cross-vendor peer (check headers go to all of them)
  std::vector<std::vector<int>> groups;  // vendor groups (ranks), for header messages
  std::vector<int> group_of;             // rank -> index in groups
  // names of header codes, for messages: field -> code -> name
  std::vector<std::map<int64_t, std::string>> field_names;
  size_t device_slot_bytes = 8 << 20;   // staging slots of message links for device data
  uint32_t device_slots = 8;
  int msg_window = 8;              // message links: requests in flight per peer and direction
  // Message links whose device data goes to the transport directly (its device_direct() must be
  // true; both ends of a link must agree, which the Python bridge guarantees by deciding from
  // both ranks' capability tables). Other links stage device data through pinned slots.
  std::vector<int> device_direct_peers;
  // Chunk size by the bytes one link carries in one direction during one plan (rows: max bytes,
  // chunk; hetccl/tuning.py): host data on zero-copy rings, device data, host data on message
  // transports. force_chunk > 0 replaces all three (HETCCL_CHUNK_BYTES).
  using Table = std::vector<std::pair<uint64_t, uint64_t>>;
  Table host_chunks, device_chunks, msg_chunks;
  uint64_t force_chunk = 0;
  // A device plan fails after its issue returned: log and stop the process (true), or release
  // the streams and let the next call raise (false). Never while closing.
  bool abort_on_device_failure = true;
};

class Engine {
 public:
  Engine(std::map<int, std::shared_ptr<Transport>> links, EngineOptions opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Posts a plan; returns its id. wait_check: see the file comment (throws ArgMismatch).
  // Throws CommError at once when the engine is broken or closed.
  uint64_t post(const PlanSpec& spec, bool wait_check);
  // Host plans: waits (driving progress) until done; rethrows the plan's error. CommTimeout
  // after the plan's own deadline.
  void wait(uint64_t id);
  bool test(uint64_t id);  // true once done; rethrows the plan's error
  // Device registration of host memory the device plans copy from/to (ring slots): called once
  // per device runtime before the first device plan.
  void set_device_ops(std::shared_ptr<DeviceOps> ops);
  // Registers the flag words (and message links' staging slots) of the links to `peers` with
  // the device runtime now, on the calling thread, instead of at the first device plan that
  // uses them (for a caller whose later posts may run while a stream waits: engine_device.cc).
  void prepare_device(int device_index, const std::vector<int>& peers);
  // Tests: message links start their positions at `base` instead of 0, so a short run crosses
  // 2^32 (the wrap-around of free-running positions). Only before the first plan; zero-copy
  // links take their positions from the transport's rings and are refused.
  void set_position_base(uint32_t base);
  // Orders `waiter` after the work queued on `waitee` so far (one reused event: a stream wait
  // keeps the event's state at the time it is enqueued).
  void stream_join(int device_index, uintptr_t waiter, uintptr_t waitee);
  // Before a normal close: waits up to timeout_ms until no device plan or message is pending
  // (their streams ran and their data left or arrived), so an isend or async collective issued
  // just before the group is destroyed still reaches its peer. true when nothing was left; false
  // after the timeout or once the engine broke (close() then fails what is left).
  bool drain(int64_t timeout_ms);
  std::string broken();  // "" while healthy, else the first failure
  void rethrow_broken();  // throws the first failure as its kind (CommTimeout, PeerFailure, ...)
  std::map<std::string, uint64_t> stats();
  void close();
  // Unregisters the device runtime's registrations of the zero-copy links' rings (the shared
  // memory of the transports, which the engine does not own), after close() and before the
  // transports close. Contract: the caller has made sure no queued stream work still uses the
  // rings (hetccl/engine.py: its streams synchronized). Else the registration outlives the
  // mapping: the next transport's segment, mapped at the same address, is then refused by
  // the runtime as "already registered" and device copies reach the old pages (the peer reads
  // stale data). Idempotent; the destructor unregisters whatever is left.
  void unregister_rings();

 private:
  struct Plan;
  struct Link;
  struct Message;      // engine_messages.cc
  struct MessageSlot;  // engine_messages.cc
  struct SendChunk;
  struct RecvChunk;
  void proxy_loop();
  bool progress_locked();  // one pass over every link; true if anything moved
  bool progress_headers(Plan& p);
  bool progress_link(Link& l);
  bool send_zc(Link& l);
  bool recv_zc(Link& l);
  bool finish_consumed(Link& l);
  bool send_msg(Link& l);
  bool recv_msg(Link& l);
  void bind_direct(Link& l, int device_index);  // before a direct device message (proxy thread)
  struct DeviceCopy {
    void* dst;
    const void* src;
    size_t len;
    uint32_t pos;
  };
  struct DeviceLane {
    Link* link;
    bool direct = false;  // direct device path: no copies, only flag writes and waits
    std::vector<DeviceCopy> sends, recvs;
  };
  using DevicePart = std::vector<DeviceLane>;
  void start_locked(std::shared_ptr<Plan> p);
  DevicePart device_part_locked(Plan& p);
  void enqueue_device(Plan& p, const DevicePart& part);
  std::string direct_memory() const;             // "cuda" / "rocm" / "host" (bind, prepare)
  void prepare_direct(const DevicePart& part);  // issuing thread: Transport::prepare_device
  void drive_device_sync(Plan& p, const DevicePart& part);
  void post_headers(Plan& p, bool waits);
  bool a_peer_did_not_wait(const Plan& p) const;
  std::string compare_headers(Plan& p);
  [[noreturn]] void fail_mismatch(Plan& p, const std::string& generic);
  void finish_chunk(Plan& p);
  void mark_done(Plan& p);
  void bury(const std::shared_ptr<Plan>& p);
  void withdraw_host_requests();  // break_engine: see engine_failure.cc
  void fail_plan(Plan& p, const std::string& msg, int kind);
  void break_engine(const std::string& msg, int kind);
  void release_device_waits();
  void check_deadlines();
  void check_liveness();
  // check_liveness at most every 100 ms (one clock for the waiters and the proxy); a peer
  // found dead or a transport error breaks the engine. Caller holds mu_.
  void check_liveness_due();
  void ensure_device_state(Link& l);  // once per link (engine_device.cc)
  std::shared_ptr<Plan> find(uint64_t id);
  // point-to-point messages (engine_messages.cc)
  struct MessageCopy;
  uint64_t post_message(const std::shared_ptr<Plan>& p);
  MessageCopy start_message_locked(const std::shared_ptr<Plan>& p, char* staging, size_t cap);
  void enqueue_message(const PlanSpec& s, const MessageCopy& c);
  bool progress_messages();
  void release_message_waits();
  void drop_messages();
  char* staging_take(size_t cap);  // nullptr: none free
  void staging_give(char* p, size_t cap);
  uint32_t slot_take();
  void grow_slots();
  Transport& link_transport(int peer);  // the transport of peer's link

  EngineOptions opts_;
  std::map<int, std::unique_ptr<Link>> links_;
  std::shared_ptr<DeviceOps> dev_;
  std::mutex mu_;                 // plans_, link queues and positions, broken_ (progress state)
  std::condition_variable cv_;    // proxy wake-up
  std::map<uint64_t, std::shared_ptr<Plan>> plans_;
  std::vector<std::shared_ptr<Plan>> graveyard_;  // see bury()
  uint64_t next_id_ = 1;
  std::string broken_;
  int broken_kind_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> device_active_{0};  // device plans in flight: the proxy polls while > 0
  std::atomic<int> waiters_{0};        // threads driving progress in wait()
  std::thread proxy_;
  bool closed_ = false;
  // flag words for device plans (one page per link, registered with the device runtime)
  std::vector<void*> flag_pages_;
  // words streams wait on, where the runtime allocates them (DeviceOps::wait_word_alloc); freed
  // with the flag pages
  std::vector<void*> wait_words_;
  std::vector<void*> registered_;
  // HETCCL_CHECK_ARGS=async: a device plan's stream passes the plan only once its argument
  // headers have been compared (the verdict word, a position per such plan in issue order,
  // advanced by the proxy; released when the engine breaks). Without it a broadcast root (no
  // receive, so nothing of the stream waited for a peer) returned from a synchronize before
  // the mismatch was known, issued its next collective on the still-healthy engine, and that
  // one's receives were released with the stale data when the engine broke under it: a wrong
  // value and no error (test_gpu_suite test_bad_input_async_checks, 1+1+1 root). Now the
  // rank knows the verdict before anything after the mismatching call can run on its stream.
  void* verdict_ = nullptr;  // engine_detail::Word, page-locked (or the runtime's wait word)
  uint64_t verdict_dev_ = 0;
  uint32_t verdict_issued_ = 0;
  std::deque<std::shared_ptr<Plan>> verdict_q_;  // plans whose verdict is not yet published
  void ensure_verdict_word();
  void publish_verdicts();
  std::vector<void*> events_;  // fork/join events of device plans (reused)
  void* join_event_ = nullptr;
  std::mutex issue_mu_;        // device enqueueing (events_ and join_event_ are reused)
  int64_t last_liveness_ms_ = 0;
  std::map<std::string, uint64_t> stats_;
  // point-to-point messages in post order, their flag-word slots and pinned staging buffers
  // (engine_messages.cc; all under mu_)
  std::deque<std::unique_ptr<Message>> messages_;
  std::vector<std::unique_ptr<MessageSlot>> msg_slots_;
  std::vector<uint32_t> msg_free_slots_;
  std::map<size_t, std::vector<char*>> staging_free_;  // capacity -> free buffers
  size_t staging_free_bytes_ = 0;
};

}  // namespace hetccl
