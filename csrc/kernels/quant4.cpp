// CPU 4-bit block quantization and the fused 4-bit linear (see quant4.h for the definitions).
//
// qlinear walks a tile of output rows chunk by chunk along k: each row's chunk is decoded once into a small float
// buffer through the block's 16-entry table (the codebook times the scale, or q * scale + zero), then every row of x
// is multiplied with it while x's chunk stays in L1. The packed weight is read once; per (output row, x row) the
// partial sums are kept in lanes and reduced once at the end. With AVX-512 the decode is one permute per 16 codes
// (the table lives in a register) and the products are 16-wide fused multiply-adds.
#include "kernels/quant4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace fastdist {
namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + m) - m rounds half-to-even for |v| < 2^22
constexpr int64_t kTileRows = 16;            // output rows whose partial sums are kept at once
constexpr int kLanes = 16;                   // partial sums per (output row, x row)

inline bool finite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7F800000u) != 0x7F800000u;
}

// Columns decoded at a time: a multiple of the block, about 256 (x's chunk of 16 rows is then 16 KiB, in L1).
inline int64_t chunk_cols(int64_t block) { return block >= 256 ? block : block * (256 / block); }

// The 16 values w' of a block's codes. Kept out of line so that no caller's target options can fuse the int4
// multiply and add: w' is then bit-identical to quant4_dequantize_cpu and to CUDA.
__attribute__((noinline)) void block_table(Quant4Scheme scheme, float scale, float zero, float* table) {
  if (scheme == Quant4Scheme::kNF4) {
    for (int q = 0; q < 16; ++q) table[q] = nf4_code(q) * scale;
  } else {
    for (int q = 0; q < 16; ++q) {
      const float product = static_cast<float>(q) * scale;
      table[q] = product + zero;
    }
  }
}

// Columns [c0, c1) of row r (block-aligned) through the block tables, into w[0, c1 - c0).
inline void decode_portable(const uint8_t* __restrict row_packed, const float* row_scales, const float* row_zeros,
                            int64_t block, Quant4Scheme scheme, int64_t c0, int64_t c1, float* __restrict w) {
  float table[16];
  for (int64_t b0 = c0; b0 < c1; b0 += block) {
    const int64_t g = b0 / block;
    block_table(scheme, row_scales[g], row_zeros ? row_zeros[g] : 0.0f, table);
    for (int64_t j = b0 / 2; j < (b0 + block) / 2; ++j) {
      const uint8_t byte = row_packed[j];
      w[2 * j - c0] = table[byte >> 4];
      w[2 * j + 1 - c0] = table[byte & 15];
    }
  }
}

// The rows' sums of products, lane by lane: lanes[l] += sum over i = l (mod kLanes) of w[i] x[i], then a fixed
// pairwise reduction (in the caller).
inline void dot_lanes(const float* __restrict w, const float* __restrict x, int64_t len, float* __restrict lanes) {
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += w[i + l] * x[i + l];
  }
  for (int l = 0; i < len; ++i, ++l) lanes[l] += w[i] * x[i];
}

inline float reduce_lanes(const float* lanes) {
  float t[kLanes];
  std::memcpy(t, lanes, sizeof t);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) t[l] += t[l + width];
  }
  return t[0];
}

void qlinear_portable_impl(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                           const float* zeros, int64_t n, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                           const float* bias, float* out, int64_t row_begin, int64_t row_end) {
  if (rows == 0) return;
  const int64_t chunk = k > 0 ? chunk_cols(block) : 0;
  const int64_t groups = k > 0 ? k / block : 0;
  std::vector<float> w(static_cast<size_t>(std::max<int64_t>(chunk, 1)));
  std::vector<float> lanes(static_cast<size_t>(kTileRows * rows * kLanes));
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
    const int64_t r1 = std::min(row_end, r0 + kTileRows);
    std::fill(lanes.begin(), lanes.end(), 0.0f);
    for (int64_t c0 = 0; c0 < k; c0 += chunk) {
      const int64_t c1 = std::min(k, c0 + chunk);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t at = (r / block_rows) * groups;
        decode_portable(packed + r * (k / 2), scales + at, zeros ? zeros + at : nullptr, block, scheme, c0, c1,
                        w.data());
        for (int64_t m = 0; m < rows; ++m) {
          dot_lanes(w.data(), x + m * k + c0, c1 - c0, lanes.data() + ((r - r0) * rows + m) * kLanes);
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      const float b = bias ? bias[r] : 0.0f;
      for (int64_t m = 0; m < rows; ++m) {
        out[m * n + r] = reduce_lanes(lanes.data() + ((r - r0) * rows + m) * kLanes) + b;
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTDIST_QUANT4_AVX512 1
#define FASTDIST_AVX512 __attribute__((target("avx512f")))

// The 16 codes of 8 packed bytes as 32-bit lanes, in column order (high nibble first). The zero-masked forms say the
// same as the plain ones without GCC 12's false "may be used uninitialized" on their undefined pass-through operand.
FASTDIST_AVX512 inline __m512i codes16(const uint8_t* bytes8) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes8));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
  const __m128i low = _mm_and_si128(bytes, low_nibbles);
  return _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_unpacklo_epi8(high, low));
}

