// hetccl C API: the communicator behind hetcclComm_t, its settings, and the collectives'
// entry points (one file per (collective, algorithm): coll_*.cc).
//
// Data goes straight down: c_api.cc (validates arguments, maps exceptions to result codes) ->
// the collective's file (which bytes go to which peer, step by step) -> Comm::step (one engine
// plan: engine.h) -> the transports (transport.h). No file here includes a transport's file.
//
// Links (comm.cc): a rank's ring neighbours on its own host are reached through shared memory,
// every other peer through tcp in lazy mode (connections dialled on the first message), so
// connections and shared memory per rank stay constant however many ranks the job has; a peer
// that is never addressed costs nothing but its row of the table.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../engine.h"
#include "../hetccl.h"
#include "../transport.h"
#include "bootstrap.h"
#include "device_route.h"
#include "stream_path.h"

namespace hetccl {
namespace api {

// Settings of the C faces: the one place they read the environment (settings.cc). The names
// are those of hetccl/config.py, which documents them all (tests/test_capi.py checks it).
struct Settings {
  int64_t timeout_ms = 300000;  // HETCCL_TIMEOUT_S: init and every operation
  int tcp_nconn = 4;            // HETCCL_TCP_NCONN
  std::string ifname;           // HETCCL_SOCKET_IFNAME: interface to listen on (root and tcp)
  size_t shm_slot_bytes = 0;    // HETCCL_SHM_SLOT_BYTES (0: the transport's default)
  int shm_nslots = 8;           // HETCCL_SHM_NSLOTS
  // HETCCL_SHM_BUDGET_BYTES: the shared memory one rank creates, both neighbours together
  // (0: 8 MiB, or 64 MiB in a process that has the device runtime loaded, whose device route
  // moves large chunks through the rings: comm.cc)
  size_t shm_budget_bytes = 0;
  int reduce_threads = 0;       // HETCCL_REDUCE_THREADS
  bool check_args = true;       // HETCCL_CHECK_ARGS (off / on; async counts as on here)
  bool shm = true;              // HETCCL_CAPI_SHM: ring neighbours on one host through shm
  std::string vendor;           // HETCCL_VENDOR (the label of this rank's vendor group)
  std::string vendor_split;     // HETCCL_VENDOR_SPLIT: the label by rank when HETCCL_VENDOR is unset
  bool crash_backtrace = false; // HETCCL_CRASH_BACKTRACE: crash.h
  std::string algo = "auto";    // HETCCL_CAPI_ALGO: auto (select.cc's table), ring, rd
  size_t rd_max_bytes = 64 << 10;  // select.cc: recursive doubling up to this size
  // The stream path's device runtime (stream_path.h): HETCCL_CAPI_DEVICE (cuda, hip, emulated,
  // emulated-hip) and HETCCL_CAPI_DEVICE_LIBRARY (the runtime's library; default: the one the
  // process has loaded under its usual name)
  std::string device_runtime;
  std::string device_library;
  // HETCCL_STREAM_CHUNK_BYTES: a stream-ordered all_reduce larger than this runs chunk by chunk,
  // its copies overlapping the host collective (stream_path.h); 0 (default): whole calls
  size_t stream_chunk_bytes = 0;
  size_t device_chunk_bytes = 0;  // HETCCL_CAPI_DEVICE_CHUNK_BYTES: the device route's chunk (0: the table)
  // HETCCL_STREAM_DEVICE_BYTES: stream-ordered collectives of at least this many bytes (the
  // larger of input and output) take the device route (device_route.h) where the runtime has
  // one; "off" (SIZE_MAX) never
  size_t stream_device_bytes = 1 << 20;
  // HETCCL_CAPI_ROUTE_LAUNCH: how the device route runs a call: "streams" (default: its plans'
  // stream operations on the route's own streams, device_route.h) or "kernel" (one program
  // kernel per call on the caller's stream, device_program.h)
  bool route_program = false;
  uint32_t program_blocks = 4;  // HETCCL_CAPI_PROGRAM_BLOCKS: a program's blocks per group
  // engine chunk tables: hetccl/tuning.py's HOST, MESSAGE and DEVICE rows (tests/test_capi.py
  // checks they are equal)
  EngineOptions::Table host_chunks, msg_chunks, device_chunks;
};
Settings read_settings();
// HETCCL_VENDOR_SPLIT's label for a rank (RANK when set, else `rank`), as hetccl/vendor.py.
std::string split_label(const std::string& split, int rank);
// The IPv4 address of interface `ifname`; throws CommError naming it if it has none.
std::string iface_addr(const std::string& ifname);

struct PeerInfo {
  std::string host_id, hostname, vendor;
  int64_t pid = 0;
};

class Comm {
 public:
  // vendor: this process's label when already known (a split's child keeps its parent's)
  Comm(int nranks, const hetcclUniqueId& id, int rank, const std::string* vendor = nullptr);
  ~Comm();

