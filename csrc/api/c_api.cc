// hetccl C API entry points (hetccl.h): argument validation, the argument check, errors mapped
// to result codes and texts. Algorithms live in coll_*.cc, the communicator in comm.cc.
//
// Error contract:
//  * a bad argument this rank can see (unknown dtype or op, a root out of range, a stream whose
//    device runtime cannot be opened) is that rank's refusal; with the argument check on
//    (default) it travels in the check's header so that every rank returns
//    hetcclInvalidArgument / hetcclInvalidUsage with its text, and the communicator stays
//    usable. On the stream path (stream_path.h) the refusing rank returns it at once and the
//    others' calls break their communicators with it (an async error: their streams already
//    hold the call's copies);
//  * ranks that disagree (counts, dtypes, ops, roots) all return hetcclInvalidArgument;
//  * a dead peer or a timeout returns hetcclRemoteError, anything else hetcclInternalError or
//    hetcclSystemError; the communicator is then broken: every later call returns that code at
//    once, and hetcclCommGetAsyncError reports it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "../common.h"
#include "../hetccl.h"
#include "bootstrap.h"
#include "comm.h"

using hetccl::api::Comm;

struct hetcclComm {
  Comm* c;
};

namespace {

thread_local std::string t_last_error;

using UsageError = hetccl::api::UsageRefusal;

hetcclResult_t fail(hetcclComm* comm, hetcclResult_t code, const std::string& text) {
  t_last_error = text;
  if (comm && comm->c) comm->c->last_error = text;
  return code;
}

struct DT {
  bool ok = false;
  size_t size = 0;
  hetccl::DType engine = hetccl::DType::UINT8;
  bool unsigned_wide = false;  // uint32/uint64: reduced as int32/int64 where the bits agree (unsigned_order)
  const char* name = "?";
};

DT dtype_of(int d) {
  using hetccl::DType;
  DT t;
  t.ok = true;
  switch (d) {
    case hetcclInt8: t.size = 1; t.engine = DType::INT8; t.name = "int8"; break;
    case hetcclUint8: t.size = 1; t.engine = DType::UINT8; t.name = "uint8"; break;
    case hetcclInt32: t.size = 4; t.engine = DType::INT32; t.name = "int32"; break;
    case hetcclUint32: t.size = 4; t.engine = DType::INT32; t.unsigned_wide = true; t.name = "uint32"; break;
    case hetcclInt64: t.size = 8; t.engine = DType::INT64; t.name = "int64"; break;
    case hetcclUint64: t.size = 8; t.engine = DType::INT64; t.unsigned_wide = true; t.name = "uint64"; break;
    case hetcclFloat16: t.size = 2; t.engine = DType::FLOAT16; t.name = "float16"; break;
    case hetcclFloat32: t.size = 4; t.engine = DType::FLOAT32; t.name = "float32"; break;
    case hetcclFloat64: t.size = 8; t.engine = DType::FLOAT64; t.name = "float64"; break;
    case hetcclBfloat16: t.size = 2; t.engine = DType::BFLOAT16; t.name = "bfloat16"; break;
    default: t.ok = false;
  }
  return t;
}

bool op_of(int op, hetccl::ReduceOp* out) {
  using hetccl::ReduceOp;
  switch (op) {
    case hetcclSum: *out = ReduceOp::SUM; return true;
    case hetcclProd: *out = ReduceOp::PROD; return true;
    case hetcclMax: *out = ReduceOp::MAX; return true;
    case hetcclMin: *out = ReduceOp::MIN; return true;
    case hetcclAvg: *out = ReduceOp::AVG; return true;
    default: return false;
  }
}

// Runs one call on a healthy communicator, mapping exceptions to result codes.
hetcclResult_t run(hetcclComm* comm, const char* what, const std::function<void(Comm&)>& fn) {
  if (!comm || !comm->c)
    return fail(comm, hetcclInvalidArgument, std::string("hetccl: ") + what + ": comm is NULL");
  Comm& c = *comm->c;
  Comm::CallGuard in_call(c);  // hetcclCommAbort from another thread waits for it to leave
  if (c.broken_code() != hetcclSuccess)
    return fail(comm, c.broken_code(), std::string("hetccl: ") + what +
                                           ": the communicator is unusable after an earlier failure: " +
                                           c.broken_text());
  if (c.aborting())  // entered while another thread aborts: nothing may start (NCCL: undefined)
    return fail(comm, hetcclInvalidUsage, std::string("hetccl: ") + what + ": the communicator is being aborted");
  try {
    fn(c);
    return hetcclSuccess;
  } catch (...) {
    std::string text;
    bool argument = false;
    hetcclResult_t code = hetccl::api::classify(std::current_exception(), &text, &argument);
    if (!argument) c.mark_broken(code, text);
    return fail(comm, code, text);
  }
}

// This rank's refusal of a call: text, and whether it is of usage (else of an argument).
struct Refusal {
  std::string text;
  bool usage = false;
  bool empty() const { return text.empty(); }
};

// The check (when on) with this rank's own refusal; without it, the refusal returns here.
// device_route / all_device: check_args's (comm.h).
void checked(Comm& c, hetccl::api::Coll coll, size_t count, int dtype, int op, int root,
             const Refusal& refusal, bool device_route = false, bool* all_device = nullptr) {
  if (all_device) *all_device = device_route;
  if (c.settings.check_args)
    hetccl::api::check_args(c, coll, int64_t(count), dtype, op, root, refusal.text, refusal.usage, device_route,
                            all_device);
  if (!refusal.empty()) {
    if (refusal.usage) throw UsageError(refusal.text);
    throw hetccl::ArgMismatch(refusal.text);
  }
}

// The datatype known, and the bytes the call spans (count elements, `blocks` times: one per rank
// for all_gather, reduce_scatter and all_to_all) within an address space: a count that is a
// negative int cast to size_t is refused, never wrapped into a small size.
Refusal common_refusal(const char* what, const DT& dt, int dtype, size_t count, size_t blocks = 1) {
  if (!dt.ok) return {std::string("hetccl: ") + what + ": unknown datatype " + std::to_string(dtype)};
  size_t b = 0;
  if (__builtin_mul_overflow(count, dt.size, &b) || __builtin_mul_overflow(b, blocks, &b) ||
      b > size_t(PTRDIFF_MAX))
    return {std::string("hetccl: ") + what + ": count " + std::to_string(count) + " of " + std::to_string(dt.size) +
            "-byte elements" + (blocks > 1 ? " times " + std::to_string(blocks) + " ranks" : "") +
            " is more bytes than an address space holds"};
  return {};
}

[[noreturn]] void refuse(const Refusal& why) {
  if (why.usage) throw UsageError(why.text);
  throw hetccl::ArgMismatch(why.text);
}

// A new unique id: a bootstrap root in this process, listening where the settings say.
hetcclUniqueId new_unique_id(const hetccl::api::Settings& s) {
  std::string host = s.ifname.empty() ? hetccl::api::default_root_host() : hetccl::api::iface_addr(s.ifname);
  return hetccl::api::make_root(host, s.timeout_ms);
}

// A host call: inline, or on the stream path's executor once the communicator has one (the
// order every rank issues in is then kept: stream_path.h).
void host_call(Comm& c, const std::function<void(Comm&)>& fn) {
  if (c.has_streams())
    c.streams().run_host(fn);
  else
    fn(c);
}

void* resolve_stream(Comm& c, void* stream) {
  return stream == HETCCL_STREAM_DEFAULT ? c.streams().default_stream() : stream;
}

// One collective as both paths need it: its header for the check, this rank's refusal, the
// algorithm on host pointers, and where its data sits in a staging buffer (stream path:
// send = staging + in_off, recv = staging + out_off; in place wherever the layout allows).
struct Call {
  hetccl::api::Coll coll;
  size_t count;
  int dtype, op, root;
  Refusal why;
  std::function<void(Comm&, const void*, void*)> algo;
  const void* send;
  void* recv;
  size_t bytes = 0, in_off = 0, in_bytes = 0, out_off = 0, out_bytes = 0;
  // PreMulSum: the input (in_bytes at in_off) is multiplied by the scalar first (on a copy:
  // the caller's sendbuff stays as it was).
  const Comm::PreMul* premul = nullptr;
  // Elementwise collectives (all_reduce): the algorithm on `count` elements at any offset, so
  // the stream path may run a large call chunk by chunk (HETCCL_STREAM_CHUNK_BYTES).
  std::function<void(Comm&, const void*, void*, size_t)> chunk_algo = nullptr;
  // The device route's algorithm (device_route.h) on the caller's own pointers, where the
  // collective has one; scalar_dev / scalar_host: a PreMulSum scalar (at most one set) for the
  // algorithm to apply to its working copy of the input.
  std::function<void(Comm&, hetccl::api::DeviceRoute&, const void* send, void* recv, const void* scalar_dev,
                     const void* scalar_host)>
      device_algo = nullptr;
};

void premul_scale(const Comm& c, const DT& dt, void* data, size_t bytes, const void* scalar) {
  hetccl::scale_mul(dt.engine, data, bytes / dt.size, scalar, c.settings.reduce_threads);
}

// Opens the stream path; a runtime that cannot be opened is this rank's usage refusal (the
// call then goes the host way, so the refusal reaches every rank through the check).
bool stream_usable(Comm& c, const char* what, Refusal* why) {
  try {
    c.streams();
    return true;
  } catch (const std::exception& e) {
    if (why->empty()) *why = {std::string("hetccl: ") + what + ": a stream was given, but " + e.what(), true};
    return false;
  }
}

void dispatch(Comm& c, void* stream, Call k) {
  if (stream && !stream_usable(c, hetccl::api::coll_name(k.coll), &k.why)) stream = nullptr;
  DT dt = dtype_of(k.dtype);
  if (!stream) {
    host_call(c, [&](Comm& cc) {
      checked(cc, k.coll, k.count, k.dtype, k.op, k.root, k.why);
      if (k.premul && k.in_bytes) {
        std::vector<char> scaled(static_cast<const char*>(k.send), static_cast<const char*>(k.send) + k.in_bytes);
        premul_scale(cc, dt, scaled.data(), k.in_bytes, k.premul->device ? k.premul->ptr : k.premul->value);
        k.algo(cc, scaled.data(), k.recv);
        return;
      }
      k.algo(cc, k.send, k.recv);
    });
    return;
  }
  hetccl::api::StreamJob j;
  j.stream = resolve_stream(c, stream);
  if (!k.why.empty()) {
    // The refusal still travels to every rank (their stream calls break with its text);
    // this rank returns it now.
    if (c.settings.check_args) {
      j.host = [k](Comm& cc, char*) { checked(cc, k.coll, k.count, k.dtype, k.op, k.root, k.why); };
      c.streams().issue(std::move(j));
    }
    refuse(k.why);
  }
  j.bytes = k.bytes;
  if (k.in_bytes) j.in.push_back({const_cast<void*>(k.send), k.in_off, k.in_bytes});
  if (k.out_bytes) j.out.push_back({k.recv, k.out_off, k.out_bytes});
  // PreMulSum with a device scalar: one more copy in, after the data
  size_t scalar_off = (k.bytes + 63) / 64 * 64;
  Comm::PreMul pm;
  if (k.premul) {
    pm = *k.premul;
    if (pm.device) {
      j.in.push_back({const_cast<void*>(pm.ptr), scalar_off, dt.size});
      j.bytes = scalar_off + dt.size;
    }
  }
  bool has_premul = k.premul != nullptr;
  k.premul = nullptr;
  // the host collective on the staging buffer, the check already made
  auto staged_host = [k, dt, pm, has_premul, scalar_off](Comm& cc, char* st) {
    if (has_premul) premul_scale(cc, dt, st + k.in_off, k.in_bytes, pm.device ? st + scalar_off : pm.value);
    k.algo(cc, st + k.in_off, st + k.out_off);
  };
  // The device route (device_route.h): large calls whose collective has one, where the runtime
  // has one. Every rank decides alike from the call (sizes, the setting, the runtime); where the
  // check finds a rank on the host route, the call runs staged on the route's stream instead.
  hetccl::api::DeviceRoute* route = c.streams().route();
  if (route && k.device_algo && std::max(k.in_bytes, k.out_bytes) >= c.settings.stream_device_bytes) {
    hetccl::api::StreamJob staged = j;
    staged.host = staged_host;
    j.in.clear();
    j.out.clear();
    j.bytes = 0;
    j.device = [k, staged, pm, has_premul](Comm& cc, hetccl::api::DeviceRoute& d) {
      bool all = false;
      {
        const auto t0 = std::chrono::steady_clock::now();
        struct Add {  // counted however the check ends
          std::chrono::steady_clock::time_point t0;
          std::atomic<uint64_t>& to;
          ~Add() {
            to += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                               .count());
          }
        } add{t0, cc.streams().route_check_ns};
        checked(cc, k.coll, k.count, k.dtype, k.op, k.root, Refusal{}, true, &all);
      }
      if (!all) {
        cc.streams().staged_on(d.main, staged);
        return;
      }
      const void* sdev = has_premul && pm.device ? pm.ptr : nullptr;
      const void* shost = has_premul && !pm.device ? pm.value : nullptr;
      k.device_algo(cc, d, k.send, k.recv, sdev, shost);
    };
    c.streams().issue(std::move(j));
    return;
  }
  j.host = [k, staged_host](Comm& cc, char* st) {
    checked(cc, k.coll, k.count, k.dtype, k.op, k.root, Refusal{});
    staged_host(cc, st);
  };
  // Chunked (stream_path.h): the first chunk checks the whole call's arguments, so a refused
  // call leaves every chunk as it was; later chunks agree by construction (every rank splits
  // the same count alike: HETCCL_STREAM_CHUNK_BYTES must be equal on every rank). A device
  // PreMulSum scalar sits after the data: such calls stay whole.
  size_t cb = c.settings.stream_chunk_bytes / dt.size * dt.size;
  if (k.chunk_algo && cb && k.in_off == k.out_off && !(has_premul && pm.device)) {
    j.chunk = cb;
    j.chunk_host = [k, dt, pm, has_premul](Comm& cc, char* st, size_t off, size_t bytes) {
      if (off == 0) checked(cc, k.coll, k.count, k.dtype, k.op, k.root, Refusal{});
      char* at = st + k.in_off + off;
      if (has_premul) premul_scale(cc, dt, at, bytes, pm.value);
      k.chunk_algo(cc, at, at, bytes / dt.size);
    };
  }
  c.streams().issue(std::move(j));
}

