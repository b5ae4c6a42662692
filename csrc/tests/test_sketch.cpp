// The count-sketch hash against a naive reference that uses % on unsigned __int128, and the CPU kernels against
// naive element-at-a-time references, over sizes, supports and split ranges that hit every path (direct hashing,
// lane stepping forward and back, skipped chunks, partial chunks, runs of rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/sketch.h"

namespace {

using fastdist::packed_bytes;
using fastdist::SketchHash;
using fastdist::StorageType;
using u128 = unsigned __int128;
constexpr uint64_t kP = (uint64_t{1} << 61) - 1;

// ---- references ----

uint64_t ref_splitmix(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct RefHash {
  int rows;
  uint64_t cols;
  std::vector<uint64_t> a, b, c, d, g;

  RefHash(uint64_t seed, int rows_, uint64_t cols_) : rows(rows_), cols(cols_) {
    uint64_t state = seed;
    for (int j = 0; j < rows; ++j) {
      a.push_back(1 + ref_splitmix(state) % (kP - 1));
      b.push_back(ref_splitmix(state) % kP);
      c.push_back(1 + ref_splitmix(state) % (kP - 1));
      d.push_back(ref_splitmix(state) % kP);
    }
    uint64_t column_state = seed ^ 0x243F6A8885A308D3ULL;
    for (int j = 0; j < rows; ++j) g.push_back(1 + ref_splitmix(column_state) % (kP - 1));
  }
  int64_t bucket(int j, uint64_t u, uint64_t col) const {
    return static_cast<int64_t>(((u128{a[j]} * u + b[j]) % kP % cols + col) % cols);
  }
  bool negative(int j, uint64_t u, uint64_t col) const {
    const bool unit = (((u128{c[j]} * u + d[j]) % kP) >> 30) & 1;
    const bool column = (((u128{g[j]} * col) % kP) >> 30) & 1;
    return unit != column;
  }
};

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// binary16 -> float by its definition.
float ref_half(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
  float v;
  if (exponent == 31) {
    v = mantissa ? std::nanf("") : INFINITY;
  } else if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    v = std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
  }
  return sign ? -v : v;
}

float ref_value(const void* x, StorageType type, int64_t i) {
  switch (type) {
    case StorageType::kFloat32:
      return static_cast<const float*>(x)[i];
    case StorageType::kFloat64:
      return static_cast<float>(static_cast<const double*>(x)[i]);
    case StorageType::kFloat16:
      return ref_half(static_cast<const uint16_t*>(x)[i]);
    case StorageType::kBFloat16:
      return bits_float(uint32_t{static_cast<const uint16_t*>(x)[i]} << 16);
  }
  return 0;
}

bool bit(const std::vector<uint8_t>& bitmap, int64_t u) { return (bitmap[u >> 3] >> (u & 7)) & 1; }

// Every value of every supported unit (or every non-zero value), in increasing index, in float32.
std::vector<float> ref_sketch(const void* x, StorageType type, int64_t n, int64_t m,
                              const std::vector<uint8_t>* support, const SketchHash& h) {
  std::vector<float> table(h.rows * h.cols, 0.0f);
  for (int64_t i = 0; i < n * m; ++i) {
    if (support != nullptr && !bit(*support, i / m)) continue;
    const float v = ref_value(x, type, i);
    const uint64_t u = static_cast<uint64_t>(i / m), col = static_cast<uint64_t>(i % m);
    for (int j = 0; j < h.rows; ++j) table[j * h.cols + h.bucket(j, u, col)] += h.negative(j, u, col) ? -v : v;
  }
  return table;
}

std::vector<float> ref_decode(const std::vector<float>& table, const std::vector<uint8_t>& support, int64_t n,
                              int64_t m, const SketchHash& h) {
  std::vector<float> out(n * m, 0.0f);
  for (int64_t i = 0; i < n * m; ++i) {
    if (!bit(support, i / m)) continue;
    std::vector<float> est;
    const uint64_t u = static_cast<uint64_t>(i / m), col = static_cast<uint64_t>(i % m);
    for (int j = 0; j < h.rows; ++j) {
      const float t = table[j * h.cols + h.bucket(j, u, col)];
      est.push_back(h.negative(j, u, col) ? -t : t);
    }
    const auto first_nan = std::find_if(est.begin(), est.end(), [](float v) { return std::isnan(v); });
    if (first_nan != est.end()) {
      out[i] = *first_nan;
      continue;
    }
    std::sort(est.begin(), est.end());
    const size_t r = est.size();
    out[i] = r % 2 ? est[r / 2] : 0.5f * est[r / 2 - 1] + 0.5f * est[r / 2];
  }
  return out;
}

// Bitwise equality, NaN equal to NaN.
bool same_bits(float a, float b) { return float_bits(a) == float_bits(b) || (std::isnan(a) && std::isnan(b)); }

int64_t first_mismatch(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return -2;
  for (size_t i = 0; i < got.size(); ++i)
    if (!same_bits(got[i], want[i])) return static_cast<int64_t>(i);
  return -1;
}

std::vector<uint8_t> random_bitmap(int64_t n, double density, std::mt19937_64& rng) {
  std::vector<uint8_t> bitmap(packed_bytes(n), 0);
  std::bernoulli_distribution keep(density);
  for (int64_t u = 0; u < n; ++u)
    if (keep(rng)) bitmap[u >> 3] |= static_cast<uint8_t>(1 << (u & 7));
  return bitmap;
}

// n * m float32 values, a fraction `density` of them non-zero.
std::vector<float> random_values(int64_t count, double density, std::mt19937_64& rng) {
  std::vector<float> v(count, 0.0f);
  std::bernoulli_distribution keep(density);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  for (auto& x : v)
    if (keep(rng)) x = value(rng);
  return v;
}

std::vector<int64_t> random_cuts(int64_t total, std::mt19937_64& rng) {
  std::vector<int64_t> cuts = {0, total};
  std::uniform_int_distribution<int64_t> dist(0, total);
  for (int i = 0; i < 4; ++i) cuts.push_back(dist(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

const uint64_t kEdgeIndices[] = {
    0,          1,    2,      7,      8,          (1ULL << 31) - 1, 1ULL << 31,   1ULL << 32,
    kP - 1,     kP,   kP + 1, 2 * kP, 1ULL << 40, (1ULL << 40) - 1, (1ULL << 62), (1ULL << 63) - 1,
    1ULL << 63, ~0ULL};

}  // namespace

// ---- the hash ----

TEST(Sketch, mersenne_arithmetic_matches_int128_remainders) {
  std::mt19937_64 rng(1);
  std::vector<uint64_t> xs(std::begin(kEdgeIndices), std::end(kEdgeIndices));
  for (int k = 0; k < 2000; ++k) xs.push_back(rng());
  for (uint64_t x : xs) {
    EXPECT_TRUE(fastdist::sketch_mod_p(x) == x % kP) << "x=" << x;
    const uint64_t a = x % kP;
    for (uint64_t y : {uint64_t{0}, uint64_t{1}, kP - 1, rng() % kP, rng() % kP}) {
      EXPECT_TRUE(fastdist::sketch_mulmod(a, y) == static_cast<uint64_t>(u128{a} * y % kP)) << "a=" << a << " y=" << y;
    }
  }
}

TEST(Sketch, fastmod_matches_remainder) {
  std::mt19937_64 rng(2);
  const std::vector<uint64_t> divisors = {1,
                                          2,
                                          3,
                                          7,
                                          1000,
                                          65536,
                                          1000003,
                                          (uint64_t{1} << 31) - 1,
                                          (uint64_t{1} << 32) - 1,
                                          rng() % (uint64_t{1} << 32) + 1};
  for (uint64_t d : divisors) {
    const uint64_t inv = ~uint64_t{0} / d;
    for (uint64_t x : {uint64_t{0}, d - 1, d, kP - 1, (uint64_t{1} << 62) - 1, 2 * kP}) {
      EXPECT_TRUE(fastdist::sketch_fastmod(x, d, inv) == x % d) << "x=" << x << " d=" << d;
    }
    for (int k = 0; k < 2000; ++k) {
      const uint64_t x = rng() >> 2;
      EXPECT_TRUE(fastdist::sketch_fastmod(x, d, inv) == x % d) << "x=" << x << " d=" << d;
    }
  }
}

TEST(Sketch, hash_matches_the_int128_reference) {
  std::mt19937_64 rng(3);
  const std::vector<uint64_t> seeds = {0, 1, 12345, (uint64_t{1} << 63) - 1, rng() >> 1};
  for (uint64_t seed : seeds) {
    for (int64_t cols : {int64_t{1}, int64_t{2}, int64_t{1000}, int64_t{65537}, fastdist::kSketchMaxCols}) {
      const SketchHash h = fastdist::make_sketch_hash(seed, fastdist::kSketchMaxRows, cols);
      const RefHash ref(seed, fastdist::kSketchMaxRows, static_cast<uint64_t>(cols));
      std::vector<uint64_t> indices(std::begin(kEdgeIndices), std::end(kEdgeIndices));
      for (int k = 0; k < 100; ++k) indices.push_back(rng() >> (k % 3 == 0 ? 1 : k % 3 == 1 ? 24 : 44));
      // columns past 2^62 take the bucket's plain-% path
      std::vector<uint64_t> columns = {
          0, 1, 2, 3, 1023, (uint64_t{1} << 62) - 1, uint64_t{1} << 62, kP, kP + 1, (uint64_t{1} << 63) - 1};
      for (int k = 0; k < 6; ++k) columns.push_back(rng() >> (k % 2 ? 20 : 50));
      for (int j = 0; j < h.rows; ++j) {
        EXPECT_TRUE(h.a[j] == ref.a[j] && h.b[j] == ref.b[j] && h.c[j] == ref.c[j] && h.d[j] == ref.d[j] &&
                    h.g[j] == ref.g[j])
            << "coefficients of row " << j << " seed " << seed;
        EXPECT_TRUE(h.a[j] >= 1 && h.a[j] < kP && h.b[j] < kP && h.c[j] >= 1 && h.c[j] < kP && h.d[j] < kP &&
                    h.g[j] >= 1 && h.g[j] < kP)
            << "coefficient range, row " << j;
        for (uint64_t i : indices) {
          for (uint64_t col : columns) {
            EXPECT_TRUE(h.bucket(j, i, col) == ref.bucket(j, i, col))
                << "seed=" << seed << " cols=" << cols << " j=" << j << " u=" << i << " col=" << col;
            EXPECT_TRUE(h.negative(j, i, col) == ref.negative(j, i, col))
                << "seed=" << seed << " j=" << j << " u=" << i << " col=" << col;
          }
        }
        // col 0 is the textbook per-value hash of the index: what element granularity (m = 1) uses
        for (uint64_t i : indices) {
          EXPECT_TRUE(h.bucket(j, i, 0) == static_cast<int64_t>(((u128{ref.a[j]} * i + ref.b[j]) % kP) % cols) &&
                      h.negative(j, i, 0) == (((((u128{ref.c[j]} * i + ref.d[j]) % kP) >> 30) & 1) != 0))
              << "seed=" << seed << " j=" << j << " i=" << i;
        }
      }
    }
  }
}

TEST(Sketch, sketch_hash_cpu_writes_rows_by_len_over_split_ranges) {
  std::mt19937_64 rng(4);
  const SketchHash h = fastdist::make_sketch_hash(77, 5, 999);
  std::vector<int64_t> idx(1000);
  for (auto& i : idx) i = static_cast<int64_t>(rng());
  const int64_t len = static_cast<int64_t>(idx.size());
  for (int64_t m : {int64_t{1}, int64_t{7}, int64_t{1024}}) {
    std::vector<int64_t> bucket(5 * len, -1);
    std::vector<int8_t> sign(5 * len, 0);
    const std::vector<int64_t> cuts = random_cuts(len, rng);
    for (size_t k = 0; k + 1 < cuts.size(); ++k)
      fastdist::sketch_hash_cpu(idx.data(), len, m, h, bucket.data(), sign.data(), cuts[k], cuts[k + 1]);
    for (int j = 0; j < 5; ++j)
      for (int64_t t = 0; t < len; ++t) {
        const uint64_t i = static_cast<uint64_t>(idx[t]), u = i / m, col = i % m;
        EXPECT_TRUE(bucket[j * len + t] == h.bucket(j, u, col)) << "m=" << m << " j=" << j << " t=" << t;
        EXPECT_TRUE(sign[j * len + t] == (h.negative(j, u, col) ? -1 : 1)) << "m=" << m << " j=" << j << " t=" << t;
      }
  }
}

TEST(Sketch, median_of_rows) {
  float three[] = {3.0f, -1.0f, 2.0f};
  EXPECT_TRUE(fastdist::sketch_median(three, 3) == 2.0f);
  float four[] = {4.0f, 1.0f, 8.0f, 2.0f};
  EXPECT_TRUE(fastdist::sketch_median(four, 4) == 3.0f) << "mean of 2 and 4";
  float one[] = {-5.0f};
  EXPECT_TRUE(fastdist::sketch_median(one, 1) == -5.0f);
  float with_nan[] = {1.0f, std::nanf(""), 2.0f};
  EXPECT_TRUE(std::isnan(fastdist::sketch_median(with_nan, 3)));
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> value(-10.0f, 10.0f);
  for (int rows = 1; rows <= fastdist::kSketchMaxRows; ++rows)
    for (int k = 0; k < 200; ++k) {
      std::vector<float> v(rows);
      for (auto& x : v) x = k % 4 == 0 ? std::round(value(rng)) : value(rng);  // ties too
      std::vector<float> sorted = v;
      std::sort(sorted.begin(), sorted.end());
      const float want = rows % 2 ? sorted[rows / 2] : 0.5f * sorted[rows / 2 - 1] + 0.5f * sorted[rows / 2];
      EXPECT_TRUE(fastdist::sketch_median(v.data(), rows) == want) << "rows=" << rows;
    }
}

// ---- nonzero_bitmap_cpu ----

template <typename U>
void check_nonzero_bitmap(std::mt19937_64& rng) {
  const U sign = U{1} << (8 * sizeof(U) - 1);
  for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1000}, int64_t{3000}})
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{8}, int64_t{13}, int64_t{64}, int64_t{100}}) {
      std::vector<U> x(n * m, 0);
      std::uniform_int_distribution<int> pick(0, 9);
      for (auto& v : x) {
        const int p = pick(rng);  // mostly +-0; some with one random bit set (subnormal, NaN, anything)
        v = p == 0 ? static_cast<U>(U{1} << (rng() % (8 * sizeof(U) - 1))) : p == 1 ? sign : 0;
        if (p == 0 && rng() % 2) v |= sign;
      }
      const int64_t bytes = packed_bytes(n);
      std::vector<uint8_t> want(bytes, 0);
      for (int64_t u = 0; u < n; ++u) {
        bool any = false;
        for (int64_t k = 0; k < m; ++k) any |= (x[u * m + k] & ~sign) != 0;
        if (any) want[u >> 3] |= static_cast<uint8_t>(1 << (u & 7));
      }
      std::vector<uint8_t> got(bytes, 0xAB);
      const std::vector<int64_t> cuts = random_cuts(bytes, rng);
      for (size_t k = 0; k + 1 < cuts.size(); ++k)
        fastdist::nonzero_bitmap_cpu(x.data(), sizeof(U), n, m, got.data(), cuts[k], cuts[k + 1]);
      EXPECT_TRUE(got == want) << "elem_bytes=" << sizeof(U) << " n=" << n << " m=" << m;
    }
}