  const int rank, size;
  Settings settings;
  std::vector<PeerInfo> peers;  // every rank's row of the table (this one included)
  // Vendor groups from peers[].vendor (the same on every rank): labels in order of their first
  // rank, each group's ranks ascending; each rank's group and its index there. The
  // hierarchical all_reduce's (coll_allreduce_hier.cc); vgroup_lcm: the least common multiple
  // of the groups' sizes (0 above kHierMaxBlocks: that algorithm is not taken then).
  std::vector<std::vector<int>> vgroups;
  std::vector<int> vgroup_of, vlocal;
  int vgroup_lcm = 0;
  static constexpr int kHierMaxBlocks = 256;

  int next() const { return (rank + 1) % size; }
  int prev() const { return (rank + size - 1) % size; }

  // One step of an algorithm: sends and receives with the peers listed (each item's bytes move
  // whole; the engine cuts them into chunks). reduce: receives reduce into their buffers with
  // op/dtype instead of copying. Blocks until done; throws the engine's error.
  struct Item {
    int peer;
    bool send;
    void* ptr;
    size_t nbytes;
  };
  void step(uint64_t tag_base, const std::vector<Item>& items, bool reduce = false,
            ReduceOp op = ReduceOp::SUM, DType dtype = DType::UINT8);
  // The two halves of step, for algorithms whose sends and receives of one step carry
  // different tags (broadcast_chain): post returns 0 when no item has bytes.
  uint64_t post(uint64_t tag_base, const std::vector<Item>& items, bool reduce = false,
                ReduceOp op = ReduceOp::SUM, DType dtype = DType::UINT8);
  // One step on device memory (device_route.h): an engine device plan on the route's streams
  // (receives on main, sends on side); it returns once enqueued. Never reduces: receives land
  // where the items say, and the algorithm reduces them with the route's kernels.
  void post_device(uint64_t tag_base, const std::vector<Item>& items, DeviceRoute& d);
  // The device runtime the engine's device plans use (the stream path's), set once, and the
  // ring neighbours' links registered with it (device_route.h: on the issuing thread).
  void attach_device(std::shared_ptr<DeviceOps> ops, int device_index);
  void wait(uint64_t plan);
  // A new collective: its sequence number (the high bits of every tag it uses).
  uint64_t begin() { return ++seq_; }
  // The host all_reduce algorithms' common start (coll_allreduce_{ring,rd,hier}.cc): sendbuff
  // copied into recvbuff (they work in place from then on) and the call's sequence number
  // taken -- every rank takes one per call, even where nothing moves, so tags stay in step.
  // False where nothing is left to move (one rank, or no bytes).
  bool begin_in_place(const void* send, void* recv, size_t nbytes, uint64_t& seq) {
    if (send != recv && nbytes) std::memmove(recv, send, nbytes);
    seq = begin();
    return size > 1 && nbytes > 0;
  }
  // tag of step `s` of collective `seq`; the check's steps have their own range.
  static uint64_t tag(uint64_t seq, uint32_t s, bool check = false);
  static constexpr uint32_t kMaxSteps = 1u << 15;

  // Point to point (the transport's tagged path, tag space of its own: FIFO per pair).
  RequestPtr post_send(int peer, const void* buf, size_t nbytes);
  RequestPtr post_recv(int peer, void* buf, size_t nbytes);
  // A small message of the communicator's own on the transport's tagged path, beside the
  // engine's rings (shm: the tagged ring, not the zero-copy one), so it never queues behind
  // plans that hold a link's ring slots (a device-route call's chunks wait there for the
  // stream). tag: a Comm::tag of this call; the point-to-point bit keeps it apart from the
  // engine's tags, and the low bits from the users' point-to-point messages.
  RequestPtr post_tagged(int peer, bool send, void* buf, size_t nbytes, uint64_t tag);
  // Waits for a transport request of the communicator's own (the check's summary, host point to
  // point) up to the timeout, in slices, so that an abort from another thread (torch's watchdog
  // calling ncclCommAbort on a hung peer) ends the wait at once instead of after the timeout:
  // throws CommError then. Returns the bytes transferred.
  size_t wait_request(const RequestPtr& req);
  // A request a failed call leaves behind (its group failed before waiting for it): a receive
  // no data reached is withdrawn as if never posted; anything else gets within_ms to finish.
  // True once the transport is done with its buffer.
  bool settle(const RequestPtr& req, bool recv, int64_t within_ms);
  // Transport::cancel of a posted receive on its peer's link (unpost: as if never posted);
  // false for a request of no link or a closed transport.
  bool withdraw(const RequestPtr& req, bool unpost);

