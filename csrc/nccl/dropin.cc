// hetccl's drop-in NCCL (libnccl.so.2) and RCCL (librccl.so.1, HETCCL_DROPIN_RCCL): NCCL's C
// ABI (nccl_abi.h) over hetccl's C API (csrc/hetccl.h), from this one source.
//
// Contract:
//  * A communicator is created through hetccl's bootstrap (the unique id is a hetcclUniqueId:
//    it works between hosts). Its ranks' vendor labels (HETCCL_VENDOR; default "nvidia" in
//    libnccl, "amd" in librccl, which is what a process that loaded this library is) decide its
//    kind once, the same on every rank:
//      - one vendor group: the REAL library (found by path, below) makes the communicator, with
//        a real unique id that rank 0 creates and hetccl broadcasts; every later call on it is
//        forwarded unchanged, so a one-vendor job runs at the real library's speed;
//      - several vendor groups: hetccl's communicator serves every call (stream-ordered on the
//        caller's stream: csrc/api/stream_path.h).
//  * ncclCommSplit and ncclCommShrink of a hetccl communicator make their children through
//    hetccl and give each child the same choice (a child inside one vendor becomes a real
//    communicator); a shrink needs no collective over the parent (NCCL_SHRINK_ABORT after a
//    dead peer: csrc/hetccl.h).
//  * Groups: ncclGroupStart/End go to both the real library and hetccl, so a group may hold
//    calls of both kinds of communicator. Inits inside a group (one thread making several
//    communicators, as nccl-tests -g N and NCCL's docs do) are deferred to the outermost
//    ncclGroupEnd, which runs them concurrently, one thread each on its caller's device, and
//    returns the first failure; a communicator is usable once that ncclGroupEnd returned.
//    Calls on hetccl communicators inside a group are issued there too, after the inits
//    (DeferredCall: one thread per communicator where a thread drives several).
//  * What has no cross-vendor meaning is refused on a hetccl communicator with
//    ncclInvalidUsage and a message in ncclGetLastError: windows (symmetric memory), device
//    communicators and ncclCommRevoke; ncclCommRegister is accepted as the hint it
//    is (hetccl stages through its own pinned memory) and returns a handle that deregisters.
//  * FP8 types are moved as bytes where nothing is reduced; reductions of them across vendors
//    are refused (ncclInvalidArgument).
// The real library: HETCCL_NCCL_LIBRARY (HETCCL_RCCL_LIBRARY) names it ("none": none); else the
// first libnccl.so.2 (librccl.so.1) in LD_LIBRARY_PATH and the system's library directories that
// is not this file. It is opened with RTLD_DEEPBIND so that its own calls of its public names
// stay inside it. `hetccl run` sets the variable to the library the program would have loaded.
#include <dlfcn.h>
#include <link.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "../hetccl.h"
#include "nccl_abi.h"

#ifdef HETCCL_DROPIN_RCCL
#define DROPIN_SONAME "librccl.so.1"
#define DROPIN_REAL_ENV "HETCCL_RCCL_LIBRARY"
#define DROPIN_VENDOR "amd"
#define DROPIN_RUNTIME "hip"
#define DROPIN_NAME "RCCL"
#define DROPIN_ABI_VERSION 22203  // the RCCL generation whose ABI nccl_abi.h matches
#else
#define DROPIN_SONAME "libnccl.so.2"
#define DROPIN_REAL_ENV "HETCCL_NCCL_LIBRARY"
#define DROPIN_VENDOR "nvidia"
#define DROPIN_RUNTIME "cuda"
#define DROPIN_NAME "NCCL"
#define DROPIN_ABI_VERSION 22809  // NCCL 2.28.9
#endif

struct ncclComm {
  ncclComm_t real = nullptr;    // the real library's communicator (one vendor)
  hetcclComm_t het = nullptr;   // hetccl's (across vendors)
  int rank = 0, nranks = 0, device = 0;
  // An init called inside ncclGroupStart/End runs at the outermost ncclGroupEnd (NCCL's
  // one-thread-several-devices pattern): until then the communicator is WAITING; if that init
  // failed it is FAILED, and only destroy or abort are accepted. init_error is stored before
  // state (release), so a thread that reads FAILED reads the error too.
  enum State : int { READY, WAITING, FAILED };
  std::atomic<int> state{READY};
  std::atomic<int> init_error{0};  // FAILED: what the init returned
  // A deferred init's ownership, under mu: `running` once its ncclGroupEnd started it;
  // `abandoned` when ncclCommDestroy/Abort (from any thread) came first: whoever sees the init
  // end frees the communicator then.
  std::mutex mu;
  bool running = false, abandoned = false;
  // A group's deferred calls being issued on this communicator (by ncclGroupEnd, on any thread):
  // `users` counts the issuers, `closing` is set by ncclCommDestroy/Abort, which then waits on
  // `idle` until no issuer is left before freeing anything (issuers stop at `closing`).
  int users = 0;
  bool closing = false;
  std::condition_variable idle;
};

extern "C" HETCCL_NCCL_API const char* hetcclDropinInfo(void);
extern "C" HETCCL_NCCL_API hetcclComm_t hetcclDropinComm(ncclComm_t comm);

namespace {

thread_local std::string t_error;
// This thread's ncclGroupStart depth, and the last call refused inside its group (NCCL's
// ncclGroupErrCheck, which keeps the latest): the outermost ncclGroupEnd then launches none of
// hetccl's calls or inits of the group and returns that error (NCCL cancels a group with a
// failed call). As in NCCL, only the calls that enqueue work or make, split or end a
// communicator count (group_refusal); a refused query (ncclCommCount, ncclCommUserRank, ...)
// fails alone.
thread_local int t_group_depth = 0;
thread_local ncclResult_t t_group_error = ncclSuccess;
thread_local std::string t_group_error_text;

ncclResult_t fail(ncclResult_t r, const std::string& text) {
  t_error = text;
  return r;
}

// r, recorded as the group's error when it is a failure inside a group (see above).
ncclResult_t group_refusal(ncclResult_t r) {
  if (t_group_depth > 0 && r != ncclSuccess && r != ncclInProgress) {
    t_group_error = r;
    t_group_error_text = t_error;
  }
  return r;
}

// ------------------------------------------------------------------ the real library
std::once_flag g_real_once;
void* g_real = nullptr;
std::string g_real_path, g_real_why;

std::string self_path() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&hetcclDropinInfo), &info) || !info.dli_fname) return "";
  char buf[PATH_MAX];
  return realpath(info.dli_fname, buf) ? std::string(buf) : std::string(info.dli_fname);
}

void open_real() {
  const char* env = getenv(DROPIN_REAL_ENV);
  std::vector<std::string> cands;
  if (env && *env) {
    if (std::string(env) == "none") {
      g_real_why = std::string(DROPIN_REAL_ENV) + "=none";
      return;
    }
    cands.push_back(env);
  } else {
    if (const char* ld = getenv("LD_LIBRARY_PATH")) {
      std::string s = ld;
      size_t a = 0;
      while (a <= s.size()) {
        size_t b = s.find(':', a);
        if (b == std::string::npos) b = s.size();
        if (b > a) cands.push_back(s.substr(a, b - a) + "/" DROPIN_SONAME);
        a = b + 1;
      }
    }
    for (const char* d : {"/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/opt/rocm/lib", "/usr/lib"})
      cands.push_back(std::string(d) + "/" DROPIN_SONAME);
  }
  std::string self = self_path();
  for (auto& c : cands) {
    char buf[PATH_MAX];
    if (!realpath(c.c_str(), buf)) continue;
    if (self == buf) continue;
    void* h = dlopen(buf, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!h) {
      g_real_why = dlerror();
      continue;
    }
    if (dlsym(h, "hetcclDropinInfo") || !dlsym(h, "ncclAllReduce")) {  // another drop-in, or no NCCL
      dlclose(h);
      continue;
    }
    g_real = h;
    g_real_path = buf;
    return;
  }
  if (g_real_why.empty())
    g_real_why = env ? std::string("cannot open ") + env : std::string("no ") + DROPIN_SONAME + " found beside this one";
}

