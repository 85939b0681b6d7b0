// hetccl C API entry points (hetccl.h): argument validation, the argument check, errors mapped
// to result codes and texts. Algorithms live in coll_*.cc, the communicator in comm.cc.
//
// Error contract:
//  * a bad argument this rank can see (unknown dtype or op, a root out of range, a stream) is
//    that rank's refusal; with the argument check on (default) it travels in the check's header
//    so that every rank returns hetcclInvalidArgument / hetcclInvalidUsage with its text, and the
//    communicator stays usable;
//  * ranks that disagree (counts, dtypes, ops, roots) all return hetcclInvalidArgument;
//  * a dead peer or a timeout returns hetcclRemoteError, anything else hetcclInternalError or
//    hetcclSystemError; the communicator is then broken: every later call returns that code at
//    once, and hetcclCommGetAsyncError reports it.
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
  bool unsigned_wide = false;  // uint32/uint64: reduced as int32/int64 where the bits agree
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
  if (c.broken_code() != hetcclSuccess)
    return fail(comm, c.broken_code(), std::string("hetccl: ") + what +
                                           ": the communicator is unusable after an earlier failure: " +
                                           c.broken_text());
  try {
    fn(c);
    return hetcclSuccess;
  } catch (const UsageError& e) {
    return fail(comm, hetcclInvalidUsage, e.what());
  } catch (const hetccl::ArgMismatch& e) {
    return fail(comm, hetcclInvalidArgument, e.what());
  } catch (const hetccl::PeerFailure& e) {
    c.mark_broken(hetcclRemoteError, e.what());
    return fail(comm, hetcclRemoteError, e.what());
  } catch (const hetccl::CommTimeout& e) {
    c.mark_broken(hetcclRemoteError, e.what());
    return fail(comm, hetcclRemoteError, e.what());
  } catch (const hetccl::CommError& e) {
    c.mark_broken(hetcclSystemError, e.what());
    return fail(comm, hetcclSystemError, e.what());
  } catch (const std::bad_alloc&) {
    c.mark_broken(hetcclSystemError, "hetccl: out of memory");
    return fail(comm, hetcclSystemError, std::string("hetccl: ") + what + ": out of memory");
  } catch (const std::exception& e) {
    c.mark_broken(hetcclInternalError, e.what());
    return fail(comm, hetcclInternalError, e.what());
  }
}

// This rank's refusal of a call: text, and whether it is of usage (else of an argument).
struct Refusal {
  std::string text;
  bool usage = false;
  bool empty() const { return text.empty(); }
};

// The check (when on) with this rank's own refusal; without it, the refusal returns here.
void checked(Comm& c, hetccl::api::Coll coll, size_t count, int dtype, int op, int root,
             const Refusal& refusal) {
  if (c.settings.check_args)
    hetccl::api::check_args(c, coll, int64_t(count), dtype, op, root, refusal.text, refusal.usage);
  if (!refusal.empty()) {
    if (refusal.usage) throw UsageError(refusal.text);
    throw hetccl::ArgMismatch(refusal.text);
  }
}

Refusal common_refusal(const char* what, const void* stream, const DT& dt, int dtype) {
  if (stream)
    return {std::string("hetccl: ") + what + ": a stream was given, but this C API revision "
            "takes host memory only (stream must be NULL)", true};
  if (!dt.ok) return {std::string("hetccl: ") + what + ": unknown datatype " + std::to_string(dtype)};
  return {};
}

Refusal reduce_refusal(const char* what, const DT& dt, int op, hetccl::ReduceOp* rop) {
  if (!op_of(op, rop)) return {std::string("hetccl: ") + what + ": unknown reduction op " + std::to_string(op)};
  if (dt.unsigned_wide && *rop != hetccl::ReduceOp::SUM && *rop != hetccl::ReduceOp::PROD)
    return {std::string("hetccl: ") + what + ": reductions other than sum and prod of " + dt.name +
            " are not supported"};
  return {};
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
  return out.c_str();
}

hetcclResult_t hetcclGetUniqueId(hetcclUniqueId* id) {
  if (!id) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclGetUniqueId: uniqueId is NULL");
  try {
    hetccl::api::Settings s = hetccl::api::read_settings();
    std::string host = s.ifname.empty() ? hetccl::api::default_root_host() : hetccl::api::iface_addr(s.ifname);
    *id = hetccl::api::make_root(host, s.timeout_ms);
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
  } catch (const std::exception& e) {
    std::string t = e.what();
    return fail(nullptr, t.find("unique id") != std::string::npos ? hetcclInvalidArgument : hetcclSystemError, t);
  }
}

hetcclResult_t hetcclCommDestroy(hetcclComm_t comm) {
  if (!comm) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclCommDestroy: comm is NULL");
  delete comm->c;  // every call is blocking: nothing is in flight
  delete comm;
  return hetcclSuccess;
}

hetcclResult_t hetcclCommAbort(hetcclComm_t comm) {
  if (!comm) return fail(nullptr, hetcclInvalidArgument, "hetccl: hetcclCommAbort: comm is NULL");
  if (comm->c) comm->c->abort();
  delete comm->c;
  delete comm;
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
  return hetcclSuccess;
}

hetcclResult_t hetcclCommInfo(hetcclComm_t comm, char* buf, size_t len) {
  if (!comm || !comm->c || !buf) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommInfo: NULL argument");
  std::string s = comm->c->info();
  if (s.size() + 1 > len) return fail(comm, hetcclInvalidArgument, "hetccl: hetcclCommInfo: buffer of " + std::to_string(len) + " bytes, the line needs " + std::to_string(s.size() + 1));
  std::memcpy(buf, s.c_str(), s.size() + 1);
  return hetcclSuccess;
}