  // Failure state: after a non-argument error every call fails at once with it. Thread-safe
  // (the stream path's executor breaks the communicator while the caller issues).
  void mark_broken(hetcclResult_t code, const std::string& text);
  // Also learns of a failure the engine met on its own (a device plan's peer died after the
  // executor had moved on: nothing waits for device plans on the host).
  hetcclResult_t broken_code();
  std::string broken_text();
  // Breaks the communicator with the code of an exception (classify), unless it is an argument
  // refusal and arguments_too is false (host calls: the communicator stays usable).
  void note_failure(std::exception_ptr e, bool arguments_too);
  // The stream path, created on the first call with a stream (stream_path.h). has_streams():
  // whether it exists (host calls then run on its executor, in order).
  StreamPath& streams();
  bool has_streams() const {
    std::lock_guard<std::mutex> g(stream_path_mu_);
    return stream_path_ != nullptr;
  }
  std::string last_error;
  std::map<std::string, uint64_t> algo_runs;  // "all_reduce_ring", ... (info(): which ran)
  // PreMulSum operators (hetcclRedOpCreatePreMulSum): op value hetcclNumOps + index.
  struct PreMul {
    bool live = false;
    int dtype = 0;
    bool device = false;       // the scalar is read when the call runs (a device pointer)
    const void* ptr = nullptr; // device: where it lives
    char value[8] = {0};       // host immediate: its value
  };
  std::vector<PreMul> premul;

  std::string info();
  void abort();
  // hetcclCommAbort from another thread than a call in progress: interrupt() ends every wait of
  // the communicator at once (the executor's, the issuing thread's, the engine's plans: each
  // fails with "aborted"), wait_calls_left() waits until every C API call that entered has
  // returned, and only then is the communicator torn down and freed.
  void interrupt();
  // true once every call left; false: one is still inside after 30 s (a wait that no interrupt
  // reaches, e.g. a split's bootstrap join): the caller must not free the communicator then.
  bool wait_calls_left(int own = 0);  // own: calls the caller itself is inside (CallGuard)
  bool aborting() const { return aborting_.load(); }
  // A buffer that a request given up on (timeout, abort) may still be written into or read
  // from by its transport: kept until the communicator's transports are closed (~Comm).
  void keep_until_closed(std::shared_ptr<void> buf);
  struct CallGuard {  // one C API call in progress (c_api.cc run())
    explicit CallGuard(Comm& c) : c_(c) { c_.calls_.fetch_add(1); }
    ~CallGuard() { c_.calls_.fetch_sub(1); }
    Comm& c_;
  };

  // hetcclCommShrink (c_api.cc): the key of a shrink that excludes `excluded` (sorted): the
  // set and how many shrinks of this set this rank made before. Every survivor of a set takes
  // part in every shrink of that set (it is never excluded from it), so all survivors derive
  // the same key whatever else each of them did. Then the unique id's passage from the leader
  // to the other survivors through their bootstrap listeners (bootstrap.h Mailbox), which
  // needs nothing of this communicator's transports or engine.
  uint64_t next_shrink(const std::vector<int>& excluded);
  void mail_to(int peer, uint64_t key, const std::string& payload);
  std::string mail_from(int leader, uint64_t key);

