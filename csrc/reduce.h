// Host-side reductions: the engine and the transports' irecv_reduce (host data, device data
// staged through host memory), the C API's host collectives (scale_div for AVG, scale_mul for
// PreMulSum) and the emulated device's kernels.
//
// Contract: reduce_into(op, dtype, dst, src, count) computes dst[i] = op(dst[i], src[i]) for
// i < count; dst and src may not overlap partially (identical pointers are allowed).
// float16/bfloat16 are computed in float32 and rounded to nearest-even once per call.
// AVG is not a pairwise op: callers reduce with SUM and then call scale_div(dtype, p, count, n),
// which divides by n (integer types: truncating division, as torch does for integer avg).
// reduce_into(AVG, ...) therefore reduces as SUM. Integer SUM/PROD wrap around on overflow
// (two's complement, as torch). Float MIN/MAX propagate NaN (as torch.minimum/maximum).
// Large buffers are split across `threads` worker threads (0 = hardware concurrency), small
// ones stay on the calling thread. Functions take void pointers, not templates, in the public
// API: the dtype switch lives in one place (reduce.cc).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"

namespace hetccl {

enum class ReduceOp : int { SUM = 0, PROD = 1, MIN = 2, MAX = 3, AVG = 4 };
// UINT32/UINT64: the C API's unsigned MIN/MAX/AVG on the host only (its SUM/PROD, whose bits
// agree with INT32/INT64's, and everything of the torch face use the signed types); the
// device kernels (device/kernels) have no unsigned 32/64-bit entries.
enum class DType : int {
  FLOAT32 = 0, FLOAT64 = 1, FLOAT16 = 2, BFLOAT16 = 3,
  INT8 = 4, UINT8 = 5, INT32 = 6, INT64 = 7, UINT32 = 8, UINT64 = 9
};

size_t dtype_size(DType t);
ReduceOp parse_op(const std::string& s);     // "sum","prod","min","max","avg"; throws CommError
DType parse_dtype(const std::string& s);     // "float32",...,"int64" (torch names without "torch."; not uint32/64)
const char* op_name(ReduceOp op);
const char* dtype_name(DType t);
std::vector<std::string> op_names();         // every name parse_op accepts
std::vector<std::string> dtype_names();      // every name parse_dtype accepts (dtype_name names all)

void reduce_into(ReduceOp op, DType dtype, void* dst, const void* src, size_t count, int threads = 0);
void scale_div(DType dtype, void* p, size_t count, int64_t n, int threads = 0);
// p[i] *= *scalar (scalar: one element of dtype), the local step of NCCL's PreMulSum.
void scale_mul(DType dtype, void* p, size_t count, const void* scalar, int threads = 0);

}  // namespace hetccl