// The index of op among this communicator's live PreMulSum operators, -1 if it is none.
int premul_index(const Comm& c, int op) {
  int i = op - hetcclNumOps;
  return i < 0 || i >= int(c.premul.size()) || !c.premul[size_t(i)].live ? -1 : i;
}

// A PreMulSum operator of this communicator (nullptr for the built-in ones).
const Comm::PreMul* premul_of(const Comm& c, int op) {
  int i = premul_index(c, op);
  return i < 0 ? nullptr : &c.premul[size_t(i)];
}

Refusal reduce_refusal(const Comm& c, const char* what, const DT& dt, int op, hetccl::ReduceOp* rop) {
  if (const Comm::PreMul* pm = premul_of(c, op)) {
    if (std::strcmp(dtype_of(pm->dtype).name, dt.name) != 0)
      return {std::string("hetccl: ") + what + ": the PreMulSum operator " + std::to_string(op) + " was made for " +
              dtype_of(pm->dtype).name + ", the call's datatype is " + dt.name};
    *rop = hetccl::ReduceOp::SUM;
    return {};
  }
  if (!op_of(op, rop)) return {std::string("hetccl: ") + what + ": unknown reduction op " + std::to_string(op)};
  return {};
}

// uint32/uint64 MIN, MAX and AVG (NCCL reduces every type with every op): reduced on the host
// as the unsigned engine types; the device kernels have none, so such calls stay staged (true:
// no device route; the decision depends only on the call's dtype and op, alike on every rank).
// SUM and PROD keep the signed types, whose bits agree, and with them the device route.
bool unsigned_order(DT& dt, hetccl::ReduceOp rop) {
  if (!dt.unsigned_wide || rop == hetccl::ReduceOp::SUM || rop == hetccl::ReduceOp::PROD) return false;
  dt.engine = dt.size == 4 ? hetccl::DType::UINT32 : hetccl::DType::UINT64;
  return true;
}

}  // namespace

