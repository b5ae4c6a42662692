// Count-sketch: nonzero bitmaps, sketching a tensor into a small table, and decoding it back.
//
// A tensor of N values is viewed as `n` units (rows) of `m` values, N = n * m, row-major: value `col` of unit
// `u` has the flat index i = u * m + col. Row granularity is an embedding gradient [vocab, dim] seen as
// n = vocab units of m = dim values; element granularity is n = N units of m = 1.
//
// A support is a packed bitmap of units, uint8 [ceil(n / 8)], in pack_bits' bit order (bitpack.h): bit j of
// byte k is unit 8 * k + j. Padding bits past n are ignored.
//
// ---- The hash family (the one definition: CPU kernels, CUDA kernels and the sketch_hash op all use it) ----
//
//   p = 2^61 - 1 (a Mersenne prime).
//   Per sketch row j < rows, four coefficients, drawn from a splitmix64 stream (splitmix64.h) seeded with `seed`:
//       state = seed;  next() = splitmix64_next(state)
//       for j = 0, 1, ..., rows - 1 in turn:
//           a_j = 1 + next() % (p - 1);   b_j = next() % p;       (bucket hash, a_j in [1, p-1], b_j in [0, p-1])
//           c_j = 1 + next() % (p - 1);   d_j = next() % p;       (sign hash, same ranges)
//   and a fifth, g_j = 1 + next() % (p - 1) (column sign), from a second such stream seeded with
//   seed ^ kSketchColumnSeed, again for j = 0, 1, ... in turn. So row j's coefficients do not depend on `rows` (a
//   3-row sketch is the first 3 rows of a 5-row one) nor on `cols`.
//
//   Value `col` of unit u (flat index i = u * m + col; u and col any 64-bit values, the ops pass them < 2^63):
//       bucket  h_j(u, col) = (((a_j * u + b_j) mod p) mod cols + col) mod cols
//       sign    s_j(u, col) = -1 if bit kSketchSignBit (= 30) of (c_j * u + d_j) mod p
//                             XOR bit kSketchSignBit of (g_j * col) mod p is set, else +1
//   A unit's values land on consecutive buckets (cyclically) from a hashed start, each with its own sign. For m = 1
//   (element granularity: u = i, col = 0) this is the textbook count-sketch hash h_j(i) = ((a_j i + b_j) mod p)
//   mod cols, s_j(i) from (c_j i + d_j) mod p. For m > 1 it keeps what the count-sketch's error bound uses:
//   two values of different units share a bucket with probability 1/cols and then have independent signs (the
//   unit hashes are pairwise independent), and two values of one unit share one only when cols < m, with
//   independent column signs. So each estimate's variance is that of the per-value hash; errors within a unit are
//   correlated instead of independent (measured: the same relative L2 error on Zipf-weighted embedding rows). It
//   buys a sketch and a decode that stream a unit into a contiguous window of each table row (vector adds and
//   loads) instead of scattering every value at random: several times faster on a CPU (bench/README.md), coalesced
//   atomics on a GPU.
//   Bit 30 rather than bit 0: every bit of a value uniform on [0, p) is within 2^-31 of fair, and a middle bit
//   keeps that true even when the inputs are structured (consecutive indices step the value by c_j mod p).
//   Products are exact: 64 x 64 -> 128-bit multiply (unsigned __int128 on the host, __umul64hi on the device)
//   and Mersenne reduction x mod p = (x & p) + (x >> 61), then one conditional subtract.
//
// ---- The ops ----
//   table[j, h_j(u, col)] = sum over sketched values of s_j(u, col) * x, in float32, summed in increasing flat index
//   (CPU). decode: estimate = median over j of s_j(u, col) * table[j, h_j(u, col)] (sketch_median below).
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous and row-major.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/bitpack.h"
#include "kernels/float_bits.h"
#include "kernels/splitmix64.h"

