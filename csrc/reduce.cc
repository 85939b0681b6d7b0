// Host reductions: one templated kernel per (op, dtype), dispatched from void pointers here.
//
// Vectorisation: the kernels are plain loops over __restrict pointers that -O3 vectorises. Each
// kernel is compiled twice, for baseline x86-64 and with target("avx2,f16c,fma"), and the AVX2
// version is picked at load time when the CPU has those features (no -march=native, so the binary
// runs on any x86-64). target_clones("arch=haswell") is NOT used: GCC dispatches "arch=" clones
// on the CPU model, not on features, so newer CPUs would get the baseline version. float16 uses
// the compiler's _Float16 (F16C conversions in the AVX2 version, libgcc's exact ones otherwise);
// bfloat16 is converted with integer arithmetic (round to nearest even, NaN kept quiet).
//
// Threading: buffers of at least kParallelBytes are split into chunks run on a persistent
// pool (created on first use, never torn down: its threads sleep on a condition variable).
// One caller uses the pool at a time; a concurrent caller (e.g. a transport thread) runs on
// its own thread instead of queueing behind it.
#include "reduce.h"

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <iterator>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define HETCCL_X86_DISPATCH 1
#define HETCCL_AVX2 __attribute__((target("avx2,f16c,fma")))
#else
#define HETCCL_X86_DISPATCH 0
#define HETCCL_AVX2
#endif
#define HETCCL_INLINE inline __attribute__((always_inline))

