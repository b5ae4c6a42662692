// CPU magnitude TopK by radix select (see topk.h for the definition and the output order).
//
// Per row, streaming passes and no sort. The first builds a histogram of the key's top 11 bits (four interleaved
// sub-histograms, so consecutive increments of one bucket do not wait on each other's store). On CPUs with AVX2 two
// more passes follow, compactions of eight lanes at a time (compare, movemask, a permutation from a 256-entry
// table, one unaligned store): one collects the keys of the chosen bucket (the candidates), whose two histograms
// (bits 10..19, then 0..9) pin the threshold key T; the last writes every value with key > T, and the first ties
// with key == T, in index order. On a long row the first pass reads only a sample (1/8 of the row), which points
// at a few buckets; the collecting pass keeps their keys, counts the keys above them and checks that the k-th
// largest is among them (else the row is done again from a full histogram). Without AVX2 one pass writes, by
// branch-free compaction, the positions of every value in a higher bucket (all kept) and the keys and positions of
// the candidates; the kept candidates are compacted in place, and the two ascending position lists are merged while
// the values are read.
#include "kernels/topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FASTDIST_TOPK_AVX2 1
#include <immintrin.h>
#endif

namespace fastdist {
namespace {

inline uint32_t magnitude_key(const float* x, int64_t i) {
  uint32_t u;
  std::memcpy(&u, x + i, sizeof u);
  return topk_key(u);
}

// The bucket holding the `need`-th largest element (1-based) of a histogram scanned from the top, and how many of
// that bucket's elements are still needed once every larger bucket is taken.
struct Pick {
  uint32_t bucket;
  int64_t need;
};

inline Pick pick_from_top(const uint32_t* hist, int buckets, int64_t need) {
  for (int b = buckets - 1; b > 0; --b) {
    if (need <= static_cast<int64_t>(hist[b])) return {static_cast<uint32_t>(b), need};
    need -= hist[b];
  }
  return {0, need};
}

// The threshold key T of a row whose top-11-bit bucket `bucket` holds its `need` largest remaining keys, from the
// candidate keys of that bucket: a histogram of bits [10, 20), then one of bits [0, 10) of the chosen sub-bucket.
// *ties = how many values with key == T are kept.
uint32_t threshold_from_candidates(const uint32_t* keys, int64_t n, uint32_t bucket, int64_t need, int64_t* ties) {
  uint32_t small[kTopkPass23Buckets];
  std::memset(small, 0, sizeof small);
  for (int64_t c = 0; c < n; ++c) ++small[(keys[c] >> kTopkPass2Shift) & (kTopkPass23Buckets - 1)];
  const Pick p2 = pick_from_top(small, kTopkPass23Buckets, need);
  std::memset(small, 0, sizeof small);
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t key = keys[c];
    small[key & (kTopkPass23Buckets - 1)] += ((key >> kTopkPass2Shift) & (kTopkPass23Buckets - 1)) == p2.bucket;
  }
  const Pick p3 = pick_from_top(small, kTopkPass23Buckets, p2.need);
  *ties = p3.need;
  return (bucket << kTopkPass1Shift) | (p2.bucket << kTopkPass2Shift) | p3.bucket;
}

// The set positions of bitmap row `row` (d bits) from byte `b` on, appended at n of idx [k] (past k only counted);
// returns the count of set bits, n included. Bits past d are ignored.
int64_t bitmap_row_to_indices_scalar(const uint8_t* row, int64_t b, int64_t d, int64_t k, int32_t* idx, int64_t n) {
  const int64_t bytes = packed_bytes(d);
  for (; b < bytes; b += 8) {
    const int64_t len = std::min<int64_t>(8, bytes - b);
    uint64_t word = 0;
    std::memcpy(&word, row + b, len);  // little-endian: byte b + t is bits 8t..8t+7
    const int64_t valid = d - 8 * b;   // bits of this word that are positions < d
    if (valid < 64) word &= (uint64_t{1} << valid) - 1;
    while (word) {
      if (n < k) idx[n] = static_cast<int32_t>(8 * b + __builtin_ctzll(word));
      ++n;
      word &= word - 1;
    }
  }
  return n;
}

#ifdef FASTDIST_TOPK_AVX2
// Keys of x[begin, end) whose top-11-bit bucket is in [lo, hi], appended to keys[n...]; returns the new n and adds
// the count of keys in higher buckets to *n_above.
int64_t collect_scalar(const float* __restrict x, int64_t begin, int64_t end, uint32_t lo, uint32_t hi,
                       uint32_t* __restrict keys, int64_t n, int64_t* n_above) {
  int64_t above = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = magnitude_key(x, i);
    const uint32_t b = key >> kTopkPass1Shift;
    keys[n] = key;
    n += (b >= lo) & (b <= hi);
    above += b > hi;
  }
  *n_above += above;
  return n;
}