namespace fastdist {

constexpr uint64_t kSketchPrime = (uint64_t{1} << 61) - 1;
constexpr int kSketchMaxRows = 15;
constexpr int64_t kSketchMaxCols = (int64_t{1} << 31) - 1;  // buckets fit 31 bits (the CPU kernel packs a sign bit)
constexpr int kSketchSignBit = 30;
constexpr uint64_t kSketchColumnSeed = 0x243F6A8885A308D3ULL;  // the column-sign stream's seed: seed ^ this

// v with its sign flipped where `sign_mask` is 0x80000000 (unchanged where it is 0): a negation by XOR, which keeps a
// NaN's payload (a negation may canonicalize it), the same bits on host and device.
FASTDIST_HOST_DEVICE inline float xor_sign(float v, uint32_t sign_mask) {
  return float_from_bits(bits_of_float(v) ^ sign_mask);
}

// ---- exact modular arithmetic mod p = 2^61 - 1 ----

// x mod p for any 64-bit x: x = hi * 2^61 + lo = hi + lo (mod p), hi + lo < p + 8, then one subtract.
FASTDIST_HOST_DEVICE inline uint64_t sketch_mod_p(uint64_t x) {
  const uint64_t folded = (x & kSketchPrime) + (x >> 61);
  return folded >= kSketchPrime ? folded - kSketchPrime : folded;
}

// High 64 bits of the 128-bit product a * b.
FASTDIST_HOST_DEVICE inline uint64_t sketch_mulhi(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// a * x mod p for a, x < p. The product is < 2^122 = hi * 2^64 + lo; split it at bit 61 instead:
// low 61 bits (lo & p) + the rest ((hi << 3) | (lo >> 61)), each < 2^61, so the sum is < 2^62.
FASTDIST_HOST_DEVICE inline uint64_t sketch_mulmod(uint64_t a, uint64_t x) {
  const uint64_t lo = a * x;
  const uint64_t hi = sketch_mulhi(a, x);
  return sketch_mod_p((lo & kSketchPrime) + ((hi << 3) | (lo >> 61)));
}

// (a * i + b) mod p for a, b < p and any 64-bit i.
FASTDIST_HOST_DEVICE inline uint64_t sketch_affine(uint64_t a, uint64_t b, uint64_t i) {
  const uint64_t v = sketch_mulmod(a, sketch_mod_p(i)) + b;  // < 2p
  return v >= kSketchPrime ? v - kSketchPrime : v;
}

// x mod d without a division, for x < 2^62 and 1 <= d < 2^32, given inv = floor((2^64 - 1) / d):
// q = mulhi(x, inv) is floor(x / d) or one less, so x - q * d is in [0, 2d).
FASTDIST_HOST_DEVICE inline uint64_t sketch_fastmod(uint64_t x, uint64_t d, uint64_t inv) {
  const uint64_t r = x - sketch_mulhi(x, inv) * d;
  return r >= d ? r - d : r;
}

// The coefficients of one sketch (computed on the host once per call, passed to kernels by value).
struct SketchHash {
  int32_t rows;        // 1..kSketchMaxRows
  int64_t cols;        // 1..kSketchMaxCols
  uint64_t cols_inv;   // floor((2^64 - 1) / cols), for sketch_fastmod
  uint64_t a[kSketchMaxRows], b[kSketchMaxRows], c[kSketchMaxRows], d[kSketchMaxRows], g[kSketchMaxRows];

  // Where unit u's window starts in row j: ((a_j u + b_j) mod p) mod cols.
  FASTDIST_HOST_DEVICE int64_t start(int j, uint64_t u) const {
    return static_cast<int64_t>(sketch_fastmod(sketch_affine(a[j], b[j], u), static_cast<uint64_t>(cols), cols_inv));
  }
  // The unit's sign: bit kSketchSignBit of (c_j u + d_j) mod p.
  FASTDIST_HOST_DEVICE bool unit_negative(int j, uint64_t u) const {
    return (sketch_affine(c[j], d[j], u) >> kSketchSignBit) & 1;
  }
  // The column's sign: bit kSketchSignBit of (g_j col) mod p (0 for col 0).
  FASTDIST_HOST_DEVICE bool column_negative(int j, uint64_t col) const {
    return (sketch_mulmod(g[j], sketch_mod_p(col)) >> kSketchSignBit) & 1;
  }
  // (start + col) mod cols for a window start in [0, cols): the bucket of column col of a unit starting there.
  // Columns within one row width (the common case) need no division.
  FASTDIST_HOST_DEVICE int64_t window_bucket(int64_t start, uint64_t col) const {
    const uint64_t c = static_cast<uint64_t>(cols);
    const uint64_t offset = col < c ? col : col < (uint64_t{1} << 62) ? sketch_fastmod(col, c, cols_inv) : col % c;
    const uint64_t b = static_cast<uint64_t>(start) + offset;  // < 2 cols
    return static_cast<int64_t>(b >= c ? b - c : b);
  }
  // h_j(u, col)
  FASTDIST_HOST_DEVICE int64_t bucket(int j, uint64_t u, uint64_t col) const { return window_bucket(start(j, u), col); }
  // s_j(u, col) == -1
  FASTDIST_HOST_DEVICE bool negative(int j, uint64_t u, uint64_t col) const {
    return unit_negative(j, u) != column_negative(j, col);
  }
};

// The hash of a sketch with `rows` rows (1..kSketchMaxRows) and `cols` columns (1..kSketchMaxCols); the caller
// checks the ranges. Unused rows' coefficients are zero.
inline SketchHash make_sketch_hash(uint64_t seed, int rows, int64_t cols) {
  SketchHash h{};
  h.rows = rows;
  h.cols = cols;
  h.cols_inv = ~uint64_t{0} / static_cast<uint64_t>(cols);
  uint64_t state = seed;
  for (int j = 0; j < rows; ++j) {
    h.a[j] = 1 + splitmix64_next(state) % (kSketchPrime - 1);
    h.b[j] = splitmix64_next(state) % kSketchPrime;
    h.c[j] = 1 + splitmix64_next(state) % (kSketchPrime - 1);
    h.d[j] = splitmix64_next(state) % kSketchPrime;
  }
  uint64_t column_state = seed ^ kSketchColumnSeed;
  for (int j = 0; j < rows; ++j) h.g[j] = 1 + splitmix64_next(column_state) % (kSketchPrime - 1);
  return h;
}

// The decode estimate from the `rows` signed table values v[0..rows): their median; for an even count the mean
// of the two middle values, computed as 0.5f * lo + 0.5f * hi. When any value is NaN, the first NaN. Reorders v.
// Written with plain comparisons (not fminf/fmaxf) so that host and device give the same bits (0.5f * x is exact
// but for subnormals, so a compiler's fused multiply-add changes nothing else).
FASTDIST_HOST_DEVICE inline float sketch_median(float* v, int rows) {
  for (int k = 0; k < rows; ++k) {
    if (v[k] != v[k]) return v[k];  // the first NaN
  }
  if (rows == 1) return v[0];
  if (rows == 3) {  // the common case, without the sort
    const float lo = v[0] < v[1] ? v[0] : v[1];
    const float hi = v[0] < v[1] ? v[1] : v[0];
    const float mid = hi < v[2] ? hi : v[2];
    return lo < mid ? mid : lo;
  }
  for (int k = 1; k < rows; ++k) {  // insertion sort: rows <= 15
    const float x = v[k];
    int t = k - 1;
    while (t >= 0 && x < v[t]) {
      v[t + 1] = v[t];
      --t;
    }
    v[t + 1] = x;
  }
  return rows % 2 ? v[rows / 2] : 0.5f * v[rows / 2 - 1] + 0.5f * v[rows / 2];
}

// ---- CPU: single-threaded over a sub-range, so the caller can run disjoint ranges in parallel. ----

// x: `n` units of `m` values, each `elem_bytes` (2, 4 or 8) wide, read as raw bits: a value is non-zero when any
// bit other than the sign bit is set (so -0.0 is zero; NaN, infinities and subnormals are non-zero). out: the
// packed support, bit u set when unit u has a non-zero value; writes out bytes [byte_begin, byte_end)
// (0 <= byte_begin <= byte_end <= packed_bytes(n)), with padding bits zero.
void nonzero_bitmap_cpu(const void* x, int elem_bytes, int64_t n, int64_t m, uint8_t* out, int64_t byte_begin,
                        int64_t byte_end);

// Sketch the table positions [begin, end) (0 <= begin <= end <= hash.rows * hash.cols; position j * cols + b is
// bucket b of row j) of the table (float32 [hash.rows, hash.cols]); overwrites them. For m == 1 the range must be
// whole rows (begin and end multiples of cols); for m > 1 any range, so that threads can share the buckets evenly.
// x: n * m values stored as `type` (the table and the decoded values are always float32). support: packed units
// (nullptr: every unit). Adds s_j(u, col) * x into table[j, h_j(u, col)] for every value of a supported unit, in
// increasing flat index, in float32 (float64 values are rounded to float32 first). Whether zero values are added or
// skipped changes no bit: adding a zero never changes a bucket (buckets start at +0.0 and round-to-nearest never
// makes a sum -0.0 from a +0.0 operand). So any split of the positions between calls gives the same table, bit for
// bit.
// m == 1 hashes each value per sketch row of the range; m > 1 hashes each unit once per row and adds its values
// into the row's window with vector adds, clipped to the range. Every call reads all the values it sketches.
void count_sketch_cpu(const void* x, StorageType type, int64_t n, int64_t m, const uint8_t* support,
                      const SketchHash& hash, float* table, int64_t begin, int64_t end);

// values: k units of m values of `type`, unit t being unit units[t] of a larger tensor (taken as unsigned 64-bit).
// The same table positions count_sketch_cpu writes from that tensor with the units' support, bit for bit, when
// units are strictly increasing (values are added in the order listed); the same range rules.
void count_sketch_units_cpu(const void* values, StorageType type, const int64_t* units, int64_t k, int64_t m,
                            const SketchHash& hash, float* table, int64_t begin, int64_t end);

// Decode units [unit_begin, unit_end) (0 <= unit_begin <= unit_end <= n) of out (float32 [n, m]): for each
// supported unit u, out[u * m + col] = sketch_median of s_j(u, col) * table[j, h_j(u, col)] over j < hash.rows;
// other units are 0.
void count_sketch_decode_cpu(const float* table, const uint8_t* support, int64_t n, int64_t m, const SketchHash& hash,
                             float* out, int64_t unit_begin, int64_t unit_end);

// Decode listed units: for t in [begin, end), out[t * m + col] (float32 [k, m]) = sketch_median of
// s_j(u, col) * table[j, h_j(u, col)] over j < hash.rows, u = units[t] (unsigned 64-bit). The same values
// count_sketch_decode_cpu writes for a supported unit, without touching the rest of [n, m].
void count_sketch_decode_units_cpu(const float* table, const int64_t* units, int64_t m, const SketchHash& hash,
                                   float* out, int64_t begin, int64_t end);

// For t in [begin, end): bucket[j * len + t] = h_j(u, col), sign[j * len + t] = s_j(u, col) for j < hash.rows, where
// idx[t] (taken as unsigned 64-bit) is the flat index u * m + col of a tensor of units of m >= 1 values.
void sketch_hash_cpu(const int64_t* idx, int64_t len, int64_t m, const SketchHash& hash, int64_t* bucket,
                     int8_t* sign, int64_t begin, int64_t end);

// ---- The union of p supports and the sum of their rows: the local step of sketch_allreduce's lossless gather ----
// bitmaps: p packed supports of n units, support r at bitmaps + r * bitmap_stride bytes (packed_bytes(n) bytes each,
// padding bits past n ignored). rows: rank r's rows at rows + r * rank_stride values of `type`: one row of m values
// per unit of its support, in increasing unit order (rows past its count are not read). The work is cut by ranges
// [byte_begin, byte_end) of the packed supports, 0 <= byte_begin <= byte_end <= packed_bytes(n).

// counts[r] (r < p) = the units of support r in the byte range; counts[p] = the units of their union there.
void union_rows_count_cpu(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, int64_t* counts,
                          int64_t byte_begin, int64_t byte_end);

// The union's units in the byte range, increasing: units[t] = u and sums[t * m + col] its sum, for t from first[p]
// on, where first[r] (r < p) is the number of units of support r before the range (the index of its next row). A sum
// starts at +0.0 and adds the row of every rank whose support holds u, in increasing rank order, each add rounded to
// `type` (computed in float32 for the 16-bit types: what torch's index_add_ into zeros gives), then is divided by
// `divisor` and rounded again unless divisor is 1 (what torch's div_ gives). The same bits for any cut of the bytes.
void union_sum_rows_cpu(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, const void* rows,
                        StorageType type, int64_t rank_stride, int64_t m, int64_t divisor, const int64_t* first,
                        int64_t* units, void* sums, int64_t byte_begin, int64_t byte_end);

// The CUDA union sum works on chunks of this many packed bytes (a block walks one chunk's units in order).
constexpr int64_t kUnionChunkBytes = 64;
// and keeps one row cursor per rank in shared memory: at most this many ranks.
constexpr int64_t kUnionMaxRanksCuda = 4096;

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
// Declared only for nvcc-compiled sources. Hashes are the same functions as above, so buckets and signs are
// bit-identical to the CPU's. count_sketch_cuda accumulates with float atomicAdd: each bucket is the same sum as
// on the CPU in an unspecified order, so it differs from the CPU result by rounding only (each order is within
// (k - 1) * 2^-24 * sum |s * x| of the exact sum for a bucket of k values, so the two within twice that) and may
// differ run to run. One more difference: a global float atomicAdd flushes subnormal operands and results to zero
// (whatever -ftz says), so subnormal values (|x| < 2^-126, bfloat16's subnormals among them) add nothing on CUDA,
// and a bucket whose sum is subnormal reads +-0.
#ifdef __CUDACC__

cudaError_t nonzero_bitmap_cuda(const void* x, int elem_bytes, int64_t n, int64_t m, uint8_t* out,
                                cudaStream_t stream);
cudaError_t count_sketch_cuda(const void* x, StorageType type, int64_t n, int64_t m, const uint8_t* support,
                              const SketchHash& hash, float* table, cudaStream_t stream);
cudaError_t count_sketch_decode_cuda(const float* table, const uint8_t* support, int64_t n, int64_t m,
                                     const SketchHash& hash, float* out, cudaStream_t stream);
cudaError_t count_sketch_units_cuda(const void* values, StorageType type, const int64_t* units, int64_t k,
                                    int64_t m, const SketchHash& hash, float* table, cudaStream_t stream);
cudaError_t count_sketch_decode_units_cuda(const float* table, const int64_t* units, int64_t k, int64_t m,
                                           const SketchHash& hash, float* out, cudaStream_t stream);
cudaError_t sketch_hash_cuda(const int64_t* idx, int64_t len, int64_t m, const SketchHash& hash, int64_t* bucket,
                             int8_t* sign, cudaStream_t stream);
// chunk_counts: int64 [chunks, p + 1], chunks = ceil(packed_bytes(n) / kUnionChunkBytes): union_rows_count_cpu of each
// chunk of kUnionChunkBytes bytes.
cudaError_t union_rows_count_cuda(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n,
                                  int64_t* chunk_counts, cudaStream_t stream);
// chunk_first: int64 [chunks, p + 1], the sums of chunk_counts over the chunks before each (exclusive prefix sums):
// union_sum_rows_cpu of every chunk, bit-identical to the CPU's (the same adds in the same order per value).
// p <= kUnionMaxRanksCuda.
cudaError_t union_sum_rows_cuda(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, const void* rows,
                                StorageType type, int64_t rank_stride, int64_t m, int64_t divisor,
                                const int64_t* chunk_first, int64_t* units, void* sums, cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
