// 4-bit block quantization of a weight matrix and the fused 4-bit linear layer (dequantize a tile, multiply,
// accumulate; the full float weight never exists).
//
// W is [n, k] float32 (n output rows, k input columns), cut into blocks of `block_rows` rows x `block` columns
// (block even, k % block == 0, n % block_rows == 0; block_rows = 1 is the usual block along the input):
// block (b, g) holds W[b*block_rows : (b+1)*block_rows, g*block : (g+1)*block]. Each block has a float32 scale, and
// for int4 a float32 zero point; each value a 4-bit code q. Two schemes:
//
//   nf4:  s = max |w| over the block (the QLoRA / bitsandbytes "absmax"); v = clamp(w * (1 / max(s, 1e-38)), -1, 1);
//         q = the number of NF4 midpoints m_i = (c_i + c_{i+1}) / 2 below v (bucketize), c the NF4 codebook;
//         w' = c[q] * s. Exactly bitsandbytes' CPU quantize_4bit / dequantize_4bit arithmetic.
//   int4: lo, hi = min, max of the block; scale = (hi - lo) / 15; zero = lo; inv = 1 / scale (0 when scale == 0);
//         q = clamp(round-half-even((w - lo) * inv), 0, 15); w' = q * scale + zero (multiply, then add: no fused
//         multiply-add, so CPU and CUDA give the same w'). The zero point is in weight units, so adding a constant
//         d to a whole block is exact up to one rounding: zero' = zero + d (the adapters' merge relies on it).
//
// Packing (bitsandbytes' order): byte j of row r is (q[r, 2j] << 4) | q[r, 2j + 1]; packed is [n, k / 2].
// scales (and zeros) are [n / block_rows, k / block], row-major.
//
// qlinear: out[m, r] = sum_c x[m, c] * w'[r, c] (+ bias[r]) for x [rows, k] float32. Each output is summed by one
// thread in a fixed order (16 lanes of partial sums, each over its columns in order, then reduced pairwise), so
// results do not depend on the thread count, the row range or the number of rows of x given together; the
// order differs from a plain dot product by float rounding.
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace fastdist {

enum class Quant4Scheme : int32_t { kNF4 = 0, kInt4 = 1 };

// The NF4 codebook of QLoRA (bitsandbytes' float32 values), sorted.
FASTDIST_HOST_DEVICE inline float nf4_code(int q) {
  constexpr float kCode[16] = {-1.0f,
                               -0.6961928009986877f,
                               -0.5250730514526367f,
                               -0.39491748809814453f,
                               -0.28444138169288635f,
                               -0.18477343022823334f,
                               -0.09105003625154495f,
                               0.0f,
                               0.07958029955625534f,
                               0.16093020141124725f,
                               0.24611230194568634f,
                               0.33791524171829224f,
                               0.44070982933044434f,
                               0.5626170039176941f,
                               0.7229568362236023f,
                               1.0f};
  return kCode[q];
}

// ---- CPU: single-threaded over a row range, so the caller can run disjoint ranges in parallel. ----

// Scales, zeros (int4; may be nullptr for nf4) and packed codes of the row blocks [block_begin, block_end) (rows
// [block_begin * block_rows, block_end * block_rows)). Returns how many of those blocks hold a non-finite value
// (or, for int4, a range that overflows float32).
int64_t quant4_quantize_cpu(const float* w, int64_t k, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                            uint8_t* packed, float* scales, float* zeros, int64_t block_begin, int64_t block_end);

// The CPU code path: kBest uses AVX-512 when the CPU has it (quant4_cpu_isa()); kPortable never does (for tests
// comparing the two). Both give the same w' bit for bit.
enum class Quant4Path : int32_t { kBest = 0, kPortable = 1 };

// Rows [row_begin, row_end) of w' into out, row r at out + (r - row_begin) * k.
void quant4_dequantize_cpu(const uint8_t* packed, const float* scales, const float* zeros, int64_t k, int64_t block,
                           int64_t block_rows, Quant4Scheme scheme, float* out, int64_t row_begin, int64_t row_end,
                           Quant4Path path = Quant4Path::kBest);

// out[m, r] = sum_c x[m, c] w'[r, c] + (bias ? bias[r] : 0) for m < rows, r in [row_begin, row_end); out is
// [rows, n] row-major, x is [rows, k]. Meant for few rows of x (decoding): it streams the packed weight once and
// reads x from cache.
void qlinear_cpu(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                 const float* zeros, int64_t n, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                 const float* bias, float* out, int64_t row_begin, int64_t row_end,
                 Quant4Path path = Quant4Path::kBest);

// "avx512" or "portable": the path qlinear_cpu takes on this CPU.
const char* quant4_cpu_isa();

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
#ifdef __CUDACC__

// Same codes, scales and zeros as the CPU; *bad_blocks (a device int64) receives the non-finite block count.
cudaError_t quant4_quantize_cuda(const float* w, int64_t n, int64_t k, int64_t block, int64_t block_rows,
                                 Quant4Scheme scheme, uint8_t* packed, float* scales, float* zeros,
                                 int64_t* bad_blocks, cudaStream_t stream);
// Rows [row_begin, row_end) of w' into out, row r at out + (r - row_begin) * k.
cudaError_t quant4_dequantize_cuda(const uint8_t* packed, const float* scales, const float* zeros, int64_t k,
                                   int64_t block, int64_t block_rows, Quant4Scheme scheme, float* out,
                                   int64_t row_begin, int64_t row_end, cudaStream_t stream);
// The decoding qlinear: one warp per output row, rows <= kQlinearCudaMaxRows.
constexpr int64_t kQlinearCudaMaxRows = 16;
cudaError_t qlinear_cuda(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                         const float* zeros, int64_t n, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                         const float* bias, float* out, cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