TEST(Sketch, nonzero_bitmap_cpu_matches_reference_over_split_ranges) {
  std::mt19937_64 rng(6);
  check_nonzero_bitmap<uint16_t>(rng);
  check_nonzero_bitmap<uint32_t>(rng);
  check_nonzero_bitmap<uint64_t>(rng);
}

// ---- count_sketch_cpu ----

TEST(Sketch, count_sketch_cpu_matches_in_order_reference) {
  std::mt19937_64 rng(7);
  struct Shape {
    int64_t n, m;
  };
  for (Shape s : {Shape{0, 5}, Shape{1, 1}, Shape{7, 1}, Shape{300, 1}, Shape{5000, 1}, Shape{40, 2}, Shape{50, 3},
                  Shape{9, 257}, Shape{30, 64}, Shape{3, 1000}, Shape{2, 20000}})  // past the column-sign cache
    for (double density : {0.002, 0.05, 0.5, 1.0})
      for (int support_kind = 0; support_kind < 3; ++support_kind) {  // none, unit bitmap, all units
        const std::vector<float> x = random_values(s.n * s.m, support_kind == 0 ? density : 1.0, rng);
        const std::vector<uint8_t> support =
            support_kind == 1 ? random_bitmap(s.n, density, rng) : random_bitmap(s.n, 1.0, rng);
        const std::vector<uint8_t>* sup = support_kind == 0 ? nullptr : &support;
        for (int rows : {1, 3}) {
          const SketchHash h = fastdist::make_sketch_hash(rng() >> 1, rows, 1 + static_cast<int64_t>(rng() % 700));
          std::vector<float> got(rows * h.cols, 1.0f);  // every row must be overwritten
          fastdist::count_sketch_cpu(x.data(), StorageType::kFloat32, s.n, s.m, sup ? sup->data() : nullptr, h,
                                     got.data(), 0, rows * h.cols);
          const int64_t bad = first_mismatch(got, ref_sketch(x.data(), StorageType::kFloat32, s.n, s.m, sup, h));
          EXPECT_TRUE(bad == -1) << "n=" << s.n << " m=" << s.m << " density=" << density << " support=" << support_kind
                                 << " rows=" << rows << " first wrong bucket " << bad;
        }
      }
}

