// The CPU TopK kernels against a stable-sort reference (largest key first, lower index first among equal keys),
// over sizes and value distributions that exercise every radix pass, and over split row ranges.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/bitpack.h"
#include "kernels/topk.h"

namespace {

// The magnitude's bits; every NaN the one key just above infinity's.
uint32_t key_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return std::isnan(v) ? 0x7F800001u : u & 0x7FFFFFFFu;
}

std::vector<int32_t> reference_row(const float* x, int64_t d, int64_t k) {
  std::vector<int32_t> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key_of(x[a]) > key_of(x[b]); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<float> random_row_values(int64_t count, int kind, std::mt19937& rng) {
  std::vector<float> v(count);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_int_distribution<uint32_t> low_bits(0, 2047);
  for (int64_t i = 0; i < count; ++i) {
    float& x = v[i];
    if (kind == 0) x = normal(rng);
    if (kind == 1) x = static_cast<float>(small(rng));  // heavy ties
    if (kind == 2) {                                    // one radix bucket, differing in the low bits only
      uint32_t u = 0x3FC00000u + low_bits(rng);
      std::memcpy(&x, &u, sizeof x);
    }
    // the largest values away from the blocks a sampling selection reads first (64 of every 512): its guess fails
    if (kind == 3) x = normal(rng) + (i % 512 < 64 ? 0.0f : 1000.0f);
  }
  return v;
}

struct Selection {
  std::vector<float> values;
  std::vector<int32_t> indices;
};

// topk_compress_cpu of one row.
Selection select_top(const std::vector<float>& row, int64_t k) {
  const int64_t d = static_cast<int64_t>(row.size());
  Selection out{std::vector<float>(k), std::vector<int32_t>(k)};
  std::vector<uint64_t> scratch((fastdist::topk_cpu_scratch_bytes(d) + 7) / 8);
  fastdist::topk_compress_cpu(row.data(), 1, d, k, out.values.data(), out.indices.data(), 0, 1, scratch.data());
  return out;
}

}  // namespace

TEST(Topk, topk_compress_cpu_matches_the_stable_sort_reference) {
  std::mt19937 rng(7);
  const int64_t ds[] = {1, 2, 5, 8, 9, 31, 100, 1000, 4099, 20011, 65536};
  for (int kind = 0; kind < 4; ++kind) {
    for (const int64_t d : ds) {
      const int64_t rows = 3;
      const std::vector<float> x = random_row_values(rows * d, kind, rng);
      for (const int64_t k : {int64_t{1}, (d + 1) / 2, std::max<int64_t>(d / 10, 1), d}) {
        std::vector<float> values(rows * k);
        std::vector<int32_t> indices(rows * k);
        std::vector<uint64_t> scratch((fastdist::topk_cpu_scratch_bytes(d) + 7) / 8);
        // two ranges, as two threads would run them
        fastdist::topk_compress_cpu(x.data(), rows, d, k, values.data(), indices.data(), 0, 1, scratch.data());
        fastdist::topk_compress_cpu(x.data(), rows, d, k, values.data(), indices.data(), 1, rows, scratch.data());
        for (int64_t r = 0; r < rows; ++r) {
          const std::vector<int32_t> want = reference_row(x.data() + r * d, d, k);
          for (int64_t j = 0; j < k; ++j) {
            EXPECT_TRUE(indices[r * k + j] == want[j])
                << "kind " << kind << " d " << d << " k " << k << " row " << r << " j " << j << " got "
                << indices[r * k + j] << " want " << want[j];
            EXPECT_TRUE(values[r * k + j] == x[r * d + want[j]]) << "value at j " << j;
          }
        }
      }
    }
  }
}

