// CPU 4-bit block quantization and the fused 4-bit linear (see quant4.h for the definitions).
//
// qlinear walks a tile of output rows chunk by chunk along k: each row's chunk is decoded once into a small float
// buffer through the block's 16-entry table (the codebook times the scale, or q * scale + zero), then every row of x
// is multiplied with it while x's chunk stays in L1. The packed weight is read once; per (output row, x row) the
// partial sums are kept in lanes and reduced once at the end. With AVX-512 the decode is one permute per 16 codes
// (the table lives in a register), the products are 16-wide fused multiply-adds, and for up to 4 rows of x the
// codes are decoded straight into registers (no buffer), 32 columns per 16 packed bytes.
#include "kernels/quant4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
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

// The decode's per-call constants. level: the codebook (nf4) or 0..15 (int4). For blocks whose width is not a
// multiple of 16 columns, each 16 columns' lanes take their scales (and zeros) from the few blocks they touch through
// a permute: offsets[j * 16 + l] is the block of column 16 j + l less the block of column 16 j, a pattern that
// repeats every `period` vectors (lcm(16, block) columns). spread: the same for the even (or odd) columns of a group
// of 32, lane i's block (2 i) / block, when the block divides 32.
struct DecodeSetup {
  __m512 level;
  __m512i spread;
  int64_t period;
  std::vector<int32_t> offsets;
};

FASTDIST_AVX512 DecodeSetup decode_setup(Quant4Scheme scheme, int64_t block) {
  alignas(64) float levels[16];
  for (int q = 0; q < 16; ++q) levels[q] = scheme == Quant4Scheme::kNF4 ? nf4_code(q) : static_cast<float>(q);
  alignas(64) int32_t spread[16];
  for (int i = 0; i < 16; ++i) spread[i] = static_cast<int32_t>(2 * i / block);
  DecodeSetup setup{_mm512_load_ps(levels), _mm512_load_si512(spread), 1, {}};
  if (block % 32 != 0) {  // decode16_spread's widths (decode_avx512's, and groups of 32 across blocks)
    setup.period = block / std::gcd<int64_t>(block, 16);
    setup.offsets.resize(static_cast<size_t>(setup.period * 16));
    for (int64_t j = 0; j < setup.period; ++j) {
      for (int64_t l = 0; l < 16; ++l) setup.offsets[j * 16 + l] = static_cast<int32_t>((16 * j + l) / block - 16 * j / block);
    }
  }
  return setup;
}

// The values of the columns [c, c + len) (len <= 16, even) of a row in column order, lanes past len zero, for any
// block width: lane l's scale (and zero) is its block's, picked by a permute from the blocks the columns touch, and its
// value c[q] * scale (or q * scale + zero), one explicit rounding per operation (bit for bit block_table's).
FASTDIST_AVX512 inline __m512 decode16_spread(const uint8_t* row_packed, const float* row_scales,
                                              const float* row_zeros, int64_t block, bool int4,
                                              const DecodeSetup& setup, int64_t c, int64_t len) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t first = c / block, count = (c + len - 1) / block - first + 1;
  const __mmask16 present = static_cast<__mmask16>((1u << count) - 1u);
  const __m512i offset = _mm512_loadu_si512(setup.offsets.data() + ((c / 16) % setup.period) * 16);
  const __m512 scale = _mm512_maskz_permutexvar_ps(0xFFFF, offset, _mm512_maskz_loadu_ps(present, row_scales + first));
  __m512i codes;
  if (len == 16) {
    codes = codes16(row_packed + c / 2);
  } else {
    alignas(16) uint8_t tail[16] = {};
    std::memcpy(tail, row_packed + c / 2, static_cast<size_t>(len / 2));
    codes = codes16(tail);
  }
  __m512 v;
  if (int4) {
    const __m512 zero = _mm512_maskz_permutexvar_ps(0xFFFF, offset, _mm512_maskz_loadu_ps(present, row_zeros + first));
    v = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_cvtepi32_ps(0xFFFF, codes), scale, kRound);
    v = _mm512_maskz_add_round_ps(0xFFFF, v, zero, kRound);
  } else {
    v = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_permutexvar_ps(0xFFFF, codes, setup.level), scale, kRound);
  }
  return len == 16 ? v : _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << len) - 1u), v);
}