extern "C" {

hetcclResult_t hetcclGetVersion(int* version) {
  if (!version) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclGetVersion: version is NULL");
  *version = HETCCL_VERSION_CODE;
  return hetcclSuccess;
}

const char* hetcclGetErrorString(hetcclResult_t r) {
  switch (r) {
    case hetcclSuccess: return "no error";
    case hetcclUnhandledCudaError: return "unhandled device runtime error";
    case hetcclSystemError: return "unhandled system error (run with the last error's text)";
    case hetcclInternalError: return "internal error - please report this issue to the hetccl developers";
    case hetcclInvalidArgument: return "invalid argument";
    case hetcclInvalidUsage: return "invalid usage";
    case hetcclRemoteError: return "remote process exited or there was a network error";
    case hetcclInProgress: return "operation in progress";
  }
  return "unknown result code";
}

const char* hetcclGetLastError(hetcclComm_t comm) {
  static thread_local std::string out;
  out = comm && comm->c ? comm->c->last_error : t_last_error;
  // a broken communicator whose failure no call of this thread returned (the stream path's
  // executor broke it): its failure's text, not an empty line
  if (out.empty() && comm && comm->c && comm->c->broken_code() != hetcclSuccess) out = comm->c->broken_text();
  return out.c_str();
}

hetcclResult_t hetcclGetUniqueId(hetcclUniqueId* id) {
  if (!id) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclGetUniqueId: uniqueId is NULL");
  try {
    *id = new_unique_id(hetccl::api::read_settings());
    return hetcclSuccess;
  } catch (const std::exception& e) {
    return fail(nullptr, hetcclSystemError, e.what());
  }
}

hetcclResult_t hetcclCommInitRank(hetcclComm_t* comm, int nranks, hetcclUniqueId id, int rank) {
  if (!comm) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclCommInitRank: comm is NULL");
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclCommInitRank: rank " + std::to_string(rank) +
                                                    " is out of range for nranks=" + std::to_string(nranks));
  try {
    auto* h = new hetcclComm{nullptr};
    try {
      h->c = new Comm(nranks, id, rank);
    } catch (...) {
      delete h;
      throw;
    }
    *comm = h;
    return hetcclSuccess;
  } catch (const hetccl::CommTimeout& e) {
    return fail(nullptr, hetcclRemoteError, e.what());
  } catch (const hetccl::PeerFailure& e) {
    return fail(nullptr, hetcclRemoteError, e.what());
  } catch (const hetccl::api::UsageRefusal& e) {  // the ranks' settings differ (comm.cc)
    return fail(nullptr, hetcclInvalidUsage, e.what());
  } catch (const std::exception& e) {
    std::string t = e.what();
    return fail(nullptr, t.find("unique id") != std::string::npos ? hetcclInvalidArgument : hetcclSystemError, t);
  }
}

hetcclResult_t hetcclCommDestroy(hetcclComm_t comm) {
  if (!comm) return hetcclSuccess;  // as NCCL: destroying NULL is a no-op
  delete comm->c;  // every call is blocking: nothing is in flight
  delete comm;
  return hetcclSuccess;
}

hetcclResult_t hetcclCommAbort(hetcclComm_t comm) {
  if (!comm) return hetcclSuccess;  // as NCCL: aborting NULL is a no-op
  if (comm->c) {
    // Another thread may be inside a call on this communicator (torch's watchdog aborts while
    // the main thread waits in a collective): end its waits first, let it return, then free.
    comm->c->interrupt();
    // a call still inside after the bound: nothing is torn down or freed under it (leaked;
    // its waits were interrupted, the engine is closed)
    if (!comm->c->wait_calls_left()) return hetcclSuccess;
    comm->c->abort();
  }
  delete comm->c;
  delete comm;
  return hetcclSuccess;
}