TEST(Sketch, count_sketch_cpu_row_ranges_write_only_their_rows) {  // element granularity splits whole rows
  std::mt19937_64 rng(8);
  const int rows = 7;
  const int64_t cols = 501;
  const SketchHash h = fastdist::make_sketch_hash(9, rows, cols);
  for (double density : {0.01, 0.3}) {  // direct hashing and lane stepping
    const std::vector<float> x = random_values(20000, density, rng);
    const std::vector<float> want = ref_sketch(x.data(), StorageType::kFloat32, 20000, 1, nullptr, h);
    std::vector<float> got(rows * cols, -1.0f);
    const std::vector<int64_t> cuts = random_cuts(rows, rng);
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      fastdist::count_sketch_cpu(x.data(), StorageType::kFloat32, 20000, 1, nullptr, h, got.data(), cuts[k] * cols,
                                 cuts[k + 1] * cols);
      for (int64_t b = 0; b < rows * cols; ++b) {
        const bool written = b < cuts[k + 1] * cols;
        EXPECT_TRUE(same_bits(got[b], written ? want[b] : -1.0f))
            << "density=" << density << " rows [" << cuts[k] << ", " << cuts[k + 1] << ") bucket " << b;
      }
    }
  }
}

TEST(Sketch, unit_sketches_over_any_position_ranges_write_only_those_positions_bit_for_bit) {
  std::mt19937_64 rng(18);
  struct Shape {
    int64_t n, m, cols;
  };
  // windows inside a row, windows that wrap, windows longer than the row (cols < m), a unit past one chunk, units
  // past the column-sign cache whose windows are whole (several rows added in one pass); 3 rows go in one pass, 5 as
  // three and two
  for (Shape s : {Shape{300, 37, 501}, Shape{40, 600, 501}, Shape{50, 300, 7}, Shape{20, 1000, 4096},
                  Shape{20, 3000, 40000}, Shape{3, 17000, 60000}})
    for (int rows : {3, 5})
      for (bool with_support : {false, true}) {
        const SketchHash h = fastdist::make_sketch_hash(rng() >> 1, rows, s.cols);
        const std::vector<float> x = random_values(s.n * s.m, 0.5, rng);
        const std::vector<uint8_t> support = random_bitmap(s.n, 0.3, rng);
        const uint8_t* sup = with_support ? support.data() : nullptr;
        const std::vector<float> want =
            ref_sketch(x.data(), StorageType::kFloat32, s.n, s.m, with_support ? &support : nullptr, h);
        std::vector<int64_t> units;  // the supported units' values, compacted, for count_sketch_units_cpu
        std::vector<float> values;
        for (int64_t u = 0; u < s.n; ++u) {
          if (sup != nullptr && !((support[u >> 3] >> (u & 7)) & 1)) continue;
          units.push_back(u);
          values.insert(values.end(), x.begin() + u * s.m, x.begin() + (u + 1) * s.m);
        }
        std::vector<float> got(rows * s.cols, -1.0f), got_units(rows * s.cols, -1.0f);
        const std::vector<int64_t> cuts = random_cuts(rows * s.cols, rng);
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
          fastdist::count_sketch_cpu(x.data(), StorageType::kFloat32, s.n, s.m, sup, h, got.data(), cuts[k],
                                     cuts[k + 1]);
          fastdist::count_sketch_units_cpu(values.data(), StorageType::kFloat32, units.data(),
                                           static_cast<int64_t>(units.size()), s.m, h, got_units.data(), cuts[k],
                                           cuts[k + 1]);
          for (int64_t b = 0; b < rows * s.cols; ++b) {
            const float expected = b < cuts[k + 1] ? want[b] : -1.0f;
            EXPECT_TRUE(same_bits(got[b], expected) && same_bits(got_units[b], expected))
                << "n=" << s.n << " m=" << s.m << " cols=" << s.cols << " support=" << with_support << " range ["
                << cuts[k] << ", " << cuts[k + 1] << ") position " << b;
          }
        }
      }
}