namespace hetccl {

namespace {

constexpr size_t kParallelBytes = 1 << 20;   // below this, one thread
constexpr size_t kMinChunkBytes = 256 << 10;  // no thread gets less than this

// ---------------------------------------------------------------- element types
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;  // keep sign and payload, force quiet
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Compute type and conversions per storage type.
template <typename T> struct Traits {
  using C = T;
  static C load(T v) { return v; }
  static T store(C v) { return v; }
};
template <> struct Traits<_Float16> {
  using C = float;
  static float load(_Float16 v) { return float(v); }
  static _Float16 store(float v) { return _Float16(v); }
};
template <> struct Traits<bf16> {
  using C = float;
  static float load(bf16 v) { return bf16_to_float(v.bits); }
  static bf16 store(float v) { return bf16{float_to_bf16(v)}; }
};

// Integer SUM/PROD run in the unsigned type of the same width: wrap-around is defined there.
template <typename C> struct Arith {
  using U = C;
};
template <> struct Arith<int8_t> { using U = uint8_t; };
template <> struct Arith<int32_t> { using U = uint32_t; };
template <> struct Arith<int64_t> { using U = uint64_t; };

template <ReduceOp OP, typename C>
inline C apply(C a, C b) {
  if constexpr (OP == ReduceOp::SUM || OP == ReduceOp::AVG) {
    if constexpr (std::is_integral_v<C>) {
      using U = typename Arith<C>::U;
      return C(U(U(a) + U(b)));
    } else {
      return a + b;
    }
  } else if constexpr (OP == ReduceOp::PROD) {
    if constexpr (std::is_integral_v<C>) {
      using U = typename Arith<C>::U;
      return C(U(U(a) * U(b)));
    } else {
      return a * b;
    }
  } else if constexpr (OP == ReduceOp::MIN) {
    if constexpr (std::is_floating_point_v<C>) return (b < a || b != b) ? b : a;
    else return b < a ? b : a;
  } else {
    if constexpr (std::is_floating_point_v<C>) return (b > a || b != b) ? b : a;
    else return b > a ? b : a;
  }
}

// ---------------------------------------------------------------- kernels
// Bodies are always_inline so each is compiled inside both the baseline and the AVX2 wrapper.
template <ReduceOp OP, typename T>
HETCCL_INLINE void reduce_body(T* __restrict d, const T* __restrict s, size_t n) {
  using Tr = Traits<T>;
  for (size_t i = 0; i < n; ++i) d[i] = Tr::store(apply<OP>(Tr::load(d[i]), Tr::load(s[i])));
}
// dst == src is allowed by the contract; __restrict would then be a lie.
template <ReduceOp OP, typename T>
HETCCL_INLINE void alias_body(T* d, size_t n) {
  using Tr = Traits<T>;
  for (size_t i = 0; i < n; ++i) d[i] = Tr::store(apply<OP>(Tr::load(d[i]), Tr::load(d[i])));
}
template <typename T>
HETCCL_INLINE void div_body(T* __restrict p, size_t n, int64_t by) {
  using Tr = Traits<T>;
  using C = typename Tr::C;
  if constexpr (std::is_integral_v<C> && std::is_unsigned_v<C> && sizeof(C) >= 4) {
    // NCCL's unsigned AVG: the wrapped sum divided (an int64 detour would turn values above
    // INT64_MAX negative)
    for (size_t i = 0; i < n; ++i) p[i] = T(p[i] / uint64_t(by));
  } else if constexpr (std::is_integral_v<C>) {
    for (size_t i = 0; i < n; ++i) p[i] = T(int64_t(p[i]) / by);
  } else {
    const C den = C(by);
    for (size_t i = 0; i < n; ++i) p[i] = Tr::store(Tr::load(p[i]) / den);
  }
}

#if HETCCL_X86_DISPATCH
// Explicit AVX2 kernels for float16 and bfloat16: GCC 12 does not vectorise the _Float16
// conversions nor, well, the bfloat16 bit arithmetic. 8 elements per step, computed in float32.
template <ReduceOp OP>
HETCCL_AVX2 HETCCL_INLINE __m256 vapply(__m256 a, __m256 b) {
  if constexpr (OP == ReduceOp::SUM || OP == ReduceOp::AVG) {
    return _mm256_add_ps(a, b);
  } else if constexpr (OP == ReduceOp::PROD) {
    return _mm256_mul_ps(a, b);
  } else {
    // take b where b is NaN or better than a (NaN in a stays): same as apply<> above
    __m256 better = OP == ReduceOp::MIN ? _mm256_cmp_ps(b, a, _CMP_LT_OQ) : _mm256_cmp_ps(b, a, _CMP_GT_OQ);
    __m256 take = _mm256_or_ps(better, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(a, b, take);
  }
}
HETCCL_AVX2 HETCCL_INLINE __m256 bf16x8_load(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
HETCCL_AVX2 HETCCL_INLINE void bf16x8_store(uint16_t* p, __m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
  __m256i r = _mm256_blendv_epi8(rounded, quiet, isnan);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <ReduceOp OP>
HETCCL_AVX2 void reduce_f16_avx2(void* dv, const void* sv, size_t n) {
  auto* d = static_cast<_Float16*>(dv);
  auto* s = static_cast<const _Float16*>(sv);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    __m128i r = _mm256_cvtps_ph(vapply<OP>(a, b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), r);
  }
  reduce_body<OP, _Float16>(d + i, s + i, n - i);
}
template <ReduceOp OP>
HETCCL_AVX2 void reduce_bf16_avx2(void* dv, const void* sv, size_t n) {
  auto* d = static_cast<uint16_t*>(dv);
  auto* s = static_cast<const uint16_t*>(sv);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) bf16x8_store(d + i, vapply<OP>(bf16x8_load(d + i), bf16x8_load(s + i)));
  reduce_body<OP, bf16>(reinterpret_cast<bf16*>(d + i), reinterpret_cast<const bf16*>(s + i), n - i);
}
#endif

using ReduceFn = void (*)(void*, const void*, size_t);
using AliasFn = void (*)(void*, size_t);
using DivFn = void (*)(void*, size_t, int64_t);

template <ReduceOp OP, typename T>
void reduce_base(void* d, const void* s, size_t n) {
  reduce_body<OP, T>(static_cast<T*>(d), static_cast<const T*>(s), n);
}
template <ReduceOp OP, typename T>
HETCCL_AVX2 void reduce_avx2(void* d, const void* s, size_t n) {
  reduce_body<OP, T>(static_cast<T*>(d), static_cast<const T*>(s), n);
}
template <ReduceOp OP, typename T>
void alias_base(void* d, size_t n) { alias_body<OP, T>(static_cast<T*>(d), n); }
template <ReduceOp OP, typename T>
HETCCL_AVX2 void alias_avx2(void* d, size_t n) { alias_body<OP, T>(static_cast<T*>(d), n); }
template <typename T>
void div_base(void* p, size_t n, int64_t by) { div_body<T>(static_cast<T*>(p), n, by); }
template <typename T>
HETCCL_AVX2 void div_avx2(void* p, size_t n, int64_t by) { div_body<T>(static_cast<T*>(p), n, by); }

bool use_avx2() {
#if HETCCL_X86_DISPATCH
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

template <ReduceOp OP, typename T>
ReduceFn reduce_fn() {
  if (!use_avx2()) return reduce_base<OP, T>;
#if HETCCL_X86_DISPATCH
  if constexpr (std::is_same_v<T, _Float16>) return reduce_f16_avx2<OP>;
  if constexpr (std::is_same_v<T, bf16>) return reduce_bf16_avx2<OP>;
#endif
  return reduce_avx2<OP, T>;
}
template <ReduceOp OP, typename T>
AliasFn alias_fn() { return use_avx2() ? alias_avx2<OP, T> : alias_base<OP, T>; }

template <typename T>
ReduceFn pick_reduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: return reduce_fn<ReduceOp::SUM, T>();
    case ReduceOp::PROD: return reduce_fn<ReduceOp::PROD, T>();
    case ReduceOp::MIN: return reduce_fn<ReduceOp::MIN, T>();
    case ReduceOp::MAX: return reduce_fn<ReduceOp::MAX, T>();
  }
  throw CommError("hetccl: bad reduce op " + std::to_string(int(op)));
}
template <typename T>
AliasFn pick_alias(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: return alias_fn<ReduceOp::SUM, T>();
    case ReduceOp::PROD: return alias_fn<ReduceOp::PROD, T>();
    case ReduceOp::MIN: return alias_fn<ReduceOp::MIN, T>();
    case ReduceOp::MAX: return alias_fn<ReduceOp::MAX, T>();
  }
  throw CommError("hetccl: bad reduce op " + std::to_string(int(op)));
}

// The one dtype switch.
template <template <typename> class F, typename... A>
auto dispatch(DType t, A... a) {
  switch (t) {
    case DType::FLOAT32: return F<float>::get(a...);
    case DType::FLOAT64: return F<double>::get(a...);
    case DType::FLOAT16: return F<_Float16>::get(a...);
    case DType::BFLOAT16: return F<bf16>::get(a...);
    case DType::INT8: return F<int8_t>::get(a...);
    case DType::UINT8: return F<uint8_t>::get(a...);
    case DType::INT32: return F<int32_t>::get(a...);
    case DType::INT64: return F<int64_t>::get(a...);
    case DType::UINT32: return F<uint32_t>::get(a...);
    case DType::UINT64: return F<uint64_t>::get(a...);
  }
  throw CommError("hetccl: bad dtype " + std::to_string(int(t)));
}
template <typename T> struct GetReduce { static ReduceFn get(ReduceOp op) { return pick_reduce<T>(op); } };
template <typename T> struct GetAlias { static AliasFn get(ReduceOp op) { return pick_alias<T>(op); } };
// p[i] = p[i] * scalar in T's compute type (PreMulSum's local step); integers wrap.
using MulFn = void (*)(void*, size_t, const void*);
template <typename T>
void mul_base(void* pv, size_t n, const void* sv) {
  T* p = static_cast<T*>(pv);
  T sc;
  std::memcpy(&sc, sv, sizeof(T));
  const auto c = Traits<T>::load(sc);
  for (size_t i = 0; i < n; ++i) p[i] = Traits<T>::store(apply<ReduceOp::PROD>(Traits<T>::load(p[i]), c));
}
template <typename T> struct GetMul {
  static MulFn get() { return mul_base<T>; }
};
template <typename T> struct GetDiv {
  static DivFn get() { return use_avx2() ? div_avx2<T> : div_base<T>; }
};

// ---------------------------------------------------------------- thread pool
class Pool {
 public:
  explicit Pool(int nworkers) {
    for (int i = 0; i < nworkers; ++i) workers_.emplace_back([this] { loop(); });
  }
  int workers() const { return int(workers_.size()); }

