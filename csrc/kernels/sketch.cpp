// CPU count-sketch. Single-threaded over the range it is given; the glue runs disjoint ranges in parallel.
//
// Units of m > 1 values (row granularity) hash once per unit and row and stream the unit into a contiguous window
// of the row (see "windows" below): vector adds, no scatter.
//
// Units of one value (element granularity) hash every value. Sketch and decode walk the flat index space in chunks
// of kChunk values, in increasing index. A chunk with no active value (outside the support, or all zero when
// sketching) is skipped; a chunk with few active values hashes each of them directly (two 64x64->128 multiplies per
// hash); a denser chunk uses lane stepping: the hash state of kLanes consecutive indices is kept per sketch row and
// advanced by kLanes indices at a time with adds and conditional subtracts only, exact because
//     (a*(i+k) + b) mod p = ((a*i + b) mod p + (k*a mod p)) mod p
// and the bucket ((...) mod p) mod cols follows from the same step: when the mod-p sum wraps (subtracts p), the
// bucket moves by (k*a mod p - p) mod cols instead of (k*a mod p) mod cols. That loop vectorizes (AVX2 picked at
// run time, so the build needs no -mavx2); the scatter into / gather from the table stays scalar.
// Both paths compute the same hashes and add in increasing index, so the path taken never changes a bit.
#include "kernels/sketch.h"

#include <algorithm>
#include <cstring>
#include <memory>

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTDIST_SKETCH_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FASTDIST_SKETCH_CLONES
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the bitmap word loads assume a little-endian CPU");

namespace fastdist {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kChunk = 256;         // values per chunk: a multiple of 64 (bitmap words) and of kLanes
constexpr int kChunkWords = kChunk / 64;
constexpr int64_t kP = static_cast<int64_t>(kSketchPrime);
constexpr uint32_t kBucketMask = 0x7FFFFFFFu;
constexpr uint32_t kSignMask = 0x80000000u;
static_assert(kSketchSignBit == 30, "lane_codes moves the sign bit (30) of y to bit 31 of a code with one shift");
// A chunk hashes its active values directly when active * kDirectRatio < chunk length. A direct hash costs several
// lane steps, but the lane path adds every value of the chunk (zeros are no-ops) and the direct path only the active
// ones, so they break even near 1 in 4 (timings in bench/README.md).
constexpr int64_t kDirectRatio = 4;


// out[e] = x[e] as float32 (float64 rounded to nearest) for e < len.
template <typename Format>
FASTDIST_SKETCH_CLONES void convert_values(const typename Format::Storage* __restrict x, float* __restrict out,
                                           int64_t len) {
  for (int64_t e = 0; e < len; ++e) out[e] = static_cast<float>(Format::load(x[e]));
}

// Values [s, s + len) of x, stored as `type`, as float32.
void load_values(const void* x, StorageType type, int64_t s, int64_t len, float* out) {
  dispatch_storage(type, [&](auto format) {
    using Format = decltype(format);
    convert_values<Format>(static_cast<const typename Format::Storage*>(x) + s, out, len);
  });
}

// words[w] bit k = (v[64 w + k] is not +-0), for the len <= kChunk values; bits past len are 0.
FASTDIST_SKETCH_CLONES void nonzero_words(const float* __restrict v, int64_t len, uint64_t* __restrict words) {
  for (int w = 0; w < kChunkWords; ++w) {
    uint64_t word = 0;
    const int64_t base = 64 * w;
    const int64_t count = std::min<int64_t>(64, std::max<int64_t>(len - base, 0));
    for (int64_t k = 0; k < count; ++k) word |= static_cast<uint64_t>((bits_of_float(v[base + k]) << 1) != 0) << k;
    words[w] = word;
  }
}

// ---- support bitmaps ----

// Bits [pos, pos + count) of a packed bitmap, 1 <= count <= 64: bit k of the result is unit pos + k. Reads only
// the bytes that hold those bits.
inline uint64_t load_bits(const uint8_t* bitmap, int64_t pos, int count) {
  const uint8_t* p = bitmap + (pos >> 3);
  const int shift = static_cast<int>(pos & 7);
  const int bytes = (shift + count + 7) >> 3;  // 1..9
  uint64_t word = 0;
  std::memcpy(&word, p, std::min(bytes, 8));
  word >>= shift;
  if (bytes > 8) word |= static_cast<uint64_t>(p[8]) << (64 - shift);
  return count == 64 ? word : word & ((uint64_t{1} << count) - 1);
}

// The first unit in [pos, end) whose bit equals `value`, or end. Scans 64 units per step.
int64_t find_bit(const uint8_t* bitmap, int64_t pos, int64_t end, bool value) {
  while (pos < end) {
    const int count = static_cast<int>(std::min<int64_t>(64, end - pos));
    uint64_t word = load_bits(bitmap, pos, count);
    if (!value) word = ~word & (count == 64 ? ~uint64_t{0} : (uint64_t{1} << count) - 1);
    if (word) return pos + __builtin_ctzll(word);
    pos += count;
  }
  return end;
}

// Calls fn(u0, u1) for each maximal run [u0, u1) of set bits within [begin, end), in order, and
// gap(g0, g1) for each maximal run of clear bits.
template <typename RunFn, typename GapFn>
void for_each_run(const uint8_t* bitmap, int64_t begin, int64_t end, RunFn fn, GapFn gap) {
  int64_t u = begin;
  while (u < end) {
    const int64_t u0 = find_bit(bitmap, u, end, true);
    if (u0 > u) gap(u, u0);
    if (u0 == end) return;
    const int64_t u1 = find_bit(bitmap, u0, end, false);
    fn(u0, u1);
    u = u1;
  }
}

// Support bits of the chunk [s, s + len) as kChunkWords words (bits past len are 0).
void load_chunk_bits(const uint8_t* bitmap, int64_t s, int64_t len, uint64_t* words) {
  for (int w = 0; w < kChunkWords; ++w) {
    const int64_t count = std::min<int64_t>(64, len - 64 * w);
    words[w] = count > 0 ? load_bits(bitmap, s + 64 * w, static_cast<int>(count)) : 0;
  }
}

int popcount_words(const uint64_t* words) {
  int count = 0;
  for (int w = 0; w < kChunkWords; ++w) count += __builtin_popcountll(words[w]);
  return count;
}

// Calls fn(e) for every set bit e of the chunk's words, in increasing e.
template <typename Fn>
void for_each_set_bit(const uint64_t* words, Fn fn) {
  for (int w = 0; w < kChunkWords; ++w) {
    for (uint64_t word = words[w]; word; word &= word - 1) fn(64 * w + __builtin_ctzll(word));
  }
}

// ---- lane stepping ----

// How to move one sketch row's hash state forward by some distance D: x += dx (mod p); the bucket moves by
// db_nowrap, or by db_wrap when x wrapped; y (the sign hash) += dy (mod p). All in [0, p) or [0, cols).
struct Step {
  int64_t dx, db_nowrap, db_wrap, dy;
};

// The hash state of one sketch row for the kLanes indices pos, pos + 1, ...: x = (a i + b) mod p,
// bucket = x mod cols, y = (c i + d) mod p.
struct RowLanes {
  alignas(64) int64_t x[kLanes];
  alignas(64) int64_t bucket[kLanes];
  alignas(64) int64_t y[kLanes];
  int64_t pos = -1;  // -1: not yet placed
  Step step;         // by kLanes indices
};

// The lanes of the sketch rows [row_begin, row_end) with their kLanes steps, and direct hashing.
class Hasher {
 public:
  Hasher(const SketchHash& hash, int row_begin, int row_end) : h_(hash), row_begin_(row_begin), row_end_(row_end) {
    p_mod_cols_ = static_cast<int64_t>(kSketchPrime % static_cast<uint64_t>(h_.cols));
    for (int j = row_begin_; j < row_end_; ++j) lanes_[j].step = step_for(j, kLanes);
  }