// The real library's mapped address range. torch preloads the real libnccl.so.2 with
// RTLD_GLOBAL before this library opens it, so the handle open_real gets is that object, not a
// DEEPBIND one: the real library's own calls of its public names (ncclCommGetAsyncError from
// its enqueue checks, ncclGroupStart/End, ncclGetUniqueId inside ncclCommInitAll, ...) then bind
// to this drop-in, first in the global scope. Every entry point therefore hands a call whose
// caller lies inside the real library straight back to the real function (FROM_REAL), with its
// arguments untouched.
uintptr_t g_real_lo = 0, g_real_hi = 0;

void find_real_range() {
  link_map* lm = nullptr;
  if (dlinfo(g_real, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return;
  struct Q {
    uintptr_t base, lo, hi;
  } q{uintptr_t(lm->l_addr), 0, 0};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* q = static_cast<Q*>(data);
        if (uintptr_t(info->dlpi_addr) != q->base) return 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          uintptr_t a = q->base + ph.p_vaddr, b = a + ph.p_memsz;
          if (!q->lo || a < q->lo) q->lo = a;
          if (b > q->hi) q->hi = b;
        }
        return 1;
      },
      &q);
  g_real_lo = q.lo;
  g_real_hi = q.hi;
}

void* real() {
  std::call_once(g_real_once, [] {
    open_real();
    if (g_real) find_real_range();
  });
  return g_real;
}

inline bool from_real(void* return_address) {
  uintptr_t a = reinterpret_cast<uintptr_t>(return_address);
  return a >= g_real_lo && a < g_real_hi;
}

template <typename F>
F real_fn(const char* name) {
  void* lib = real();
  return lib ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
}
// resolved once per name (a function-local static at each use)
#define REAL(fn) ([] {                                            \
  static const auto p = real_fn<decltype(&fn)>(#fn);            \
  return p;                                                     \
}())

// First statement of every entry point: a call from inside the real library goes back to it.
#define FROM_REAL(fn, ...)                                            \
  do {                                                                \
    if (from_real(__builtin_return_address(0))) return REAL(fn)(__VA_ARGS__); \
  } while (0)

ncclResult_t no_real(const char* what) {
  return fail(ncclInvalidUsage, std::string("hetccl: ") + what + " needs the real " DROPIN_NAME " library: " +
                                    (g_real_why.empty() ? "none was found" : g_real_why) + " (set " DROPIN_REAL_ENV ")");
}

// ------------------------------------------------------------------ settings, device
void defaults() {
  const char* split = getenv("HETCCL_VENDOR_SPLIT");
  if (!(split && *split)) setenv("HETCCL_VENDOR", DROPIN_VENDOR, 0);  // emulation labels win
  setenv("HETCCL_CAPI_DEVICE", DROPIN_RUNTIME, 0);
}

bool native_allowed() {
  const char* v = getenv("HETCCL_DROPIN_NATIVE");
  return !(v && (std::string(v) == "0" || std::string(v) == "off"));
}

#ifdef HETCCL_DROPIN_RCCL
// A HIP runtime entry point of the process's loaded runtime: the global scope first, then the
// loaded library by its versioned and unversioned names (never loads one).
void* hip_fn(const char* name) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  for (const char* lib : {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"})
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD))
      if (void* f = dlsym(h, name)) return f;
  return nullptr;
}
#endif

int current_device() {
#ifdef HETCCL_DROPIN_RCCL
  auto get = reinterpret_cast<int (*)(int*)>(hip_fn("hipGetDevice"));
  int d = 0;
  if (get && get(&d) == 0) return d;
  return 0;
#else
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  auto get = h ? reinterpret_cast<int (*)(int*)>(dlsym(h, "cuCtxGetDevice")) : nullptr;
  int d = 0;
  if (get && get(&d) == 0) return d;
  return 0;
#endif
}

// Make `device` current on this (new) thread, as the init's caller had it: the real library and
// hetccl's device runtime take the device of the calling thread.
void set_device(int device) {
#ifdef HETCCL_DROPIN_RCCL
  auto set = reinterpret_cast<int (*)(int)>(hip_fn("hipSetDevice"));
  if (set) set(device);
#else
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) return;  // no CUDA in this process (the emulated device of the tests)
  auto get = reinterpret_cast<int (*)(int*, int)>(dlsym(h, "cuDeviceGet"));
  auto retain = reinterpret_cast<int (*)(void**, int)>(dlsym(h, "cuDevicePrimaryCtxRetain"));
  auto set = reinterpret_cast<int (*)(void*)>(dlsym(h, "cuCtxSetCurrent"));
  int dev = 0;
  void* ctx = nullptr;  // retained for the process's life, as the runtime's own primary context
  if (get && retain && set && get(&dev, device) == 0 && retain(&ctx, dev) == 0) set(ctx);
#endif
}

bool quiet() {
  const char* v = getenv("HETCCL_LOG_LEVEL");
  if (!v) return false;
  std::string s = v;
  return s == "WARN" || s == "WARNING" || s == "ERROR" || s == "warn" || s == "warning" || s == "error";
}
bool info_log() {
  const char* v = getenv("HETCCL_LOG_LEVEL");
  const char* n = getenv("NCCL_DEBUG");
  return (v && (std::string(v) == "INFO" || std::string(v) == "DEBUG")) || (n && std::string(n) == "INFO");
}

std::once_flag g_banner;
void banner() {
  std::call_once(g_banner, [] {
    real();
    if (!quiet())
      fprintf(stderr, "hetccl: serving %s calls (drop-in %s); real library: %s\n", DROPIN_NAME, DROPIN_SONAME,
              g_real ? g_real_path.c_str() : ("none (" + g_real_why + ")").c_str());
  });
}

// The result of a hetccl call, its text (this thread's last hetccl error) kept for
// ncclGetLastError. It reads nothing of the communicator: ncclCommAbort from another thread may
// have freed it by the time a call in progress returns (hetcclCommAbort lets such a call leave
// first, then frees).
ncclResult_t from_het(hetcclResult_t r) {
  if (r != hetcclSuccess) t_error = hetcclGetLastError(nullptr);
  return ncclResult_t(r);
}

// datatype for hetccl: FP8 moves as bytes when nothing is reduced
bool het_dtype(ncclDataType_t d, bool reduces, hetcclDataType_t* out, std::string* why) {
  if (d == ncclFloat8e4m3 || d == ncclFloat8e5m2) {
    if (reduces) {
      *why = "hetccl: reductions of FP8 data across vendors are not supported";
      return false;
    }
    *out = hetcclUint8;
    return true;
  }
  *out = hetcclDataType_t(d);
  return true;
}

size_t elem_size(hetcclDataType_t d) {
  switch (d) {
    case hetcclInt8: case hetcclUint8: return 1;
    case hetcclFloat16: case hetcclBfloat16: return 2;
    case hetcclInt64: case hetcclUint64: case hetcclFloat64: return 8;
    default: return 4;
  }
}

void* het_stream(cudaStream_t s) { return s ? s : HETCCL_STREAM_DEFAULT; }