// Columns [c0, c1) of a row into w, 16 codes (8 bytes) at a time, with explicitly rounded multiplies and adds, which
// the compiler cannot fuse, so the values equal block_table's bit for bit. Blocks of 16 columns or more: one permute
// per 16 codes through the block's table (the codebook, or 0..15, times the scale, plus the zero) in a register.
// Blocks of 2, 4 or 8 columns (QA-HiRA's narrow and 2-D blocks): the 16 lanes' scales (and zeros) are the 16 / block
// blocks' values spread by a permute, and each code's value is c[q] * scale (or q * scale + zero), the same single
// rounding per operation as the table. Other block widths, and a tail shorter than 16 columns, take the portable
// decode. c0 is a multiple of 16 and of the block (chunk_cols' chunks are).
FASTDIST_AVX512 void decode_avx512(const uint8_t* __restrict row_packed, const float* row_scales,
                                   const float* row_zeros, int64_t block, Quant4Scheme scheme, int64_t c0, int64_t c1,
                                   float* __restrict w) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  alignas(64) float levels[16];
  for (int q = 0; q < 16; ++q) levels[q] = scheme == Quant4Scheme::kNF4 ? nf4_code(q) : static_cast<float>(q);
  const __m512 level = _mm512_load_ps(levels);
  const bool int4 = scheme == Quant4Scheme::kInt4;
  if (block % 16 == 0) {
    for (int64_t b0 = c0; b0 < c1; b0 += block) {
      const int64_t g = b0 / block;
      __m512 lut = _mm512_maskz_mul_round_ps(0xFFFF, level, _mm512_set1_ps(row_scales[g]), kRound);
      if (int4) lut = _mm512_maskz_add_round_ps(0xFFFF, lut, _mm512_set1_ps(row_zeros[g]), kRound);
      for (int64_t c = b0; c < b0 + block; c += 16) {
        _mm512_storeu_ps(w + (c - c0), _mm512_maskz_permutexvar_ps(0xFFFF, codes16(row_packed + c / 2), lut));
      }
    }
    return;
  }
  if (16 % block != 0) return decode_portable(row_packed, row_scales, row_zeros, block, scheme, c0, c1, w);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(block));  // lane l reads block l / block
  const __m512i spread = _mm512_maskz_srli_epi32(
      0xFFFF, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), static_cast<unsigned>(shift));
  const __mmask16 per16 = static_cast<__mmask16>((1u << (16 / block)) - 1u);
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    const int64_t g = c / block;
    const __m512 scale = _mm512_maskz_permutexvar_ps(0xFFFF, spread, _mm512_maskz_loadu_ps(per16, row_scales + g));
    const __m512i codes = codes16(row_packed + c / 2);
    __m512 v;
    if (int4) {
      const __m512 zero = _mm512_maskz_permutexvar_ps(0xFFFF, spread, _mm512_maskz_loadu_ps(per16, row_zeros + g));
      v = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_cvtepi32_ps(0xFFFF, codes), scale, kRound);
      v = _mm512_maskz_add_round_ps(0xFFFF, v, zero, kRound);
    } else {
      v = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_permutexvar_ps(0xFFFF, codes, level), scale, kRound);
    }
    _mm512_storeu_ps(w + (c - c0), v);
  }
  if (c < c1) decode_portable(row_packed, row_scales, row_zeros, block, scheme, c, c1, w + (c - c0));
}