hetcclResult_t hetcclCommInterrupt(hetcclComm_t comm) {
  if (!comm || !comm->c) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommInterrupt: NULL argument");
  comm->c->interrupt();
  return hetcclSuccess;
}

hetcclResult_t hetcclCommCount(const hetcclComm_t comm, int* count) {
  if (!comm || !comm->c || !count) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommCount: NULL argument");
  *count = comm->c->size;
  return hetcclSuccess;
}

hetcclResult_t hetcclCommUserRank(const hetcclComm_t comm, int* rank) {
  if (!comm || !comm->c || !rank) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommUserRank: NULL argument");
  *rank = comm->c->rank;
  return hetcclSuccess;
}

hetcclResult_t hetcclCommGetAsyncError(hetcclComm_t comm, hetcclResult_t* err) {
  if (!comm || !comm->c || !err) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommGetAsyncError: NULL argument");
  *err = comm->c->broken_code();
  // the failure's text becomes this thread's last error: a watchdog that polls this and then
  // asks hetcclGetLastError(NULL) (torch's, through ncclGetLastError) reads why
  if (*err != hetcclSuccess) t_last_error = comm->c->broken_text();
  return hetcclSuccess;
}

hetcclResult_t hetcclCommInfo(hetcclComm_t comm, char* buf, size_t len) {
  if (!comm || !comm->c || !buf) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommInfo: NULL argument");
  std::string s = comm->c->info();
  if (s.size() + 1 > len) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommInfo: buffer of " + std::to_string(len) + " bytes, the line needs " + std::to_string(s.size() + 1));
  std::memcpy(buf, s.c_str(), s.size() + 1);
  return hetcclSuccess;
}

namespace {
void all_reduce_any(Comm& c, const void* send, void* recv, size_t count, const DT& dt, hetccl::ReduceOp rop) {
  const hetccl::api::Algo a = hetccl::api::select_all_reduce(c, count * dt.size);
  if (a == hetccl::api::Algo::RecursiveDoubling) {
    ++c.algo_runs["all_reduce_rd"];
    hetccl::api::all_reduce_recursive_doubling(c, send, recv, count, dt.engine, dt.size, rop);
  } else if (a == hetccl::api::Algo::Hierarchical) {
    ++c.algo_runs["all_reduce_hier"];
    hetccl::api::all_reduce_hier(c, send, recv, count, dt.engine, dt.size, rop);
  } else {
    ++c.algo_runs["all_reduce_ring"];
    hetccl::api::all_reduce_ring(c, send, recv, count, dt.engine, dt.size, rop);
  }
}
void broadcast_any(Comm& c, const void* send, void* recv, size_t nbytes, int root) {
  if (hetccl::api::select_broadcast(c, nbytes) == hetccl::api::Algo::Binomial) {
    ++c.algo_runs["broadcast_binomial"];
    hetccl::api::broadcast_binomial(c, send, recv, nbytes, root);
  } else {
    ++c.algo_runs["broadcast_chain"];
    hetccl::api::broadcast_chain(c, send, recv, nbytes, root);
  }
}
void all_gather_any(Comm& c, const void* send, void* recv, size_t sendcount, size_t es) {
  if (hetccl::api::select_all_gather(c, sendcount * es * size_t(c.size)) == hetccl::api::Algo::Bruck) {
    ++c.algo_runs["all_gather_bruck"];
    hetccl::api::all_gather_bruck(c, send, recv, sendcount, es);
  } else {
    ++c.algo_runs["all_gather_ring"];
    hetccl::api::all_gather_ring(c, send, recv, sendcount, es);
  }
}
void reduce_scatter_any(Comm& c, const void* send, void* recv, size_t recvcount, const DT& dt, hetccl::ReduceOp rop) {
  if (hetccl::api::select_reduce_scatter(c, recvcount * dt.size * size_t(c.size)) == hetccl::api::Algo::RecursiveDoubling) {
    ++c.algo_runs["reduce_scatter_rd"];
    hetccl::api::reduce_scatter_rd(c, send, recv, recvcount, dt.engine, dt.size, rop);
  } else {
    ++c.algo_runs["reduce_scatter_ring"];
    hetccl::api::reduce_scatter_ring(c, send, recv, recvcount, dt.engine, dt.size, rop);
  }
}
// all_reduce on the device route: a PreMulSum scales recvbuff (a copy of sendbuff) first.
void all_reduce_device(Comm& c, hetccl::api::DeviceRoute& d, const void* send, void* recv, size_t count,
                       const DT& dt, hetccl::ReduceOp rop, const void* sdev, const void* shost) {
  if (sdev || shost) {
    if (send != recv) d.ops.memcpy_async(recv, send, count * dt.size, d.main);
    d.ops.scale_mul(recv, count, dt.engine, sdev, shost, d.main);
    send = recv;
  }
  ++c.algo_runs["all_reduce_ring_device"];
  hetccl::api::all_reduce_ring_device(c, d, send, recv, count, dt.engine, dt.size, rop);
}
}  // namespace

hetcclResult_t hetcclAllReduce(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                               hetcclRedOp_t op, hetcclComm_t comm, void* stream) {
  return run(comm, "all_reduce", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    hetccl::ReduceOp rop = hetccl::ReduceOp::SUM;
    Refusal why = common_refusal("all_reduce", dt, datatype, count);
    if (why.empty()) why = reduce_refusal(c, "all_reduce", dt, op, &rop);
    if (why.empty() && count && (!sendbuff || !recvbuff)) why = {"hetccl: all_reduce: a NULL buffer"};
    const bool staged_only = why.empty() && unsigned_order(dt, rop);
    size_t n = count * dt.size;
    Call k{hetccl::api::Coll::AllReduce, count, datatype, op, -1, why,
           [count, dt, rop](Comm& cc, const void* s, void* r) { all_reduce_any(cc, s, r, count, dt, rop); },
           sendbuff, recvbuff};
    k.bytes = k.in_bytes = k.out_bytes = n;
    k.premul = premul_of(c, op);
    k.chunk_algo = [dt, rop](Comm& cc, const void* s, void* r, size_t cnt) { all_reduce_any(cc, s, r, cnt, dt, rop); };
    if (!staged_only)
      k.device_algo = [count, dt, rop](Comm& cc, hetccl::api::DeviceRoute& d, const void* s, void* r,
                                       const void* sdev, const void* shost) {
        all_reduce_device(cc, d, s, r, count, dt, rop, sdev, shost);
      };
    dispatch(c, stream, k);
  });
}