TEST(Sketch, count_sketch_cpu_reads_every_value_type) {
  std::mt19937_64 rng(9);
  const int64_t count = 3000;
  std::vector<uint16_t> halves(count), bf16(count);
  std::vector<double> doubles(count);
  for (int64_t i = 0; i < count; ++i) {
    halves[i] = static_cast<uint16_t>(rng() % 4 ? rng() : 0);  // every bit pattern, NaN and subnormals included
    bf16[i] = static_cast<uint16_t>(rng() % 4 ? rng() : 0x8000);
    doubles[i] = rng() % 4 ? std::ldexp(static_cast<double>(static_cast<int64_t>(rng() >> 11)), -40) : 1e-300;
  }
  const SketchHash h = fastdist::make_sketch_hash(10, 3, 4096);
  struct Case {
    const void* x;
    StorageType type;
  };
  for (Case c : {Case{halves.data(), StorageType::kFloat16}, Case{bf16.data(), StorageType::kBFloat16},
                 Case{doubles.data(), StorageType::kFloat64}}) {
    std::vector<float> got(3 * 4096);
    fastdist::count_sketch_cpu(c.x, c.type, count, 1, nullptr, h, got.data(), 0, 3 * 4096);
    const int64_t bad = first_mismatch(got, ref_sketch(c.x, c.type, count, 1, nullptr, h));
    EXPECT_TRUE(bad == -1) << "type " << static_cast<int>(c.type) << " first wrong bucket " << bad;
  }
}