  // Places row j's lanes at pos (pos >= 0): directly the first time, then by stepping from where they are.
  void seek(int j, int64_t pos) {
    RowLanes& row = lanes_[j];
    if (row.pos == pos) return;
    if (row.pos < 0) {
      for (int k = 0; k < kLanes; ++k) {
        const uint64_t i = static_cast<uint64_t>(pos + k);
        row.x[k] = static_cast<int64_t>(sketch_affine(h_.a[j], h_.b[j], i));
        row.bucket[k] = static_cast<int64_t>(fastmod(static_cast<uint64_t>(row.x[k])));
        row.y[k] = static_cast<int64_t>(sketch_affine(h_.c[j], h_.d[j], i));
      }
    } else {
      const int64_t delta = pos - row.pos;
      uint64_t dist = sketch_mod_p(static_cast<uint64_t>(delta >= 0 ? delta : -delta));
      if (delta < 0 && dist != 0) dist = kSketchPrime - dist;  // moving back by D = moving forward by p - D
      const Step step = step_for(j, dist);
      for (int k = 0; k < kLanes; ++k) advance(row, k, step);
    }
    row.pos = pos;
  }

  // Direct hash of index i in row j, as code = bucket | sign << 31.
  uint32_t code(int j, uint64_t i) const {
    return static_cast<uint32_t>(h_.start(j, i)) | (h_.unit_negative(j, i) ? kSignMask : 0u);
  }

  RowLanes& lanes(int j) { return lanes_[j]; }
  int64_t cols() const { return h_.cols; }
  int row_begin() const { return row_begin_; }
  int row_end() const { return row_end_; }
  int rows() const { return h_.rows; }

 private:
  uint64_t fastmod(uint64_t x) const { return sketch_fastmod(x, static_cast<uint64_t>(h_.cols), h_.cols_inv); }

  // The step by `dist` indices (dist < p) for row j.
  Step step_for(int j, uint64_t dist) const {
    const uint64_t dx = sketch_mulmod(h_.a[j], dist);
    const int64_t db = static_cast<int64_t>(fastmod(dx));
    const int64_t db_wrap = db >= p_mod_cols_ ? db - p_mod_cols_ : db - p_mod_cols_ + h_.cols;
    return {static_cast<int64_t>(dx), db, db_wrap, static_cast<int64_t>(sketch_mulmod(h_.c[j], dist))};
  }

  // Moves lane k of `row` forward by `step`.
  void advance(RowLanes& row, int k, const Step& step) const {
    const int64_t x = row.x[k] + step.dx;
    const bool wrap = x >= kP;
    row.x[k] = wrap ? x - kP : x;
    const int64_t b = row.bucket[k] + (wrap ? step.db_wrap : step.db_nowrap);
    row.bucket[k] = b >= h_.cols ? b - h_.cols : b;
    const int64_t y = row.y[k] + step.dy;
    row.y[k] = y >= kP ? y - kP : y;
  }