// A new hetccl communicator becomes a real one when its ranks are one vendor: rank 0 makes the
// real unique id (or reports that it could not) and hetccl broadcasts it.
ncclResult_t settle(ncclComm* c, ncclConfig_t* config) {
  int groups = 0;
  hetcclResult_t r = hetcclCommVendorGroups(c->het, &groups, nullptr);
  if (r != hetcclSuccess) return from_het(r);
  bool native = groups == 1 && native_allowed();
  // Every rank must be able to take the real library's way (allowed, found, with the entry
  // points this init needs), or none does: ranks that disagreed called a missing entry point or
  // waited in the real init for ranks that kept hetccl's communicator.
  int32_t can = native && real() && REAL(ncclGetUniqueId) &&
                        (config ? REAL(ncclCommInitRankConfig) != nullptr : REAL(ncclCommInitRank) != nullptr)
                    ? 1
                    : 0;
  if (groups == 1) {
    r = hetcclAllReduce(&can, &can, 1, hetcclInt32, hetcclMin, c->het, nullptr);
    if (r != hetcclSuccess) return from_het(r);
  }
  struct {
    int rc;
    int have_real;
    ncclUniqueId id;
  } msg;
  memset(&msg, 0, sizeof msg);
  if (c->rank == 0) {
    msg.have_real = can;
    if (msg.have_real) msg.rc = REAL(ncclGetUniqueId)(&msg.id);
  }
  r = hetcclBroadcast(&msg, &msg, sizeof msg, hetcclUint8, 0, c->het, nullptr);
  if (r != hetcclSuccess) return from_het(r);
  if (!native || !msg.have_real) {
    if (info_log())
      fprintf(stderr, "hetccl: rank %d/%d: %d vendor group(s): hetccl serves this communicator%s\n", c->rank,
              c->nranks, groups, native ? " (the real library is not usable on every rank)" : "");
    return ncclSuccess;
  }
  if (msg.rc != ncclSuccess) return fail(ncclResult_t(msg.rc), "hetccl: rank 0's real ncclGetUniqueId failed");
  ncclResult_t rr = config ? REAL(ncclCommInitRankConfig)(&c->real, c->nranks, msg.id, c->rank, config)
                           : REAL(ncclCommInitRank)(&c->real, c->nranks, msg.id, c->rank);
  hetcclCommDestroy(c->het);
  c->het = nullptr;
  if (info_log())
    fprintf(stderr, "hetccl: rank %d/%d: one vendor: the real %s serves this communicator\n", c->rank, c->nranks,
            DROPIN_NAME);
  return rr;
}

// The init proper: hetccl's bootstrap, then settle. On failure nothing of c's is left open.
ncclResult_t init_now(ncclComm* c, const ncclUniqueId& id, ncclConfig_t* config) {
  hetcclUniqueId hid;
  static_assert(sizeof hid == sizeof id, "unique ids of one size");
  memcpy(&hid, &id, sizeof hid);
  hetcclResult_t r = hetcclCommInitRank(&c->het, c->nranks, hid, c->rank);
  if (r != hetcclSuccess) {
    c->het = nullptr;
    t_error = hetcclGetLastError(nullptr);
    return ncclResult_t(r);
  }
  ncclResult_t s = settle(c, config);
  if (s != ncclSuccess && s != ncclInProgress) {
    if (c->het) hetcclCommAbort(c->het);
    if (c->real && REAL(ncclCommAbort)) REAL(ncclCommAbort)(c->real);
    c->het = nullptr;
    c->real = nullptr;
  }
  return s;
}

// The inits waiting for this thread's outermost ncclGroupEnd.
struct DeferredInit {
  ncclComm* c;
  ncclUniqueId id;
  std::vector<char> config;  // a copy of the caller's ncclConfig_t (its first field is its size)
};
thread_local std::vector<DeferredInit> t_inits;

ncclResult_t init(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, ncclConfig_t* config) {
  if (!out) return group_refusal(fail(ncclInvalidArgument, "hetccl: ncclCommInitRank: comm is NULL"));
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return group_refusal(fail(ncclInvalidArgument, "hetccl: ncclCommInitRank: rank " + std::to_string(rank) +
                                                       " is not in [0, nranks) for nranks " + std::to_string(nranks)));
  defaults();
  banner();
  auto* c = new (std::nothrow) ncclComm();
  if (!c) return fail(ncclSystemError, "hetccl: out of memory");
  c->rank = rank;
  c->nranks = nranks;
  c->device = current_device();
  if (t_group_depth > 0) {  // runs at the outermost ncclGroupEnd
    DeferredInit d{c, id, {}};
    if (config) {
      size_t n = *reinterpret_cast<const size_t*>(config);
      if (n < sizeof(size_t) || n > 4096) {
        delete c;
        return group_refusal(fail(ncclInvalidArgument, "hetccl: ncclCommInitRankConfig: config->size " +
                                                           std::to_string(n) +
                                                           " is not that of an ncclConfig_t (use NCCL_CONFIG_INITIALIZER)"));
      }
      d.config.assign(reinterpret_cast<const char*>(config), reinterpret_cast<const char*>(config) + n);
    }
    c->state.store(ncclComm::WAITING, std::memory_order_release);
    t_inits.push_back(std::move(d));
    *out = c;
    return ncclSuccess;
  }
  ncclResult_t s = init_now(c, id, config);
  if (s != ncclSuccess && s != ncclInProgress) {
    delete c;
    return s;
  }
  *out = c;
  return s;
}

// Runs job(k) for every k in `ks`, each on a thread of its own with device[k] made current, and
// waits for them all (the calling thread's own current device stays as it was). An exception
// of job(k), or a thread that cannot start, goes to failed(k, code, text) instead.
template <class Job, class Failed>
void on_own_threads(const std::vector<size_t>& ks, const std::vector<int>& device, Job job, Failed failed) {
  std::vector<std::thread> th;
  for (size_t k : ks) {
    try {
      th.emplace_back([&, k] {
        try {
          set_device(device[k]);
          job(k);
        } catch (const std::exception& e) {
          failed(k, ncclInternalError, std::string(e.what()));
        }
      });
    } catch (const std::exception& e) {
      failed(k, ncclSystemError, std::string("hetccl: cannot start a thread: ") + e.what());
    }
  }
  for (auto& t : th) t.join();
}

// The outermost ncclGroupEnd's inits: each on a thread of its own (each bootstrap waits for
// the ranks the others make; the caller's own current device stays as it was), on the device
// its caller had. The first failure is returned with its text; a failed communicator is left
// FAILED for the caller's destroy or abort; one abandoned meanwhile is freed here.
ncclResult_t run_deferred_inits() {
  std::vector<DeferredInit> inits;
  inits.swap(t_inits);
  if (inits.empty()) return ncclSuccess;
  const size_t n = inits.size();
  std::vector<ncclResult_t> rc(n, ncclSuccess);
  std::vector<std::string> text(n);
  std::vector<int> ranks(n), sizes(n), device(n);
  std::vector<size_t> started;
  for (size_t i = 0; i < n; ++i) {
    ncclComm* c = inits[i].c;
    ranks[i] = c->rank;
    sizes[i] = c->nranks;
    device[i] = c->device;
    std::unique_lock<std::mutex> g(c->mu);
    if (c->abandoned) {  // destroyed before its group ended (by another thread)
      g.unlock();
      delete c;
      continue;
    }
    c->running = true;
    started.push_back(i);
  }
  on_own_threads(
      started, device,
      [&](size_t i) {
        DeferredInit& d = inits[i];
        rc[i] = init_now(d.c, d.id, d.config.empty() ? nullptr : reinterpret_cast<ncclConfig_t*>(d.config.data()));
        if (rc[i] != ncclSuccess && rc[i] != ncclInProgress) {
          text[i] = t_error;
          if (text[i].empty() && REAL(ncclGetLastError)) text[i] = REAL(ncclGetLastError)(nullptr);  // the real init's
        }
      },
      [&](size_t i, ncclResult_t code, const std::string& why) {
        rc[i] = code;
        text[i] = why;
      });
  // each init's end: FAILED or READY, or freed when it was abandoned while it ran
  for (size_t i : started) {
    ncclComm* c = inits[i].c;
    bool ok = rc[i] == ncclSuccess || rc[i] == ncclInProgress;
    std::unique_lock<std::mutex> g(c->mu);
    c->running = false;
    if (c->abandoned) {
      g.unlock();
      if (c->het) hetcclCommAbort(c->het);
      if (c->real && REAL(ncclCommAbort)) REAL(ncclCommAbort)(c->real);
      delete c;
      continue;
    }
    c->init_error.store(rc[i], std::memory_order_relaxed);
    c->state.store(ok ? ncclComm::READY : ncclComm::FAILED, std::memory_order_release);
  }
  ncclResult_t first = ncclSuccess;
  for (size_t i : started) {
    if (rc[i] == ncclSuccess || rc[i] == ncclInProgress) {
      if (first == ncclSuccess) first = rc[i];
      continue;
    }
    if (first == ncclSuccess || first == ncclInProgress) {
      first = rc[i];
      t_error = "hetccl: ncclGroupEnd: the init of rank " + std::to_string(ranks[i]) + " of " +
                std::to_string(sizes[i]) + " failed: " + text[i];
    }
  }
  return first;
}