TEST(Sketch, float16_values_convert_exactly_for_every_bit_pattern) {
  // One value per call, one bucket: the table holds +-value exactly.
  const SketchHash h = fastdist::make_sketch_hash(0, 1, 1);
  const float sign = h.negative(0, 0, 0) ? -1.0f : 1.0f;
  int wrong = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t half = static_cast<uint16_t>(bits);
    float table = 123.0f;
    fastdist::count_sketch_cpu(&half, StorageType::kFloat16, 1, 1, nullptr, h, &table, 0, 1);
    const float want = sign * ref_half(half);
    const bool ok = std::isnan(want) ? std::isnan(table) : table == want;
    if (!ok && wrong++ < 5) {
      EXPECT_TRUE(ok) << "half bits 0x" << std::hex << bits << " got " << table << " want " << want;
    }
  }
  EXPECT_TRUE(wrong == 0) << wrong << " wrong conversions";
}

// ---- count_sketch_decode_cpu ----

TEST(Sketch, count_sketch_decode_cpu_matches_reference_over_split_ranges) {
  std::mt19937_64 rng(11);
  struct Shape {
    int64_t n, m;
  };
  for (Shape s : {Shape{0, 3}, Shape{1, 1}, Shape{9, 1}, Shape{5000, 1}, Shape{40, 2}, Shape{70, 3}, Shape{9, 257},
                  Shape{20, 64}, Shape{3, 1000}, Shape{2, 20000}, Shape{5, 0}})
    for (double density : {0.002, 0.05, 0.5, 1.0})
      for (int rows : {1, 2, 3, 4, 5, 15}) {
        // short rows: windows that wrap; long ones: whole windows, which three rows decode in one pass
        const int64_t cols =
            rng() % 2 ? 1 + static_cast<int64_t>(rng() % 500) : 20000 + static_cast<int64_t>(rng() % 50000);
        const SketchHash h = fastdist::make_sketch_hash(rng() >> 1, rows, cols);
        std::vector<float> table = random_values(rows * h.cols, 1.0, rng);
        if (rows == 3) table[rng() % table.size()] = std::nanf("");
        const std::vector<uint8_t> support = random_bitmap(s.n, density, rng);
        const std::vector<float> want = ref_decode(table, support, s.n, s.m, h);
        std::vector<float> got(s.n * s.m, 7.0f);
        const std::vector<int64_t> cuts = random_cuts(s.n, rng);
        for (size_t k = 0; k + 1 < cuts.size(); ++k)
          fastdist::count_sketch_decode_cpu(table.data(), support.data(), s.n, s.m, h, got.data(), cuts[k],
                                            cuts[k + 1]);
        const int64_t bad = first_mismatch(got, want);
        EXPECT_TRUE(bad == -1) << "n=" << s.n << " m=" << s.m << " density=" << density << " rows=" << rows
                               << " first wrong value " << bad;
      }
}