hetcclResult_t hetcclReduce(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                            hetcclRedOp_t op, int root, hetcclComm_t comm, void* stream) {
  return run(comm, "reduce", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    hetccl::ReduceOp rop = hetccl::ReduceOp::SUM;
    Refusal why = common_refusal("reduce", dt, datatype, count);
    if (why.empty()) why = reduce_refusal(c, "reduce", dt, op, &rop);
    if (why.empty() && (root < 0 || root >= c.size))
      why = {"hetccl: reduce: root " + std::to_string(root) + " is out of range for " + std::to_string(c.size) + " ranks"};
    if (why.empty() && count && (!sendbuff || (c.rank == root && !recvbuff))) why = {"hetccl: reduce: a NULL buffer"};
    const bool staged_only = why.empty() && unsigned_order(dt, rop);
    size_t n = count * dt.size;
    bool is_root = c.rank == root;
    // An all_reduce whose result only the root keeps (the other ranks' recvbuff is untouched,
    // as NCCL documents it as unused there): the flat algorithms have no cheaper rooted form.
    Call k{hetccl::api::Coll::Reduce, count, datatype, op, root, why,
           [count, dt, rop, is_root, n](Comm& cc, const void* s, void* r) {
             if (is_root) {
               all_reduce_any(cc, s, r, count, dt, rop);
             } else {
               std::vector<char> scratch(n);
               all_reduce_any(cc, s, scratch.data(), count, dt, rop);
             }
           },
           sendbuff, recvbuff};
    k.bytes = k.in_bytes = n;
    k.out_bytes = is_root ? n : 0;
    k.premul = premul_of(c, op);
    if (!staged_only)
      k.device_algo = [count, dt, rop, is_root, n](Comm& cc, hetccl::api::DeviceRoute& d, const void* s, void* r,
                                                   const void* sdev, const void* shost) {
        if (is_root) return all_reduce_device(cc, d, s, r, count, dt, rop, sdev, shost);
        hetccl::api::RouteScratch out(d, n);  // the other ranks' result goes nowhere
        all_reduce_device(cc, d, s, out.get(), count, dt, rop, sdev, shost);
        out.release();
      };
    dispatch(c, stream, k);
  });
}

hetcclResult_t hetcclBroadcast(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                               int root, hetcclComm_t comm, void* stream) {
  return run(comm, "broadcast", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal("broadcast", dt, datatype, count);
    if (why.empty() && (root < 0 || root >= c.size))
      why = {"hetccl: broadcast: root " + std::to_string(root) + " is out of range for " +
             std::to_string(c.size) + " ranks"};
    if (why.empty() && count && (!recvbuff || (c.rank == root && !sendbuff))) why = {"hetccl: broadcast: a NULL buffer"};
    size_t n = count * dt.size;
    Call k{hetccl::api::Coll::Broadcast, count, datatype, -1, root, why,
           [n, root](Comm& cc, const void* s, void* r) { broadcast_any(cc, s, r, n, root); },
           sendbuff, recvbuff};
    k.bytes = k.out_bytes = n;
    k.in_bytes = c.rank == root ? n : 0;
    k.device_algo = [n, root](Comm& cc, hetccl::api::DeviceRoute& d, const void* s, void* r, const void*, const void*) {
      ++cc.algo_runs["broadcast_chain_device"];
      hetccl::api::broadcast_chain_device(cc, d, s, r, n, root);
    };
    dispatch(c, stream, k);
  });
}

hetcclResult_t hetcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, hetcclDataType_t datatype,
                               hetcclComm_t comm, void* stream) {
  return run(comm, "all_gather", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal("all_gather", dt, datatype, sendcount, size_t(c.size));
    if (why.empty() && sendcount && (!sendbuff || !recvbuff)) why = {"hetccl: all_gather: a NULL buffer"};
    size_t n = sendcount * dt.size;
    Call k{hetccl::api::Coll::AllGather, sendcount, datatype, -1, -1, why,
           [sendcount, dt](Comm& cc, const void* s, void* r) { all_gather_any(cc, s, r, sendcount, dt.size); },
           sendbuff, recvbuff};
    k.bytes = k.out_bytes = n * size_t(c.size);
    k.in_off = n * size_t(c.rank);  // in place in the staging buffer
    k.in_bytes = n;
    k.device_algo = [sendcount, dt](Comm& cc, hetccl::api::DeviceRoute& d, const void* s, void* r, const void*,
                                    const void*) {
      ++cc.algo_runs["all_gather_ring_device"];
      hetccl::api::all_gather_ring_device(cc, d, s, r, sendcount, dt.size);
    };
    dispatch(c, stream, k);
  });
}

hetcclResult_t hetcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                   hetcclDataType_t datatype, hetcclRedOp_t op, hetcclComm_t comm, void* stream) {
  return run(comm, "reduce_scatter", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    hetccl::ReduceOp rop = hetccl::ReduceOp::SUM;
    Refusal why = common_refusal("reduce_scatter", dt, datatype, recvcount, size_t(c.size));
    if (why.empty()) why = reduce_refusal(c, "reduce_scatter", dt, op, &rop);
    if (why.empty() && recvcount && (!sendbuff || !recvbuff)) why = {"hetccl: reduce_scatter: a NULL buffer"};
    const bool staged_only = why.empty() && unsigned_order(dt, rop);
    size_t n = recvcount * dt.size;
    Call k{hetccl::api::Coll::ReduceScatter, recvcount, datatype, op, -1, why,
           [recvcount, dt, rop](Comm& cc, const void* s, void* r) {
             reduce_scatter_any(cc, s, r, recvcount, dt, rop);
           },
           sendbuff, recvbuff};
    k.bytes = k.in_bytes = n * size_t(c.size);
    k.out_off = n * size_t(c.rank);  // in place in the staging buffer
    k.out_bytes = n;
    k.premul = premul_of(c, op);
    if (!staged_only)
      k.device_algo = [recvcount, dt, rop](Comm& cc, hetccl::api::DeviceRoute& d, const void* s, void* r,
                                           const void* sdev, const void* shost) {
        ++cc.algo_runs["reduce_scatter_ring_device"];
        hetccl::api::reduce_scatter_ring_device(cc, d, s, r, recvcount, dt.engine, dt.size, rop, sdev, shost);
      };
    dispatch(c, stream, k);
  });
}

hetcclResult_t hetcclAllToAll(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                              hetcclComm_t comm, void* stream) {
  return run(comm, "all_to_all", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal("all_to_all", dt, datatype, count, size_t(c.size));
    if (why.empty() && count && (!sendbuff || !recvbuff)) why = {"hetccl: all_to_all: a NULL buffer"};
    size_t n = count * dt.size, total = n * size_t(c.size);
    if (why.empty() && count && sendbuff != recvbuff) {
      const char* s = static_cast<const char*>(sendbuff);
      const char* r = static_cast<const char*>(recvbuff);
      if (s < r + total && r < s + total) why = {"hetccl: all_to_all: sendbuff and recvbuff overlap without being equal"};
    }
    Call k{hetccl::api::Coll::AllToAll, count, datatype, -1, -1, why,
           [n](Comm& cc, const void* s, void* r) { hetccl::api::all_to_all_pairwise(cc, s, r, n); },
           sendbuff, recvbuff};
    k.bytes = 2 * total;  // staging: sends, then receives
    k.in_bytes = total;
    k.out_off = total;
    k.out_bytes = total;
    dispatch(c, stream, k);
  });
}