// Columns [c0, c1) of a row into w (c0 a multiple of 16 and of the block), with explicitly rounded multiplies and
// adds, which the compiler cannot fuse, so the values equal block_table's bit for bit. Blocks of a multiple of 16
// columns: one permute per 16 codes through the block's table (the codebook, or 0..15, times the scale, plus the
// zero) in a register. Other widths (QA-HiRA's narrow and 2-D blocks of 2, 4 or 8 columns, and 6, 10, 12, 24, ...):
// decode16_spread, a tail shorter than 16 columns included.
FASTDIST_AVX512 void decode_avx512(const uint8_t* __restrict row_packed, const float* row_scales,
                                   const float* row_zeros, int64_t block, Quant4Scheme scheme,
                                   const DecodeSetup& setup, int64_t c0, int64_t c1, float* __restrict w) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const bool int4 = scheme == Quant4Scheme::kInt4;
  if (block % 16 == 0) {
    for (int64_t b0 = c0; b0 < c1; b0 += block) {
      const int64_t g = b0 / block;
      __m512 lut = _mm512_maskz_mul_round_ps(0xFFFF, setup.level, _mm512_set1_ps(row_scales[g]), kRound);
      if (int4) lut = _mm512_maskz_add_round_ps(0xFFFF, lut, _mm512_set1_ps(row_zeros[g]), kRound);
      for (int64_t c = b0; c < b0 + block; c += 16) {
        _mm512_storeu_ps(w + (c - c0), _mm512_maskz_permutexvar_ps(0xFFFF, codes16(row_packed + c / 2), lut));
      }
    }
    return;
  }
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    _mm512_storeu_ps(w + (c - c0), decode16_spread(row_packed, row_scales, row_zeros, block, int4, setup, c, 16));
  }
  if (c < c1) {
    const __m512 v = decode16_spread(row_packed, row_scales, row_zeros, block, int4, setup, c, c1 - c);
    _mm512_mask_storeu_ps(w + (c - c0), static_cast<__mmask16>((1u << (c1 - c)) - 1u), v);
  }
}

// ---- The AVX-512 qlinear. ----
//
// Summation order: the columns fall in groups of 32 (from column 0); in a group, lane i (of 16) adds the products of
// columns 2i and 2i + 1, in that order, and each lane runs over the groups in order; the lanes are then reduced
// pairwise (reduce_lanes). It is the order in which 16 packed bytes decode into two registers (byte i holds the
// codes of columns 2i and 2i + 1), so every path below (codes decoded straight into registers for few rows of x, or
// decoded rows in a buffer for more) gives the same sums bit for bit, whatever the number of rows of x, the row
// range or the thread count. x is read in that order: a copy of it with each group's even columns first, then its
// odd ones (zero-padded to whole groups), made once per call.

constexpr int64_t kGroup = 32;

// Columns [0, k) of x's rows, group by group, even columns then odd ones, into xp (rows x kp, kp = k rounded up to
// whole groups; the missing columns of the last group are zeros).
FASTDIST_AVX512 void deinterleave_x(const float* x, int64_t rows, int64_t k, int64_t kp, float* xp) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k;
    float* dst = xp + m * kp;
    int64_t c = 0;
    for (; c + kGroup <= k; c += kGroup) {
      const __m512 a = _mm512_loadu_ps(row + c), b = _mm512_loadu_ps(row + c + 16);
      _mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(a, even, b));
      _mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(a, odd, b));
    }
    if (c < k) {
      std::fill(dst + c, dst + c + kGroup, 0.0f);
      for (int64_t i = 0; c + 2 * i < k; ++i) {
        dst[c + i] = row[c + 2 * i];
        dst[c + 16 + i] = row[c + 2 * i + 1];
      }
    }
  }
}