TEST(Sketch, count_sketch_decode_units_cpu_equals_the_full_decode_of_each_listed_unit) {
  std::mt19937_64 rng(21);
  for (int64_t m : {1, 2, 7, 300, 1000}) {
    const int64_t n = 3000 / m + 20;
    const SketchHash h = fastdist::make_sketch_hash(rng() >> 1, 3, m % 2 ? 97 : 40009);
    const std::vector<float> table = random_values(3 * h.cols, 1.0, rng);
    const std::vector<uint8_t> all(static_cast<size_t>(packed_bytes(n)), 0xFF);
    std::vector<float> full(n * m);
    fastdist::count_sketch_decode_cpu(table.data(), all.data(), n, m, h, full.data(), 0, n);
    std::vector<int64_t> units;
    for (int64_t u = 3; u < std::min<int64_t>(n, 300); ++u) units.push_back(u);     // a long run
    for (int k = 0; k < 50; ++k) units.push_back(static_cast<int64_t>(rng() % n));  // scattered, repeats
    const int64_t k = static_cast<int64_t>(units.size());
    std::vector<float> got(k * m, 7.0f);
    const std::vector<int64_t> cuts = random_cuts(k, rng);
    for (size_t c = 0; c + 1 < cuts.size(); ++c)
      fastdist::count_sketch_decode_units_cpu(table.data(), units.data(), m, h, got.data(), cuts[c], cuts[c + 1]);
    int64_t wrong = 0;
    for (int64_t t = 0; t < k; ++t)
      for (int64_t e = 0; e < m; ++e)
        wrong += std::memcmp(&got[t * m + e], &full[units[t] * m + e], sizeof(float)) != 0;
    EXPECT_TRUE(wrong == 0) << "m=" << m << ": " << wrong << " wrong values";
  }
}