// ---------------------------------------------------------------------------- communicators
hetcclResult_t hetcclCommVendorGroups(hetcclComm_t comm, int* ngroups, int* mygroupsize) {
  return run(comm, "hetcclCommVendorGroups", [&](Comm& c) {
    std::vector<std::string> labels;
    int mine = 0;
    for (auto& p : c.peers) {
      if (std::find(labels.begin(), labels.end(), p.vendor) == labels.end()) labels.push_back(p.vendor);
      if (p.vendor == c.peers[size_t(c.rank)].vendor) ++mine;
    }
    if (ngroups) *ngroups = int(labels.size());
    if (mygroupsize) *mygroupsize = mine;
  });
}

hetcclResult_t hetcclCommSplit(hetcclComm_t comm, int color, int key, hetcclComm_t* newcomm) {
  if (!newcomm) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommSplit: newcomm is NULL");
  *newcomm = nullptr;
  Comm* made = nullptr;
  hetcclResult_t r = run(comm, "comm_split", [&](Comm& c) {
    // 1: every rank's (color, key); 2: each color's first rank makes a unique id, every rank
    // gathers the ids; 3: the members of a color join with their place in (key, rank) order.
    // A bad color is refused after step 1, on every rank alike (naming the rank): refusing it
    // before would leave the other ranks waiting in the gather until their timeout.
    const int n = c.size;
    std::vector<int64_t> ck(2 * size_t(n));
    int64_t mine[2] = {color, key};
    host_call(c, [&](Comm& cc) { all_gather_any(cc, mine, ck.data(), 2, sizeof(int64_t)); });
    for (int p = 0; p < n; ++p)
      if (ck[2 * size_t(p)] < HETCCL_SPLIT_NOCOLOR)
        throw hetccl::ArgMismatch("hetccl: comm_split: rank " + std::to_string(p) + "'s color " +
                                  std::to_string(ck[2 * size_t(p)]) +
                                  " is negative (only HETCCL_SPLIT_NOCOLOR = -1 is allowed)");
    int leader = -1, place = 0, members = 0;
    std::vector<std::pair<int64_t, int>> order;
    for (int p = 0; p < n; ++p)
      if (ck[2 * size_t(p)] == color) {
        if (leader < 0) leader = p;
        order.push_back({ck[2 * size_t(p) + 1], p});
      }
    std::sort(order.begin(), order.end());
    for (size_t i = 0; i < order.size(); ++i)
      if (order[i].second == c.rank) place = int(i);
    members = int(order.size());
    hetcclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (color != HETCCL_SPLIT_NOCOLOR && leader == c.rank) id = new_unique_id(c.settings);
    std::vector<hetcclUniqueId> ids(static_cast<size_t>(n));
    host_call(c, [&](Comm& cc) { all_gather_any(cc, &id, ids.data(), 1, sizeof(hetcclUniqueId)); });
    if (color == HETCCL_SPLIT_NOCOLOR) return;
    made = new Comm(members, ids[size_t(leader)], place, &c.settings.vendor);
  });
  if (r != hetcclSuccess) return r;
  if (made) *newcomm = new hetcclComm{made};
  return hetcclSuccess;
}

hetcclResult_t hetcclCommShrink(hetcclComm_t comm, const int* exclude, int nexclude, hetcclComm_t* newcomm,
                                int flags) {
  // Not through run(): a communicator broken by a dead peer is what a shrink is for.
  if (!comm || !comm->c) return fail(comm, hetcclInvalidArgument, "hetccl: comm_shrink: comm is NULL");
  if (!newcomm) return fail(comm, hetcclInvalidArgument, "hetccl: comm_shrink: newcomm is NULL");
  *newcomm = nullptr;
  Comm& c = *comm->c;
  Comm::CallGuard in_call(c);  // a concurrent hetcclCommAbort waits for the shrink to leave
  try {
    if (flags != HETCCL_SHRINK_DEFAULT && flags != HETCCL_SHRINK_ABORT)
      throw hetccl::ArgMismatch("hetccl: comm_shrink: unknown flags " + std::to_string(flags) +
                                " (HETCCL_SHRINK_DEFAULT = 0 or HETCCL_SHRINK_ABORT = 1)");
    if (nexclude < 0 || (nexclude > 0 && !exclude))
      throw hetccl::ArgMismatch("hetccl: comm_shrink: the list of excluded ranks is NULL or of negative length");
    std::vector<bool> out(size_t(c.size), false);
    for (int i = 0; i < nexclude; ++i) {
      int r = exclude[i];
      if (r < 0 || r >= c.size)
        throw hetccl::ArgMismatch("hetccl: comm_shrink: excluded rank " + std::to_string(r) + " is out of range for " +
                                  std::to_string(c.size) + " ranks");
      if (out[size_t(r)])
        throw hetccl::ArgMismatch("hetccl: comm_shrink: rank " + std::to_string(r) + " is listed twice");
      out[size_t(r)] = true;
    }
    if (out[size_t(c.rank)])
      throw UsageError("hetccl: comm_shrink: rank " + std::to_string(c.rank) +
                         " is in the excluded list: excluded ranks do not call it");
    std::vector<int> keep, gone;  // survivors, excluded (both in rank order)
    int place = 0;
    for (int p = 0; p < c.size; ++p) {
      if (out[size_t(p)]) {
        gone.push_back(p);
        continue;
      }
      if (p == c.rank) place = int(keep.size());
      keep.push_back(p);
    }
    if (flags == HETCCL_SHRINK_ABORT) {
      // calls in flight on other threads end now and leave before the parent is torn down (as
      // hetcclCommAbort); comm stays broken
      c.mark_broken(hetcclInvalidUsage, "hetccl: the communicator was shrunk with HETCCL_SHRINK_ABORT");
      c.interrupt();
      if (!c.wait_calls_left(/*own=*/1))
        throw hetccl::CommError("hetccl: comm_shrink: a call on the communicator did not return after "
                                "HETCCL_SHRINK_ABORT interrupted it");
      c.abort();
    }
    uint64_t key = c.next_shrink(gone);
    hetcclUniqueId id;
    std::string wire;
    if (c.rank == keep[0]) {
      id = new_unique_id(c.settings);
      wire.assign(reinterpret_cast<const char*>(&id), sizeof id);
      for (size_t i = 1; i < keep.size(); ++i) c.mail_to(keep[i], key, wire);
    } else {
      wire = c.mail_from(keep[0], key);
      if (wire.size() != sizeof id) throw hetccl::CommError("hetccl: comm_shrink: a malformed id from the leader");
      std::memcpy(&id, wire.data(), sizeof id);
    }
    Comm* made = new Comm(int(keep.size()), id, place, &c.settings.vendor);
    *newcomm = new hetcclComm{made};
    return hetcclSuccess;
  } catch (...) {
    std::string text;
    bool argument = false;
    hetcclResult_t code = hetccl::api::classify(std::current_exception(), &text, &argument);
    return fail(comm, code, text);  // the parent is left as it was (broken only by ABORT)
  }
}

