// CUDA 4-bit block quantization and the decoding qlinear (see quant4.h for the definitions). Quantization runs one
// thread per (1-D or 2-D) block (statistics, codes and bytes of the block), dequantization one thread per packed
// byte, and qlinear one warp per output row: the lanes walk the row's packed bytes (coalesced), decode two codes
// through the block's scale and zero, accumulate every x row's product in registers, and reduce by warp shuffles.
// Arithmetic of codes and w' uses the _rn intrinsics so that nvcc cannot fuse a multiply and an add: they are
// bit-identical to the CPU's.
#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/quant4.h"

namespace fastdist {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

// The NF4 codebook in shared memory (filled by the first 16 threads; the caller synchronizes).
__device__ __forceinline__ void load_nf4(float* table) {
  if (threadIdx.x < 16) table[threadIdx.x] = nf4_code(static_cast<int>(threadIdx.x));
}

__device__ __forceinline__ float decode(uint32_t q, Quant4Scheme scheme, const float* nf4, float scale, float zero) {
  return scheme == Quant4Scheme::kNF4 ? __fmul_rn(nf4[q], scale)
                                      : __fadd_rn(__fmul_rn(static_cast<float>(q), scale), zero);
}

// One thread per block of block_rows x block values.
__global__ void quantize_kernel(const float* __restrict__ w, int64_t blocks, int64_t k, int64_t block,
                                int64_t block_rows, Quant4Scheme scheme, uint8_t* __restrict__ packed,
                                float* __restrict__ scales, float* __restrict__ zeros,
                                unsigned long long* __restrict__ bad) {
  __shared__ float nf4[16];
  load_nf4(nf4);
  __syncthreads();
  float midpoints[15];
  for (int i = 0; i < 15; ++i) midpoints[i] = __fdiv_rn(__fadd_rn(nf4[i], nf4[i + 1]), 2.0f);
  const int64_t groups = k / block;
  for (int64_t at = global_thread(); at < blocks; at += grid_threads()) {
    const int64_t b = at / groups, g = at % groups;
    const float* first = w + b * block_rows * k + g * block;
    float lo = first[0], hi = first[0];
    uint32_t nonfinite = 0;
    for (int64_t rr = 0; rr < block_rows; ++rr) {
      for (int64_t i = 0; i < block; ++i) {
        const float v = first[rr * k + i];
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
        nonfinite |= (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u;
      }
    }
    float scale, inv, lower = 0.0f;
    if (scheme == Quant4Scheme::kNF4) {
      scale = fmaxf(-lo, hi);
      inv = __fdiv_rn(1.0f, fmaxf(scale, 1e-38f));
      zeros[at] = 0.0f;
    } else {
      scale = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
      inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
      lower = lo;
      zeros[at] = lo;
    }
    scales[at] = scale;
    if (nonfinite || (__float_as_uint(scale) & 0x7F800000u) == 0x7F800000u) atomicAdd(bad, 1ull);
    for (int64_t rr = 0; rr < block_rows; ++rr) {
      const float* v = first + rr * k;
      uint8_t* dst = packed + (b * block_rows + rr) * (k / 2) + g * (block / 2);
      for (int64_t j = 0; j < block / 2; ++j) {
        uint32_t byte = 0;
        for (int t = 0; t < 2; ++t) {
          const float value = v[2 * j + t];
          uint32_t q;
          if (scheme == Quant4Scheme::kNF4) {
            const float s = fminf(fmaxf(__fmul_rn(value, inv), -1.0f), 1.0f);
            q = 0;
            for (int i = 0; i < 15; ++i) q += midpoints[i] < s;
          } else {
            const float r =
                __fsub_rn(__fadd_rn(__fmul_rn(__fsub_rn(value, lower), inv), kRoundMagic), kRoundMagic);
            q = static_cast<uint32_t>(fminf(fmaxf(0.0f, r), 15.0f));
          }
          byte |= q << (t == 0 ? 4 : 0);
        }
        dst[j] = static_cast<uint8_t>(byte);
      }
    }
  }
}

// Rows [row_begin, row_begin + bytes / (k / 2)): one thread per packed byte.
__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                                  const float* __restrict__ zeros, int64_t row_begin, int64_t bytes, int64_t k,
                                  int64_t block, int64_t block_rows, Quant4Scheme scheme, float* __restrict__ out) {
  __shared__ float nf4[16];
  load_nf4(nf4);
  __syncthreads();
  const int64_t groups = k / block, half = k / 2;
  for (int64_t b = global_thread(); b < bytes; b += grid_threads()) {
    const int64_t local = b / half, r = row_begin + local, c = 2 * (b % half);
    const int64_t at = (r / block_rows) * groups + c / block;
    const float scale = scales[at], zero = zeros ? zeros[at] : 0.0f;
    const uint32_t byte = packed[r * half + c / 2];
    out[local * k + c] = decode(byte >> 4, scheme, nf4, scale, zero);
    out[local * k + c + 1] = decode(byte & 15u, scheme, nf4, scale, zero);
  }
}

__global__ void qlinear_kernel(const float* __restrict__ x, int64_t rows, int64_t k, const uint8_t* __restrict__ packed,
                               const float* __restrict__ scales, const float* __restrict__ zeros, int64_t n,
                               int64_t block, int64_t block_rows, Quant4Scheme scheme,
                               const float* __restrict__ bias, float* __restrict__ out) {
  __shared__ float nf4[16];
  load_nf4(nf4);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t groups = k / block, half = k / 2;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < n; r += warps) {
    float acc[kQlinearCudaMaxRows];
#pragma unroll
    for (int m = 0; m < kQlinearCudaMaxRows; ++m) acc[m] = 0.0f;
    for (int64_t j = lane; j < half; j += 32) {
      const int64_t c = 2 * j;
      const int64_t at = (r / block_rows) * groups + c / block;
      const float scale = scales[at], zero = zeros ? zeros[at] : 0.0f;
      const uint32_t byte = packed[r * half + j];
      const float w0 = decode(byte >> 4, scheme, nf4, scale, zero);
      const float w1 = decode(byte & 15u, scheme, nf4, scale, zero);
#pragma unroll
      for (int m = 0; m < kQlinearCudaMaxRows; ++m) {
        if (m < rows) acc[m] = fmaf(w1, x[m * k + c + 1], fmaf(w0, x[m * k + c], acc[m]));
      }
    }
#pragma unroll
    for (int m = 0; m < kQlinearCudaMaxRows; ++m) {
      for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xFFFFFFFFu, acc[m], offset);
      if (lane == 0 && m < rows) out[m * n + r] = acc[m] + (bias ? bias[r] : 0.0f);
    }
  }
}

}  // namespace

