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

template <class D, int OP>
__device__ __forceinline__ void reduce(void* dv, const void* sv, u64 n) {
  typename D::S* d = static_cast<typename D::S*>(dv);
  const typename D::S* s = static_cast<const typename D::S*>(sv);
  for (u64 i = u64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += u64(gridDim.x) * blockDim.x)
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
__device__ __forceinline__ void div(void* dv, u64 n, i64 by) {
  typename D::S* d = static_cast<typename D::S*>(dv);
  for (u64 i = u64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += u64(gridDim.x) * blockDim.x)
    d[i] = Div<D, IsInt<D>::v>::f(d[i], by);
}

template <class D>
__device__ __forceinline__ void mul(void* dv, u64 n, const void* sp, u64 imm) {
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
  for (u64 i = u64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += u64(gridDim.x) * blockDim.x)
    d[i] = D::store(Apply<D, 1>::f(D::load(d[i]), c));
}

}  // namespace hk

#define HETCCL_KERNELS(name, D)                                                                  \
  extern "C" __global__ void hetccl_reduce_##name##_sum(void* d, const void* s, u64 n) { hk::reduce<hk::D, 0>(d, s, n); } \
  extern "C" __global__ void hetccl_reduce_##name##_prod(void* d, const void* s, u64 n) { hk::reduce<hk::D, 1>(d, s, n); } \
  extern "C" __global__ void hetccl_reduce_##name##_min(void* d, const void* s, u64 n) { hk::reduce<hk::D, 2>(d, s, n); } \
  extern "C" __global__ void hetccl_reduce_##name##_max(void* d, const void* s, u64 n) { hk::reduce<hk::D, 3>(d, s, n); } \
  extern "C" __global__ void hetccl_div_##name(void* d, u64 n, i64 by) { hk::div<hk::D>(d, n, by); } \
  extern "C" __global__ void hetccl_mul_##name(void* d, u64 n, const void* sp, u64 imm) { hk::mul<hk::D>(d, n, sp, imm); }

HETCCL_KERNELS(float32, F32)
HETCCL_KERNELS(float64, F64)
HETCCL_KERNELS(float16, F16)
HETCCL_KERNELS(bfloat16, BF16)
HETCCL_KERNELS(int8, I8)
HETCCL_KERNELS(uint8, U8)
HETCCL_KERNELS(int32, I32)
HETCCL_KERNELS(int64, I64)