// A cancelled group's inits (a call of the group was refused): none runs; each communicator
// is left FAILED with the group's error, for the caller's destroy or abort (one abandoned
// meanwhile is freed here).
void cancel_deferred_inits(ncclResult_t why) {
  std::vector<DeferredInit> inits;
  inits.swap(t_inits);
  for (auto& d : inits) {
    ncclComm* c = d.c;
    std::unique_lock<std::mutex> g(c->mu);
    if (c->abandoned) {
      g.unlock();
      delete c;
      continue;
    }
    c->init_error.store(why, std::memory_order_relaxed);
    c->state.store(ncclComm::FAILED, std::memory_order_release);
  }
}

// A communicator whose init waits for ncclGroupEnd, or failed there.
ncclResult_t not_ready(const ncclComm* c, const std::string& what) {
  if (c->state.load(std::memory_order_acquire) == ncclComm::WAITING)
    return fail(ncclInvalidUsage, "hetccl: " + what + ": the communicator's init waits for ncclGroupEnd (it was "
                                                      "called inside ncclGroupStart/End)");
  return fail(ncclInvalidUsage, "hetccl: " + what + ": the communicator's init failed at ncclGroupEnd; only "
                                                    "ncclCommDestroy or ncclCommAbort are left");
}

// Destroy or abort of a communicator whose init was deferred. True when handled here: a failed
// one freed (nothing of it is open), a waiting one dropped from this thread's group and freed,
// or left to whoever runs its init (another thread's group, or its running init) to free.
// False when its init has finished meanwhile (READY): the caller destroys it as any other.
bool drop_unready(ncclComm* c) {
  {
    std::lock_guard<std::mutex> g(c->mu);
    int s = c->state.load(std::memory_order_acquire);
    if (s == ncclComm::READY) return false;
    if (s == ncclComm::WAITING) {
      auto it = std::find_if(t_inits.begin(), t_inits.end(), [c](const DeferredInit& d) { return d.c == c; });
      if (c->running || it == t_inits.end()) {
        c->abandoned = true;
        return true;
      }
      t_inits.erase(it);
    }
  }
  delete c;
  return true;
}

// Calls on hetccl communicators inside ncclGroupStart/End wait for the outermost ncclGroupEnd,
// as NCCL launches a group's work there: a thread that drives several ranks (nccl-tests -g N)
// issues each communicator's calls at once, in call order, one thread per communicator on its
// device, so no rank's call waits for a call its thread has not made yet (the device route's
// issue waits for the argument check with the peers). ncclGroupSimulateEnd drops them, as
// NCCL's simulation launches nothing. A call refused by the drop-in itself (comm, datatype)
// still fails at the call; hetccl's own verdicts come from ncclGroupEnd.
struct DeferredCall {
  ncclComm* c;
  std::function<hetcclResult_t()> run;
  void* stream = nullptr;  // the caller's stream (calls that share one are issued by one thread)
  bool always = false;     // runs even where the group's calls are dropped (ncclRedOpDestroy)
};
thread_local std::vector<DeferredCall> t_calls;

bool has_deferred(const ncclComm* c) {
  for (auto& d : t_calls)
    if (d.c == c) return true;
  return false;
}

// Runs one communicator's deferred calls inside a hetccl group of this thread (its sends and
// receives then go out together, as before); the first failure and its text.
// Each call runs only while its communicator is not being destroyed or aborted (`users`,
// `closing`: a communicator closed meanwhile by another thread gets no further call).
ncclResult_t run_calls_of(const std::vector<DeferredCall*>& calls, bool drop, std::string* text) {
  std::vector<ncclComm*> held;  // communicators this issuer counts as a user of
  auto enter = [&](ncclComm* c) {
    if (std::find(held.begin(), held.end(), c) != held.end()) {
      std::lock_guard<std::mutex> g(c->mu);
      return !c->closing;
    }
    std::lock_guard<std::mutex> g(c->mu);
    if (c->closing) return false;
    ++c->users;
    held.push_back(c);
    return true;
  };
  hetcclGroupStart();
  hetcclResult_t first = hetcclSuccess;
  for (DeferredCall* d : calls) {
    if (drop && !d->always) continue;
    if (!enter(d->c)) {
      if (first == hetcclSuccess) {
        first = hetcclInvalidUsage;
        *text = "hetccl: ncclGroupEnd: the communicator was destroyed or aborted while its group was issued";
      }
      continue;
    }
    hetcclResult_t r = d->run();
    if (r != hetcclSuccess && first == hetcclSuccess) {
      first = r;
      *text = hetcclGetLastError(nullptr);
    }
  }
  hetcclResult_t e = hetcclGroupEnd();  // this thread's queued sends and receives (held above)
  if (first == hetcclSuccess && e != hetcclSuccess) {
    first = e;
    *text = hetcclGetLastError(nullptr);
  }
  for (ncclComm* c : held) {  // last touch of c: a closer may free it once users is 0
    std::lock_guard<std::mutex> g(c->mu);
    if (--c->users == 0) c->idle.notify_all();
  }
  return ncclResult_t(first);
}

ncclResult_t run_deferred_calls(bool drop) {
  std::vector<DeferredCall> calls;
  calls.swap(t_calls);
  if (calls.empty()) return ncclSuccess;
  // Issuers: communicators that share a stream are issued by one thread in call order (each
  // call enqueues a wait on its stream: two threads could enqueue them in different orders on
  // different ranks and deadlock the streams); the others get a thread each.
  std::vector<ncclComm*> comms;  // in the order of their first call
  std::vector<size_t> parent;
  auto find = [&](size_t k) {
    while (parent[k] != k) k = parent[k] = parent[parent[k]];
    return k;
  };
  auto index_of = [&](ncclComm* c) {
    size_t k = std::find(comms.begin(), comms.end(), c) - comms.begin();
    if (k == comms.size()) {
      comms.push_back(c);
      parent.push_back(k);
    }
    return k;
  };
  std::vector<std::pair<void*, size_t>> stream_owner;
  for (auto& d : calls) {
    size_t k = index_of(d.c);
    if (!d.stream) continue;
    auto it = std::find_if(stream_owner.begin(), stream_owner.end(), [&](auto& p) { return p.first == d.stream; });
    if (it == stream_owner.end()) stream_owner.push_back({d.stream, k});
    else parent[find(k)] = find(it->second);
  }
  std::vector<size_t> roots;
  std::vector<std::vector<DeferredCall*>> of;
  for (auto& d : calls) {
    size_t r = find(index_of(d.c));
    size_t g = std::find(roots.begin(), roots.end(), r) - roots.begin();
    if (g == roots.size()) {
      roots.push_back(r);
      of.emplace_back();
    }
    of[g].push_back(&d);
  }
  std::vector<ncclResult_t> rc(of.size(), ncclSuccess);
  std::vector<std::string> text(of.size());
  if (of.size() == 1) {
    rc[0] = run_calls_of(of[0], drop, &text[0]);
  } else {
    std::vector<size_t> all(of.size());
    std::vector<int> device(of.size());
    for (size_t g = 0; g < of.size(); ++g) {
      all[g] = g;
      device[g] = comms[roots[g]]->device;  // read here: the issuer counts itself a user only later
    }
    on_own_threads(
        all, device, [&](size_t g) { rc[g] = run_calls_of(of[g], drop, &text[g]); },
        [&](size_t g, ncclResult_t code, const std::string& why) {
          rc[g] = code;
          text[g] = why;
        });
  }
  for (size_t g = 0; g < of.size(); ++g)
    if (rc[g] != ncclSuccess) {
      t_error = text[g];
      return rc[g];
    }
  return ncclSuccess;
}

