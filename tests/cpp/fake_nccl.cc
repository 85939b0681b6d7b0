// A stand-in for the real NCCL (tests/test_dropin.py): the drop-in's one-vendor path forwards
// to it. Every call appends its name to $FAKE_NCCL_LOG; communicators are single-process
// records; ncclAllReduce of float32 writes send + 1000 + rank into recv (a mark that only a
// forwarded call leaves); collectives are otherwise no-ops. Not NCCL: it proves forwarding only.
// Its ncclAllReduce calls its own ncclCommGetAsyncError by name, as the real NCCL's enqueue
// check does, so a drop-in in front of it in the global scope must hand that call back.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../csrc/nccl/nccl_abi.h"

struct ncclComm {
  int magic, rank, nranks;  // magic: the real NCCL's CommCheck reads its own fields too
};
constexpr int kMagic = 0x7a4e;

namespace {
void log(const char* what) {
  const char* p = getenv("FAKE_NCCL_LOG");
  if (!p) return;
  FILE* f = fopen(p, "a");
  if (!f) return;
  fprintf(f, "%s\n", what);
  fclose(f);
}
}  // namespace

extern "C" {
ncclResult_t ncclGetVersion(int* v) { log("ncclGetVersion"); *v = 99999; return ncclSuccess; }
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) { log("ncclGetUniqueId"); memset(id, 7, sizeof *id); return ncclSuccess; }
ncclResult_t ncclCommInitRank(ncclComm_t* c, int n, ncclUniqueId id, int r) {
  log("ncclCommInitRank");
  if (id.internal[0] != 7) return ncclInvalidArgument;  // the id rank 0 made reached every rank
  *c = new ncclComm{kMagic, r, n};
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* c, int n, ncclUniqueId id, int r, ncclConfig_t*) {
  log("ncclCommInitRankConfig");
  return ncclCommInitRank(c, n, id, r);
}
ncclResult_t ncclCommDestroy(ncclComm_t c) { log("ncclCommDestroy"); delete c; return ncclSuccess; }
ncclResult_t ncclCommAbort(ncclComm_t c) { log("ncclCommAbort"); delete c; return ncclSuccess; }
ncclResult_t ncclCommCount(const ncclComm_t c, int* n) { *n = c->nranks; return ncclSuccess; }
ncclResult_t ncclCommUserRank(const ncclComm_t c, int* r) { *r = c->rank; return ncclSuccess; }
ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* e) {
  if (!c || c->magic != kMagic) return ncclInvalidArgument;  // not one of this library's
  *e = ncclSuccess;
  return ncclSuccess;
}
ncclResult_t ncclAllReduce(const void* s, void* r, size_t count, ncclDataType_t dt, ncclRedOp_t, ncclComm_t c, cudaStream_t) {
  log("ncclAllReduce");
  // as the real NCCL's enqueue check does: a call of its own public name, which a library
  // earlier in the global scope (the preloaded drop-in) receives first
  ncclResult_t e;
  if (ncclCommGetAsyncError(c, &e) != ncclSuccess) return ncclInternalError;
  if (dt == ncclFloat32)
    for (size_t i = 0; i < count; ++i) static_cast<float*>(r)[i] = static_cast<const float*>(s)[i] + 1000.f + float(c->rank);
  return ncclSuccess;
}
ncclResult_t ncclGroupStart(void) { log("ncclGroupStart"); return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { log("ncclGroupEnd"); return ncclSuccess; }
const char* ncclGetErrorString(ncclResult_t) { return "fake"; }
const char* ncclGetLastError(ncclComm_t) { return "fake last error"; }
}
