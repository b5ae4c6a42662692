// The CPU TopK kernels against a stable-sort reference (largest key first, lower index first among equal keys),
// over sizes and value distributions that exercise every radix pass, and over split row ranges.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/bitpack.h"
#include "kernels/topk.h"
#include "testing.h"

namespace {

uint32_t key_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u & 0x7FFFFFFFu;
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
    if (kind == 2) {                                   // one radix bucket, differing in the low bits only
      uint32_t u = 0x3FC00000u + low_bits(rng);
      std::memcpy(&x, &u, sizeof x);
    }
    // the largest values away from the blocks a sampling selection reads first (64 of every 512): its guess fails
    if (kind == 3) x = normal(rng) + (i % 512 < 64 ? 0.0f : 1000.0f);
  }
  return v;
}

}  // namespace

FD_TEST(topk_compress_cpu_matches_the_stable_sort_reference) {
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
            FD_EXPECT(indices[r * k + j] == want[j], "kind " << kind << " d " << d << " k " << k << " row " << r
                                                             << " j " << j << " got " << indices[r * k + j]
                                                             << " want " << want[j]);
            FD_EXPECT(values[r * k + j] == x[r * d + want[j]], "value at j " << j);
          }
        }
      }
    }
  }
}

FD_TEST(topk_decompress_and_bitmaps_round_trip) {
  std::mt19937 rng(3);
  for (const auto& [d, k] : {std::pair<int64_t, int64_t>{77, 20}, {4096, 4000}, {20011, 2002}}) {
    const int64_t rows = 4;
    const std::vector<float> x = random_row_values(rows * d, 0, rng);
    std::vector<float> values(rows * k);
    std::vector<int32_t> indices(rows * k);
    std::vector<uint64_t> scratch((fastdist::topk_cpu_scratch_bytes(d) + 7) / 8);
    fastdist::topk_compress_cpu(x.data(), rows, d, k, values.data(), indices.data(), 0, rows, scratch.data());

    std::vector<float> dense(rows * d, -1.0f);
    FD_EXPECT(fastdist::topk_decompress_cpu(values.data(), indices.data(), rows, k, d, dense.data(), 0, rows) == 0, "");
    std::vector<uint8_t> mask(rows * d, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k; ++j) mask[r * d + indices[r * k + j]] = 1;
    for (int64_t i = 0; i < rows * d; ++i) FD_EXPECT(dense[i] == (mask[i] ? x[i] : 0.0f), "i " << i);

    const int64_t bytes = fastdist::packed_bytes(d);
    std::vector<uint8_t> bitmap(rows * bytes), packed(rows * bytes);
    FD_EXPECT(fastdist::topk_indices_to_bitmap_cpu(indices.data(), rows, k, d, bitmap.data(), 0, rows) == 0, "");
    fastdist::pack_bits_cpu(mask.data(), rows, d, packed.data(), 0, rows * bytes);
    FD_EXPECT(bitmap == packed, "bitmap is pack_bits of the mask");
    std::vector<int32_t> back(rows * k);
    FD_EXPECT(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k, d, back.data(), 0, rows) == 0, "");
    FD_EXPECT(back == indices, "bitmap decodes to the indices");
    std::vector<int32_t> wider(rows * (k + 1));
    FD_EXPECT(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k + 1, d, wider.data(), 0, rows) == rows,
              "a wrong count is reported for every row");
    std::vector<int32_t> narrower(rows * (k - 1) + 1, -7);  // the last entry must stay untouched
    FD_EXPECT(fastdist::topk_bitmap_to_indices_cpu(bitmap.data(), rows, k - 1, d, narrower.data(), 0, rows) == rows,
              "too many set bits are reported for every row");
    FD_EXPECT(narrower.back() == -7, "nothing is written past the rows");
    indices[3] = indices[2];
    FD_EXPECT(fastdist::topk_indices_to_bitmap_cpu(indices.data(), rows, k, d, bitmap.data(), 0, rows) == 1,
              "a repeated index is reported");
  }
}