// acc[o][t] += w_o[0, len) * x_t[0, len) lane by lane, for kOut decoded weight rows w_o = w + o * w_stride and the x
// rows x_t = x0 + t * k, t < kRows; acc[o][t] is at acc + (o * rows + t) * kLanes. Register-blocked: each 16 columns
// load kOut weight and kRows x vectors for kOut * kRows multiply-adds. Every lane's sum is accumulated in column
// order, whatever the blocking, so the result does not depend on kOut or kRows.
template <int kOut, int kRows>
FASTDIST_AVX512 inline void fma_block(const float* __restrict w, int64_t w_stride, const float* __restrict x0,
                                      int64_t k, int64_t len, float* __restrict acc, int64_t rows) {
  __m512 sum[kOut][kRows];
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) sum[o][t] = _mm512_loadu_ps(acc + (o * rows + t) * kLanes);
  }
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 wv[kOut];
    for (int o = 0; o < kOut; ++o) wv[o] = _mm512_loadu_ps(w + o * w_stride + i);
    for (int t = 0; t < kRows; ++t) {
      const __m512 xv = _mm512_loadu_ps(x0 + t * k + i);
      for (int o = 0; o < kOut; ++o) sum[o][t] = _mm512_fmadd_ps(wv[o], xv, sum[o][t]);
    }
  }
  if (i < len) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (len - i)) - 1u);
    __m512 wv[kOut];
    for (int o = 0; o < kOut; ++o) wv[o] = _mm512_maskz_loadu_ps(mask, w + o * w_stride + i);
    for (int t = 0; t < kRows; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x0 + t * k + i);
      for (int o = 0; o < kOut; ++o) sum[o][t] = _mm512_fmadd_ps(wv[o], xv, sum[o][t]);
    }
  }
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) _mm512_storeu_ps(acc + (o * rows + t) * kLanes, sum[o][t]);
  }
}

// The x rows of one group of kOut decoded weight rows, 4 x rows at a time.
template <int kOut>
FASTDIST_AVX512 inline void fma_x_rows(const float* w, int64_t w_stride, const float* x, int64_t rows, int64_t k,
                                       int64_t c0, int64_t len, float* acc) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) fma_block<kOut, 4>(w, w_stride, x + m * k + c0, k, len, acc + m * kLanes, rows);
  for (; m < rows; ++m) fma_block<kOut, 1>(w, w_stride, x + m * k + c0, k, len, acc + m * kLanes, rows);
}

// Output rows decoded together, so that each x vector loaded feeds this many multiply-adds.
constexpr int64_t kOutBlock = 4;