cudaError_t quant4_quantize_cuda(const float* w, int64_t n, int64_t k, int64_t block, int64_t block_rows,
                                 Quant4Scheme scheme, uint8_t* packed, float* scales, float* zeros,
                                 int64_t* bad_blocks, cudaStream_t stream) {
  auto* bad = reinterpret_cast<unsigned long long*>(bad_blocks);
  cudaError_t err = cudaMemsetAsync(bad, 0, sizeof(*bad), stream);
  if (err != cudaSuccess || n == 0 || k == 0) return err;
  const int64_t blocks = n / block_rows * (k / block);
  quantize_kernel<<<grid_for(blocks, kThreads), kThreads, 0, stream>>>(w, blocks, k, block, block_rows, scheme,
                                                                        packed, scales, zeros, bad);
  return cudaGetLastError();
}

cudaError_t quant4_dequantize_cuda(const uint8_t* packed, const float* scales, const float* zeros, int64_t k,
                                   int64_t block, int64_t block_rows, Quant4Scheme scheme, float* out,
                                   int64_t row_begin, int64_t row_end, cudaStream_t stream) {
  const int64_t bytes = (row_end - row_begin) * (k / 2);
  if (bytes > 0) {
    dequantize_kernel<<<grid_for(bytes, kThreads), kThreads, 0, stream>>>(packed, scales, zeros, row_begin, bytes, k,
                                                                          block, block_rows, scheme, out);
  }
  return cudaGetLastError();
}

cudaError_t qlinear_cuda(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                         const float* zeros, int64_t n, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                         const float* bias, float* out, cudaStream_t stream) {
  if (rows > 0 && n > 0) {
    qlinear_kernel<<<grid_for(n, kWarpsPerBlock), kThreads, 0, stream>>>(x, rows, k, packed, scales, zeros, n, block,
                                                                          block_rows, scheme, bias, out);
  }
  return cudaGetLastError();
}

}  // namespace fastdist