// How a row's groups of 32 columns decode. kTable: blocks of a multiple of 32 columns, one 16-entry table per block
// in a register (a group lies in one block), one permute per 16 codes. kSpread: blocks of 2, 4, 8 or 16 columns,
// each lane's scale (and zero) picked from the group's 32 / block blocks by a permute. kOther: other widths, the
// group's two halves decoded in column order (decode16_spread), then split into even and odd columns.
enum class GroupDecode { kTable, kSpread, kOther };

inline GroupDecode group_decode(int64_t block) {
  if (block % kGroup == 0) return GroupDecode::kTable;
  if (kGroup % block == 0) return GroupDecode::kSpread;
  return GroupDecode::kOther;
}

// The codes of 16 packed bytes (32 columns): high nibbles (even columns) and low nibbles (odd columns), as 32-bit
// lanes.
FASTDIST_AVX512 inline void codes32(const uint8_t* bytes16, __m512i& even, __m512i& odd) {
  const __m512i bytes = _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16)));
  even = _mm512_maskz_srli_epi32(0xFFFF, bytes, 4);
  odd = _mm512_maskz_and_epi32(0xFFFF, bytes, _mm512_set1_epi32(15));
}

// One row's decoder: the group of columns [c, c + len) (c a multiple of 32, len <= 32 and even) into its even and odd
// columns' values w' (bit for bit block_table's), lanes past len / 2 zero.
struct RowDecoder {
  const uint8_t* packed;
  const float* scales;
  const float* zeros;
  int64_t block;
  bool int4;
  GroupDecode how;

  // kTable: the 16 values of block g's codes.
  FASTDIST_AVX512 inline __m512 table(const DecodeSetup& setup, int64_t g) const {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 lut = _mm512_maskz_mul_round_ps(0xFFFF, setup.level, _mm512_set1_ps(scales[g]), kRound);
    return int4 ? _mm512_maskz_add_round_ps(0xFFFF, lut, _mm512_set1_ps(zeros[g]), kRound) : lut;
  }

  // kTable, the group's block's table given.
  FASTDIST_AVX512 inline void group_in(__m512 lut, int64_t c, __m512& even, __m512& odd) const {
    __m512i qe, qo;
    codes32(packed + c / 2, qe, qo);
    even = _mm512_maskz_permutexvar_ps(0xFFFF, qe, lut);
    odd = _mm512_maskz_permutexvar_ps(0xFFFF, qo, lut);
  }

  FASTDIST_AVX512 inline void group(const DecodeSetup& setup, int64_t c, int64_t len, __m512& even,
                                    __m512& odd) const {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    if (how == GroupDecode::kOther) {
      const __m512 a = decode16_spread(packed, scales, zeros, block, int4, setup, c, std::min<int64_t>(16, len));
      const __m512 b = len > 16 ? decode16_spread(packed, scales, zeros, block, int4, setup, c + 16, len - 16)
                                : _mm512_setzero_ps();
      const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      even = _mm512_permutex2var_ps(a, even_idx, b);
      odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(even_idx, _mm512_set1_epi32(1)), b);
      return;
    }
    __m512i qe, qo;
    if (len == kGroup) {
      codes32(packed + c / 2, qe, qo);
    } else {
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, packed + c / 2, static_cast<size_t>(len / 2));
      codes32(tail, qe, qo);
    }
    const int64_t g = c / block;
    if (how == GroupDecode::kTable) {
      const __m512 lut = table(setup, g);
      even = _mm512_maskz_permutexvar_ps(0xFFFF, qe, lut);
      odd = _mm512_maskz_permutexvar_ps(0xFFFF, qo, lut);
    } else {
      const int64_t count = (len + block - 1) / block;  // the group's blocks
      const __mmask16 present = static_cast<__mmask16>((1u << count) - 1u);
      const __m512 scale =
          _mm512_maskz_permutexvar_ps(0xFFFF, setup.spread, _mm512_maskz_loadu_ps(present, scales + g));
      if (int4) {
        const __m512 zero =
            _mm512_maskz_permutexvar_ps(0xFFFF, setup.spread, _mm512_maskz_loadu_ps(present, zeros + g));
        even = _mm512_maskz_add_round_ps(
            0xFFFF, _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_cvtepi32_ps(0xFFFF, qe), scale, kRound), zero,
            kRound);
        odd = _mm512_maskz_add_round_ps(
            0xFFFF, _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_cvtepi32_ps(0xFFFF, qo), scale, kRound), zero,
            kRound);
      } else {
        even = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_permutexvar_ps(0xFFFF, qe, setup.level), scale, kRound);
        odd = _mm512_maskz_mul_round_ps(0xFFFF, _mm512_maskz_permutexvar_ps(0xFFFF, qo, setup.level), scale, kRound);
      }
    }
    if (len < kGroup) {
      const __mmask16 valid = static_cast<__mmask16>((1u << (len / 2)) - 1u);
      even = _mm512_maskz_mov_ps(valid, even);
      odd = _mm512_maskz_mov_ps(valid, odd);
    }
  }
};