hetcclResult_t hetcclAllReduce(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                               hetcclRedOp_t op, hetcclComm_t comm, void* stream) {
  return run(comm, "all_reduce", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    hetccl::ReduceOp rop = hetccl::ReduceOp::SUM;
    Refusal why = common_refusal("all_reduce", stream, dt, datatype);
    if (why.empty()) why = reduce_refusal("all_reduce", dt, op, &rop);
    if (why.empty() && count && (!sendbuff || !recvbuff)) why = {"hetccl: all_reduce: a NULL buffer"};
    checked(c, hetccl::api::Coll::AllReduce, count, datatype, op, -1, why);
    if (hetccl::api::select_all_reduce(c, count * dt.size) == hetccl::api::Algo::RecursiveDoubling) {
      ++c.algo_runs["all_reduce_rd"];
      hetccl::api::all_reduce_recursive_doubling(c, sendbuff, recvbuff, count, dt.engine, dt.size, rop);
    } else {
      ++c.algo_runs["all_reduce_ring"];
      hetccl::api::all_reduce_ring(c, sendbuff, recvbuff, count, dt.engine, dt.size, rop);
    }
  });
}

hetcclResult_t hetcclBroadcast(const void* sendbuff, void* recvbuff, size_t count, hetcclDataType_t datatype,
                               int root, hetcclComm_t comm, void* stream) {
  return run(comm, "broadcast", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal("broadcast", stream, dt, datatype);
    if (why.empty() && (root < 0 || root >= c.size))
      why = {"hetccl: broadcast: root " + std::to_string(root) + " is out of range for " +
             std::to_string(c.size) + " ranks"};
    if (why.empty() && count && (!recvbuff || (c.rank == root && !sendbuff))) why = {"hetccl: broadcast: a NULL buffer"};
    checked(c, hetccl::api::Coll::Broadcast, count, datatype, -1, root, why);
    hetccl::api::broadcast_chain(c, sendbuff, recvbuff, count * dt.size, root);
  });
}

hetcclResult_t hetcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, hetcclDataType_t datatype,
                               hetcclComm_t comm, void* stream) {
  return run(comm, "all_gather", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal("all_gather", stream, dt, datatype);
    if (why.empty() && sendcount && (!sendbuff || !recvbuff)) why = {"hetccl: all_gather: a NULL buffer"};
    checked(c, hetccl::api::Coll::AllGather, sendcount, datatype, -1, -1, why);
    hetccl::api::all_gather_ring(c, sendbuff, recvbuff, sendcount, dt.size);
  });
}

hetcclResult_t hetcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                   hetcclDataType_t datatype, hetcclRedOp_t op, hetcclComm_t comm, void* stream) {
  return run(comm, "reduce_scatter", [&](Comm& c) {
    DT dt = dtype_of(datatype);
    hetccl::ReduceOp rop = hetccl::ReduceOp::SUM;
    Refusal why = common_refusal("reduce_scatter", stream, dt, datatype);
    if (why.empty()) why = reduce_refusal("reduce_scatter", dt, op, &rop);
    if (why.empty() && recvcount && (!sendbuff || !recvbuff)) why = {"hetccl: reduce_scatter: a NULL buffer"};
    checked(c, hetccl::api::Coll::ReduceScatter, recvcount, datatype, op, -1, why);
    hetccl::api::reduce_scatter_ring(c, sendbuff, recvbuff, recvcount, dt.engine, dt.size, rop);
  });
}

// ---------------------------------------------------------------------------- point to point
namespace {
struct Pending {
  hetcclComm* comm;
  hetccl::RequestPtr req;
  bool send;
  int peer;
  size_t nbytes;
};

// A receive that completed with fewer bytes than it expected (NCCL: sizes must match).
void check_size(bool send, int peer, size_t got, size_t n) {
  if (!send && got != n)
    throw hetccl::ArgMismatch("hetccl: recv from rank " + std::to_string(peer) + ": the message has " +
                              std::to_string(got) + " bytes, the receive expects " + std::to_string(n));
}
thread_local int t_group_depth = 0;
thread_local std::vector<Pending> t_group;

hetcclResult_t p2p(bool send, void* buf, size_t count, hetcclDataType_t datatype, int peer,
                   hetcclComm_t comm, void* stream) {
  const char* what = send ? "send" : "recv";
  return run(comm, what, [&](Comm& c) {
    DT dt = dtype_of(datatype);
    Refusal why = common_refusal(what, stream, dt, datatype);
    if (!why.empty()) {
      if (why.usage) throw UsageError(why.text);
      throw hetccl::ArgMismatch(why.text);
    }
    if (peer < 0 || peer >= c.size || peer == c.rank)
      throw hetccl::ArgMismatch(std::string("hetccl: ") + what + ": peer " + std::to_string(peer) +
                                " is not another rank of this communicator of " + std::to_string(c.size));
    size_t n = count * dt.size;
    auto req = send ? c.post_send(peer, buf, n) : c.post_recv(peer, buf, n);
    if (t_group_depth > 0) {
      t_group.push_back({comm, req, send, peer, n});
      return;
    }
    check_size(send, peer, req->wait(c.settings.timeout_ms), n);
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
  std::vector<Pending> ops;
  ops.swap(t_group);
  hetcclResult_t first = hetcclSuccess;
  for (auto& p : ops) {
    hetcclResult_t r = run(p.comm, "group", [&](Comm& c) {
      check_size(p.send, p.peer, p.req->wait(c.settings.timeout_ms), p.nbytes);
    });
    if (r != hetcclSuccess && first == hetcclSuccess) first = r;
  }
  return first;
}

}  // extern "C"