TEST(Topk, topk_decompress_and_bitmaps_round_trip) {
  std::mt19937 rng(3);
  for (const auto& [d, k] : {std::pair<int64_t, int64_t>{77, 20}, {4096, 4000}, {20011, 2002}}) {
    const int64_t rows = 4;
    const std::vector<float> x = random_row_values(rows * d, 0, rng);
    std::vector<float> values(rows * k);
    std::vector<int32_t> indices(rows * k);
    std::vector<uint64_t> scratch((fastdist::topk_cpu_scratch_bytes(d) + 7) / 8);
    fastdist::topk_compress_cpu(x.data(), rows, d, k, values.data(), indices.data(), 0, rows, scratch.data());

    std::vector<float> dense(rows * d, -1.0f);
    EXPECT_TRUE(fastdist::topk_decompress_cpu(values.data(), indices.data(), rows, k, d, dense.data(), 0, rows) == 0);
    std::vector<uint8_t> mask(rows * d, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k; ++j) mask[r * d + indices[r * k + j]] = 1;
    for (int64_t i = 0; i < rows * d; ++i) EXPECT_TRUE(dense[i] == (mask[i] ? x[i] : 0.0f)) << "i " << i;

    const int64_t bytes = fastdist::packed_bytes(d);
    std::vector<uint8_t> bitmap(rows * bytes), packed(rows * bytes);
    EXPECT_TRUE(fastdist::topk_indices_to_bitmap_cpu(indices.data(), rows, k, d, bitmap.data(), 0, rows) == 0);
    fastdist::pack_bits_cpu(mask.data(), rows, d, packed.data(), 0, rows * bytes);
    EXPECT_TRUE(bitmap == packed) << "bitmap is pack_bits of the mask";
    std::vector<int32_t> back(rows * k);
    EXPECT_TRUE(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k, d, back.data(), 0, rows) == 0);
    EXPECT_TRUE(back == indices) << "bitmap decodes to the indices";
    std::vector<int32_t> wider(rows * (k + 1));
    EXPECT_TRUE(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k + 1, d, wider.data(), 0, rows) == rows)
        << "a wrong count is reported for every row";
    std::vector<int32_t> narrower(rows * (k - 1) + 1, -7);  // the last entry must stay untouched
    EXPECT_TRUE(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k - 1, d, narrower.data(), 0, rows) == rows)
        << "too many set bits are reported for every row";
    EXPECT_TRUE(narrower.back() == -7) << "nothing is written past the rows";
    indices[3] = indices[2];
    EXPECT_TRUE(fastdist::topk_indices_to_bitmap_cpu(indices.data(), rows, k, d, bitmap.data(), 0, rows) == 1)
        << "a repeated index is reported";
  }
}

TEST(Topk, equal_magnitudes_keep_the_lower_indices_whatever_their_sign) {
  // +-1.5 everywhere (and +-0.0, which tie too): the first k positions win, with their signs.
  std::vector<float> row(100);
  for (size_t i = 0; i < row.size(); ++i) row[i] = i % 3 == 0 ? -1.5f : 1.5f;
  const Selection top = select_top(row, 7);
  EXPECT_EQ(top.indices, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(top.values, (std::vector<float>{-1.5f, 1.5f, 1.5f, -1.5f, 1.5f, 1.5f, -1.5f}));
  const Selection zeros = select_top({0.0f, -0.0f, 0.0f, -0.0f}, 2);
  EXPECT_EQ(zeros.indices, (std::vector<int32_t>{0, 1}));
}

TEST(Topk, nan_ranks_above_infinity_which_ranks_above_every_finite_value) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<float> row = {1.0f, -inf, 3e38f, nan, -2.0f, inf, 0.5f};
  const Selection three = select_top(row, 3);
  EXPECT_EQ(three.indices, (std::vector<int32_t>{1, 3, 5}));  // NaN, then both infinities; ascending positions
  EXPECT_TRUE(three.values[0] == -inf && std::isnan(three.values[1]) && three.values[2] == inf);
  EXPECT_EQ(select_top(row, 4).indices, (std::vector<int32_t>{1, 2, 3, 5}));  // then the largest finite magnitude
  EXPECT_EQ(select_top(row, 1).indices, (std::vector<int32_t>{3}));           // NaN alone
}