 private:
  Transport& link(int peer);
  // Declared before the transports, so destroyed after them (keep_until_closed).
  std::mutex kept_mu_;
  std::vector<std::shared_ptr<void>> kept_;
  // The two transports the C API runs, chosen from the registry by capability (comm.cc): near
  // (zero-copy rings to ring neighbours on this host), far (every other peer, connected lazily).
  std::shared_ptr<Transport> far_, near_;
  std::string far_name_, near_name_;
  std::map<int, std::shared_ptr<Transport>> links_;
  std::unique_ptr<Engine> engine_;
  uint64_t seq_ = 0;
  size_t table_bytes_ = 0;  // the bootstrap's table as this rank received it (every rank's row)
  std::atomic<hetcclResult_t> broken_code_{hetcclSuccess};
  std::mutex broken_mu_;
  std::string broken_text_;
  // Created by the first call with a stream (streams()), read by interrupt() on an aborting
  // thread: both under stream_path_mu_.
  mutable std::mutex stream_path_mu_;
  std::unique_ptr<StreamPath> stream_path_;
  bool closed_ = false;
  std::atomic<bool> aborting_{false};  // set first by interrupt() / abort(): wait_request gives up
  std::atomic<int> calls_{0};          // C API calls in progress (CallGuard)
  std::string secret_;                  // the unique id's: authenticates mail between ranks
  std::vector<std::string> listeners_;  // every rank's bootstrap listener (its mailbox)
  std::unique_ptr<Mailbox> mailbox_;    // this rank's, for the communicator's life
  std::map<std::vector<int>, uint64_t> shrinks_;  // excluded set -> shrinks of it so far
};

// An exception's result code and text (c_api.cc and the stream path map errors alike):
// argument refusals (ArgMismatch: hetcclInvalidArgument, UsageRefusal: hetcclInvalidUsage) set
// *argument; a dead peer or a timeout is hetcclRemoteError, other CommErrors hetcclSystemError,
// anything else hetcclInternalError.
hetcclResult_t classify(std::exception_ptr e, std::string* text, bool* argument);

// Algorithm selection (select.cc: the one table of switch points).
enum class Algo { Ring, RecursiveDoubling, Bruck, Chain, Binomial, Hierarchical };
Algo select_all_reduce(const Comm& c, size_t bytes);
Algo select_check(const Comm& c);
Algo select_broadcast(const Comm& c, size_t bytes);  // Chain or Binomial
Algo select_all_gather(const Comm& c, size_t out_bytes);      // Ring or Bruck
Algo select_reduce_scatter(const Comm& c, size_t in_bytes);   // Ring or RecursiveDoubling

// The collectives (coll_*.cc). Arguments are validated by c_api.cc; counts in elements.
void all_reduce_ring(Comm& c, const void* send, void* recv, size_t count, DType dt, size_t esize,
                     ReduceOp op);
void all_reduce_recursive_doubling(Comm& c, const void* send, void* recv, size_t count, DType dt,
                                   size_t esize, ReduceOp op);
void all_reduce_hier(Comm& c, const void* send, void* recv, size_t count, DType dt, size_t esize,
                     ReduceOp op);
void reduce_scatter_ring(Comm& c, const void* send, void* recv, size_t recvcount, DType dt,
                         size_t esize, ReduceOp op);
void all_gather_ring(Comm& c, const void* send, void* recv, size_t sendcount, size_t esize);
void all_gather_bruck(Comm& c, const void* send, void* recv, size_t sendcount, size_t esize);
void reduce_scatter_rd(Comm& c, const void* send, void* recv, size_t recvcount, DType dt,
                       size_t esize, ReduceOp op);
void broadcast_chain(Comm& c, const void* send, void* recv, size_t nbytes, int root);
void broadcast_binomial(Comm& c, const void* send, void* recv, size_t nbytes, int root);
// blk bytes from block p of send to rank p, block p of recv from rank p (send == recv allowed)
void all_to_all_pairwise(Comm& c, const void* send, void* recv, size_t blk);
// The argument check (check.cc): a summary all_reduce of every rank's (collective, count,
// dtype, op, root), then every rank's header to every rank where they disagree (select_check);
// throws ArgMismatch with the same text on every rank.
// The collectives as the argument check's header names them (values travel between ranks).
enum class Coll : int64_t { AllReduce = 1, Broadcast = 2, AllGather = 3, ReduceScatter = 4, Reduce = 5, AllToAll = 6 };
const char* coll_name(Coll c);  // "all_reduce", ...

// A refusal of the call's usage (hetcclInvalidUsage) rather than of an argument's value.
struct UsageRefusal : ArgMismatch {
  using ArgMismatch::ArgMismatch;
};
// The check found that EVERY rank refused the call itself: each returned the refusal to its
// caller at the call and no data moved, so the communicator is not broken by it (a blocking
// NCCL communicator stays usable after an argument error). Thrown as one of the two below;
// Comm::note_failure ignores it.
struct EveryRankRefused {};
struct ArgRefusedEverywhere : ArgMismatch, EveryRankRefused {
  using ArgMismatch::ArgMismatch;
};
struct UsageRefusedEverywhere : UsageRefusal, EveryRankRefused {
  using UsageRefusal::UsageRefusal;
};
// refusal: this rank's own verdict on its arguments ("" when fine), shared with every rank;
// usage: it is a usage refusal (UsageRefusal on every rank).
// device_route: this rank took the device route (device_route.h); *all_device (when given):
// whether every rank did (with the check off: this rank's own route, NCCL's rule that ranks
// call alike).
void check_args(Comm& c, Coll coll, int64_t count, int64_t dtype, int64_t op, int64_t root,
                const std::string& refusal, bool usage, bool device_route = false,
                bool* all_device = nullptr);

}  // namespace api
}  // namespace hetccl