// Destroy or abort of a hetccl communicator: this thread's deferred calls on it are dropped
// (they would run on a freed communicator at ncclGroupEnd); issuers on other threads are told
// to stop (abort: their call in progress is interrupted) and waited for.
void close_calls_of(ncclComm* c, bool abort) {
  t_calls.erase(std::remove_if(t_calls.begin(), t_calls.end(), [c](const DeferredCall& d) { return d.c == c; }),
                t_calls.end());
  std::unique_lock<std::mutex> g(c->mu);
  c->closing = true;
  if (c->users == 0) return;
  if (abort && c->het) hetcclCommInterrupt(c->het);
  c->idle.wait(g, [c] { return c->users == 0; });
}

// The outermost group's end when a call of it was refused (or the real library's group
// failed): its inits and calls are dropped unrun (ncclRedOpDestroy still runs) and the refusal
// is returned, as NCCL cancels a group with a failed call. Else ncclSuccess.
ncclResult_t cancelled_group(ncclResult_t real) {
  ncclResult_t e = t_group_error;
  std::string why = t_group_error_text;
  t_group_error = ncclSuccess;
  t_group_error_text.clear();
  // the real library's group cancelled for a refused call of its own (argument classes); a
  // failure while launching (system, CUDA, remote) leaves hetccl's part to run as it would
  bool real_failed = real == ncclInvalidArgument || real == ncclInvalidUsage;
  if (e == ncclSuccess && !real_failed) return ncclSuccess;
  if (e == ncclSuccess) {
    e = real;
    why = REAL(ncclGetLastError) ? REAL(ncclGetLastError)(nullptr) : "the real library's group failed";
  }
  cancel_deferred_inits(e);
  run_deferred_calls(true);
  t_error = "hetccl: ncclGroupEnd: a call of the group failed (" + why +
            "), so none of hetccl's calls or communicator inits of the group was launched (NCCL "
            "cancels a group with a failed call; calls on communicators of the real library are "
            "that library's to launch or cancel)";
  return e;
}

// A group's result from its parts (the real library's, hetccl's group, inits, calls): a
// failure before an ncclInProgress (a nonblocking real communicator's), which would hide it.
ncclResult_t group_result(std::initializer_list<ncclResult_t> parts) {
  for (ncclResult_t x : parts)
    if (x != ncclSuccess && x != ncclInProgress) return x;
  for (ncclResult_t x : parts)
    if (x == ncclInProgress) return x;
  return ncclSuccess;
}

// A split or shrink of a hetccl communicator is a collective over it, run now: inside a group,
// the parent's deferred calls must go first, as every rank issues them. They are issued here
// when they are this thread's only deferred calls; a thread with calls on other communicators
// pending gets a clear refusal instead of an order its peers may not share.
ncclResult_t before_child_of(ncclComm* parent, const char* what) {
  if (t_group_depth == 0 || !has_deferred(parent)) return ncclSuccess;
  for (auto& d : t_calls)
    if (d.c != parent)
      return group_refusal(fail(ncclInvalidUsage, std::string("hetccl: ") + what +
                                                      " inside a group that also holds calls on other "
                                                      "communicators of this thread: end the group first"));
  return group_refusal(run_deferred_calls(false));
}

// A hetccl call of an entry point: now, or at the outermost ncclGroupEnd inside a group.
// `st`: the call's stream (nullptr: none); `always`: runs also in a simulated group.
#define HET_CALL_ON(c, st, always, ...)                                   \
  do {                                                                    \
    if (t_group_depth > 0) {                                              \
      t_calls.push_back({(c), [=]() -> hetcclResult_t { return __VA_ARGS__; }, (st), (always)}); \
      return ncclSuccess;                                                 \
    }                                                                     \
    return from_het(__VA_ARGS__);                                         \
  } while (0)
#define HET_CALL(c, ...) HET_CALL_ON(c, het_stream(stream), false, __VA_ARGS__)

#define CHECK_COMM_AS(c, what, wrap)                                                                      \
  if (!(c)) return wrap(fail(ncclInvalidArgument, std::string("hetccl: ") + what + ": comm is NULL"));     \
  if ((c)->state.load(std::memory_order_acquire) != ncclComm::READY) return wrap(not_ready(c, what));    \
  if (!(c)->real && !(c)->het) return wrap(fail(ncclInvalidArgument, std::string("hetccl: ") + what + ": comm is NULL"))
#define NO_GROUP_ERROR(r) (r)
// queries: a refusal fails that call alone
#define CHECK_COMM(c, what) CHECK_COMM_AS(c, what, NO_GROUP_ERROR)
// calls that enqueue work or make, split or end a communicator: a refusal inside a group
// cancels the group (group_refusal)
#define CHECK_CALL(c, what) CHECK_COMM_AS(c, what, group_refusal)
// a root out of range (gather, scatter: built here from sends and receives), refused at the call.
// Other argument errors (datatype, root, peer, op, count) are hetccl's verdicts: refused on
// every rank through the argument check (csrc/api/c_api.cc), at the call outside a group and
// at ncclGroupEnd inside one, where they do not cancel the group's other calls.
#define CHECK_RANK(c, r, what, name)                                                                 \
  if ((r) < 0 || (r) >= (c)->nranks)                                                                 \
  return group_refusal(fail(ncclInvalidArgument, std::string("hetccl: ") + what + ": " + name + " " +  \
                                                     std::to_string(r) + " is not in [0, " +           \
                                                     std::to_string((c)->nranks) + ")"))
#define FORWARD(c, fn, ...)                                            \
  do {                                                                 \
    auto f = REAL(fn);                                                 \
    if (!f) return no_real(#fn);                                       \
    return f(__VA_ARGS__);                                             \
  } while (0)

// A communicator the real library made (a split's or shrink's child): its size and rank as the
// real library reports them (a nonblocking child may not know them yet: 0 then).
ncclComm* wrap_real(ncclComm_t child, int device) {
  auto* c = new ncclComm();
  c->real = child;
  c->device = device;
  if (auto cnt = REAL(ncclCommCount)) cnt(child, &c->nranks);
  if (auto ur = REAL(ncclCommUserRank)) ur(child, &c->rank);
  return c;
}

ncclResult_t refuse_cross(const char* what, const char* why) {
  return fail(ncclInvalidUsage, std::string("hetccl: ") + what + " on a communicator that spans vendors: " + why);
}

}  // namespace

