// hetccl device kernels: the reductions of collectives whose data stays on the device (the C
// API's device route, csrc/api/device_route.cc). One source for every runtime:
//   * CUDA: compiled to PTX by csrc/device/kernels/gen_kernels.py (nvcc -ptx) and embedded in
//     reduce_kernels_gen.h; the CUDA module loads it with cuModuleLoadData, so the driver
//     compiles it for whatever GPU the process has and nothing is compiled at install time;
//   * HIP: the same text compiled at run time by hiprtc for the GPU's architecture;
//   * the emulated device runs reduce.cc's host kernels instead (same arithmetic).
// No header is included, so the text compiles under nvcc and hiprtc alike. The arithmetic is
// reduce.cc's, element for element (reduce.h's contract): float16 and bfloat16 are computed in
// float32 and rounded to nearest-even once (bfloat16 with reduce.cc's integer rounding, NaN kept
// quiet; float16 through an exact bit conversion), integer SUM/PROD wrap (unsigned arithmetic),
// float MIN/MAX propagate NaN, integer AVG truncates (int64 division).
// Kernel names: hetccl_reduce_<dtype>_<op> (dst[i] = dst[i] op src[i]), hetccl_div_<dtype>
// (dst[i] /= by), hetccl_mul_<dtype> (dst[i] *= scalar: *sp if sp is not null, else the
// scalar's bits in imm); each a grid-stride loop over n elements.
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;