hetcclResult_t hetcclRedOpCreatePreMulSum(hetcclRedOp_t* op, void* scalar, hetcclDataType_t datatype,
                                          hetcclScalarResidence_t residence, hetcclComm_t comm) {
  return run(comm, "hetcclRedOpCreatePreMulSum", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    if (!op || !scalar) throw hetccl::ArgMismatch("hetccl: hetcclRedOpCreatePreMulSum: NULL argument");
    if (!dt.ok) throw hetccl::ArgMismatch("hetccl: hetcclRedOpCreatePreMulSum: unknown datatype " + std::to_string(datatype));
    if (residence != hetcclScalarDevice && residence != hetcclScalarHostImmediate)
      throw hetccl::ArgMismatch("hetccl: hetcclRedOpCreatePreMulSum: unknown residence " + std::to_string(residence));
    Comm::PreMul pm;
    pm.live = true;
    pm.dtype = datatype;
    pm.device = residence == hetcclScalarDevice;
    pm.ptr = scalar;
    if (!pm.device) std::memcpy(pm.value, scalar, dt.size);
    size_t i = 0;
    while (i < c.premul.size() && c.premul[i].live) ++i;
    if (i == c.premul.size()) c.premul.push_back(pm);
    else c.premul[i] = pm;
    *op = hetcclRedOp_t(hetcclNumOps + int(i));
  });
}

hetcclResult_t hetcclRedOpDestroy(hetcclRedOp_t op, hetcclComm_t comm) {
  return run(comm, "hetcclRedOpDestroy", [&](Comm& c) {
    int i = premul_index(c, op);
    if (i < 0)
      throw hetccl::ArgMismatch("hetccl: hetcclRedOpDestroy: " + std::to_string(int(op)) +
                                " is not a PreMulSum operator of this communicator");
    c.premul[size_t(i)].live = false;  // calls already issued hold their own copy
  });
}

// ---------------------------------------------------------------------------- point to point
namespace {
struct P2P {
  hetcclComm* comm;
  bool send;
  int peer;
  void* buf;     // the caller's buffer (host, or device with a stream)
  size_t nbytes;
  void* stream;  // resolved; nullptr: host
};

// A receive that completed with fewer bytes than it expected (NCCL: sizes must match).
void check_size(bool send, int peer, size_t got, size_t n) {
  if (!send && got != n)
    throw hetccl::ArgMismatch("hetccl: recv from rank " + std::to_string(peer) + ": the message has " +
                              std::to_string(got) + " bytes, the receive expects " + std::to_string(n));
}

// Posts every operation (at bufs[i]), then waits for all: a pair can exchange both ways.
void run_p2p(Comm& c, const std::vector<P2P>& ops, const std::vector<char*>& bufs) {
  std::vector<hetccl::RequestPtr> reqs;
  reqs.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i)
    reqs.push_back(ops[i].send ? c.post_send(ops[i].peer, bufs[i], ops[i].nbytes)
                               : c.post_recv(ops[i].peer, bufs[i], ops[i].nbytes));
  size_t i = 0;
  try {
    for (; i < ops.size(); ++i) check_size(ops[i].send, ops[i].peer, c.wait_request(reqs[i]), ops[i].nbytes);
  } catch (...) {
    // The rest are still posted into the caller's buffers, which it may free once the call
    // returns: receives no data reached are withdrawn as if never posted (their messages go to
    // later receives), the others get a moment to finish; one that does not leaves the
    // communicator broken (it must not be used with a request still in flight).
    bool settled = true;
    for (size_t j = i + 1; j < ops.size(); ++j) settled = c.settle(reqs[j], !ops[j].send, 1000) && settled;
    if (!settled)
      c.mark_broken(hetcclInternalError, "hetccl: a failed group of sends and receives left an operation in "
                                         "flight; the communicator cannot be used any more");
    throw;
  }
}

// Sends to and receives from this rank itself (NCCL allows them, in one group): matched in
// order, sizes equal. Returns, for every operation, the index of its partner (-1: not a self one).
std::vector<int> pair_self(const Comm& c, const std::vector<P2P>& ops) {
  std::vector<int> partner(ops.size(), -1);
  std::vector<size_t> sends, recvs;
  for (size_t i = 0; i < ops.size(); ++i)
    if (ops[i].peer == c.rank) (ops[i].send ? sends : recvs).push_back(i);
  if (sends.size() != recvs.size())
    throw hetccl::ArgMismatch("hetccl: " + std::to_string(sends.size()) + " sends to this rank itself and " +
                              std::to_string(recvs.size()) + " receives from it: each needs its partner in the same group");
  for (size_t k = 0; k < sends.size(); ++k) {
    const P2P &s = ops[sends[k]], &r = ops[recvs[k]];
    if (s.nbytes != r.nbytes)
      throw hetccl::ArgMismatch("hetccl: recv from rank " + std::to_string(c.rank) + " (itself): the message has " +
                                std::to_string(s.nbytes) + " bytes, the receive expects " + std::to_string(r.nbytes));
    partner[sends[k]] = int(recvs[k]);
    partner[recvs[k]] = int(sends[k]);
  }
  return partner;
}