  // Runs f(0..n-1), the caller taking part. Returns false (nothing run) if another caller
  // holds the pool.
  bool run(size_t n, const std::function<void(size_t)>& f) {
    std::unique_lock<std::mutex> use(use_mu_, std::try_to_lock);
    if (!use.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = &f;
      njobs_ = n;
      next_.store(0);
      finished_ = 0;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [&] { return finished_ == njobs_; });
    job_ = nullptr;
    return true;
  }

 private:
  void work() {
    size_t done = 0;
    const std::function<void(size_t)>* job;
    size_t n;
    {
      std::lock_guard<std::mutex> g(mu_);
      job = job_;
      n = njobs_;
    }
    if (!job) return;
    for (size_t i; (i = next_.fetch_add(1)) < n;) {
      (*job)(i);
      ++done;
    }
    if (done) {
      std::lock_guard<std::mutex> g(mu_);
      finished_ += done;
      if (finished_ == njobs_) done_cv_.notify_all();
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex use_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t njobs_ = 0, finished_ = 0;
  std::atomic<size_t> next_{0};
  uint64_t generation_ = 0;
};

int hw_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}

// The pool is created on first use and deliberately never destroyed (its threads must not be
// joined from a static destructor). After fork() the child has no worker threads: a new pool
// is made for it (the parent's object is leaked in the child).
Pool* pool() {
  static std::mutex mu;
  static Pool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> g(mu);
  if (!p || owner != getpid()) {
    p = new Pool(std::max(0, hw_threads() - 1));
    owner = getpid();
  }
  return p;
}

// Splits [0, count) into at most `threads` chunks (multiples of 64 elements) and runs
// body(begin, end) on them.
template <typename Body>
void parallel(size_t count, size_t elem, int threads, Body body) {
  size_t bytes = count * elem;
  if (threads <= 0) threads = hw_threads();
  size_t nchunks = std::min<size_t>(size_t(threads), bytes / kMinChunkBytes);
  if (bytes < kParallelBytes || nchunks < 2) {
    body(0, count);
    return;
  }
  Pool* p = pool();
  nchunks = std::min<size_t>(nchunks, size_t(p->workers()) + 1);
  if (nchunks < 2) {
    body(0, count);
    return;
  }
  size_t per = (count + nchunks - 1) / nchunks;
  per = (per + 63) / 64 * 64;
  std::function<void(size_t)> f = [&](size_t i) {
    size_t b = i * per, e = std::min(count, b + per);
    if (b < e) body(b, e);
  };
  if (!p->run(nchunks, f)) body(0, count);
}

const char* const kOpNames[] = {"sum", "prod", "min", "max", "avg"};
const char* const kDtypeNames[] = {"float32", "float64", "float16", "bfloat16",
                                   "int8",    "uint8",   "int32",   "int64",   "uint32",  "uint64"};
// The names parse_dtype accepts (the torch face's host dtypes, _core.HOST_REDUCE_DTYPES):
// UINT32/UINT64 are the C API's alone, reached through the enum.
constexpr int kNamedDtypes = 8;

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::FLOAT32: return 4;
    case DType::FLOAT64: return 8;
    case DType::FLOAT16: return 2;
    case DType::BFLOAT16: return 2;
    case DType::INT8: return 1;
    case DType::UINT8: return 1;
    case DType::INT32: return 4;
    case DType::INT64: return 8;
    case DType::UINT32: return 4;
    case DType::UINT64: return 8;
  }
  throw CommError("hetccl: bad dtype " + std::to_string(int(t)));
}