// Few rows of x: each group of kOut output rows is decoded into registers and multiplied with the kRows rows of x
// (deinterleaved, xp with row stride kp) at once; the kOut * kRows sums stay in registers over the whole row.
template <int kOut, int kRows>
FASTDIST_AVX512 void direct_rows(const RowDecoder* dec, const DecodeSetup& setup, const float* xp, int64_t k,
                                 int64_t kp, float* lanes_out) {
  __m512 acc[kOut][kRows];
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) acc[o][t] = _mm512_setzero_ps();
  }
  const auto multiply = [&](int64_t c, const __m512* even, const __m512* odd) FASTDIST_AVX512 {
    for (int t = 0; t < kRows; ++t) {
      const __m512 xe = _mm512_loadu_ps(xp + t * kp + c), xo = _mm512_loadu_ps(xp + t * kp + c + 16);
      for (int o = 0; o < kOut; ++o) {
        acc[o][t] = _mm512_fmadd_ps(even[o], xe, acc[o][t]);
        acc[o][t] = _mm512_fmadd_ps(odd[o], xo, acc[o][t]);
      }
    }
  };
  __m512 even[kOut], odd[kOut];
  int64_t c = 0;
  if (dec[0].how == GroupDecode::kTable) {  // whole blocks (whole groups), one table per row and block
    const int64_t block = dec[0].block;
    for (; c + block <= k; c += block) {
      __m512 lut[kOut];
      for (int o = 0; o < kOut; ++o) lut[o] = dec[o].table(setup, c / block);
      for (int64_t g = c; g < c + block; g += kGroup) {
        for (int o = 0; o < kOut; ++o) dec[o].group_in(lut[o], g, even[o], odd[o]);
        multiply(g, even, odd);
      }
    }
  }
  for (; c < k; c += kGroup) {
    const int64_t len = std::min(kGroup, k - c);
    for (int o = 0; o < kOut; ++o) dec[o].group(setup, c, len, even[o], odd[o]);
    multiply(c, even, odd);
  }
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) _mm512_storeu_ps(lanes_out + (o * kRows + t) * kLanes, acc[o][t]);
  }
}

template <int kOut>
FASTDIST_AVX512 void direct_dispatch(const RowDecoder* dec, const DecodeSetup& setup, const float* xp, int64_t rows,
                                     int64_t k, int64_t kp, float* lanes_out) {
  switch (rows) {
    case 1: return direct_rows<kOut, 1>(dec, setup, xp, k, kp, lanes_out);
    case 2: return direct_rows<kOut, 2>(dec, setup, xp, k, kp, lanes_out);
    case 3: return direct_rows<kOut, 3>(dec, setup, xp, k, kp, lanes_out);
    default: return direct_rows<kOut, 4>(dec, setup, xp, k, kp, lanes_out);
  }
}

// Rows of x up to which the codes are decoded straight into registers.
constexpr int64_t kDirectRows = 4;
// Output rows decoded together on the direct path.
constexpr int kDirectOut = 4;