extern "C" {

HETCCL_NCCL_API const char* hetcclDropinInfo(void) {
  static std::string s;
  real();
  s = std::string("library=" DROPIN_SONAME " abi=") + std::to_string(DROPIN_ABI_VERSION) +
      " real=" + (g_real ? g_real_path : std::string("none")) + (g_real ? "" : " why=" + g_real_why);
  return s.c_str();
}

// The hetccl communicator behind an NCCL one (NULL when the real library serves it): for tests
// and `hetccl doctor` (hetcclCommInfo, the emulated runtime's streams).
HETCCL_NCCL_API hetcclComm_t hetcclDropinComm(ncclComm_t comm) { return comm ? comm->het : nullptr; }

ncclResult_t ncclGetVersion(int* version) {
  FROM_REAL(ncclGetVersion, version);
  if (!version) return fail(ncclInvalidArgument, "hetccl: ncclGetVersion: version is NULL");
  if (auto f = REAL(ncclGetVersion)) return f(version);
  *version = DROPIN_ABI_VERSION;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  FROM_REAL(ncclGetErrorString, result);
  if (auto f = REAL(ncclGetErrorString)) return f(result);
  return hetcclGetErrorString(hetcclResult_t(result));
}

const char* ncclGetLastError(ncclComm_t comm) {
  FROM_REAL(ncclGetLastError, comm);
  static thread_local std::string out;
  if (comm && comm->real) {
    if (auto f = REAL(ncclGetLastError)) return f(comm->real);
  }
  // this thread's newest failure first (as NCCL: a thread-local text): every failing return of
  // the drop-in sets it, its own refusals included, which the communicator's text does not see
  if (!t_error.empty()) return t_error.c_str();
  if (comm && comm->het) {
    out = hetcclGetLastError(comm->het);
    if (!out.empty()) return out.c_str();
  }
  if (auto f = REAL(ncclGetLastError)) return f(nullptr);
  return "";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  FROM_REAL(ncclGetUniqueId, uniqueId);
  if (!uniqueId) return fail(ncclInvalidArgument, "hetccl: ncclGetUniqueId: uniqueId is NULL");
  defaults();
  banner();
  hetcclUniqueId id;
  hetcclResult_t r = hetcclGetUniqueId(&id);
  if (r != hetcclSuccess) return from_het(r);
  memcpy(uniqueId, &id, sizeof id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  FROM_REAL(ncclCommInitRank, comm, nranks, commId, rank);
  return init(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
  FROM_REAL(ncclCommInitRankConfig, comm, nranks, commId, rank, config);
  return init(comm, nranks, commId, rank, config);
}

ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds,
                                      ncclConfig_t* config) {
  FROM_REAL(ncclCommInitRankScalable, newcomm, nranks, myrank, nId, commIds, config);
  if (nId < 1 || !commIds) return fail(ncclInvalidArgument, "hetccl: ncclCommInitRankScalable: no unique id");
  return init(newcomm, nranks, commIds[0], myrank, config);  // one hetccl root serves every rank
}

ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  FROM_REAL(ncclCommInitAll, comm, ndev, devlist);
  // One process, several devices: always one vendor, so the real library serves it.
  banner();
  if (!comm || ndev < 1) return fail(ncclInvalidArgument, "hetccl: ncclCommInitAll: no communicators asked for");
  auto f = REAL(ncclCommInitAll);
  if (!f) return no_real("ncclCommInitAll");
  std::vector<ncclComm_t> reals(static_cast<size_t>(ndev));
  ncclResult_t r = f(reals.data(), ndev, devlist);
  if (r != ncclSuccess) return r;
  for (int i = 0; i < ndev; ++i) {
    comm[i] = new ncclComm();
    comm[i]->real = reals[size_t(i)];
    comm[i]->rank = i;
    comm[i]->nranks = ndev;
    comm[i]->device = devlist ? devlist[i] : i;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  FROM_REAL(ncclCommFinalize, comm);
  CHECK_CALL(comm, "ncclCommFinalize");
  if (comm->real) FORWARD(comm, ncclCommFinalize, comm->real);
  return ncclSuccess;  // hetcclCommDestroy completes what was issued
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  FROM_REAL(ncclCommDestroy, comm);
  if (!comm) return ncclSuccess;  // as NCCL (init.cc): a no-op on NULL
  if (comm->state.load(std::memory_order_acquire) != ncclComm::READY && drop_unready(comm)) return ncclSuccess;
  CHECK_CALL(comm, "ncclCommDestroy");
  if (comm->het) close_calls_of(comm, false);
  ncclResult_t r = ncclSuccess;
  if (comm->real) {
    auto f = REAL(ncclCommDestroy);
    r = f ? f(comm->real) : no_real("ncclCommDestroy");
  } else {
    r = from_het(hetcclCommDestroy(comm->het));
  }
  delete comm;
  return r;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  FROM_REAL(ncclCommAbort, comm);
  if (!comm) return ncclSuccess;  // as NCCL (init.cc): a no-op on NULL
  if (comm->state.load(std::memory_order_acquire) != ncclComm::READY && drop_unready(comm)) return ncclSuccess;
  CHECK_CALL(comm, "ncclCommAbort");
  if (comm->het) close_calls_of(comm, true);
  ncclResult_t r = ncclSuccess;
  if (comm->real) {
    auto f = REAL(ncclCommAbort);
    r = f ? f(comm->real) : no_real("ncclCommAbort");
  } else {
    r = from_het(hetcclCommAbort(comm->het));
  }
  delete comm;
  return r;
}

ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) {
  FROM_REAL(ncclCommRevoke, comm, revokeFlags);
  CHECK_CALL(comm, "ncclCommRevoke");
  if (comm->real) FORWARD(comm, ncclCommRevoke, comm->real, revokeFlags);
  return refuse_cross("ncclCommRevoke", "not supported (use ncclCommAbort)");
}

// A hetccl child (of a split or a shrink) as NCCL's communicator, settled like a new one: one
// vendor left means the real library serves it.
static ncclResult_t adopt(hetcclComm_t child, int device, ncclConfig_t* config, ncclComm_t* newcomm) {
  auto* c = new ncclComm();
  c->het = child;
  c->device = device;
  hetcclCommCount(child, &c->nranks);
  hetcclCommUserRank(child, &c->rank);
  ncclResult_t s = settle(c, config);
  if (s != ncclSuccess && s != ncclInProgress) {
    if (c->het) hetcclCommAbort(c->het);
    delete c;
    return s;
  }
  *newcomm = c;
  return s;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  FROM_REAL(ncclCommSplit, comm, color, key, newcomm, config);
  CHECK_CALL(comm, "ncclCommSplit");
  if (!newcomm) return group_refusal(fail(ncclInvalidArgument, "hetccl: ncclCommSplit: newcomm is NULL"));
  *newcomm = nullptr;
  if (comm->real) {
    auto f = REAL(ncclCommSplit);
    if (!f) return no_real("ncclCommSplit");
    ncclComm_t child = nullptr;
    ncclResult_t r = f(comm->real, color, key, &child, config);
    if (r != ncclSuccess && r != ncclInProgress) return r;
    if (child) *newcomm = wrap_real(child, comm->device);
    return r;
  }
  if (ncclResult_t b = before_child_of(comm, "ncclCommSplit"); b != ncclSuccess) return b;
  hetcclComm_t child = nullptr;
  hetcclResult_t hr = hetcclCommSplit(comm->het, color, key, &child);
  if (hr != hetcclSuccess) return group_refusal(from_het(hr));
  if (!child) return ncclSuccess;  // NCCL_SPLIT_NOCOLOR
  return adopt(child, comm->device, config, newcomm);
}

ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm,
                            ncclConfig_t* config, int shrinkFlags) {
  FROM_REAL(ncclCommShrink, comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags);
  CHECK_CALL(comm, "ncclCommShrink");
  if (comm->real) {
    auto f = REAL(ncclCommShrink);
    if (!f) return no_real("ncclCommShrink");
    ncclComm_t child = nullptr;
    ncclResult_t r = f(comm->real, excludeRanksList, excludeRanksCount, &child, config, shrinkFlags);
    if (newcomm) *newcomm = nullptr;
    if ((r == ncclSuccess || r == ncclInProgress) && child && newcomm) *newcomm = wrap_real(child, comm->device);
    return r;
  }
  if (!newcomm) return group_refusal(fail(ncclInvalidArgument, "hetccl: ncclCommShrink: newcomm is NULL"));
  *newcomm = nullptr;
  if (ncclResult_t b = before_child_of(comm, "ncclCommShrink"); b != ncclSuccess) return b;
  hetcclComm_t child = nullptr;
  hetcclResult_t hr = hetcclCommShrink(comm->het, excludeRanksList, excludeRanksCount, &child, shrinkFlags);
  if (hr != hetcclSuccess) return group_refusal(from_het(hr));
  return adopt(child, comm->device, config, newcomm);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  FROM_REAL(ncclCommGetAsyncError, comm, asyncError);
  if (comm && asyncError) {  // as NCCL's: in progress, or the init's error
    int st = comm->state.load(std::memory_order_acquire);
    if (st != ncclComm::READY) {
      *asyncError = st == ncclComm::WAITING ? ncclInProgress : ncclResult_t(comm->init_error.load());
      return ncclSuccess;
    }
  }
  CHECK_COMM(comm, "ncclCommGetAsyncError");
  if (comm->real) FORWARD(comm, ncclCommGetAsyncError, comm->real, asyncError);
  if (!asyncError) return fail(ncclInvalidArgument, "hetccl: ncclCommGetAsyncError: asyncError is NULL");
  hetcclResult_t e = hetcclSuccess;
  hetcclResult_t r = hetcclCommGetAsyncError(comm->het, &e);
  *asyncError = ncclResult_t(e);
  // NCCL's contract: after an async error, ncclGetLastError names it (torch's watchdog prints
  // ncclGetLastError(NULL) under "Last error:" from the thread that polled)
  if (r == hetcclSuccess && e != hetcclSuccess) t_error = hetcclGetLastError(nullptr);
  return from_het(r);
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  FROM_REAL(ncclCommCount, comm, count);
  CHECK_COMM(comm, "ncclCommCount");
  if (!count) return fail(ncclInvalidArgument, "hetccl: ncclCommCount: count is NULL");
  if (comm->real) FORWARD(comm, ncclCommCount, comm->real, count);
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  FROM_REAL(ncclCommCuDevice, comm, device);
  CHECK_COMM(comm, "ncclCommCuDevice");
  if (!device) return fail(ncclInvalidArgument, "hetccl: ncclCommCuDevice: device is NULL");
  if (comm->real) FORWARD(comm, ncclCommCuDevice, comm->real, device);
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  FROM_REAL(ncclCommUserRank, comm, rank);
  CHECK_COMM(comm, "ncclCommUserRank");
  if (!rank) return fail(ncclInvalidArgument, "hetccl: ncclCommUserRank: rank is NULL");
  if (comm->real) FORWARD(comm, ncclCommUserRank, comm->real, rank);
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle) {
  FROM_REAL(ncclCommRegister, comm, buff, size, handle);
  CHECK_COMM(comm, "ncclCommRegister");
  if (comm->real) FORWARD(comm, ncclCommRegister, comm->real, buff, size, handle);
  if (!handle) return fail(ncclInvalidArgument, "hetccl: ncclCommRegister: handle is NULL");
  *handle = comm;  // a hint only: hetccl stages through its own pinned memory
  return ncclSuccess;
}

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle) {
  FROM_REAL(ncclCommDeregister, comm, handle);
  CHECK_COMM(comm, "ncclCommDeregister");
  if (comm->real) FORWARD(comm, ncclCommDeregister, comm->real, handle);
  if (handle != comm) return fail(ncclInvalidArgument, "hetccl: ncclCommDeregister: not a handle of this communicator");
  return ncclSuccess;
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags) {
  FROM_REAL(ncclCommWindowRegister, comm, buff, size, win, winFlags);
  CHECK_COMM(comm, "ncclCommWindowRegister");
  if (comm->real) FORWARD(comm, ncclCommWindowRegister, comm->real, buff, size, win, winFlags);
  return refuse_cross("ncclCommWindowRegister", "symmetric memory windows need one vendor's peer memory");
}

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  FROM_REAL(ncclCommWindowDeregister, comm, win);
  CHECK_COMM(comm, "ncclCommWindowDeregister");
  if (comm->real) FORWARD(comm, ncclCommWindowDeregister, comm->real, win);
  return refuse_cross("ncclCommWindowDeregister", "symmetric memory windows need one vendor's peer memory");
}

