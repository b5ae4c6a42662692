// CPU bit packing. Single-threaded over the range it is given; the glue runs disjoint ranges in parallel.
//
// The inner loops work on whole packed bytes (8 mask bytes each). A portable path does 8 mask bytes at a
// time with 64-bit arithmetic; on x86 CPUs with AVX2 (checked at run time, so the build needs no -mavx2)
// pack and unpack do 32 mask bytes at a time and the OR loop uses 32-byte vectors, which is what keeps them
// near copy bandwidth.
#include "kernels/bitpack.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTDIST_BITPACK_AVX2 1
#define FASTDIST_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#include <immintrin.h>
#else
#define FASTDIST_AVX2_CLONES
#endif

namespace fastdist {
namespace {

constexpr uint64_t kLowBits = 0x0101010101010101ULL;

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store_u64(uint8_t* p, uint64_t x) { std::memcpy(p, &x, sizeof x); }

// 8 mask bytes (as a little-endian word) -> 1 packed byte. The multiply moves bit 0 of byte k to bit 56 + k;
// the partial products land on distinct bit positions, so no carries disturb the top byte.
inline uint8_t pack8(uint64_t x) { return static_cast<uint8_t>(((x & kLowBits) * 0x0102040810204080ULL) >> 56); }

// packed byte -> its 8 mask bytes as a little-endian word.
constexpr std::array<uint64_t, 256> make_unpack_table() {
  std::array<uint64_t, 256> table{};
  for (int byte = 0; byte < 256; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      if (byte & (1 << bit)) table[byte] |= uint64_t{1} << (8 * bit);
    }
  }
  return table;
}
constexpr std::array<uint64_t, 256> kUnpackTable = make_unpack_table();

// Whole packed bytes: `count` packed bytes <-> 8 * count mask bytes.
using PackFullFn = void (*)(const uint8_t* mask, uint8_t* out, int64_t count);
using UnpackFullFn = void (*)(const uint8_t* packed, uint8_t* out, int64_t count);

void pack_full_portable(const uint8_t* mask, uint8_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = pack8(load_u64(mask + 8 * i));
}

void unpack_full_portable(const uint8_t* packed, uint8_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) store_u64(out + 8 * i, kUnpackTable[packed[i]]);
}

#ifdef FASTDIST_BITPACK_AVX2
__attribute__((target("avx2"))) void pack_full_avx2(const uint8_t* mask, uint8_t* out, int64_t count) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + 8 * i));
    // Bit 0 of every byte to bit 7 (a 16-bit shift; what crosses into the neighbouring byte lands below
    // its bit 7 and is ignored), then movemask gathers the 32 bit-7s in order: byte k -> bit k.
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
    std::memcpy(out + i, &bits, sizeof bits);
  }
  pack_full_portable(mask + 8 * i, out + i, count - i);
}

__attribute__((target("avx2"))) void unpack_full_avx2(const uint8_t* packed, uint8_t* out, int64_t count) {
  // Output byte k of a 32-byte block takes packed byte k / 8 and tests bit k % 8 of it.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i one = _mm256_set1_epi8(1);
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    uint32_t word;
    std::memcpy(&word, packed + i, sizeof word);
    // Every 128-bit lane holds the 4 packed bytes, so the in-lane shuffle can reach bytes 2 and 3 too.
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word)), spread);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), _mm256_and_si256(set, one));
  }
  unpack_full_portable(packed + i, out + 8 * i, count - i);
}
#endif

PackFullFn pack_full() {
#ifdef FASTDIST_BITPACK_AVX2
  static const PackFullFn fn = __builtin_cpu_supports("avx2") ? pack_full_avx2 : pack_full_portable;
  return fn;
#else
  return pack_full_portable;
#endif
}

UnpackFullFn unpack_full() {
#ifdef FASTDIST_BITPACK_AVX2
  static const UnpackFullFn fn = __builtin_cpu_supports("avx2") ? unpack_full_avx2 : unpack_full_portable;
  return fn;
#else
  return unpack_full_portable;
#endif
}

// Packed bytes [j0, j1) of one row of `nbits` mask bytes.
void pack_row(const uint8_t* mask, int64_t nbits, uint8_t* out, int64_t j0, int64_t j1) {
  const int64_t full = nbits / 8;
  const int64_t full_end = std::min(j1, full);
  if (j0 < full_end) pack_full()(mask + 8 * j0, out + j0, full_end - j0);
  if (j1 > full) {  // the row's last byte is partial and in range; its padding bits stay zero
    uint8_t byte = 0;
    for (int64_t k = 8 * full; k < nbits; ++k) byte |= static_cast<uint8_t>((mask[k] & 1) << (k - 8 * full));
    out[full] = byte;
  }
}

