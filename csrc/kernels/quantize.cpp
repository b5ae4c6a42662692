// CPU quantization (see quantize.h for the definition). Codes are computed a block at a time into a small byte
// buffer by a loop with one scale per group segment (it vectorizes: multiply, add, the round-by-magic-constant,
// clamp, convert), then packed 8 / bits codes per byte.
#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>

namespace fastdist {
namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + m) - m rounds half-to-even for |v| < 2^22
constexpr int64_t kBlock = 1024;            // codes computed per step (a multiple of 8)

inline bool finite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7F800000u) != 0x7F800000u;
}

inline float inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Codes of x[i0, i1) (all in one group, whose scale and zero are given) into codes[0, i1 - i0).
void codes_of_segment(const float* __restrict x, int64_t i0, int64_t i1, QuantScheme scheme, QuantLevels lv,
                      float scale, float zero, bool stochastic, uint64_t seed, uint8_t* __restrict codes) {
  const float inv = inverse(scale);
  const float qmin = static_cast<float>(lv.qmin), qmax = static_cast<float>(lv.qmax);
  const float offset = scheme == QuantScheme::kMinMax ? zero : 0.0f;  // minmax: x - lo; absmax: x * inv + c
  const float centre = lv.centre;
  const int64_t len = i1 - i0;
  if (!stochastic) {
    for (int64_t t = 0; t < len; ++t) {
      const float v = (x[i0 + t] - offset) * inv + centre;
      float q = (v + kRoundMagic) - kRoundMagic;
      q = std::min(std::max(qmin, q), qmax);  // qmin first: a NaN (of a group the caller refuses) becomes qmin
      codes[t] = static_cast<uint8_t>(static_cast<int32_t>(q));
    }
  } else {
    for (int64_t t = 0; t < len; ++t) {
      const float v = (x[i0 + t] - offset) * inv + centre + quant_uniform(seed, static_cast<uint64_t>(i0 + t));
      const float q = std::min(std::max(qmin, v), qmax);  // >= 0, so truncation is floor; NaN becomes qmin
      codes[t] = static_cast<uint8_t>(static_cast<int32_t>(q));
    }
  }
}

// `count` codes (a multiple of 8 / bits, or the stream's last codes) into ceil(count * bits / 8) bytes.
template <int kBits>
void pack_codes_of(const uint8_t* __restrict codes, int64_t count, uint8_t* __restrict out) {
  constexpr int kPer = 8 / kBits;
  const int64_t full = count / kPer;
  for (int64_t b = 0; b < full; ++b) {
    uint32_t byte = 0;
    for (int t = 0; t < kPer; ++t) byte |= static_cast<uint32_t>(codes[b * kPer + t]) << (t * kBits);
    out[b] = static_cast<uint8_t>(byte);
  }
  if (full * kPer < count) {
    uint32_t byte = 0;
    for (int64_t t = full * kPer; t < count; ++t) byte |= static_cast<uint32_t>(codes[t]) << ((t - full * kPer) * kBits);
    out[full] = static_cast<uint8_t>(byte);
  }
}

void pack_codes(const uint8_t* codes, int64_t count, int bits, uint8_t* out) {
  switch (bits) {
    case 1: return pack_codes_of<1>(codes, count, out);
    case 2: return pack_codes_of<2>(codes, count, out);
    case 4: return pack_codes_of<4>(codes, count, out);
    default: std::memcpy(out, codes, count);
  }
}

// Values [begin, end) with the code width a compile-time constant, so that locating a code is shifts and masks.
template <int kBits>
void dequantize_range(const uint8_t* __restrict packed, int64_t group, QuantScheme scheme, const float* scales,
                      const float* zeros, float* __restrict out, int64_t begin, int64_t end) {
  constexpr int kPer = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  const QuantLevels lv = quant_levels(scheme, kBits);
  for (int64_t s0 = begin; s0 < end;) {
    const int64_t g = s0 / group;
    const int64_t s1 = std::min(end, (g + 1) * group);
    const float scale = scales[g];
    // x' = zero + q * scale (minmax) or (q - c) * scale (absmax): one affine form with a per-scheme order
    if (scheme == QuantScheme::kMinMax) {
      const float zero = zeros[g];
      for (int64_t i = s0; i < s1; ++i) {
        const uint32_t q = (packed[i / kPer] >> ((i % kPer) * kBits)) & kMask;
        out[i] = zero + static_cast<float>(q) * scale;
      }
    } else {
      const float centre = lv.centre;
      for (int64_t i = s0; i < s1; ++i) {
        const uint32_t q = (packed[i / kPer] >> ((i % kPer) * kBits)) & kMask;
        out[i] = (static_cast<float>(q) - centre) * scale;
      }
    }
    s0 = s1;
  }
}

}  // namespace

int64_t quantize_stats_cpu(const float* x, int64_t group, int bits, QuantScheme scheme, float* scales, float* zeros,
                           int64_t group_begin, int64_t group_end) {
  int64_t bad = 0;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const float* __restrict v = x + g * group;
    float lo = v[0], hi = v[0];
    uint32_t nonfinite = 0;
    for (int64_t i = 0; i < group; ++i) {
      lo = std::min(lo, v[i]);
      hi = std::max(hi, v[i]);
      uint32_t u;
      std::memcpy(&u, v + i, sizeof u);
      nonfinite |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
    }
    float scale;
    if (scheme == QuantScheme::kMinMax) {
      scale = (hi - lo) / static_cast<float>((1 << bits) - 1);
      if (zeros) zeros[g] = lo;
    } else {
      const float s = std::max(-lo, hi);
      scale = bits == 1 ? 2.0f * s : s / static_cast<float>((1 << (bits - 1)) - 1);
      if (zeros) zeros[g] = 0.0f;
    }
    scales[g] = scale;
    bad += (nonfinite != 0) || !finite(scale);
  }
  return bad;
}

void quantize_pack_cpu(const float* x, int64_t n, int64_t group, int bits, QuantScheme scheme, const float* scales,
                       const float* zeros, bool stochastic, uint64_t seed, uint8_t* packed, int64_t byte_begin,
                       int64_t byte_end) {
  const QuantLevels lv = quant_levels(scheme, bits);
  const int64_t per = 8 / bits;
  const int64_t e_end = std::min(n, byte_end * per);
  uint8_t codes[kBlock];
  for (int64_t e0 = byte_begin * per; e0 < e_end; e0 += kBlock) {
    const int64_t e1 = std::min(e0 + kBlock, e_end);
    for (int64_t s0 = e0; s0 < e1;) {  // segments of the block that lie in one group
      const int64_t g = s0 / group;
      const int64_t s1 = std::min(e1, (g + 1) * group);
      codes_of_segment(x, s0, s1, scheme, lv, scales[g], zeros ? zeros[g] : 0.0f, stochastic, seed, codes + (s0 - e0));
      s0 = s1;
    }
    pack_codes(codes, e1 - e0, bits, packed + e0 / per);
  }
}

void dequantize_cpu(const uint8_t* packed, int64_t n, int64_t group, int bits, QuantScheme scheme,
                    const float* scales, const float* zeros, float* out, int64_t begin, int64_t end) {
  (void)n;
  switch (bits) {
    case 1: return dequantize_range<1>(packed, group, scheme, scales, zeros, out, begin, end);
    case 2: return dequantize_range<2>(packed, group, scheme, scales, zeros, out, begin, end);
    case 4: return dequantize_range<4>(packed, group, scheme, scales, zeros, out, begin, end);
    default: return dequantize_range<8>(packed, group, scheme, scales, zeros, out, begin, end);
  }
}

}  // namespace fastdist