  const SketchHash& h_;
  int row_begin_, row_end_;
  int64_t p_mod_cols_;
  RowLanes lanes_[kSketchMaxRows];
};

// GCC/Clang vector extensions: 4 x int64 per vector, compiled to AVX2 in the avx2 clone, to SSE2 otherwise.
typedef int64_t I64x4 __attribute__((vector_size(32)));
typedef uint32_t U32x4 __attribute__((vector_size(16)));
static_assert(kLanes % 4 == 0, "lanes are held as 4-wide vectors");

// code[e] = bucket | sign << 31 for e < kLanes * blocks, stepping the lanes by kLanes each block.
FASTDIST_SKETCH_CLONES void lane_codes(RowLanes& row, int64_t cols, int64_t blocks, uint32_t* __restrict code) {
  constexpr int kVecs = kLanes / 4;
  I64x4 x[kVecs], bucket[kVecs], y[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    std::memcpy(&x[v], row.x + 4 * v, sizeof x[v]);
    std::memcpy(&bucket[v], row.bucket + 4 * v, sizeof bucket[v]);
    std::memcpy(&y[v], row.y + 4 * v, sizeof y[v]);
  }
  const Step step = row.step;
  const int64_t p_minus_1 = kP - 1, cols_minus_1 = cols - 1, wrap_extra = step.db_wrap - step.db_nowrap;
  for (int64_t t = 0; t < blocks; ++t) {
    for (int v = 0; v < kVecs; ++v) {
      // bit 31 of (y << 1) is bit kSketchSignBit (30) of y
      const U32x4 c = __builtin_convertvector(bucket[v], U32x4) |
                      (__builtin_convertvector(y[v] << 1, U32x4) & kSignMask);
      std::memcpy(code + t * kLanes + 4 * v, &c, sizeof c);
      const I64x4 xs = x[v] + step.dx;
      const I64x4 wrap = xs > p_minus_1;  // lanes of -1 (true) or 0
      x[v] = xs - (wrap & kP);
      const I64x4 b = bucket[v] + step.db_nowrap + (wrap & wrap_extra);
      bucket[v] = b - ((b > cols_minus_1) & cols);
      const I64x4 ys = y[v] + step.dy;
      y[v] = ys - ((ys > p_minus_1) & kP);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    std::memcpy(row.x + 4 * v, &x[v], sizeof x[v]);
    std::memcpy(row.bucket + 4 * v, &bucket[v], sizeof bucket[v]);
    std::memcpy(row.y + 4 * v, &y[v], sizeof y[v]);
  }
  row.pos += kLanes * blocks;
}

// table[bucket] += +-v[e] for e < len, in order. kPrefetch: prefetch the bucket kPrefetchAhead values ahead, which
// overlaps the cache misses of a table row too large for L2 (for a cache-resident row it only costs instructions,
// hence kPrefetchRowBytes). Long runs matter too: the first kPrefetchAhead updates of a run are
// not prefetched, which is why the sketcher stages a few thousand values per call.
constexpr int64_t kPrefetchRowBytes = 1 << 20;
constexpr int64_t kPrefetchAhead = 32;

template <bool kPrefetch>
void scatter(float* table, const uint32_t* __restrict code, const float* __restrict v, int64_t len) {
  for (int64_t e = 0; e < len; ++e) {
    if (kPrefetch && e + kPrefetchAhead < len) {
      __builtin_prefetch(table + (code[e + kPrefetchAhead] & kBucketMask), 1, 3);
    }
    const uint32_t c = code[e];
    table[c & kBucketMask] += xor_sign(v[e], c & kSignMask);
  }
}

// est[e] = +-table[bucket] for e < len; kPrefetch as for scatter.
template <bool kPrefetch>
void gather(const float* table, const uint32_t* __restrict code, float* __restrict est, int64_t len) {
  for (int64_t e = 0; e < len; ++e) {
    if (kPrefetch && e + kPrefetchAhead < len) {
      __builtin_prefetch(table + (code[e + kPrefetchAhead] & kBucketMask), 0, 3);
    }
    const uint32_t c = code[e];
    est[e] = xor_sign(table[c & kBucketMask], c & kSignMask);
  }
}

// sketch_median of three values: the same min/max network, branch-free so that loops over it vectorize.
inline float median3(float a, float b, float c) {
  const float lo = a < b ? a : b;
  const float hi = a < b ? b : a;
  const float mid = hi < c ? hi : c;
  const float med = lo < mid ? mid : lo;
  return a != a ? a : b != b ? b : c != c ? c : med;
}

// out[e] = sketch_median(est[0][e], est[1][e], ...) for e < len.
FASTDIST_SKETCH_CLONES void medians(const float (*est)[kChunk], int rows, int64_t len, float* __restrict out) {
  if (rows == 3) {
    const float* __restrict e0 = est[0];
    const float* __restrict e1 = est[1];
    const float* __restrict e2 = est[2];
    for (int64_t e = 0; e < len; ++e) out[e] = median3(e0[e], e1[e], e2[e]);
    return;
  }
  for (int64_t e = 0; e < len; ++e) {
    float v[kSketchMaxRows];
    for (int j = 0; j < rows; ++j) v[j] = est[j][e];
    out[e] = sketch_median(v, rows);
  }
}

// out[e] = the median of three whole windows' estimates (read_window without the wrap) for e < len, as medians does.
FASTDIST_SKETCH_CLONES void median_of_windows3(const float* __restrict t0, const float* __restrict t1,
                                               const float* __restrict t2, const uint32_t* __restrict m0,
                                               const uint32_t* __restrict m1, const uint32_t* __restrict m2,
                                               uint32_t u0, uint32_t u1, uint32_t u2, float* __restrict out,
                                               int64_t len) {
  for (int64_t e = 0; e < len; ++e) {
    out[e] = median3(xor_sign(t0[e], m0[e] ^ u0), xor_sign(t1[e], m1[e] ^ u1), xor_sign(t2[e], m2[e] ^ u2));
  }
}

// Calls fn(e) for each active e < len of a chunk: the set bits of `active`, or every e when active is null.
template <typename Fn>
void for_each_active(const uint64_t* active, int64_t len, Fn fn) {
  if (active == nullptr) {
    for (int64_t e = 0; e < len; ++e) fn(e);
  } else {
    for_each_set_bit(active, fn);
  }
}

// A chunk of `count` active values out of `len` goes the direct way when lane stepping would mostly hash
// inactive values, or when the chunk is too short to fill the lanes.
bool go_direct(int64_t count, int64_t len) { return count * kDirectRatio < len || len < 2 * kLanes; }

// Sketches chunks in blocks: chunks are queued until kBlockChunks are waiting, then each sketch row runs over the
// whole block before the next row starts, so that one table row at a time is the scatter's working set (several
// large rows scattered into together miss the caches and the TLB far more than one after the other).
// Each row still sees the values in increasing index.
class Sketcher {
 public:
  static constexpr int kBlockChunks = 128;

  Sketcher(const SketchHash& hash, float* table, int row_begin, int row_end)
      : hasher_(hash, row_begin, row_end), table_(table) {}

  // Where the next queued chunk's float32 values may be written (kChunk floats).
  float* slot() { return values_ + queued_ * kChunk; }

  // Queues the chunk [s, s + len): vals its values (inactive ones are +-0 or ignored; kept until the block is
  // sketched), active its active values, count how many.
  void push(int64_t s, int64_t len, const float* vals, const uint64_t* active, int64_t count) {
    if (count == 0) return;
    Chunk& c = chunks_[queued_];
    c.s = s;
    c.len = len;
    c.count = count;
    c.vals = vals;
    std::memcpy(c.active, active, sizeof c.active);
    if (++queued_ == kBlockChunks) flush();
  }

  // Sketches the queued chunks: per sketch row, stages the codes and values of up to kStage values (hashed
  // directly or by the lanes, in index order) and scatters them in one run.
  void flush() {
    const int64_t cols = hasher_.cols();
    const bool prefetch = cols * static_cast<int64_t>(sizeof(float)) > kPrefetchRowBytes;
    for (int j = hasher_.row_begin(); j < hasher_.row_end(); ++j) {
      float* table = table_ + j * cols;
      for (int q = 0; q < queued_;) {
        int64_t staged = 0;
        for (; q < queued_ && staged + kChunk <= kStage; ++q) {
          const Chunk& c = chunks_[q];
          if (go_direct(c.count, c.len)) {
            for_each_set_bit(c.active, [&](int64_t e) {
              stage_code_[staged] = hasher_.code(j, static_cast<uint64_t>(c.s + e));
              stage_value_[staged++] = c.vals[e];
            });
          } else if (prefetch && c.count < c.len) {
            // A table row beyond the caches: an add is a memory access, so stage only the active values.
            hasher_.seek(j, c.s);
            lane_codes(hasher_.lanes(j), cols, (c.len + kLanes - 1) / kLanes, code_);
            for_each_set_bit(c.active, [&](int64_t e) {
              stage_code_[staged] = code_[e];
              stage_value_[staged++] = c.vals[e];
            });
          } else {
            hasher_.seek(j, c.s);
            // writes up to kLanes - 1 codes past the chunk: the stage has room, the next chunk overwrites them
            lane_codes(hasher_.lanes(j), cols, (c.len + kLanes - 1) / kLanes, stage_code_ + staged);
            std::memcpy(stage_value_ + staged, c.vals, c.len * sizeof(float));
            staged += c.len;
          }
        }
        (prefetch ? scatter<true> : scatter<false>)(table, stage_code_, stage_value_, staged);
      }
    }
    queued_ = 0;
  }

 private:
  struct Chunk {
    int64_t s, len, count;
    const float* vals;
    uint64_t active[kChunkWords];
  };

  static constexpr int64_t kStage = 16 * kChunk;

  Hasher hasher_;
  float* table_;
  int queued_ = 0;
  Chunk chunks_[kBlockChunks];
  alignas(64) uint32_t code_[kChunk];
  alignas(64) uint32_t stage_code_[kStage + kLanes];
  alignas(64) float stage_value_[kStage];
  alignas(64) float values_[kBlockChunks * kChunk];
};

class Decoder {
 public:
  Decoder(const SketchHash& hash, const float* table) : hasher_(hash, 0, hash.rows), table_(table) {}

  // Writes out[0, len) for the indices [s, s + len): the estimate where active (null: everywhere), 0 elsewhere.
  void chunk(int64_t s, int64_t len, const uint64_t* active, int64_t count, float* out) {
    const int rows = hasher_.rows();
    const int64_t cols = hasher_.cols();
    if (go_direct(count, len)) {
      if (count < len) std::memset(out, 0, len * sizeof(float));
      for_each_active(active, len, [&](int64_t e) {
        float v[kSketchMaxRows];
        for (int j = 0; j < rows; ++j) {
          const uint32_t c = hasher_.code(j, static_cast<uint64_t>(s + e));
          v[j] = xor_sign(table_[j * cols + (c & kBucketMask)], c & kSignMask);
        }
        out[e] = sketch_median(v, rows);
      });
      return;
    }
    const int64_t blocks = (len + kLanes - 1) / kLanes;
    const bool prefetch = cols * static_cast<int64_t>(sizeof(float)) > kPrefetchRowBytes;
    for (int j = 0; j < rows; ++j) {
      hasher_.seek(j, s);
      lane_codes(hasher_.lanes(j), cols, blocks, code_);
      if (prefetch && active != nullptr) {  // a read is a memory access: read only for the active values
        const float* table = table_ + j * cols;
        std::memset(est_[j], 0, len * sizeof(float));
        for_each_set_bit(active, [&](int64_t e) {
          const uint32_t c = code_[e];
          est_[j][e] = xor_sign(table[c & kBucketMask], c & kSignMask);
        });
      } else {
        (prefetch ? gather<true> : gather<false>)(table_ + j * cols, code_, est_[j], len);
      }
    }
    medians(est_, rows, len, out);
    if (active != nullptr) {
      for (int64_t e = 0; e < len; ++e) out[e] = (active[e >> 6] >> (e & 63)) & 1 ? out[e] : 0.0f;
    }
  }

 private:
  Hasher hasher_;
  const float* table_;
  alignas(64) uint32_t code_[kChunk];
  alignas(64) float est_[kSketchMaxRows][kChunk];
};

// The chunk's values as float32: a pointer into x for float32 input, else converted into buf.
const float* chunk_values(const void* x, StorageType type, int64_t s, int64_t len, float* buf) {
  if (type == StorageType::kFloat32) return static_cast<const float*>(x) + s;
  load_values(x, type, s, len, buf);
  return buf;
}

// ---- units of m > 1 values: windows ----
// Unit u's values land on the consecutive buckets (start_j(u) + col) mod cols of row j (sketch.h), so a unit is
// sketched by adding its values, sign-flipped, into a window of the row, and decoded by reading the windows back:
// vector adds and loads over contiguous memory, one hash per unit and row. A sketch adds up to kWindowChunk columns
// of a unit into all of its rows' windows in one pass, so each value is loaded once (rather than once per row); a
// decode reads kChunk columns of every row, then takes their medians.
constexpr int64_t kWindowChunk = 1024;

// masks[e] = column_negative(col0 + e) << 31 for e < len, in a row with column coefficient g: (g col) mod p steps
// by g per column, four lanes at a time. Writes up to 3 masks past len.
FASTDIST_SKETCH_CLONES void column_masks(uint64_t g, uint64_t col0, int64_t len, uint32_t* __restrict masks) {
  I64x4 x;
  for (int k = 0; k < 4; ++k) x[k] = static_cast<int64_t>(sketch_mulmod(g, sketch_mod_p(col0 + k)));
  const int64_t step = static_cast<int64_t>(sketch_mulmod(g, 4)), p_minus_1 = kP - 1;
  for (int64_t e = 0; e < len; e += 4) {
    const U32x4 c = __builtin_convertvector(x << 1, U32x4) & kSignMask;  // bit 31 of (x << 1) is bit 30 of x
    std::memcpy(masks + e, &c, sizeof c);
    const I64x4 xs = x + step;
    x = xs - ((xs > p_minus_1) & kP);
  }
}

// The column-sign masks of sketch rows [row_begin, row_end) for units of m values: computed once for the first
// kCachedColumns columns, per chunk beyond (units that long are few, so each is hashed per chunk).
class ColumnSigns {
 public:
  static constexpr int64_t kCachedColumns = 16384;

  ColumnSigns(const SketchHash& hash, int row_begin, int row_end, int64_t m)
      : hash_(hash), row_begin_(row_begin), cached_(std::min(m, kCachedColumns)), stride_((cached_ + 3) / 4 * 4),
        cache_(new uint32_t[(row_end - row_begin) * stride_]) {
    for (int j = row_begin; j < row_end; ++j) column_masks(hash.g[j], 0, cached_, cache_.get() + (j - row_begin) * stride_);
  }

  // The masks of columns [col0, col0 + len) of row j, len <= kWindowChunk. Valid until the next get() for the same row.
  const uint32_t* get(int j, int64_t col0, int64_t len) {
    if (col0 + len <= cached_) return cache_.get() + (j - row_begin_) * stride_ + col0;
    column_masks(hash_.g[j], static_cast<uint64_t>(col0), len, scratch_[j - row_begin_]);
    return scratch_[j - row_begin_];
  }

 private:
  const SketchHash& hash_;
  int row_begin_;
  int64_t cached_, stride_;
  std::unique_ptr<uint32_t[]> cache_;
  alignas(64) uint32_t scratch_[kSketchMaxRows][kWindowChunk + 4];  // per row: several rows' masks are used at once
};

// table[(start + e) mod cols] += v[e] with its sign flipped by masks[e] ^ unit_mask, for e < len in increasing e,
// where the bucket is in [lo, hi) (a thread's share of the row; the rest belongs to others).
FASTDIST_SKETCH_CLONES void add_window(float* table, int64_t cols, int64_t start, const float* v,
                                       const uint32_t* masks, uint32_t unit_mask, int64_t len, int64_t lo,
                                       int64_t hi) {
  for (int64_t done = 0; done < len; start = 0) {  // a window longer than the row wraps, maybe more than once
    const int64_t seg = std::min(len - done, cols - start);
    const int64_t b0 = std::max(start, lo), b1 = std::min(start + seg, hi);
    if (b0 < b1) {
      float* __restrict t = table + b0;
      const float* __restrict x = v + done + (b0 - start);
      const uint32_t* __restrict mk = masks + done + (b0 - start);
      for (int64_t e = 0; e < b1 - b0; ++e) t[e] += xor_sign(x[e], mk[e] ^ unit_mask);
    }
    done += seg;
  }
}

// The same add into two or three whole windows of different table rows (no wrap, no clipping), each value loaded
// once for all of them.
FASTDIST_SKETCH_CLONES void add_windows2(float* __restrict t0, float* __restrict t1, const float* __restrict v,
                                         const uint32_t* __restrict m0, const uint32_t* __restrict m1, uint32_t u0,
                                         uint32_t u1, int64_t len) {
  for (int64_t e = 0; e < len; ++e) {
    const uint32_t b = bits_of_float(v[e]);
    t0[e] += float_from_bits(b ^ m0[e] ^ u0);
    t1[e] += float_from_bits(b ^ m1[e] ^ u1);
  }
}

FASTDIST_SKETCH_CLONES void add_windows3(float* __restrict t0, float* __restrict t1, float* __restrict t2,
                                         const float* __restrict v, const uint32_t* __restrict m0,
                                         const uint32_t* __restrict m1, const uint32_t* __restrict m2, uint32_t u0,
                                         uint32_t u1, uint32_t u2, int64_t len) {
  for (int64_t e = 0; e < len; ++e) {
    const uint32_t b = bits_of_float(v[e]);
    t0[e] += float_from_bits(b ^ m0[e] ^ u0);
    t1[e] += float_from_bits(b ^ m1[e] ^ u1);
    t2[e] += float_from_bits(b ^ m2[e] ^ u2);
  }
}

// est[e] = table[(start + e) mod cols] with its sign flipped by masks[e] ^ unit_mask, for e < len.
FASTDIST_SKETCH_CLONES void read_window(const float* table, int64_t cols, int64_t start, const uint32_t* masks,
                                        uint32_t unit_mask, float* est, int64_t len) {
  for (int64_t done = 0; done < len; start = 0) {
    const int64_t seg = std::min(len - done, cols - start);
    const float* __restrict t = table + start;
    const uint32_t* __restrict mk = masks + done;
    float* __restrict out = est + done;
    for (int64_t e = 0; e < seg; ++e) out[e] = xor_sign(t[e], mk[e] ^ unit_mask);
    done += seg;
  }
}

// Whether any of v[0, len) is not +-0. An OR over the bits: nonzero_words, which places a bit per value, doubles the
// window sketch's time.
FASTDIST_SKETCH_CLONES bool any_nonzero(const float* __restrict v, int64_t len) {
  uint32_t acc = 0;
  for (int64_t e = 0; e < len; ++e) acc |= bits_of_float(v[e]) << 1;
  return acc != 0;
}

// Sketches whole units of m > 1 values into the table positions [begin, end) (position j * cols + b is bucket b of
// row j), and decodes them (with every position).
class WindowSketcher {
 public:
  WindowSketcher(const SketchHash& hash, int64_t begin, int64_t end, int64_t m)
      : hash_(hash), row_begin_(static_cast<int>(begin / hash.cols)),
        row_end_(static_cast<int>(end > begin ? (end - 1) / hash.cols + 1 : row_begin_)), m_(m),
        signs_(hash, row_begin_, row_end_, m) {
    for (int j = row_begin_; j < row_end_; ++j) {
      lo_[j] = std::max<int64_t>(begin - j * hash.cols, 0);
      hi_[j] = std::min<int64_t>(end - j * hash.cols, hash.cols);
    }
  }

  // Adds unit u, whose m values start at flat index `offset` of x, into the table. skip_zero_chunks: first check
  // whether a chunk of the unit is all zero and skip it (it adds nothing, see count_sketch_cpu); worth it only when
  // most units are zero.
  void sketch(float* table, const void* x, StorageType type, int64_t offset, uint64_t u, bool skip_zero_chunks) {
    const int64_t cols = hash_.cols;
    bool placed = false;
    for (int64_t col0 = 0; col0 < m_; col0 += kWindowChunk) {
      const int64_t len = std::min(kWindowChunk, m_ - col0);
      const float* vals = chunk_values(x, type, offset + col0, len, buf_);
      if (skip_zero_chunks && !any_nonzero(vals, len)) continue;
      if (!placed) place(u);
      placed = true;
      // Windows wholly inside this range's part of their row go two or three rows at a time; a window that wraps
      // or crosses the range's edge goes alone. Every bucket still sees the units in increasing order.
      int whole[kSketchMaxRows], n_whole = 0;
      int64_t at[kSketchMaxRows];
      for (int j = row_begin_; j < row_end_; ++j) {
        const int64_t b = hash_.window_bucket(start_[j], col0);
        if (b + len <= cols && b >= lo_[j] && b + len <= hi_[j]) {
          at[n_whole] = j * cols + b;
          whole[n_whole++] = j;
        } else {
          add_window(table + j * cols, cols, b, vals, signs_.get(j, col0, len), unit_mask_[j], len, lo_[j], hi_[j]);
        }
      }
      int w = 0;
      for (; n_whole - w >= 3; w += 3) {
        const int j0 = whole[w], j1 = whole[w + 1], j2 = whole[w + 2];
        add_windows3(table + at[w], table + at[w + 1], table + at[w + 2], vals, signs_.get(j0, col0, len),
                     signs_.get(j1, col0, len), signs_.get(j2, col0, len), unit_mask_[j0], unit_mask_[j1],
                     unit_mask_[j2], len);
      }
      if (n_whole - w == 2) {
        const int j0 = whole[w], j1 = whole[w + 1];
        add_windows2(table + at[w], table + at[w + 1], vals, signs_.get(j0, col0, len), signs_.get(j1, col0, len),
                     unit_mask_[j0], unit_mask_[j1], len);
        w += 2;
      }
      if (w < n_whole) {
        const int j = whole[w];
        add_window(table + j * cols, cols, at[w] - j * cols, vals, signs_.get(j, col0, len), unit_mask_[j], len,
                   lo_[j], hi_[j]);
      }
    }
  }

  // out[0, m) = the estimates of unit u (the positions must be the whole table).
  void decode(const float* table, uint64_t u, float* out) {
    place(u);
    const int64_t cols = hash_.cols;
    for (int64_t col0 = 0; col0 < m_; col0 += kWindowChunk) {
      const int64_t len = std::min(kWindowChunk, m_ - col0);
      if (hash_.rows == 3) {  // the usual sketch: three whole windows go in one pass, without the estimates' copies
        const int64_t b0 = hash_.window_bucket(start_[0], col0), b1 = hash_.window_bucket(start_[1], col0),
                      b2 = hash_.window_bucket(start_[2], col0);
        if (std::max({b0, b1, b2}) + len <= cols) {
          median_of_windows3(table + b0, table + cols + b1, table + 2 * cols + b2, signs_.get(0, col0, len),
                             signs_.get(1, col0, len), signs_.get(2, col0, len), unit_mask_[0], unit_mask_[1],
                             unit_mask_[2], out + col0, len);
          continue;
        }
      }
      for (int64_t c0 = col0; c0 < col0 + len; c0 += kChunk) {
        const int64_t n = std::min(kChunk, col0 + len - c0);
        for (int j = 0; j < hash_.rows; ++j) {
          read_window(table + j * cols, cols, hash_.window_bucket(start_[j], c0), signs_.get(j, c0, n),
                      unit_mask_[j], est_[j], n);
        }
        medians(est_, hash_.rows, n, out + c0);
      }
    }
  }

 private:
  // Hashes unit u once per row.
  void place(uint64_t u) {
    for (int j = row_begin_; j < row_end_; ++j) {
      start_[j] = hash_.start(j, u);
      unit_mask_[j] = hash_.unit_negative(j, u) ? kSignMask : 0u;
    }
  }

  const SketchHash& hash_;
  int row_begin_, row_end_;  // the rows that hold positions of the range
  int64_t m_;
  ColumnSigns signs_;
  int64_t lo_[kSketchMaxRows], hi_[kSketchMaxRows];  // row j's buckets in the range
  int64_t start_[kSketchMaxRows];
  uint32_t unit_mask_[kSketchMaxRows];
  alignas(64) float buf_[kWindowChunk];
  alignas(64) float est_[kSketchMaxRows][kChunk];
};

// ---- nonzero bitmaps ----

// A value is non-zero when a bit other than the sign bit is set.
template <typename U>
inline bool nonzero(U u) {
  return static_cast<U>(u << 1) != 0;
}

template <typename U>
inline bool row_nonzero(const U* x, int64_t m) {
  constexpr int64_t kBlock = 1024;  // check for an early exit once per block; the block loop vectorizes
  for (int64_t b = 0; b < m; b += kBlock) {
    const int64_t end = std::min(m, b + kBlock);
    U acc = 0;
    for (int64_t e = b; e < end; ++e) acc |= static_cast<U>(x[e] << 1);
    if (acc != 0) return true;
  }
  return false;
}

template <typename U>
inline void nonzero_bitmap_of(const U* x, int64_t n, int64_t m, uint8_t* out, int64_t b0, int64_t b1) {
  if (m == 1) {
    const int64_t full_end = std::min(b1, n / 8);
    for (int64_t k = b0; k < full_end; ++k) {
      const U* v = x + 8 * k;
      uint32_t byte = 0;
      for (int j = 0; j < 8; ++j) byte |= static_cast<uint32_t>(nonzero(v[j])) << j;
      out[k] = static_cast<uint8_t>(byte);
    }
    if (b1 > n / 8) {  // the last, partial byte; its padding bits stay zero
      uint32_t byte = 0;
      for (int64_t u = 8 * (n / 8); u < n; ++u) byte |= static_cast<uint32_t>(nonzero(x[u])) << (u & 7);
      out[n / 8] = static_cast<uint8_t>(byte);
    }
    return;
  }
  for (int64_t k = b0; k < b1; ++k) {
    uint32_t byte = 0;
    for (int64_t u = 8 * k; u < std::min(n, 8 * k + 8); ++u) {
      byte |= static_cast<uint32_t>(m > 0 && row_nonzero(x + u * m, m)) << (u & 7);
    }
    out[k] = static_cast<uint8_t>(byte);
  }
}

FASTDIST_SKETCH_CLONES void nonzero_bitmap_16(const uint16_t* x, int64_t n, int64_t m, uint8_t* out, int64_t b0,
                                              int64_t b1) {
  nonzero_bitmap_of(x, n, m, out, b0, b1);
}
FASTDIST_SKETCH_CLONES void nonzero_bitmap_32(const uint32_t* x, int64_t n, int64_t m, uint8_t* out, int64_t b0,
                                              int64_t b1) {
  nonzero_bitmap_of(x, n, m, out, b0, b1);
}
FASTDIST_SKETCH_CLONES void nonzero_bitmap_64(const uint64_t* x, int64_t n, int64_t m, uint8_t* out, int64_t b0,
                                              int64_t b1) {
  nonzero_bitmap_of(x, n, m, out, b0, b1);
}

}  // namespace

void nonzero_bitmap_cpu(const void* x, int elem_bytes, int64_t n, int64_t m, uint8_t* out, int64_t byte_begin,
                        int64_t byte_end) {
  if (byte_begin >= byte_end) return;
  switch (elem_bytes) {
    case 2: nonzero_bitmap_16(static_cast<const uint16_t*>(x), n, m, out, byte_begin, byte_end); break;
    case 4: nonzero_bitmap_32(static_cast<const uint32_t*>(x), n, m, out, byte_begin, byte_end); break;
    case 8: nonzero_bitmap_64(static_cast<const uint64_t*>(x), n, m, out, byte_begin, byte_end); break;
    default: break;
  }
}

void count_sketch_cpu(const void* x, StorageType type, int64_t n, int64_t m, const uint8_t* support,
                      const SketchHash& hash, float* table, int64_t begin, int64_t end) {
  if (begin >= end) return;
  std::memset(table + begin, 0, (end - begin) * sizeof(float));
  const int64_t total = n * m;
  if (total == 0) return;

  if (m > 1) {
    std::unique_ptr<WindowSketcher> windows(new WindowSketcher(hash, begin, end, m));  // ~80 KB
    const bool skip_zero_chunks = support == nullptr;  // a supported unit is rarely all zero
    const auto add_units = [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        windows->sketch(table, x, type, u * m, static_cast<uint64_t>(u), skip_zero_chunks);
      }
    };
    if (support != nullptr) {
      for_each_run(support, 0, n, add_units, [](int64_t, int64_t) {});
    } else {
      add_units(0, n);
    }
    return;
  }
  const int row_begin = static_cast<int>(begin / hash.cols), row_end = static_cast<int>(end / hash.cols);
  // m == 1: one bit per value, or no support (every value)
  std::unique_ptr<Sketcher> sketcher(new Sketcher(hash, table, row_begin, row_end));  // ~190 KB: not on the stack
  uint64_t active[kChunkWords];
  for (int64_t s = 0; s < total; s += kChunk) {
    const int64_t len = std::min(kChunk, total - s);
    uint64_t sup[kChunkWords];
    if (support != nullptr) {
      load_chunk_bits(support, s, len, sup);
      if (popcount_words(sup) == 0) continue;
    }
    float* slot = sketcher->slot();
    const float* vals = chunk_values(x, type, s, len, slot);
    nonzero_words(vals, len, active);
    if (support != nullptr) {
      for (int w = 0; w < kChunkWords; ++w) active[w] &= sup[w];
      const int64_t count = popcount_words(active);
      if (count > 0 && !go_direct(count, len)) {  // lane stepping adds every value: zero the unsupported ones
        for (int64_t e = 0; e < len; ++e) slot[e] = (sup[e >> 6] >> (e & 63)) & 1 ? vals[e] : 0.0f;
        vals = slot;
      }
      sketcher->push(s, len, vals, active, count);
    } else {
      sketcher->push(s, len, vals, active, popcount_words(active));
    }
  }
  sketcher->flush();
}