// Values and positions of x[begin, end) with key > T, or key == T while *ties_left > 0, appended at j of
// values/indices [k]; returns the new j. Stops at j == k: the row has no more kept values, and the branch-free
// store must not pass the row's end.
int64_t emit_scalar(const float* __restrict x, int64_t begin, int64_t end, int64_t k, uint32_t threshold,
                    int64_t* ties_left, float* __restrict values, int32_t* __restrict indices, int64_t j) {
  int64_t left = *ties_left;
  for (int64_t i = begin; i < end && j < k; ++i) {
    const uint32_t key = magnitude_key(x, i);
    const int64_t equal = key == threshold;
    const int64_t take = (key > threshold) | (equal & (left > 0));
    values[j] = x[i];
    indices[j] = static_cast<int32_t>(i);
    j += take;
    left -= equal & take;
  }
  *ties_left = left;
  return j;
}

// kCompact[m]: the positions of the set bits of the 8-bit mask m, ascending, then padding: the permutation that
// moves the selected lanes of a vector to its front, in order.
struct CompactTable {
  alignas(32) int32_t lanes[256][8];
  CompactTable() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int l = 0; l < 8; ++l) {
        if (m & (1 << l)) lanes[m][n++] = l;
      }
      while (n < 8) lanes[m][n++] = 0;
    }
  }
};
const CompactTable kCompact;

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// As collect_scalar over x[0, d), eight keys at a time. keys has room for d entries: a store of eight lanes at n
// never passes i + 8 <= d, since n <= i.
__attribute__((target("avx2,popcnt"))) int64_t collect_avx2(const float* x, int64_t d, uint32_t lo, uint32_t hi,
                                                             uint32_t* keys, int64_t* n_above) {
  const __m256i magnitude = _mm256_set1_epi32(static_cast<int>(kTopkMagnitudeMask));
  const __m256i nan_key = _mm256_set1_epi32(static_cast<int>(kTopkNanKey));
  const __m256i below_lo = _mm256_set1_epi32(static_cast<int>(lo) - 1);
  const __m256i top = _mm256_set1_epi32(static_cast<int>(hi));
  int64_t n = 0, above = 0, i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256i key = _mm256_min_epu32(
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude), nan_key);
    const __m256i b = _mm256_srli_epi32(key, kTopkPass1Shift);
    const __m256i higher = _mm256_cmpgt_epi32(b, top);
    const __m256i hit = _mm256_andnot_si256(higher, _mm256_cmpgt_epi32(b, below_lo));
    const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(hit)));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompact.lanes[m]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + n), _mm256_permutevar8x32_epi32(key, perm));
    n += __builtin_popcount(m);
    above += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(higher))));
  }
  *n_above += above;
  return collect_scalar(x, i, d, lo, hi, keys, n, n_above);
}

// The bucket range that a sample of the row places its k-th largest key in: the top-11-bit histogram of blocks of
// kSampleBlock values every kSampleStride (1/8 of the row, every part of it), read between the sample ranks
// k * (sampled / d) -+ a margin of four binomial standard deviations (at least 1/8 of the rank, at least 16). The
// caller checks the guess against the whole row; it only decides how much of the row is kept as candidates.
constexpr int64_t kSampleBlock = 64, kSampleStride = 512;