ncclResult_t ncclDevCommCreate(ncclComm_t comm, ncclDevCommRequirements_t const* reqs, ncclDevComm_t* outDevComm) {
  FROM_REAL(ncclDevCommCreate, comm, reqs, outDevComm);
  CHECK_COMM(comm, "ncclDevCommCreate");
  if (comm->real) FORWARD(comm, ncclDevCommCreate, comm->real, reqs, outDevComm);
  return refuse_cross("ncclDevCommCreate", "device-initiated communication needs one vendor's device API");
}

ncclResult_t ncclDevCommDestroy(ncclComm_t comm, ncclDevComm_t const* devComm) {
  FROM_REAL(ncclDevCommDestroy, comm, devComm);
  CHECK_COMM(comm, "ncclDevCommDestroy");
  if (comm->real) FORWARD(comm, ncclDevCommDestroy, comm->real, devComm);
  return refuse_cross("ncclDevCommDestroy", "device-initiated communication needs one vendor's device API");
}

ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  FROM_REAL(ncclMemAlloc, ptr, size);
  auto f = REAL(ncclMemAlloc);
  if (!f) return no_real("ncclMemAlloc");
  return f(ptr, size);
}

ncclResult_t ncclMemFree(void* ptr) {
  FROM_REAL(ncclMemFree, ptr);
  auto f = REAL(ncclMemFree);
  if (!f) return no_real("ncclMemFree");
  return f(ptr);
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  FROM_REAL(ncclRedOpCreatePreMulSum, op, scalar, datatype, residence, comm);
  CHECK_COMM(comm, "ncclRedOpCreatePreMulSum");
  if (comm->real) FORWARD(comm, ncclRedOpCreatePreMulSum, op, scalar, datatype, residence, comm->real);
  hetcclDataType_t dt;
  std::string why;
  if (!het_dtype(datatype, true, &dt, &why)) return fail(ncclInvalidArgument, why);
  hetcclRedOp_t hop = hetcclSum;
  hetcclResult_t r = hetcclRedOpCreatePreMulSum(&hop, scalar, dt, hetcclScalarResidence_t(residence), comm->het);
  if (op) *op = ncclRedOp_t(hop);
  return from_het(r);
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  FROM_REAL(ncclRedOpDestroy, op, comm);
  CHECK_COMM(comm, "ncclRedOpDestroy");
  if (comm->real) FORWARD(comm, ncclRedOpDestroy, op, comm->real);
  hetcclComm_t h = comm->het;
  HET_CALL_ON(comm, nullptr, true, hetcclRedOpDestroy(hetcclRedOp_t(op), h));  // after the group's calls that use it
}