void count_sketch_units_cpu(const void* values, StorageType type, const int64_t* units, int64_t k, int64_t m,
                            const SketchHash& hash, float* table, int64_t begin, int64_t end) {
  if (begin >= end) return;
  std::memset(table + begin, 0, (end - begin) * sizeof(float));
  if (k * m == 0) return;
  if (m > 1) {
    std::unique_ptr<WindowSketcher> windows(new WindowSketcher(hash, begin, end, m));
    for (int64_t t = 0; t < k; ++t) {
      windows->sketch(table, values, type, t * m, static_cast<uint64_t>(units[t]), /*skip_zero_chunks=*/false);
    }
    return;
  }
  const int row_begin = static_cast<int>(begin / hash.cols), row_end = static_cast<int>(end / hash.cols);
  std::unique_ptr<Sketcher> sketcher(new Sketcher(hash, table, row_begin, row_end));
  uint64_t active[kChunkWords];
  for (int64_t t = 0; t < k; ++t) {  // m == 1: units are flat indices
    const float* vals = chunk_values(values, type, t, 1, sketcher->slot());
    nonzero_words(vals, 1, active);
    sketcher->push(units[t], 1, vals, active, popcount_words(active));
  }
  sketcher->flush();
}

void count_sketch_decode_cpu(const float* table, const uint8_t* support, int64_t n, int64_t m, const SketchHash& hash,
                             float* out, int64_t unit_begin, int64_t unit_end) {
  (void)n;
  if (unit_begin >= unit_end || m == 0) return;
  if (m > 1) {
    std::unique_ptr<WindowSketcher> windows(new WindowSketcher(hash, 0, hash.rows * hash.cols, m));
    for_each_run(
        support, unit_begin, unit_end,
        [&](int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u) windows->decode(table, static_cast<uint64_t>(u), out + u * m);
        },
        [&](int64_t g0, int64_t g1) { std::memset(out + g0 * m, 0, (g1 - g0) * m * sizeof(float)); });
    return;
  }
  Decoder decoder(hash, table);
  for (int64_t s = unit_begin; s < unit_end; s += kChunk) {
    const int64_t len = std::min(kChunk, unit_end - s);
    uint64_t sup[kChunkWords];
    load_chunk_bits(support, s, len, sup);
    const int64_t count = popcount_words(sup);
    if (count == 0) {
      std::memset(out + s, 0, len * sizeof(float));
    } else {
      decoder.chunk(s, len, count == len ? nullptr : sup, count, out + s);
    }
  }
}

