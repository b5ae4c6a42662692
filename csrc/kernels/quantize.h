// Quantization to 1, 2, 4 or 8 bits with per-group scales, bit-packed codes, and the way back.
//
// x is n float32 values cut into groups of `group` consecutive values (n % group == 0): per-tensor is group = n,
// per-row of a [rows, d] tensor is group = d, "per-group of G" is group = G. Each group g gets a float32 scale
// (and, for minmax, a float32 zero point); each value a code q in [0, 2^bits - 1].
//
//   minmax:  lo, hi = min, max of the group;  scale = (hi - lo) / (2^bits - 1);  zero = lo
//            v = (x - lo) * inv;   x' = zero + q * scale
//   absmax:  s = max |x| of the group;
//            bits >= 2: scale = s / (2^(bits-1) - 1), c = 2^(bits-1): codes 1..2^bits-1 are the symmetric levels
//                       -s .. s and 0 is exact (code c); code 0 is unused
//            bits == 1: scale = 2 s, c = 1/2: the two levels -s and +s
//            v = x * inv + c;      x' = (q - c) * scale
//   inv = 1 / scale (0 when scale == 0, so a constant group has every code at its zero level and comes back exact).
//   Nearest rounding: q = clamp(round-half-even(v), qmin, qmax), |x - x'| <= scale / 2 (up to float32 rounding).
//   Stochastic rounding: q = clamp(floor(v + u_i), qmin, qmax) with u_i in [0, 1) from the counter-based generator
//   below at the value's flat index i: unbiased, |x - x'| < scale.
//   (qmin, qmax) = (0, 2^bits - 1), except absmax with bits >= 2: (1, 2^bits - 1).
//
// Random numbers: u_i = top 24 bits of splitmix64_mix(seed + (i + 1) * kSplitmix64Gamma) (splitmix64.h: the
// output of a stream seeded with `seed` at step i + 1), times 2^-24. A function of (seed, i) only, so CPU and CUDA
// draw the same numbers whatever the thread or block layout. The arithmetic is written so that CPU and CUDA round
// identically (no fused multiply-add; rounding by adding and subtracting 1.5 * 2^23): codes are bit-identical
// across devices.
//
// Packing: code i occupies bits [i * bits, (i + 1) * bits) of the packed byte stream, least significant bit first
// (for bits = 1 this is pack_bits' order). ceil(n * bits / 8) bytes; padding bits are zero.
//
// Non-finite input: a group holding NaN or +-inf (or whose range overflows float32) cannot be quantized; the stats
// functions count such groups so that the caller can refuse the input.
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/bitpack.h"
#include "kernels/splitmix64.h"

namespace fastdist {

enum class QuantScheme : int32_t { kMinMax = 0, kAbsMax = 1 };

FASTDIST_HOST_DEVICE inline constexpr bool quant_bits_supported(int64_t bits) {
  return bits == 1 || bits == 2 || bits == 4 || bits == 8;
}
FASTDIST_HOST_DEVICE inline constexpr int64_t quant_packed_bytes(int64_t n, int bits) { return packed_bytes(n * bits); }

// The code range and centre of a scheme (see the header comment).
struct QuantLevels {
  int32_t qmin, qmax;
  float centre;  // c: 0 for minmax
};

FASTDIST_HOST_DEVICE inline QuantLevels quant_levels(QuantScheme scheme, int bits) {
  const int32_t top = (1 << bits) - 1;
  if (scheme == QuantScheme::kMinMax) return {0, top, 0.0f};
  if (bits == 1) return {0, 1, 0.5f};
  return {1, top, static_cast<float>(1 << (bits - 1))};
}

// u_i in [0, 1), 24 random bits.
FASTDIST_HOST_DEVICE inline float quant_uniform(uint64_t seed, uint64_t i) {
  const uint64_t z = splitmix64_mix(seed + (i + 1) * kSplitmix64Gamma);
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 5.9604644775390625e-8f;  // 2^-24
}

// ---- CPU: single-threaded over a sub-range, so the caller can run disjoint ranges in parallel. ----

// Scales (and, for minmax, zero points; `zeros` may be nullptr for absmax) of groups [group_begin, group_end).
// Returns how many of those groups hold a non-finite value or have a non-finite scale.
int64_t quantize_stats_cpu(const float* x, int64_t group, int bits, QuantScheme scheme, float* scales, float* zeros,
                           int64_t group_begin, int64_t group_end);

// Packed bytes [byte_begin, byte_end) of the codes of x (n values), given the scales from quantize_stats_cpu.
void quantize_pack_cpu(const float* x, int64_t n, int64_t group, int bits, QuantScheme scheme, const float* scales,
                       const float* zeros, bool stochastic, uint64_t seed, uint8_t* packed, int64_t byte_begin,
                       int64_t byte_end);

// out[i] = x'_i for i in [begin, end).
void dequantize_cpu(const uint8_t* packed, int64_t n, int64_t group, int bits, QuantScheme scheme,
                    const float* scales, const float* zeros, float* out, int64_t begin, int64_t end);

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
// Same results bit for bit. quantize_cuda writes scales, zeros and packed, and the number of non-finite groups into
// *bad_groups (a device int64, overwritten).
#ifdef __CUDACC__

cudaError_t quantize_cuda(const float* x, int64_t n, int64_t group, int bits, QuantScheme scheme, bool stochastic,
                          uint64_t seed, float* scales, float* zeros, uint8_t* packed, int64_t* bad_groups,
                          cudaStream_t stream);
cudaError_t dequantize_cuda(const uint8_t* packed, int64_t n, int64_t group, int bits, QuantScheme scheme,
                            const float* scales, const float* zeros, float* out, cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