TEST(Topk, nans_tie_whatever_their_payload_and_sign_so_the_lower_index_wins) {
  // Payloads growing along the row, signs alternating, quiet and signalling: by payload the last would win.
  const uint32_t nan_bits[] = {0x7F800001u, 0xFFC00000u, 0x7FC00001u, 0xFFFFFFFFu};
  for (const int64_t d : {int64_t{6}, int64_t{40}, int64_t{9000}}) {  // the scalar, eight-lane and sampled paths
    std::vector<float> row(d);
    for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(i % 7) - 3.0f;
    std::vector<int32_t> at;
    for (int n = 0; n < 4; ++n) {
      at.push_back(static_cast<int32_t>((n + 1) * d / 5));
      uint32_t bits = nan_bits[n];
      std::memcpy(&row[at.back()], &bits, sizeof bits);
    }
    for (const int64_t k : {1, 2, 3}) {
      const Selection top = select_top(row, k);
      EXPECT_EQ(top.indices, std::vector<int32_t>(at.begin(), at.begin() + k)) << "d " << d << " k " << k;
      EXPECT_EQ(top.indices, reference_row(row.data(), d, k));
    }
  }
}

TEST(Topk, a_long_row_selected_in_chunks_equals_the_whole_row_selection) {
  // The glue's per-tensor path: histograms and partitions of disjoint chunks, merged in chunk order, then finished.
  std::mt19937 rng(11);
  for (int kind = 0; kind < 4; ++kind) {
    const int64_t d = 50000, chunks = 7, chunk = (d + chunks - 1) / chunks;
    const std::vector<float> x = random_row_values(d, kind, rng);
    for (const int64_t k : {int64_t{1}, int64_t{333}, d / 2, d - 1}) {
      std::vector<uint32_t> hist(fastdist::kTopkPass1Buckets, 0);
      for (int64_t c = 0; c < chunks; ++c)
        fastdist::topk_histogram_cpu(x.data(), c * chunk, std::min(d, (c + 1) * chunk), hist.data());
      int64_t need = 0;
      const uint32_t bucket = fastdist::topk_pick_bucket(hist.data(), k, &need);
      std::vector<int32_t> above(d), pos(d);
      std::vector<uint32_t> keys(d);
      int64_t n_above = 0, n_candidates = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        int64_t chunk_above = 0, chunk_candidates = 0;
        fastdist::topk_partition_cpu(x.data(), c * chunk, std::min(d, (c + 1) * chunk), bucket, above.data() + n_above,
                                     &chunk_above, keys.data() + n_candidates, pos.data() + n_candidates,
                                     &chunk_candidates);
        n_above += chunk_above;
        n_candidates += chunk_candidates;
      }
      Selection chunked{std::vector<float>(k), std::vector<int32_t>(k)};
      fastdist::topk_finish_cpu(x.data(), k, need, bucket, above.data(), n_above, keys.data(), pos.data(), n_candidates,
                                chunked.values.data(), chunked.indices.data());
      const Selection whole = select_top(x, k);
      EXPECT_EQ(chunked.indices, whole.indices) << "kind " << kind << " k " << k;
      EXPECT_EQ(chunked.indices, reference_row(x.data(), d, k)) << "kind " << kind << " k " << k;
    }
  }
}

TEST(Topk, decompress_counts_out_of_range_indices_and_keeps_the_last_of_a_repeated_one) {
  const int64_t rows = 2, k = 4, d = 6;
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int32_t> indices = {0, 5, 5, -1,  // a repeat (the later value stays) and a negative index
                                        2, 6, 3, 1};  // d itself is out of range
  std::vector<float> dense(rows * d, -9.0f);
  EXPECT_EQ(fastdist::topk_decompress_cpu(values.data(), indices.data(), rows, k, d, dense.data(), 0, rows), 2);
  EXPECT_EQ(dense, (std::vector<float>{1, 0, 0, 0, 0, 3,  //
                                       0, 8, 5, 7, 0, 0}));
}