void count_sketch_decode_units_cpu(const float* table, const int64_t* units, int64_t m, const SketchHash& hash,
                                   float* out, int64_t begin, int64_t end) {
  if (begin >= end || m == 0) return;
  if (m > 1) {
    std::unique_ptr<WindowSketcher> windows(new WindowSketcher(hash, 0, hash.rows * hash.cols, m));
    for (int64_t t = begin; t < end; ++t) windows->decode(table, static_cast<uint64_t>(units[t]), out + t * m);
    return;
  }
  // One value per unit: the units that fall in one aligned chunk of kChunk indices (consecutive in the list, as in a
  // sorted union) decode together through the chunk's active mask — lane-stepped when they are dense in it — into a
  // scratch chunk, then move to their places.
  Decoder decoder(hash, table);
  alignas(64) float scratch[kChunk];
  for (int64_t t = begin; t < end;) {
    const uint64_t s = static_cast<uint64_t>(units[t]) & ~static_cast<uint64_t>(kChunk - 1);
    uint64_t active[kChunkWords] = {};
    int64_t len = 0;
    for (; t + len < end; ++len) {
      const uint64_t offset = static_cast<uint64_t>(units[t + len]) - s;
      if (offset >= static_cast<uint64_t>(kChunk)) break;
      active[offset >> 6] |= uint64_t{1} << (offset & 63);
    }
    decoder.chunk(static_cast<int64_t>(s), kChunk, active, popcount_words(active), scratch);
    for (int64_t q = 0; q < len; ++q) out[t + q] = scratch[static_cast<uint64_t>(units[t + q]) - s];
    t += len;
  }
}