void guess_bucket_range(const float* x, int64_t d, int64_t k, uint32_t* lo, uint32_t* hi) {
  uint32_t hist[kTopkPass1Buckets];
  std::memset(hist, 0, sizeof hist);
  int64_t sampled = 0;
  for (int64_t b = 0; b + kSampleBlock <= d; b += kSampleStride) {
    for (int64_t i = b; i < b + kSampleBlock; ++i) ++hist[magnitude_key(x, i) >> kTopkPass1Shift];
    sampled += kSampleBlock;
  }
  const double rank = static_cast<double>(k) * sampled / d;
  const double margin = std::max({4.0 * std::sqrt(rank), rank / 8, 16.0});
  const int64_t first = std::max<int64_t>(1, static_cast<int64_t>(rank - margin));
  const int64_t last = static_cast<int64_t>(rank + margin) + 1;
  *hi = kTopkPass1Buckets - 1;
  *lo = 0;
  int64_t seen = 0;
  for (int b = kTopkPass1Buckets - 1; b >= 0; --b) {
    const int64_t before = seen;
    seen += hist[b];
    if (before < first && seen >= first) *hi = static_cast<uint32_t>(b);
    if (before < last && seen >= last) {
      *lo = static_cast<uint32_t>(b);
      break;
    }
  }
}

// As emit_scalar over x[0, d) into values/indices [k], eight values at a time. A group holding a key equal to T
// goes through emit_scalar (the tie rule counts them one by one), and so does the rest of the row once an
// eight-lane store could pass k.
__attribute__((target("avx2,popcnt"))) void emit_avx2(const float* x, int64_t d, int64_t k, uint32_t threshold,
                                                      int64_t ties, float* values, int32_t* indices) {
  const __m256i magnitude = _mm256_set1_epi32(static_cast<int>(kTopkMagnitudeMask));
  const __m256i nan_key = _mm256_set1_epi32(static_cast<int>(kTopkNanKey));
  const __m256i t = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t j = 0, i = 0;
  for (; i + 8 <= d && j + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i key = _mm256_min_epu32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), nan_key);
    const unsigned above = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, t))));
    const unsigned equal = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(key, t))));
    if (equal) {
      j = emit_scalar(x, i, i + 8, k, threshold, &ties, values, indices, j);
      continue;
    }
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompact.lanes[above]));
    _mm256_storeu_ps(values + j, _mm256_permutevar8x32_ps(v, perm));
    const __m256i pos = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(indices + j), _mm256_permutevar8x32_epi32(pos, perm));
    j += __builtin_popcount(above);
  }
  emit_scalar(x, i, d, k, threshold, &ties, values, indices, j);
}

// The start of bitmap_row_to_indices_scalar, a byte at a time: the set positions of byte b are the compaction
// table's row for it, plus 8b. Stops before a byte with bits past d or whose eight-lane store could pass k; returns
// the byte to go on from, *n the positions written.
__attribute__((target("avx2,popcnt"))) int64_t bitmap_row_to_indices_avx2(const uint8_t* row, int64_t d, int64_t k,
                                                                           int32_t* idx, int64_t* n) {
  int64_t j = 0, b = 0;
  for (; b < d / 8 && j + 8 <= k; ++b) {
    const unsigned m = row[b];
    const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompact.lanes[m]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + j),
                        _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(8 * b))));
    j += __builtin_popcount(m);
  }
  *n = j;
  return b;
}
#endif  // FASTDIST_TOPK_AVX2

struct Scratch {
  uint32_t* keys;  // d entries: keys of the chosen bucket's candidates
  int32_t* pos;    // d entries: their positions
  int32_t* above;  // d entries: positions of the values in higher buckets (all kept)
};