FASTDIST_AVX512 void qlinear_avx512_impl(const float* x, int64_t rows, int64_t k, const uint8_t* packed,
                                         const float* scales, const float* zeros, int64_t n, int64_t block,
                                         int64_t block_rows, Quant4Scheme scheme, const float* bias, float* out,
                                         int64_t row_begin, int64_t row_end) {
  if (rows == 0) return;
  const int64_t chunk = k > 0 ? chunk_cols(block) : 0;
  const int64_t groups = k > 0 ? k / block : 0;
  const int64_t w_stride = std::max<int64_t>(chunk, 1) + 16;
  std::vector<float> w(static_cast<size_t>(kOutBlock * w_stride));
  // lanes of (output row r - r0, x row m) at ((r - r0) * rows + m) * kLanes
  std::vector<float> lanes(static_cast<size_t>(kTileRows * rows * kLanes));
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
    const int64_t r1 = std::min(row_end, r0 + kTileRows);
    std::fill(lanes.begin(), lanes.end(), 0.0f);
    for (int64_t c0 = 0; c0 < k; c0 += chunk) {
      const int64_t c1 = std::min(k, c0 + chunk), len = c1 - c0;
      for (int64_t r = r0; r < r1; r += kOutBlock) {
        const int64_t count = std::min(kOutBlock, r1 - r);
        for (int64_t o = 0; o < count; ++o) {
          const int64_t at = ((r + o) / block_rows) * groups;
          decode_avx512(packed + (r + o) * (k / 2), scales + at, zeros ? zeros + at : nullptr, block, scheme, c0, c1,
                        w.data() + o * w_stride);
        }
        float* acc = lanes.data() + (r - r0) * rows * kLanes;
        if (count == kOutBlock) {
          fma_x_rows<kOutBlock>(w.data(), w_stride, x, rows, k, c0, len, acc);
        } else {
          for (int64_t o = 0; o < count; ++o) {
            fma_x_rows<1>(w.data() + o * w_stride, w_stride, x, rows, k, c0, len, acc + o * rows * kLanes);
          }
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      const float b = bias ? bias[r] : 0.0f;
      for (int64_t m = 0; m < rows; ++m) {
        out[m * n + r] = reduce_lanes(lanes.data() + ((r - r0) * rows + m) * kLanes) + b;
      }
    }
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

}  // namespace

int64_t quant4_quantize_cpu(const float* w, int64_t k, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                            uint8_t* packed, float* scales, float* zeros, int64_t block_begin, int64_t block_end) {
  if (k == 0) return 0;
  const int64_t groups = k / block;
  float midpoints[15];
  for (int i = 0; i < 15; ++i) midpoints[i] = (nf4_code(i) + nf4_code(i + 1)) / 2.0f;
  int64_t bad = 0;
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict first = w + b * block_rows * k + g * block;
      float lo = first[0], hi = first[0];
      uint32_t nonfinite = 0;
      for (int64_t rr = 0; rr < block_rows; ++rr) {
        const float* __restrict v = first + rr * k;
        for (int64_t i = 0; i < block; ++i) {
          lo = std::min(lo, v[i]);
          hi = std::max(hi, v[i]);
          uint32_t u;
          std::memcpy(&u, v + i, sizeof u);
          nonfinite |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
        }
      }
      const int64_t at = b * groups + g;
      float scale, inv, lower = 0.0f;
      if (scheme == Quant4Scheme::kNF4) {
        scale = std::max(-lo, hi);  // absmax
        inv = 1.0f / std::max(scale, 1e-38f);
        if (zeros) zeros[at] = 0.0f;
      } else {
        scale = (hi - lo) / 15.0f;
        inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        lower = lo;
        zeros[at] = lo;
      }
      scales[at] = scale;
      bad += (nonfinite != 0) || !finite(scale);
      for (int64_t rr = 0; rr < block_rows; ++rr) {
        const float* __restrict v = first + rr * k;
        uint8_t* __restrict dst = packed + (b * block_rows + rr) * (k / 2) + g * (block / 2);
        for (int64_t j = 0; j < block / 2; ++j) {
          uint32_t byte = 0;
          for (int t = 0; t < 2; ++t) {
            uint32_t q;
            if (scheme == Quant4Scheme::kNF4) {
              const float s = std::min(std::max(v[2 * j + t] * inv, -1.0f), 1.0f);
              q = 0;
              for (int i = 0; i < 15; ++i) q += static_cast<uint32_t>(midpoints[i] < s);
            } else {
              float r = ((v[2 * j + t] - lower) * inv + kRoundMagic) - kRoundMagic;
              r = std::min(std::max(0.0f, r), 15.0f);  // 0 first: a NaN (of a block the caller refuses) becomes 0
              q = static_cast<uint32_t>(r);
            }
            byte |= q << (t == 0 ? 4 : 0);
          }
          dst[j] = static_cast<uint8_t>(byte);
        }
      }
    }
  }
  return bad;
}

namespace {

bool use_avx512(Quant4Path path) {
#ifdef FASTDIST_QUANT4_AVX512
  return path == Quant4Path::kBest && cpu_has_avx512();
#else
  (void)path;
  return false;
#endif
}

}  // namespace

void quant4_dequantize_cpu(const uint8_t* packed, const float* scales, const float* zeros, int64_t k, int64_t block,
                           int64_t block_rows, Quant4Scheme scheme, float* out, int64_t row_begin, int64_t row_end,
                           Quant4Path path) {
  if (k == 0) return;
  const int64_t groups = k / block;
  const bool simd = use_avx512(path);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t at = (r / block_rows) * groups;
    const float* row_zeros = zeros ? zeros + at : nullptr;
    float* row_out = out + (r - row_begin) * k;
#ifdef FASTDIST_QUANT4_AVX512
    if (simd) {
      decode_avx512(packed + r * (k / 2), scales + at, row_zeros, block, scheme, 0, k, row_out);
      continue;
    }
#endif
    decode_portable(packed + r * (k / 2), scales + at, row_zeros, block, scheme, 0, k, row_out);
  }
}

void qlinear_cpu(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                 const float* zeros, int64_t n, int64_t block, int64_t block_rows, Quant4Scheme scheme,
                 const float* bias, float* out, int64_t row_begin, int64_t row_end, Quant4Path path) {
#ifdef FASTDIST_QUANT4_AVX512
  if (use_avx512(path)) {
    return qlinear_avx512_impl(x, rows, k, packed, scales, zeros, n, block, block_rows, scheme, bias, out, row_begin,
                               row_end);
  }
#endif
  qlinear_portable_impl(x, rows, k, packed, scales, zeros, n, block, block_rows, scheme, bias, out, row_begin,
                        row_end);
}

const char* quant4_cpu_isa() {
#ifdef FASTDIST_QUANT4_AVX512
  if (cpu_has_avx512()) return "avx512";
#endif
  return "portable";
}

}  // namespace fastdist