// One communicator's share of a group (or one call outside a group): host operations run on
// the calling thread (or the executor, in order), stream operations become one stream job whose
// staging buffer holds every operation's bytes (a receive from itself reads its send's bytes
// there: no host work).
void issue_p2p(Comm& c, const std::vector<P2P>& ops) {
  std::vector<P2P> host, dev;
  for (auto& o : ops) (o.stream ? dev : host).push_back(o);
  if (!host.empty()) {
    std::vector<int> partner = pair_self(c, host);
    host_call(c, [&](Comm& cc) {
      std::vector<P2P> net;
      std::vector<char*> bufs;
      for (size_t i = 0; i < host.size(); ++i) {
        if (partner[i] < 0) {
          net.push_back(host[i]);
          bufs.push_back(static_cast<char*>(host[i].buf));
        } else if (host[i].send && host[i].nbytes) {
          std::memmove(host[size_t(partner[i])].buf, host[i].buf, host[i].nbytes);
        }
      }
      run_p2p(cc, net, bufs);
    });
  }
  if (dev.empty()) return;
  std::vector<int> partner = pair_self(c, dev);
  hetccl::api::StreamJob j;
  j.stream = dev[0].stream;
  std::vector<size_t> offs(dev.size(), 0);
  for (size_t i = 0; i < dev.size(); ++i) {  // sends (and every non-self op) get room first
    if (partner[i] >= 0 && !dev[i].send) continue;
    offs[i] = j.bytes;
    j.bytes += (dev[i].nbytes + 63) / 64 * 64;
  }
  std::vector<P2P> net;
  std::vector<size_t> net_offs;
  for (size_t i = 0; i < dev.size(); ++i) {
    const P2P& o = dev[i];
    if (partner[i] >= 0 && !o.send) offs[i] = offs[size_t(partner[i])];
    if (o.nbytes) (o.send ? j.in : j.out).push_back({o.buf, offs[i], o.nbytes});
    if (partner[i] < 0) {
      net.push_back(o);
      net_offs.push_back(offs[i]);
    }
    if (o.stream != j.stream && std::find(j.others.begin(), j.others.end(), o.stream) == j.others.end())
      j.others.push_back(o.stream);
  }
  j.host = [net, net_offs](Comm& cc, char* st) {
    std::vector<char*> bufs;
    for (size_t off : net_offs) bufs.push_back(st + off);
    run_p2p(cc, net, bufs);
  };
  c.streams().issue(std::move(j));
}

thread_local int t_group_depth = 0;
thread_local std::vector<P2P> t_group;

hetcclResult_t p2p(bool send, void* buf, size_t count, hetcclDataType_t datatype, int peer,
                   hetcclComm_t comm, void* stream) {
  const char* what = send ? "send" : "recv";
  return run(comm, what, [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal(what, dt, datatype, count);
    if (!why.empty()) refuse(why);
    if (peer < 0 || peer >= c.size)
      throw hetccl::ArgMismatch(std::string("hetccl: ") + what + ": peer " + std::to_string(peer) +
                                " is not a rank of this communicator of " + std::to_string(c.size));
    size_t n = count * dt.size;
    if (n && !buf) throw hetccl::ArgMismatch(std::string("hetccl: ") + what + ": a NULL buffer");
    if (stream && !stream_usable(c, what, &why)) refuse(why);
    P2P op{comm, send, peer, buf, n, stream ? resolve_stream(c, stream) : nullptr};
    if (t_group_depth > 0) {
      t_group.push_back(op);
      return;
    }
    issue_p2p(c, {op});
  });
}
}  // namespace

hetcclResult_t hetcclSend(const void* sendbuff, size_t count, hetcclDataType_t datatype, int peer,
                          hetcclComm_t comm, void* stream) {
  return p2p(true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

hetcclResult_t hetcclRecv(void* recvbuff, size_t count, hetcclDataType_t datatype, int peer,
                          hetcclComm_t comm, void* stream) {
  return p2p(false, recvbuff, count, datatype, peer, comm, stream);
}

hetcclResult_t hetcclGroupStart(void) {
  ++t_group_depth;
  return hetcclSuccess;
}

hetcclResult_t hetcclGroupEnd(void) {
  if (t_group_depth == 0) return fail(nullptr, hetcclInvalidUsage, "hetccl: hetcclGroupEnd without hetcclGroupStart");
  if (--t_group_depth > 0) return hetcclSuccess;
  std::vector<P2P> ops;
  ops.swap(t_group);
  // one share per communicator, in the order of its first operation
  std::vector<hetcclComm*> comms;
  for (auto& o : ops)
    if (std::find(comms.begin(), comms.end(), o.comm) == comms.end()) comms.push_back(o.comm);
  hetcclResult_t first = hetcclSuccess;
  for (hetcclComm* h : comms) {
    std::vector<P2P> mine;
    for (auto& o : ops)
      if (o.comm == h) mine.push_back(o);
    hetcclResult_t r = run(h, "group", [&](Comm& c) { issue_p2p(c, mine); });
    if (r != hetcclSuccess && first == hetcclSuccess) first = r;
  }
  return first;
}

// ---------------------------------------------------------------------------- deferred joins
// (stream_path.h). Not through run(): a broken communicator still joins (its calls' done words
// are written all the same), so a work object can always order its stream.
hetcclResult_t hetcclCommDeferJoin(hetcclComm_t comm, int enable, const unsigned long long** ticket) {
  if (!comm || !comm->c) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommDeferJoin: comm is NULL");
  try {
    auto& sp = comm->c->streams();
    sp.defer_joins(enable != 0);
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "ticket word");
    if (ticket) *ticket = reinterpret_cast<const unsigned long long*>(sp.ticket_word());
    return hetcclSuccess;
  } catch (const std::exception& e) {
    return fail(comm, hetcclInvalidUsage, std::string("hetccl: hetcclCommDeferJoin: ") + e.what());
  }
}

hetcclResult_t hetcclCommJoin(hetcclComm_t comm, unsigned long long ticket, void* stream) {
  if (!comm || !comm->c) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommJoin: comm is NULL");
  if (!ticket) return hetcclSuccess;
  if (!stream) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommJoin: stream is NULL");
  try {
    if (!comm->c->has_streams())
      return fail(comm, hetcclInvalidUsage, "hetccl: hetcclCommJoin: no stream call was made on this communicator");
    comm->c->streams().join(ticket, resolve_stream(*comm->c, stream));
    return hetcclSuccess;
  } catch (const hetccl::api::UsageRefusal& e) {
    return fail(comm, hetcclInvalidUsage, e.what());
  } catch (const std::exception& e) {
    return fail(comm, hetcclSystemError, std::string("hetccl: hetcclCommJoin: ") + e.what());
  }
}

// ---------------------------------------------------------------------------- tests
// Not through run(): a test waits for its streams also after the communicator broke.
hetcclResult_t hetcclTestStreamCreate(hetcclComm_t comm, void** stream) {
  if (!comm || !comm->c || !stream) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclTestStreamCreate: NULL argument");
  try {
    *stream = comm->c->streams().test_stream();
    return hetcclSuccess;
  } catch (const std::exception& e) {
    return fail(comm, hetcclInvalidUsage, e.what());
  }
}

hetcclResult_t hetcclTestStreamSynchronize(hetcclComm_t comm, void* stream) {
  if (!comm || !comm->c) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclTestStreamSynchronize: NULL argument");
  try {
    comm->c->streams().test_sync(resolve_stream(*comm->c, stream));
    return hetcclSuccess;
  } catch (const std::exception& e) {
    return fail(comm, hetcclInvalidUsage, e.what());
  }
}

}  // extern "C"