namespace hk {

__device__ __forceinline__ float bits_f(u32 u) { return __int_as_float(int(u)); }
__device__ __forceinline__ u32 f_bits(float f) { return u32(__float_as_int(f)); }

__device__ __forceinline__ float bf16_load(u16 b) { return bits_f(u32(b) << 16); }
__device__ __forceinline__ u16 bf16_store(float f) {
  u32 u = f_bits(f);
  u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u32 nan = (u >> 16) | 0x40u;
  return u16((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
__device__ __forceinline__ float f16_load(u16 h) {
  u32 s = u32(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return s ? -v : v;
  }
  if (e == 31) return bits_f(s | 0x7f800000u | (m << 13));
  return bits_f(s | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ u16 f16_store(float f) {
  u32 x = f_bits(f);
  u32 sign = x & 0x80000000u;
  x ^= sign;
  u32 o;
  if (x >= 0x47800000u) {  // overflows to infinity, or is infinity or NaN
    o = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {  // a float16 subnormal or zero: align with a magic addend
    const u32 magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    o = f_bits(bits_f(x) + bits_f(magic)) - magic;
  } else {
    u32 odd = (x >> 13) & 1u;
    x += ((15u - 127u) << 23) + 0xfffu + odd;
    o = x >> 13;
  }
  return u16(o | (sign >> 16));
}

struct F32 { typedef float S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return v; }
  static __device__ __forceinline__ S store(C v) { return v; } };
struct F64 { typedef double S; typedef double C;
  static __device__ __forceinline__ C load(S v) { return v; }
  static __device__ __forceinline__ S store(C v) { return v; } };
struct F16 { typedef u16 S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return f16_load(v); }
  static __device__ __forceinline__ S store(C v) { return f16_store(v); } };
struct BF16 { typedef u16 S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return bf16_load(v); }
  static __device__ __forceinline__ S store(C v) { return bf16_store(v); } };
template <class T, class U> struct Int { typedef T S; typedef T C; typedef U Uns;
  static __device__ __forceinline__ C load(S v) { return v; }
  static __device__ __forceinline__ S store(C v) { return v; } };
typedef Int<i8, u8> I8;
typedef Int<u8, u8> U8;
typedef Int<int, u32> I32;
typedef Int<i64, u64> I64;

template <class D> struct IsInt { enum { v = 0 }; };
template <class T, class U> struct IsInt<Int<T, U> > { enum { v = 1 }; };

// op: 0 sum, 1 prod, 2 min, 3 max (reduce.h's ReduceOp; AVG reduces as SUM)
template <class D, int OP> struct Apply;
template <class D> struct Apply<D, 0> {
  static __device__ __forceinline__ typename D::C f(typename D::C a, typename D::C b) { return a + b; } };
template <class D> struct Apply<D, 1> {
  static __device__ __forceinline__ typename D::C f(typename D::C a, typename D::C b) { return a * b; } };
template <class D> struct Apply<D, 2> {
  static __device__ __forceinline__ typename D::C f(typename D::C a, typename D::C b) {
    return (b < a || b != b) ? b : a; } };
template <class D> struct Apply<D, 3> {
  static __device__ __forceinline__ typename D::C f(typename D::C a, typename D::C b) {
    return (b > a || b != b) ? b : a; } };
// integer SUM and PROD in the unsigned type of the same width: wrap-around is defined there
template <class T, class U> struct Apply<Int<T, U>, 0> {
  static __device__ __forceinline__ T f(T a, T b) { return T(U(U(a) + U(b))); } };
template <class T, class U> struct Apply<Int<T, U>, 1> {
  static __device__ __forceinline__ T f(T a, T b) { return T(U(U(a) * U(b))); } };

// Every loop below covers elements i0, i0 + step, ... of [0, n): the kernels' grid-stride loops
// (i0 = the global thread index, step = the grid's threads) and a device program's block
// (hetccl_program: i0 = the thread's index in its block, step = the block's threads).
template <class D, int OP>
__device__ __forceinline__ void reduce(void* dv, const void* sv, u64 n, u64 i0, u64 step) {
  typename D::S* d = static_cast<typename D::S*>(dv);
  const typename D::S* s = static_cast<const typename D::S*>(sv);
  for (u64 i = i0; i < n; i += step)
    d[i] = D::store(Apply<D, OP>::f(D::load(d[i]), D::load(s[i])));
}

template <class D, int INTEGRAL> struct Div;
template <class D> struct Div<D, 0> {
  static __device__ __forceinline__ typename D::S f(typename D::S v, i64 by) {
    return D::store(D::load(v) / typename D::C(by)); } };
template <class D> struct Div<D, 1> {
  static __device__ __forceinline__ typename D::S f(typename D::S v, i64 by) {
    return typename D::S(i64(v) / by); } };

template <class D>
__device__ __forceinline__ void div(void* dv, u64 n, i64 by, u64 i0, u64 step) {
  typename D::S* d = static_cast<typename D::S*>(dv);
  for (u64 i = i0; i < n; i += step)
    d[i] = Div<D, IsInt<D>::v>::f(d[i], by);
}

template <class D>
__device__ __forceinline__ void mul(void* dv, u64 n, const void* sp, u64 imm, u64 i0, u64 step) {
  typename D::S* d = static_cast<typename D::S*>(dv);
  typename D::S sc;
  if (sp) {
    sc = *static_cast<const typename D::S*>(sp);
  } else {
    union { u64 u; typename D::S s; } b;
    b.u = imm;
    sc = b.s;
  }
  const typename D::C c = D::load(sc);
  for (u64 i = i0; i < n; i += step)
    d[i] = D::store(Apply<D, 1>::f(D::load(d[i]), c));
}

}  // namespace hk

#define HK_I0 (u64(blockIdx.x) * blockDim.x + threadIdx.x)
#define HK_STEP (u64(gridDim.x) * blockDim.x)
#define HETCCL_KERNELS(name, D)                                                                  \
  extern "C" __global__ void hetccl_reduce_##name##_sum(void* d, const void* s, u64 n) { hk::reduce<hk::D, 0>(d, s, n, HK_I0, HK_STEP); } \
  extern "C" __global__ void hetccl_reduce_##name##_prod(void* d, const void* s, u64 n) { hk::reduce<hk::D, 1>(d, s, n, HK_I0, HK_STEP); } \
  extern "C" __global__ void hetccl_reduce_##name##_min(void* d, const void* s, u64 n) { hk::reduce<hk::D, 2>(d, s, n, HK_I0, HK_STEP); } \
  extern "C" __global__ void hetccl_reduce_##name##_max(void* d, const void* s, u64 n) { hk::reduce<hk::D, 3>(d, s, n, HK_I0, HK_STEP); } \
  extern "C" __global__ void hetccl_div_##name(void* d, u64 n, i64 by) { hk::div<hk::D>(d, n, by, HK_I0, HK_STEP); } \
  extern "C" __global__ void hetccl_mul_##name(void* d, u64 n, const void* sp, u64 imm) { hk::mul<hk::D>(d, n, sp, imm, HK_I0, HK_STEP); }

HETCCL_KERNELS(float32, F32)
HETCCL_KERNELS(float64, F64)
HETCCL_KERNELS(float16, F16)
HETCCL_KERNELS(bfloat16, BF16)
HETCCL_KERNELS(int8, I8)
HETCCL_KERNELS(uint8, U8)
HETCCL_KERNELS(int32, I32)
HETCCL_KERNELS(int64, I64)

// ---- Device programs (csrc/device/program.h: the format, the slot's layout and the contract).
// B blocks per group (blockIdx.x / B: the group, blockIdx.x % B: the block in it), every thread
// of the group executing the group's instructions in order: waits by block 0's first thread
// (the only poller of host memory: the others meet it at the group barrier, and read the
// published length from block 0's copy in device memory), data instructions spread over the
// group's threads, and a barrier of the group's blocks (in device memory, `bar`: per group a
// count and a generation) after each wait and data instruction and before each write, signal
// and end. The slot is pinned host memory, read and written with
// volatile accesses and system fences. Word indices of the slot (program.h's Slot): 0 seq,
// 1 abort, 2 fin_addr, 3 fin_value, 4 ended, 5 wide, 8 + g len, 12 + g gend, 14 + g left, 16 + e ev,
// 32 + 16 g + b taken by block b, 64 the rings (8 words an instruction, 256 a group).
namespace hp {
enum { kRing = 256, kGroups = 2, kBatch = 32, kRingWord = 64 };
enum { END = 0, WAIT = 1, WRITE = 2, COPY = 3, REDUCE = 4, DIV = 5, MUL = 6, SIGNAL = 7, AWAIT = 8 };

__device__ __forceinline__ bool reached(u64 addr, u64 v, bool wide) {
  if (wide) return *reinterpret_cast<const volatile u64*>(addr) >= v;
  u32 lo = *reinterpret_cast<const volatile u32*>(addr);
  return int(lo - u32(v)) >= 0;
}
struct alignas(16) V16 { u64 x, y; };

// dst[0, n) = src[0, n) by threads t, t + nt, ... of the group, 16 bytes a load where both are
// 16-aligned, four loads in flight per thread (the source may be host memory across the bus)
__device__ __forceinline__ void copy(char* d, const char* s, u64 n, u64 t, u64 nt) {
  u64 done = 0;
  if (((u64(d) | u64(s)) & 15) == 0) {
    const u64 m = n / 16;
    V16* D = reinterpret_cast<V16*>(d);
    const V16* S = reinterpret_cast<const V16*>(s);
    u64 i = t;
    for (; i + 3 * nt < m; i += 4 * nt) {
      V16 a = S[i], b = S[i + nt], c = S[i + 2 * nt], e = S[i + 3 * nt];
      D[i] = a;
      D[i + nt] = b;
      D[i + 2 * nt] = c;
      D[i + 3 * nt] = e;
    }
    for (; i < m; i += nt) D[i] = S[i];
    done = m * 16;
  } else if (((u64(d) | u64(s)) & 7) == 0) {
    const u64 m = n / 8;
    for (u64 i = t; i < m; i += nt) reinterpret_cast<u64*>(d)[i] = reinterpret_cast<const u64*>(s)[i];
    done = m * 8;
  }
  for (u64 i = done + t; i < n; i += nt) d[i] = s[i];
}

// the group's blocks meet (cooperative groups' grid barrier, for B blocks): their earlier
// writes are visible to each other after it; gives up once the slot is aborted
__device__ __forceinline__ void group_barrier(u32* cnt, volatile u32* gen, u32 B, volatile u64* S) {
  __syncthreads();
  if (B > 1 && threadIdx.x == 0) {
    const u32 g0 = *gen;
    __threadfence();
    if (atomicAdd(cnt, 1u) == B - 1) {
      *cnt = 0;
      __threadfence();
      atomicAdd(const_cast<u32*>(gen), 1u);
    } else {
      // the abort word is host memory read across the bus: looked at once in 256 rounds, so
      // the group's waiting blocks do not load the bus the data moves on
      for (u32 i = 1; *gen == g0; ++i)
        if ((i & 255) == 0 && S[1] != 0) break;
    }
    __threadfence();
  }
  __syncthreads();
}

template <int OP>
__device__ __forceinline__ void reduce_as(int dt, void* d, const void* s, u64 n, u64 t, u64 nt) {
  switch (dt) {
    case 0: hk::reduce<hk::F32, OP>(d, s, n, t, nt); break;
    case 1: hk::reduce<hk::F64, OP>(d, s, n, t, nt); break;
    case 2: hk::reduce<hk::F16, OP>(d, s, n, t, nt); break;
    case 3: hk::reduce<hk::BF16, OP>(d, s, n, t, nt); break;
    case 4: hk::reduce<hk::I8, OP>(d, s, n, t, nt); break;
    case 5: hk::reduce<hk::U8, OP>(d, s, n, t, nt); break;
    case 6: hk::reduce<hk::I32, OP>(d, s, n, t, nt); break;
    case 7: hk::reduce<hk::I64, OP>(d, s, n, t, nt); break;
  }
}
__device__ __forceinline__ void div_as(int dt, void* p, u64 n, i64 by, u64 t, u64 nt) {
  switch (dt) {
    case 0: hk::div<hk::F32>(p, n, by, t, nt); break;
    case 1: hk::div<hk::F64>(p, n, by, t, nt); break;
    case 2: hk::div<hk::F16>(p, n, by, t, nt); break;
    case 3: hk::div<hk::BF16>(p, n, by, t, nt); break;
    case 4: hk::div<hk::I8>(p, n, by, t, nt); break;
    case 5: hk::div<hk::U8>(p, n, by, t, nt); break;
    case 6: hk::div<hk::I32>(p, n, by, t, nt); break;
    case 7: hk::div<hk::I64>(p, n, by, t, nt); break;
  }
}
__device__ __forceinline__ void mul_as(int dt, void* p, u64 n, const void* sp, u64 imm, u64 t, u64 nt) {
  switch (dt) {
    case 0: hk::mul<hk::F32>(p, n, sp, imm, t, nt); break;
    case 1: hk::mul<hk::F64>(p, n, sp, imm, t, nt); break;
    case 2: hk::mul<hk::F16>(p, n, sp, imm, t, nt); break;
    case 3: hk::mul<hk::BF16>(p, n, sp, imm, t, nt); break;
    case 4: hk::mul<hk::I8>(p, n, sp, imm, t, nt); break;
    case 5: hk::mul<hk::U8>(p, n, sp, imm, t, nt); break;
    case 6: hk::mul<hk::I32>(p, n, sp, imm, t, nt); break;
    case 7: hk::mul<hk::I64>(p, n, sp, imm, t, nt); break;
  }
}
}  // namespace hp

// slot: the program's slot (device address of pinned host memory); bar: 32 zeroed u32 of
// device memory per group (barrier count at 0, block 0's copy of len at 8-9, barrier
// generation at 16; count and len left as found; with B == 1 the kernel never touches it, and
// it may be null: prepare_kernels' warm-up launch); B: blocks per group
extern "C" __global__ void hetccl_program(u64* slot, u32* bar, u64 blocks) {
  volatile u64* S = slot;
  const u32 B = u32(blocks);
  const u32 g = blockIdx.x / B, b = blockIdx.x % B;
  const u64 t = u64(b) * blockDim.x + threadIdx.x, nt = u64(B) * blockDim.x;
  u32* cnt = bar + 32 * g;
  volatile u32* gen = bar + 32 * g + 16;
  // the group's published length as block 0 read it (B > 1): the other blocks poll this word
  // of device memory instead of the slot across the bus, so one poller per group loads the
  // bus the data moves on (reset to 0 when the program ends)
  volatile u64* lenw = reinterpret_cast<volatile u64*>(bar + 32 * g + 8);
  __shared__ u64 ins[hp::kBatch][8];
  __shared__ u64 avail;
  const u64 seq = S[0];
  const bool wide = S[5] != 0;
  u64 pos = 0;
  bool end = false;
  while (!end) {
    if (threadIdx.x == 0) {
      u64 L;
      if (b == 0) {
        for (u32 i = 1; (L = S[8 + g]) <= pos; ++i)
          if ((i & 15) == 0 && S[1] != 0) break;  // aborted (looked at once in 16 rounds)
        __threadfence_system();  // the instructions were written before len
        if (B > 1 && L > pos) {
          *lenw = L;
          __threadfence();
        }
      } else {
        for (u32 i = 1; (L = *lenw) <= pos; ++i)
          if ((i & 255) == 0 && S[1] != 0) break;  // aborted (looked at once in 256 rounds)
        __threadfence_system();
      }
      avail = L;
    }
    __syncthreads();
    const u64 L = avail;
    if (L <= pos) break;  // aborted with nothing more published
    const u64 nb = L - pos < hp::kBatch ? L - pos : u64(hp::kBatch);
    for (u64 i = threadIdx.x; i < nb * 8; i += blockDim.x)
      ins[i / 8][i % 8] = S[hp::kRingWord + (u64(g) * hp::kRing + (pos + i / 8) % hp::kRing) * 8 + i % 8];
    __syncthreads();
    if (threadIdx.x == 0) S[32 + 16 * g + b] = pos + nb;  // read: the ring entries may be reused
    for (u64 k = 0; k < nb && !end; ++k) {
      const u64* I = ins[k];
      switch (I[0]) {
        case hp::END:
          end = true;
          break;
        case hp::WAIT:
        case hp::AWAIT:
          // block 0 polls the word (host memory, across the bus), the others meet it at the
          // group barrier (device memory)
          if (b == 0 && threadIdx.x == 0) {
            const u64 addr = I[0] == hp::WAIT ? I[1] : u64(slot + 16 + I[1]);
            const bool w = I[0] == hp::AWAIT || wide;
            for (u32 i = 1; !hp::reached(addr, I[2], w); ++i)
              if ((i & 15) == 0 && S[1] != 0) break;  // aborted (looked at once in 16 rounds)
            __threadfence_system();
          }
          hp::group_barrier(cnt, gen, B, S);
          break;
        case hp::WRITE:
        case hp::SIGNAL:
          __threadfence_system();  // every thread's earlier writes, before the word
          hp::group_barrier(cnt, gen, B, S);
          if (b == 0 && threadIdx.x == 0) {
            if (I[0] == hp::SIGNAL) S[16 + I[1]] = I[2];
            else if (wide) *reinterpret_cast<volatile u64*>(I[1]) = I[2];
            else *reinterpret_cast<volatile u32*>(I[1]) = u32(I[2]);
            __threadfence_system();
          }
          break;
        case hp::COPY:
          hp::copy(reinterpret_cast<char*>(I[1]), reinterpret_cast<const char*>(I[2]), I[3], t, nt);
          hp::group_barrier(cnt, gen, B, S);
          break;
        case hp::REDUCE: {
          void* d = reinterpret_cast<void*>(I[1]);
          const void* s = reinterpret_cast<const void*>(I[2]);
          const int dt = int(I[4]);
          switch (int(I[5])) {
            case 1: hp::reduce_as<1>(dt, d, s, I[3], t, nt); break;
            case 2: hp::reduce_as<2>(dt, d, s, I[3], t, nt); break;
            case 3: hp::reduce_as<3>(dt, d, s, I[3], t, nt); break;
            default: hp::reduce_as<0>(dt, d, s, I[3], t, nt); break;  // SUM, and AVG as SUM
          }
          hp::group_barrier(cnt, gen, B, S);
          break;
        }
        case hp::DIV:
          hp::div_as(int(I[3]), reinterpret_cast<void*>(I[1]), I[2], i64(I[4]), t, nt);
          hp::group_barrier(cnt, gen, B, S);
          break;
        case hp::MUL:
          hp::mul_as(int(I[3]), reinterpret_cast<void*>(I[1]), I[2], reinterpret_cast<const void*>(I[4]), I[5], t, nt);
          hp::group_barrier(cnt, gen, B, S);
          break;
      }
      ++pos;
    }
    __syncthreads();
  }
  __threadfence_system();
  hp::group_barrier(cnt, gen, B, S);  // every block of the group is done
  if (b == 0 && threadIdx.x == 0) {
    if (B > 1) *lenw = 0;  // as found, for the slot's next program (B == 1: bar may be null)
    // Both groups ended: whichever sees the other's mark writes fin (both may: the same values)
    S[12 + g] = seq;
    __threadfence_system();
    bool last = true;
    for (int o = 0; o < hp::kGroups; ++o)
      if (o != int(g) && S[12 + o] != seq) last = false;
    if (last) {
      if (wide) *reinterpret_cast<volatile u64*>(S[2]) = S[3];
      else *reinterpret_cast<volatile u32*>(S[2]) = u32(S[3]);
      __threadfence_system();
      S[4] = seq;
    }
    __threadfence_system();
    S[14 + g] = seq;  // the group's last access to the slot: it may be reused from here
  }
}
