// CUDA quantization (see quantize.h for the definition). Three kernels: group statistics (one warp per group, a
// warp-shuffle reduction of min / max), packing (one thread per packed byte, so no two threads share a byte) and
// dequantization (one thread per value). Arithmetic uses the _rn intrinsics so that nvcc cannot fuse a multiply and
// an add: each step rounds exactly as the CPU code does, and codes and values are bit-identical to the CPU's.
#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/quantize.h"

namespace fastdist {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

__device__ __forceinline__ float inverse(float scale) { return scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f; }

__global__ void stats_kernel(const float* __restrict__ x, int64_t groups, int64_t group, int bits, QuantScheme scheme,
                             float* __restrict__ scales, float* __restrict__ zeros,
                             unsigned long long* __restrict__ bad) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; g < groups; g += warps) {
    const float* v = x + g * group;
    float lo = v[0], hi = v[0];
    uint32_t nonfinite = 0;
    for (int64_t i = lane; i < group; i += 32) {
      const float value = v[i];
      lo = fminf(lo, value);
      hi = fmaxf(hi, value);
      nonfinite |= (__float_as_uint(value) & 0x7F800000u) == 0x7F800000u;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      lo = fminf(lo, __shfl_xor_sync(0xFFFFFFFFu, lo, offset));
      hi = fmaxf(hi, __shfl_xor_sync(0xFFFFFFFFu, hi, offset));
      nonfinite |= __shfl_xor_sync(0xFFFFFFFFu, nonfinite, offset);
    }
    if (lane == 0) {
      float scale;
      if (scheme == QuantScheme::kMinMax) {
        scale = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>((1 << bits) - 1));
        zeros[g] = lo;
      } else {
        const float s = fmaxf(-lo, hi);
        scale = bits == 1 ? __fmul_rn(2.0f, s) : __fdiv_rn(s, static_cast<float>((1 << (bits - 1)) - 1));
        zeros[g] = 0.0f;
      }
      scales[g] = scale;
      if (nonfinite || (__float_as_uint(scale) & 0x7F800000u) == 0x7F800000u) atomicAdd(bad, 1ull);
    }
  }
}

__global__ void pack_kernel(const float* __restrict__ x, int64_t n, int64_t group, int bits, QuantScheme scheme,
                            const float* __restrict__ scales, const float* __restrict__ zeros, bool stochastic,
                            uint64_t seed, uint8_t* __restrict__ packed) {
  const QuantLevels lv = quant_levels(scheme, bits);
  const float qmin = static_cast<float>(lv.qmin), qmax = static_cast<float>(lv.qmax);
  const int per = 8 / bits;
  const int64_t bytes = quant_packed_bytes(n, bits);
  for (int64_t b = global_thread(); b < bytes; b += grid_threads()) {
    uint32_t byte = 0;
    for (int t = 0; t < per; ++t) {
      const int64_t i = b * per + t;
      if (i >= n) break;
      const int64_t g = i / group;
      const float inv = inverse(scales[g]);
      const float offset = scheme == QuantScheme::kMinMax ? zeros[g] : 0.0f;
      float v = __fadd_rn(__fmul_rn(__fsub_rn(x[i], offset), inv), lv.centre);
      float q;
      if (stochastic) {
        q = fminf(fmaxf(__fadd_rn(v, quant_uniform(seed, static_cast<uint64_t>(i))), qmin), qmax);
      } else {
        q = fminf(fmaxf(__fsub_rn(__fadd_rn(v, kRoundMagic), kRoundMagic), qmin), qmax);
      }
      byte |= static_cast<uint32_t>(static_cast<int32_t>(q)) << (t * bits);
    }
    packed[b] = static_cast<uint8_t>(byte);
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, int64_t n, int64_t group, int bits,
                                  QuantScheme scheme, const float* __restrict__ scales,
                                  const float* __restrict__ zeros, float* __restrict__ out) {
  const QuantLevels lv = quant_levels(scheme, bits);
  const uint32_t mask = (1u << bits) - 1;
  const int per = 8 / bits;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float q = static_cast<float>((packed[i / per] >> ((i % per) * bits)) & mask);
    const int64_t g = i / group;
    out[i] = scheme == QuantScheme::kMinMax ? __fadd_rn(zeros[g], __fmul_rn(q, scales[g]))
                                            : __fmul_rn(__fsub_rn(q, lv.centre), scales[g]);
  }
}

}  // namespace

cudaError_t quantize_cuda(const float* x, int64_t n, int64_t group, int bits, QuantScheme scheme, bool stochastic,
                          uint64_t seed, float* scales, float* zeros, uint8_t* packed, int64_t* bad_groups,
                          cudaStream_t stream) {
  auto* bad = reinterpret_cast<unsigned long long*>(bad_groups);
  cudaError_t err = cudaMemsetAsync(bad, 0, sizeof(*bad), stream);
  if (err != cudaSuccess || n == 0) return err;
  const int64_t groups = n / group;
  stats_kernel<<<grid_for(groups, kWarpsPerBlock), kThreads, 0, stream>>>(x, groups, group, bits, scheme, scales,
                                                                           zeros, bad);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  pack_kernel<<<grid_for(quant_packed_bytes(n, bits), kThreads), kThreads, 0, stream>>>(
      x, n, group, bits, scheme, scales, zeros, stochastic, seed, packed);
  return cudaGetLastError();
}

cudaError_t dequantize_cuda(const uint8_t* packed, int64_t n, int64_t group, int bits, QuantScheme scheme,
                            const float* scales, const float* zeros, float* out, cudaStream_t stream) {
  if (n > 0) {
    dequantize_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(packed, n, group, bits, scheme, scales, zeros,
                                                                      out);
  }
  return cudaGetLastError();
}

}  // namespace fastdist