TEST(Sketch, decode_of_a_sketch_without_collisions_is_exact) {
  std::mt19937_64 rng(12);
  const int64_t n = 100000;
  std::vector<float> x(n, 0.0f);
  std::vector<uint8_t> support(packed_bytes(n), 0);
  for (int k = 0; k < 10; ++k) {
    const int64_t i = static_cast<int64_t>(rng() % n);
    x[i] = static_cast<float>(k + 1) * 0.5f;
    support[i >> 3] |= static_cast<uint8_t>(1 << (i & 7));
  }
  const SketchHash h = fastdist::make_sketch_hash(13, 3, 4096);
  std::vector<float> table(3 * 4096), out(n);
  fastdist::count_sketch_cpu(x.data(), StorageType::kFloat32, n, 1, support.data(), h, table.data(), 0, 3 * 4096);
  fastdist::count_sketch_decode_cpu(table.data(), support.data(), n, 1, h, out.data(), 0, n);
  EXPECT_TRUE(out == x) << "decoded values differ";
}

// ---- the union sum of gathered rows ----

namespace {

// p supports of n units in one buffer (stride bytes apart, garbage between them and in the padding bits) and each
// rank's rows in order (k rows per rank, rank_stride values apart), float32 or float64 (T), or float16 bits.
template <typename T>
struct GatheredRows {
  int64_t p, n, m, k, bitmap_stride, rank_stride;
  std::vector<uint8_t> bitmaps;
  std::vector<T> rows;
  std::vector<std::vector<int64_t>> units;  // each rank's units, increasing
};

template <typename T, typename Draw>
GatheredRows<T> gathered_rows(int64_t p, int64_t n, int64_t m, double density, std::mt19937_64& rng, Draw draw) {
  GatheredRows<T> g{p, n, m, 0, fastdist::packed_bytes(n) + 3, 0, {}, {}, {}};
  g.bitmaps.resize(p * g.bitmap_stride);
  for (auto& b : g.bitmaps) b = static_cast<uint8_t>(rng());  // garbage, padding bits included
  for (int64_t r = 0; r < p; ++r) {
    const std::vector<uint8_t> own = random_bitmap(n, density, rng);
    std::copy(own.begin(), own.end(), g.bitmaps.begin() + r * g.bitmap_stride);
    if (n % 8) g.bitmaps[r * g.bitmap_stride + n / 8] |= static_cast<uint8_t>(0xFF << (n % 8));  // set padding bits
    g.units.emplace_back();
    for (int64_t u = 0; u < n; ++u)
      if (bit(own, u)) g.units.back().push_back(u);
    g.k = std::max<int64_t>(g.k, static_cast<int64_t>(g.units.back().size()));
  }
  g.k += 1;  // a row past every count, not to be read
  g.rank_stride = g.k * m + 5;
  g.rows.resize(p * g.rank_stride);
  for (auto& v : g.rows) v = draw();
  return g;
}

// The reference: for each unit of the union, +0.0 then each holding rank's row in rank order, through `add` (the
// storage type's rounded add), then `divide` unless divisor is 1.
template <typename T, typename Add, typename Divide>
void reference_union_sum(const GatheredRows<T>& g, int64_t divisor, Add add, Divide divide,
                         std::vector<int64_t>& units, std::vector<T>& sums) {
  std::vector<size_t> next(g.p, 0);
  for (int64_t u = 0; u < g.n; ++u) {
    std::vector<int64_t> holders;
    for (int64_t r = 0; r < g.p; ++r)
      if (next[r] < g.units[r].size() && g.units[r][next[r]] == u) holders.push_back(r);
    if (holders.empty()) continue;
    units.push_back(u);
    std::vector<T> sum(g.m, T{});  // +0.0 in every storage type
    for (int64_t r : holders) {
      const T* row = g.rows.data() + r * g.rank_stride + next[r]++ * g.m;
      for (int64_t c = 0; c < g.m; ++c) sum[c] = add(sum[c], row[c]);
    }
    if (divisor != 1)
      for (auto& v : sum) v = divide(v, divisor);
    sums.insert(sums.end(), sum.begin(), sum.end());
  }
}

// The kernels over random cuts of the bytes: counts per range, running totals, then the sums of each range.
template <typename T>
void kernel_union_sum(const GatheredRows<T>& g, StorageType type, int64_t divisor, std::mt19937_64& rng,
                      std::vector<int64_t>& units, std::vector<T>& sums) {
  const int64_t bytes = fastdist::packed_bytes(g.n);
  const std::vector<int64_t> cuts = random_cuts(bytes, rng);
  std::vector<int64_t> first(g.p + 1, 0), counts(g.p + 1);
  std::vector<std::vector<int64_t>> firsts;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    firsts.push_back(first);
    fastdist::union_rows_count_cpu(g.bitmaps.data(), g.p, g.bitmap_stride, g.n, counts.data(), cuts[c], cuts[c + 1]);
    for (int64_t r = 0; r <= g.p; ++r) first[r] += counts[r];
  }
  for (int64_t r = 0; r < g.p; ++r) EXPECT_EQ(first[r], static_cast<int64_t>(g.units[r].size())) << "rank " << r;
  units.assign(first[g.p], -1);
  sums.assign(first[g.p] * g.m, T{});
  for (size_t c = 0; c + 1 < cuts.size(); ++c)
    fastdist::union_sum_rows_cpu(g.bitmaps.data(), g.p, g.bitmap_stride, g.n, g.rows.data(), type, g.rank_stride,
                                 g.m, divisor, firsts[c].data(), units.data(), sums.data(), cuts[c], cuts[c + 1]);
}

}  // namespace