void unpack_row(const uint8_t* packed, int64_t nbits, uint8_t* out, int64_t j0, int64_t j1) {
  const int64_t full = nbits / 8;
  const int64_t full_end = std::min(j1, full);
  if (j0 < full_end) unpack_full()(packed + j0, out + 8 * j0, full_end - j0);
  if (j1 > full) {
    for (int64_t k = 8 * full; k < nbits; ++k) out[k] = (packed[full] >> (k - 8 * full)) & 1;
  }
}

// acc[k] |= rows[r * stride + k] for r < count, k < len. Four rows per pass, so `acc` is loaded and stored once
// per four rows; the byte loops vectorize, with AVX2 where the CPU has it (a compiler-made run-time dispatch).
FASTDIST_AVX2_CLONES void or_rows_into(uint8_t* __restrict acc, const uint8_t* rows, int64_t stride, int64_t count,
                                       int64_t len) {
  int64_t r = 0;
  for (; r + 4 <= count; r += 4) {
    const uint8_t* __restrict a = rows + r * stride;
    const uint8_t* __restrict b = a + stride;
    const uint8_t* __restrict c = b + stride;
    const uint8_t* __restrict d = c + stride;
    for (int64_t k = 0; k < len; ++k) acc[k] |= a[k] | b[k] | c[k] | d[k];
  }
  for (; r < count; ++r) {
    const uint8_t* __restrict a = rows + r * stride;
    for (int64_t k = 0; k < len; ++k) acc[k] |= a[k];
  }
}

// Calls row_fn(row, nbits, j0, j1) for each row the flat packed-byte range [b0, b1) touches, with the row's part
// of the range. When n % 8 == 0 rows end on byte boundaries, so the whole array is one row of rows * n bits.
template <typename RowFn>
void for_each_row_part(int64_t rows, int64_t n, int64_t b0, int64_t b1, RowFn row_fn) {
  if (b0 >= b1) return;
  if (n % 8 == 0 || rows == 1) {
    row_fn(0, rows * n, b0, b1);
    return;
  }
  const int64_t row_bytes = packed_bytes(n);
  for (int64_t r = b0 / row_bytes; r * row_bytes < b1; ++r) {
    row_fn(r, n, std::max<int64_t>(b0 - r * row_bytes, 0), std::min<int64_t>(b1 - r * row_bytes, row_bytes));
  }
}

}  // namespace

void pack_bits_cpu(const uint8_t* mask, int64_t rows, int64_t n, uint8_t* out, int64_t byte_begin,
                   int64_t byte_end) {
  const int64_t row_bytes = packed_bytes(n);
  for_each_row_part(rows, n, byte_begin, byte_end, [&](int64_t r, int64_t nbits, int64_t j0, int64_t j1) {
    pack_row(mask + r * n, nbits, out + r * row_bytes, j0, j1);
  });
}

void unpack_bits_cpu(const uint8_t* packed, int64_t rows, int64_t n, uint8_t* out, int64_t byte_begin,
                     int64_t byte_end) {
  const int64_t row_bytes = packed_bytes(n);
  for_each_row_part(rows, n, byte_begin, byte_end, [&](int64_t r, int64_t nbits, int64_t j0, int64_t j1) {
    unpack_row(packed + r * row_bytes, nbits, out + r * n, j0, j1);
  });
}

void bitwise_or_reduce_cpu(const uint8_t* packed, int64_t p, int64_t b, uint8_t* out, int64_t col_begin,
                           int64_t col_end) {
  // Column blocks small enough that the block of `out` stays in L1 while every row is ORed into it.
  constexpr int64_t kBlock = 8192;
  for (int64_t c0 = col_begin; c0 < col_end; c0 += kBlock) {
    const int64_t len = std::min(kBlock, col_end - c0);
    std::memset(out + c0, 0, len);
    or_rows_into(out + c0, packed + c0, b, p, len);
  }
}

void bitmap_from_indices_cpu(const int64_t* indices, int64_t n, uint8_t* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t u = static_cast<uint64_t>(indices[i]);
    if (u >= static_cast<uint64_t>(n)) continue;  // also every negative index
    __atomic_fetch_or(out + (u >> 3), static_cast<uint8_t>(1u << (u & 7)), __ATOMIC_RELAXED);
  }
}

int64_t first_index_out_of_range(const int64_t* indices, int64_t k, int64_t n) {
  for (int64_t i = 0; i < k; ++i) {
    if (static_cast<uint64_t>(indices[i]) >= static_cast<uint64_t>(n)) return i;
  }
  return -1;
}

}  // namespace fastdist