// acc[o][t] += w_o * x_t over the positions [0, len) (whole groups) lane by lane, for kOut decoded (deinterleaved)
// weight rows w_o = w + o * w_stride and kRows rows x_t = x0 + t * kp; acc[o][t] is at acc + (o * rows + t) * kLanes.
// Each group adds its even columns' products, then its odd ones', to the lanes: the summation order above.
template <int kOut, int kRows>
FASTDIST_AVX512 inline void fma_block(const float* __restrict w, int64_t w_stride, const float* __restrict x0,
                                      int64_t kp, int64_t len, float* __restrict acc, int64_t rows) {
  __m512 sum[kOut][kRows];
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) sum[o][t] = _mm512_loadu_ps(acc + (o * rows + t) * kLanes);
  }
  for (int64_t i = 0; i < len; i += 16) {
    __m512 wv[kOut];
    for (int o = 0; o < kOut; ++o) wv[o] = _mm512_loadu_ps(w + o * w_stride + i);
    for (int t = 0; t < kRows; ++t) {
      const __m512 xv = _mm512_loadu_ps(x0 + t * kp + i);
      for (int o = 0; o < kOut; ++o) sum[o][t] = _mm512_fmadd_ps(wv[o], xv, sum[o][t]);
    }
  }
  for (int o = 0; o < kOut; ++o) {
    for (int t = 0; t < kRows; ++t) _mm512_storeu_ps(acc + (o * rows + t) * kLanes, sum[o][t]);
  }
}

// The x rows of one group of kOut decoded weight rows: 6 at a time (4 weight and 6 x vectors loaded per 24
// multiply-adds, 24 of the 32 registers holding sums), then 4, 2 and 1.
template <int kOut>
FASTDIST_AVX512 inline void fma_x_rows(const float* w, int64_t w_stride, const float* xp, int64_t rows, int64_t kp,
                                       int64_t c0, int64_t len, float* acc) {
  int64_t m = 0;
  for (; m + 6 <= rows; m += 6) fma_block<kOut, 6>(w, w_stride, xp + m * kp + c0, kp, len, acc + m * kLanes, rows);
  if (m + 4 <= rows) {
    fma_block<kOut, 4>(w, w_stride, xp + m * kp + c0, kp, len, acc + m * kLanes, rows);
    m += 4;
  }
  if (m + 2 <= rows) {
    fma_block<kOut, 2>(w, w_stride, xp + m * kp + c0, kp, len, acc + m * kLanes, rows);
    m += 2;
  }
  if (m < rows) fma_block<kOut, 1>(w, w_stride, xp + m * kp + c0, kp, len, acc + m * kLanes, rows);
}

// Output rows decoded together on the buffered path, so that each x vector loaded feeds this many multiply-adds.
constexpr int64_t kOutBlock = 4;
// Columns decoded at a time on the buffered path: whole groups, 384 (x's chunk of 16 rows is then 24 KiB, in L1).
constexpr int64_t kChunk = 12 * kGroup;