void select_row(const float* __restrict x, int64_t d, int64_t k, float* __restrict values,
                int32_t* __restrict indices, Scratch s) {
#ifdef FASTDIST_TOPK_AVX2
  // A long row: the candidates are the keys of the bucket range a sample points at, if the k-th largest key is
  // among them (it almost always is); they then take a histogram of their own instead of the whole row.
  if (has_avx2() && d >= 16 * kSampleStride) {
    uint32_t lo = 0, hi = 0;
    guess_bucket_range(x, d, k, &lo, &hi);
    int64_t n_above = 0;
    const int64_t n = collect_avx2(x, d, lo, hi, s.keys, &n_above);
    if (n_above < k && k <= n_above + n) {
      uint32_t hist[kTopkPass1Buckets];
      std::memset(hist, 0, sizeof hist);
      for (int64_t c = 0; c < n; ++c) ++hist[s.keys[c] >> kTopkPass1Shift];
      int64_t need = 0;
      const uint32_t bucket = topk_pick_bucket(hist, k - n_above, &need);
      int64_t m = 0;
      for (int64_t c = 0; c < n; ++c) {
        s.keys[m] = s.keys[c];
        m += (s.keys[c] >> kTopkPass1Shift) == bucket;
      }
      int64_t ties = 0;
      const uint32_t threshold = threshold_from_candidates(s.keys, m, bucket, need, &ties);
      emit_avx2(x, d, k, threshold, ties, values, indices);
      return;
    }
  }
#endif
  uint32_t hist[kTopkPass1Buckets];
  std::memset(hist, 0, sizeof hist);
  topk_histogram_cpu(x, 0, d, hist);
  int64_t need = 0;
  const uint32_t bucket = topk_pick_bucket(hist, k, &need);
#ifdef FASTDIST_TOPK_AVX2
  if (has_avx2()) {
    int64_t ties = 0, n_above = 0;
    const int64_t n = collect_avx2(x, d, bucket, bucket, s.keys, &n_above);
    const uint32_t threshold = threshold_from_candidates(s.keys, n, bucket, need, &ties);
    emit_avx2(x, d, k, threshold, ties, values, indices);
    return;
  }
#endif
  // Without AVX2: the two lists in one pass, then their merge (faster in scalar code than a third pass).
  int64_t n_above = 0, n = 0;
  topk_partition_cpu(x, 0, d, bucket, s.above, &n_above, s.keys, s.pos, &n);
  topk_finish_cpu(x, k, need, bucket, s.above, n_above, s.keys, s.pos, n, values, indices);
}

}  // namespace

void topk_histogram_cpu(const float* x, int64_t begin, int64_t end, uint32_t* hist) {
  // Four interleaved sub-histograms, so that consecutive increments of one bucket do not wait on each other.
  uint32_t hist4[4][kTopkPass1Buckets];
  std::memset(hist4, 0, sizeof hist4);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    ++hist4[0][magnitude_key(x, i) >> kTopkPass1Shift];
    ++hist4[1][magnitude_key(x, i + 1) >> kTopkPass1Shift];
    ++hist4[2][magnitude_key(x, i + 2) >> kTopkPass1Shift];
    ++hist4[3][magnitude_key(x, i + 3) >> kTopkPass1Shift];
  }
  for (; i < end; ++i) ++hist4[0][magnitude_key(x, i) >> kTopkPass1Shift];
  for (int b = 0; b < kTopkPass1Buckets; ++b) hist[b] += hist4[0][b] + hist4[1][b] + hist4[2][b] + hist4[3][b];
}

uint32_t topk_pick_bucket(const uint32_t* hist, int64_t k, int64_t* need) {
  const Pick p = pick_from_top(hist, kTopkPass1Buckets, k);
  *need = p.need;
  return p.bucket;
}

void topk_partition_cpu(const float* x, int64_t begin, int64_t end, uint32_t bucket, int32_t* above,
                        int64_t* n_above, uint32_t* keys, int32_t* pos, int64_t* n_candidates) {
  // Branch-free compaction: always write, advance on a match.
  int64_t na = 0, n = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = magnitude_key(x, i);
    const uint32_t b = key >> kTopkPass1Shift;
    above[na] = static_cast<int32_t>(i);
    keys[n] = key;
    pos[n] = static_cast<int32_t>(i);
    na += b > bucket;
    n += b == bucket;
  }
  *n_above = na;
  *n_candidates = n;
}