void sketch_hash_cpu(const int64_t* idx, int64_t len, int64_t m, const SketchHash& hash, int64_t* bucket,
                     int8_t* sign, int64_t begin, int64_t end) {
  const uint64_t width = static_cast<uint64_t>(m);
  for (int64_t t = begin; t < end; ++t) {
    const uint64_t i = static_cast<uint64_t>(idx[t]), u = i / width, col = i - u * width;
    for (int j = 0; j < hash.rows; ++j) {
      bucket[j * len + t] = hash.bucket(j, u, col);
      sign[j * len + t] = hash.negative(j, u, col) ? -1 : 1;
    }
  }
}

namespace {

// Byte b of support r, its padding bits past n cleared.
inline uint32_t support_byte(const uint8_t* bitmaps, int64_t r, int64_t bitmap_stride, int64_t n, int64_t b) {
  const uint32_t byte = bitmaps[r * bitmap_stride + b];
  const int64_t past = 8 * (b + 1) - n;  // > 0 only in the last byte
  return past > 0 ? byte & (0xFFu >> past) : byte;
}

// out = +0.0 + x (the first add into a zero sum: -0.0 becomes +0.0), then out = out + x, each rounded to Format.
template <typename Format>
inline void add_row(typename Format::Storage* __restrict out, const typename Format::Storage* __restrict x, int64_t m,
                    bool first) {
  using C = typename Format::Compute;
  if (first) {
    for (int64_t i = 0; i < m; ++i) out[i] = Format::store(C(0) + Format::load(x[i]));
  } else {
    for (int64_t i = 0; i < m; ++i) out[i] = Format::store(Format::load(out[i]) + Format::load(x[i]));
  }
}

template <typename Format>
inline void divide_row(typename Format::Storage* out, int64_t m, int64_t divisor) {
  using C = typename Format::Compute;
  const C d = static_cast<C>(divisor);
  for (int64_t i = 0; i < m; ++i) out[i] = Format::store(Format::load(out[i]) / d);
}

template <typename Format>
void union_sum_rows_of(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n,
                       const typename Format::Storage* rows, int64_t rank_stride, int64_t m, int64_t divisor,
                       const int64_t* first, int64_t* units, typename Format::Storage* sums, int64_t b0, int64_t b1) {
  std::unique_ptr<int64_t[]> next(new int64_t[p]);  // each rank's next row
  std::unique_ptr<uint32_t[]> held(new uint32_t[p]);  // each rank's byte b
  std::copy(first, first + p, next.get());
  int64_t t = first[p];
  for (int64_t b = b0; b < b1; ++b) {
    uint32_t any = 0;
    for (int64_t r = 0; r < p; ++r) any |= held[r] = support_byte(bitmaps, r, bitmap_stride, n, b);
    while (any) {
      const int j = __builtin_ctz(any);
      any &= any - 1;
      units[t] = 8 * b + j;
      typename Format::Storage* out = sums + t * m;
      bool none_yet = true;
      for (int64_t r = 0; r < p; ++r) {
        if (!((held[r] >> j) & 1)) continue;
        add_row<Format>(out, rows + r * rank_stride + next[r]++ * m, m, none_yet);  // units come in order
        none_yet = false;
      }
      if (divisor != 1) divide_row<Format>(out, m, divisor);
      ++t;
    }
  }
}

}  // namespace

void union_rows_count_cpu(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, int64_t* counts,
                          int64_t byte_begin, int64_t byte_end) {
  std::fill(counts, counts + p + 1, int64_t{0});
  for (int64_t b = byte_begin; b < byte_end; ++b) {
    uint32_t any = 0;
    for (int64_t r = 0; r < p; ++r) {
      const uint32_t byte = support_byte(bitmaps, r, bitmap_stride, n, b);
      counts[r] += __builtin_popcount(byte);
      any |= byte;
    }
    counts[p] += __builtin_popcount(any);
  }
}

void union_sum_rows_cpu(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, const void* rows,
                        StorageType type, int64_t rank_stride, int64_t m, int64_t divisor, const int64_t* first,
                        int64_t* units, void* sums, int64_t byte_begin, int64_t byte_end) {
  dispatch_storage(type, [&](auto format) {
    using Format = decltype(format);
    using S = typename Format::Storage;
    union_sum_rows_of<Format>(bitmaps, p, bitmap_stride, n, static_cast<const S*>(rows), rank_stride, m, divisor,
                              first, units, static_cast<S*>(sums), byte_begin, byte_end);
  });
}

}  // namespace fastdist