FASTDIST_AVX512 void qlinear_avx512_impl(const float* x, int64_t rows, int64_t k, const uint8_t* packed,
                                         const float* scales, const float* zeros, int64_t n, int64_t block,
                                         int64_t block_rows, Quant4Scheme scheme, const float* bias, float* out,
                                         int64_t row_begin, int64_t row_end) {
  if (rows == 0 || row_begin >= row_end) return;
  const int64_t kp = (k + kGroup - 1) / kGroup * kGroup;
  std::vector<float> xp(static_cast<size_t>(std::max<int64_t>(rows * kp, 1)));
  deinterleave_x(x, rows, k, kp, xp.data());
  const int64_t groups = k > 0 ? k / block : 0;
  const GroupDecode how = group_decode(block);
  const DecodeSetup setup = decode_setup(scheme, block);
  const auto decoder = [&](int64_t r) {
    const int64_t at = (r / block_rows) * groups;
    return RowDecoder{packed + r * (k / 2), scales + at, zeros ? zeros + at : nullptr, block,
                      scheme == Quant4Scheme::kInt4, how};
  };
  const auto finish = [&](int64_t r, int64_t m, const float* lane_sums) {
    out[m * n + r] = reduce_lanes(lane_sums) + (bias ? bias[r] : 0.0f);
  };
  if (rows <= kDirectRows) {
    float lane_sums[kDirectOut * kDirectRows * kLanes];
    int64_t r = row_begin;
    for (; r + kDirectOut <= row_end; r += kDirectOut) {
      RowDecoder dec[kDirectOut];
      for (int o = 0; o < kDirectOut; ++o) dec[o] = decoder(r + o);
      direct_dispatch<kDirectOut>(dec, setup, xp.data(), rows, k, kp, lane_sums);
      for (int o = 0; o < kDirectOut; ++o) {
        for (int64_t m = 0; m < rows; ++m) finish(r + o, m, lane_sums + (o * rows + m) * kLanes);
      }
    }
    for (; r < row_end; ++r) {
      const RowDecoder dec = decoder(r);
      direct_dispatch<1>(&dec, setup, xp.data(), rows, k, kp, lane_sums);
      for (int64_t m = 0; m < rows; ++m) finish(r, m, lane_sums + m * kLanes);
    }
    return;
  }
  const int64_t w_stride = kChunk + 16;
  std::vector<float> w(static_cast<size_t>(kOutBlock * w_stride));
  // lanes of (output row r - r0, x row m) at ((r - r0) * rows + m) * kLanes
  std::vector<float> lanes(static_cast<size_t>(kTileRows * rows * kLanes));
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
    const int64_t r1 = std::min(row_end, r0 + kTileRows);
    std::fill(lanes.begin(), lanes.end(), 0.0f);
    for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
      const int64_t c1 = std::min(k, c0 + kChunk);
      const int64_t len = (c1 - c0 + kGroup - 1) / kGroup * kGroup;
      for (int64_t r = r0; r < r1; r += kOutBlock) {
        const int64_t count = std::min(kOutBlock, r1 - r);
        for (int64_t o = 0; o < count; ++o) {
          const RowDecoder dec = decoder(r + o);
          float* row_w = w.data() + o * w_stride;
          for (int64_t c = c0; c < c1; c += kGroup) {
            __m512 even, odd;
            dec.group(setup, c, std::min(kGroup, c1 - c), even, odd);
            _mm512_storeu_ps(row_w + (c - c0), even);
            _mm512_storeu_ps(row_w + (c - c0) + 16, odd);
          }
        }
        float* acc = lanes.data() + (r - r0) * rows * kLanes;
        if (count == kOutBlock) {
          fma_x_rows<kOutBlock>(w.data(), w_stride, xp.data(), rows, kp, c0, len, acc);
        } else {
          for (int64_t o = 0; o < count; ++o) {
            fma_x_rows<1>(w.data() + o * w_stride, w_stride, xp.data(), rows, kp, c0, len, acc + o * rows * kLanes);
          }
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t m = 0; m < rows; ++m) finish(r, m, lanes.data() + ((r - r0) * rows + m) * kLanes);
    }
  }
}

FASTDIST_AVX512 void dequantize_avx512(const uint8_t* packed, const float* scales, const float* zeros, int64_t k,
                                       int64_t block, int64_t block_rows, Quant4Scheme scheme, float* out,
                                       int64_t row_begin, int64_t row_end) {
  const int64_t groups = k / block;
  const DecodeSetup setup = decode_setup(scheme, block);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t at = (r / block_rows) * groups;
    decode_avx512(packed + r * (k / 2), scales + at, zeros ? zeros + at : nullptr, block, scheme, setup, 0, k,
                  out + (r - row_begin) * k);
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
#ifdef FASTDIST_QUANT4_AVX512
  if (use_avx512(path)) return dequantize_avx512(packed, scales, zeros, k, block, block_rows, scheme, out, row_begin,
                                                 row_end);
#endif
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t at = (r / block_rows) * groups;
    decode_portable(packed + r * (k / 2), scales + at, zeros ? zeros + at : nullptr, block, scheme, 0, k,
                    out + (r - row_begin) * k);
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