TEST(Sketch, union_sum_rows_cpu_sums_each_units_rows_in_rank_order_over_split_ranges_float32) {
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  for (int64_t p : {0, 1, 2, 3, 5})
    for (int64_t n : {0, 1, 7, 8, 9, 64, 1000, 9001})
      for (int64_t m : {1, 3, 16})
        for (double density : {0.02, 0.3, 1.0})
          for (int64_t divisor : {1, 2, 3}) {
            const auto g = gathered_rows<float>(p, n, m, density, rng, [&] { return value(rng); });
            std::vector<int64_t> want_units, got_units;
            std::vector<float> want, got;
            reference_union_sum(g, divisor, [](float a, float b) { return a + b; },
                                [](float a, int64_t d) { return a / static_cast<float>(d); }, want_units, want);
            kernel_union_sum(g, StorageType::kFloat32, divisor, rng, got_units, got);
            EXPECT_TRUE(got_units == want_units) << "p=" << p << " n=" << n << " m=" << m;
            EXPECT_EQ(first_mismatch(got, want), -1) << "p=" << p << " n=" << n << " m=" << m << " d=" << divisor;
          }
}

TEST(Sketch, union_sum_rows_cpu_adds_in_the_storage_type_float64_and_float16) {
  std::mt19937_64 rng(32);
  std::uniform_real_distribution<double> value(-1e3, 1e3);
  for (int64_t p : {2, 4}) {
    const auto g = gathered_rows<double>(p, 777, 5, 0.4, rng, [&] { return value(rng); });
    std::vector<int64_t> want_units, got_units;
    std::vector<double> want, got;
    reference_union_sum(g, 3, [](double a, double b) { return a + b; },
                        [](double a, int64_t d) { return a / static_cast<double>(d); }, want_units, want);
    kernel_union_sum(g, StorageType::kFloat64, 3, rng, got_units, got);
    EXPECT_TRUE(got_units == want_units && got == want) << "float64, p=" << p;

    // float16: each add rounds to binary16 (large and small values, so that the rounding shows)
    const auto h = gathered_rows<uint16_t>(p, 777, 5, 0.4, rng, [&] {
      return fastdist::float_to_half(static_cast<float>(value(rng)) * (rng() % 2 ? 1.0f : 1e-3f));
    });
    std::vector<int64_t> want_half_units, got_half_units;
    std::vector<uint16_t> want_half, got_half;
    const auto half_add = [](uint16_t a, uint16_t b) {
      return fastdist::float_to_half(fastdist::half_to_float(a) + fastdist::half_to_float(b));
    };
    const auto half_divide = [](uint16_t a, int64_t d) {
      return fastdist::float_to_half(fastdist::half_to_float(a) / static_cast<float>(d));
    };
    reference_union_sum(h, 2, half_add, half_divide, want_half_units, want_half);
    kernel_union_sum(h, StorageType::kFloat16, 2, rng, got_half_units, got_half);
    EXPECT_TRUE(got_half_units == want_half_units && got_half == want_half) << "float16, p=" << p;
  }
}

TEST(Sketch, union_sum_rows_cpu_starts_from_positive_zero_and_keeps_nan) {
  // one unit held by both ranks: -0 + -0 is +0 from a zero sum, as index_add_ into zeros gives; NaN propagates
  const std::vector<uint8_t> bitmaps = {1, 1};
  const std::vector<float> rows = {-0.0f, NAN, -0.0f, 1.0f};  // rank r's row at 2 r: [value, value]
  std::vector<int64_t> first = {0, 0, 0}, units(1);
  std::vector<float> sums(2, 5.0f);
  fastdist::union_sum_rows_cpu(bitmaps.data(), 2, 1, 1, rows.data(), StorageType::kFloat32, 2, 2, 1, first.data(),
                               units.data(), sums.data(), 0, 1);
  EXPECT_EQ(units[0], 0);
  EXPECT_EQ(float_bits(sums[0]), float_bits(0.0f));
  EXPECT_TRUE(std::isnan(sums[1]));
}