const char* op_name(ReduceOp op) {
  int i = int(op);
  if (i < 0 || i > 4) throw CommError("hetccl: bad reduce op " + std::to_string(i));
  return kOpNames[i];
}
const char* dtype_name(DType t) {
  int i = int(t);
  if (i < 0 || i >= int(std::size(kDtypeNames))) throw CommError("hetccl: bad dtype " + std::to_string(i));
  return kDtypeNames[i];
}
std::vector<std::string> op_names() { return {std::begin(kOpNames), std::end(kOpNames)}; }
std::vector<std::string> dtype_names() { return {kDtypeNames, kDtypeNames + kNamedDtypes}; }

static std::string join_names(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

ReduceOp parse_op(const std::string& s) {
  for (int i = 0; i < 5; ++i)
    if (s == kOpNames[i]) return ReduceOp(i);
  throw CommError("hetccl: unknown reduce op '" + s + "' (known: " + join_names(op_names()) + ")");
}

DType parse_dtype(const std::string& s0) {
  std::string s = s0.rfind("torch.", 0) == 0 ? s0.substr(6) : s0;
  for (int i = 0; i < kNamedDtypes; ++i)
    if (s == kDtypeNames[i]) return DType(i);
  if (s == "half") return DType::FLOAT16;
  if (s == "float") return DType::FLOAT32;
  if (s == "double") return DType::FLOAT64;
  throw CommError("hetccl: unknown or unsupported dtype '" + s0 + "' (known: " +
                  join_names(dtype_names()) + ")");
}

void reduce_into(ReduceOp op, DType dtype, void* dst, const void* src, size_t count, int threads) {
  if (count == 0) return;
  const size_t es = dtype_size(dtype);
  if (dst == src) {
    AliasFn fn = dispatch<GetAlias>(dtype, op);
    parallel(count, es, threads, [&](size_t b, size_t e) { fn(static_cast<char*>(dst) + b * es, e - b); });
    return;
  }
  ReduceFn fn = dispatch<GetReduce>(dtype, op);
  parallel(count, es, threads, [&](size_t b, size_t e) {
    fn(static_cast<char*>(dst) + b * es, static_cast<const char*>(src) + b * es, e - b);
  });
}

void scale_div(DType dtype, void* p, size_t count, int64_t n, int threads) {
  if (n == 0) throw CommError("hetccl: scale_div by zero");
  const size_t es = dtype_size(dtype);
  DivFn fn = dispatch<GetDiv>(dtype);
  if (count == 0 || n == 1) return;
  parallel(count, es, threads, [&](size_t b, size_t e) { fn(static_cast<char*>(p) + b * es, e - b, n); });
}

void scale_mul(DType dtype, void* p, size_t count, const void* scalar, int threads) {
  const size_t es = dtype_size(dtype);
  MulFn fn = dispatch<GetMul>(dtype);
  if (count == 0) return;
  parallel(count, es, threads, [&](size_t b, size_t e) { fn(static_cast<char*>(p) + b * es, e - b, scalar); });
}

}  // namespace hetccl