void topk_finish_cpu(const float* x, int64_t k, int64_t need, uint32_t bucket, const int32_t* above, int64_t n_above,
                     uint32_t* keys, int32_t* pos, int64_t n, float* values, int32_t* indices) {
  int64_t ties = 0;
  const uint32_t threshold = threshold_from_candidates(keys, n, bucket, need, &ties);

  // The kept candidates: key > T, and the first `ties` with key == T (compacted in place, still ascending).
  int64_t equal_left = ties, m = 0;
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t key = keys[c];
    const int64_t equal = key == threshold;
    const int64_t take = (key > threshold) | (equal & (equal_left > 0));
    pos[m] = pos[c];
    m += take;
    equal_left -= equal & take;
  }

  // Merge the two ascending lists (n_above + m == k) and read the values.
  int64_t a = 0, c = 0;
  for (int64_t j = 0; j < k; ++j) {
    const bool from_above = c >= m || (a < n_above && above[a] < pos[c]);
    const int32_t p = from_above ? above[a++] : pos[c++];
    indices[j] = p;
    values[j] = x[p];
  }
}

int64_t topk_cpu_scratch_bytes(int64_t d) { return d * static_cast<int64_t>(sizeof(uint32_t) + 2 * sizeof(int32_t)); }

void topk_compress_cpu(const float* x, int64_t rows, int64_t d, int64_t k, float* values, int32_t* indices,
                       int64_t row_begin, int64_t row_end, void* scratch) {
  (void)rows;
  uint32_t* base = static_cast<uint32_t*>(scratch);
  Scratch s{base, reinterpret_cast<int32_t*>(base + d), reinterpret_cast<int32_t*>(base + 2 * d)};
  for (int64_t r = row_begin; r < row_end; ++r) {
    if (k == d) {  // everything, in order: no selection needed
      for (int64_t j = 0; j < d; ++j) {
        values[r * k + j] = x[r * d + j];
        indices[r * k + j] = static_cast<int32_t>(j);
      }
      continue;
    }
    select_row(x + r * d, d, k, values + r * k, indices + r * k, s);
  }
}

int64_t topk_decompress_cpu(const float* values, const int32_t* indices, int64_t rows, int64_t k, int64_t d,
                            float* out, int64_t row_begin, int64_t row_end) {
  (void)rows;
  if (d == 0 && k == 0) return 0;  // nothing to write, however many rows an empty tensor claims
  int64_t bad = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* __restrict row = out + r * d;
    if (d > 0) std::memset(row, 0, d * sizeof(float));  // d == 0: out may have no storage (memset of nullptr)
    const int32_t* idx = indices + r * k;
    const float* val = values + r * k;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = idx[j];
      if (p < 0 || p >= d) {
        ++bad;
        continue;
      }
      row[p] = val[j];
    }
  }
  return bad;
}

int64_t topk_indices_to_bitmap_cpu(const int32_t* indices, int64_t rows, int64_t k, int64_t d, uint8_t* bitmap,
                                   int64_t row_begin, int64_t row_end) {
  (void)rows;
  const int64_t bytes = packed_bytes(d);
  if (bytes == 0 && k == 0) return 0;  // nothing to write, however many rows an empty tensor claims
  int64_t bad_rows = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    uint8_t* row = bitmap + r * bytes;
    if (bytes > 0) std::memset(row, 0, bytes);  // d == 0: the bitmap may have no storage (memset of nullptr)
    const int32_t* idx = indices + r * k;
    int64_t previous = -1;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = idx[j];
      if (p <= previous || p >= d) {
        ++bad_rows;
        break;
      }
      row[p >> 3] |= static_cast<uint8_t>(1u << (p & 7));
      previous = p;
    }
  }
  return bad_rows;
}

int64_t topk_bitmap_to_indices_cpu(const uint8_t* bitmap, int64_t rows, int64_t k, int64_t d, int32_t* indices,
                                   int64_t row_begin, int64_t row_end) {
  (void)rows;
  const int64_t bytes = packed_bytes(d);
  if (bytes == 0 && k == 0) return 0;  // every row has its k = 0 bits, however many rows an empty tensor claims
  int64_t bad_rows = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = bitmap + r * bytes;
    int32_t* idx = indices + r * k;
    int64_t n = 0, b = 0;
#ifdef FASTDIST_TOPK_AVX2
    if (has_avx2()) b = bitmap_row_to_indices_avx2(row, d, k, idx, &n);
#endif
    bad_rows += bitmap_row_to_indices_scalar(row, b, d, k, idx, n) != k;
  }
  return bad_rows;
}

}  // namespace fastdist