// ------------------------------------------------------------------ collectives
#define HET_DTYPE(dt, reduces)                                        \
  hetcclDataType_t hdt;                                               \
  {                                                                   \
    std::string why;                                                  \
    if (!het_dtype(dt, reduces, &hdt, &why)) return group_refusal(fail(ncclInvalidArgument, why)); \
  }

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclAllReduce, sendbuff, recvbuff, count, datatype, op, comm, stream);
  CHECK_CALL(comm, "ncclAllReduce");
  if (comm->real) FORWARD(comm, ncclAllReduce, sendbuff, recvbuff, count, datatype, op, comm->real, stream);
  HET_DTYPE(datatype, true);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclAllReduce(sendbuff, recvbuff, count, hdt, hetcclRedOp_t(op), h, het_stream(stream)));
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclReduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
  CHECK_CALL(comm, "ncclReduce");
  if (comm->real) FORWARD(comm, ncclReduce, sendbuff, recvbuff, count, datatype, op, root, comm->real, stream);
  HET_DTYPE(datatype, true);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclReduce(sendbuff, recvbuff, count, hdt, hetcclRedOp_t(op), root, h, het_stream(stream)));
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclBroadcast, sendbuff, recvbuff, count, datatype, root, comm, stream);
  CHECK_CALL(comm, "ncclBroadcast");
  if (comm->real) FORWARD(comm, ncclBroadcast, sendbuff, recvbuff, count, datatype, root, comm->real, stream);
  HET_DTYPE(datatype, false);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclBroadcast(sendbuff, recvbuff, count, hdt, root, h, het_stream(stream)));
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  FROM_REAL(ncclBcast, buff, count, datatype, root, comm, stream);
  CHECK_CALL(comm, "ncclBcast");
  if (comm->real) FORWARD(comm, ncclBcast, buff, count, datatype, root, comm->real, stream);
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
  CHECK_CALL(comm, "ncclReduceScatter");
  if (comm->real) FORWARD(comm, ncclReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, comm->real, stream);
  HET_DTYPE(datatype, true);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclReduceScatter(sendbuff, recvbuff, recvcount, hdt, hetcclRedOp_t(op), h, het_stream(stream)));
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclAllGather, sendbuff, recvbuff, sendcount, datatype, comm, stream);
  CHECK_CALL(comm, "ncclAllGather");
  if (comm->real) FORWARD(comm, ncclAllGather, sendbuff, recvbuff, sendcount, datatype, comm->real, stream);
  HET_DTYPE(datatype, false);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclAllGather(sendbuff, recvbuff, sendcount, hdt, h, het_stream(stream)));
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                          cudaStream_t stream) {
  FROM_REAL(ncclAlltoAll, sendbuff, recvbuff, count, datatype, comm, stream);
  CHECK_CALL(comm, "ncclAlltoAll");
  if (comm->real) FORWARD(comm, ncclAlltoAll, sendbuff, recvbuff, count, datatype, comm->real, stream);
  HET_DTYPE(datatype, false);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclAllToAll(sendbuff, recvbuff, count, hdt, h, het_stream(stream)));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  FROM_REAL(ncclSend, sendbuff, count, datatype, peer, comm, stream);
  CHECK_CALL(comm, "ncclSend");
  if (comm->real) FORWARD(comm, ncclSend, sendbuff, count, datatype, peer, comm->real, stream);
  HET_DTYPE(datatype, false);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclSend(sendbuff, count, hdt, peer, h, het_stream(stream)));
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  FROM_REAL(ncclRecv, recvbuff, count, datatype, peer, comm, stream);
  CHECK_CALL(comm, "ncclRecv");
  if (comm->real) FORWARD(comm, ncclRecv, recvbuff, count, datatype, peer, comm->real, stream);
  HET_DTYPE(datatype, false);
  hetcclComm_t h = comm->het;
  HET_CALL(comm, hetcclRecv(recvbuff, count, hdt, peer, h, het_stream(stream)));
}

// Gather / scatter: as NCCL defines them, a group of sends and receives.
ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclGather, sendbuff, recvbuff, count, datatype, root, comm, stream);
  CHECK_CALL(comm, "ncclGather");
  if (comm->real) FORWARD(comm, ncclGather, sendbuff, recvbuff, count, datatype, root, comm->real, stream);
  HET_DTYPE(datatype, false);
  CHECK_RANK(comm, root, "ncclGather", "root");
  size_t es = elem_size(hdt);
  hetcclComm_t h = comm->het;
  int me = comm->rank, n = comm->nranks;
  HET_CALL(comm, [=] {
    hetcclGroupStart();
    hetcclResult_t r = hetcclSend(sendbuff, count, hdt, root, h, het_stream(stream));
    if (me == root)
      for (int p = 0; p < n && r == hetcclSuccess; ++p)
        r = hetcclRecv(static_cast<char*>(recvbuff) + size_t(p) * count * es, count, hdt, p, h, het_stream(stream));
    hetcclResult_t e = hetcclGroupEnd();
    return r != hetcclSuccess ? r : e;
  }());
}

ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                         ncclComm_t comm, cudaStream_t stream) {
  FROM_REAL(ncclScatter, sendbuff, recvbuff, count, datatype, root, comm, stream);
  CHECK_CALL(comm, "ncclScatter");
  if (comm->real) FORWARD(comm, ncclScatter, sendbuff, recvbuff, count, datatype, root, comm->real, stream);
  HET_DTYPE(datatype, false);
  CHECK_RANK(comm, root, "ncclScatter", "root");
  size_t es = elem_size(hdt);
  hetcclComm_t h = comm->het;
  int me = comm->rank, n = comm->nranks;
  HET_CALL(comm, [=] {
    hetcclGroupStart();
    hetcclResult_t r = hetcclSuccess;
    if (me == root)
      for (int p = 0; p < n && r == hetcclSuccess; ++p)
        r = hetcclSend(static_cast<const char*>(sendbuff) + size_t(p) * count * es, count, hdt, p, h,
                       het_stream(stream));
    if (r == hetcclSuccess) r = hetcclRecv(recvbuff, count, hdt, root, h, het_stream(stream));
    hetcclResult_t e = hetcclGroupEnd();
    return r != hetcclSuccess ? r : e;
  }());
}

ncclResult_t ncclGroupStart(void) {
  FROM_REAL(ncclGroupStart);
  if (auto f = REAL(ncclGroupStart)) {
    ncclResult_t r = f();
    if (r != ncclSuccess) return r;
  }
  ++t_group_depth;
  return from_het(hetcclGroupStart());
}

ncclResult_t ncclGroupEnd(void) {
  FROM_REAL(ncclGroupEnd);
  ncclResult_t r = ncclSuccess;
  if (auto f = REAL(ncclGroupEnd)) r = f();
  ncclResult_t h = from_het(hetcclGroupEnd());
  // the deferred inits, then the deferred calls, once both groups are closed
  ncclResult_t i = ncclSuccess, k = ncclSuccess;
  if (t_group_depth > 0 && --t_group_depth == 0) {
    if (ncclResult_t e = cancelled_group(r); e != ncclSuccess) return group_result({r, h, e});
    i = run_deferred_inits();
    std::string init_text = t_error;
    k = run_deferred_calls(false);
    if (i != ncclSuccess && i != ncclInProgress) t_error = init_text;
  }
  return group_result({r, h, i, k});
}

ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  FROM_REAL(ncclGroupSimulateEnd, simInfo);
  // The real library simulates its own calls; hetccl has no model of its own, so its calls of
  // the group are dropped unrun (as NCCL's simulation launches nothing) and simInfo keeps what
  // the real library wrote, or the caller's initial value. Inits still run: their
  // communicators were handed out.
  ncclResult_t r = ncclSuccess;
  if (auto f = REAL(ncclGroupSimulateEnd)) r = f(simInfo);
  ncclResult_t h = from_het(hetcclGroupEnd());
  ncclResult_t i = ncclSuccess, k = ncclSuccess;
  if (t_group_depth > 0 && --t_group_depth == 0) {
    if (ncclResult_t e = cancelled_group(r); e != ncclSuccess) return group_result({r, h, e});
    i = run_deferred_inits();
    std::string init_text = t_error;
    k = run_deferred_calls(true);  // only what must run anyway (ncclRedOpDestroy)
    if (i != ncclSuccess && i != ncclInProgress) t_error = init_text;
  }
  return group_result({r, h, i, k});
}

}  // extern "C"
