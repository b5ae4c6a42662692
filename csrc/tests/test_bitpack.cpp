// The CPU bit-packing kernels against a naive bit-at-a-time reference, over sizes that hit every path
// (empty, partial last byte, the 32-byte vector blocks and their tails) and over split ranges.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/bitpack.h"

namespace {

using fastdist::packed_bytes;
using Bytes = std::vector<uint8_t>;

const int64_t kSizes[] = {0,  1,  2,  7,   8,   9,   15,  16,  17,  31,   32,  33,
                          63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099};
const int64_t kRows[] = {0, 1, 2, 3, 5};

Bytes random_bytes(int64_t count, std::mt19937& rng, int max_value) {
  Bytes v(count);
  std::uniform_int_distribution<int> dist(0, max_value);
  for (auto& x : v) x = static_cast<uint8_t>(dist(rng));
  return v;
}

Bytes reference_pack(const Bytes& mask, int64_t rows, int64_t n) {
  Bytes out(rows * packed_bytes(n), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k)
      if (mask[r * n + k] & 1) out[r * packed_bytes(n) + k / 8] |= static_cast<uint8_t>(1 << (k % 8));
  return out;
}

Bytes reference_unpack(const Bytes& packed, int64_t rows, int64_t n) {
  Bytes out(rows * n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) out[r * n + k] = (packed[r * packed_bytes(n) + k / 8] >> (k % 8)) & 1;
  return out;
}

// Cut points 0 = c0 <= c1 <= ... = total, some of them equal (empty ranges are legal).
std::vector<int64_t> random_cuts(int64_t total, std::mt19937& rng) {
  std::vector<int64_t> cuts = {0, total};
  std::uniform_int_distribution<int64_t> dist(0, total);
  for (int i = 0; i < 4; ++i) cuts.push_back(dist(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

int64_t first_mismatch(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return -2;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace

TEST(Bitpack, pack_bits_cpu_matches_reference_with_zero_padding) {
  std::mt19937 rng(1);
  for (int64_t rows : kRows)
    for (int64_t n : kSizes) {
      const Bytes mask = random_bytes(rows * n, rng, 1);
      Bytes out(rows * packed_bytes(n), 0xFF);  // padding bits must be cleared, not left as they were
      fastdist::pack_bits_cpu(mask.data(), rows, n, out.data(), 0, static_cast<int64_t>(out.size()));
      const int64_t bad = first_mismatch(out, reference_pack(mask, rows, n));
      EXPECT_TRUE(bad == -1) << "rows=" << rows << " n=" << n << " first wrong byte " << bad;
    }
}

TEST(Bitpack, pack_bits_cpu_reads_only_bit_zero_of_mask_bytes) {
  std::mt19937 rng(2);
  for (int64_t n : kSizes) {
    const Bytes mask = random_bytes(3 * n, rng, 255);
    Bytes out(3 * packed_bytes(n));
    fastdist::pack_bits_cpu(mask.data(), 3, n, out.data(), 0, static_cast<int64_t>(out.size()));
    EXPECT_TRUE(first_mismatch(out, reference_pack(mask, 3, n)) == -1) << "n=" << n;
  }
}

TEST(Bitpack, pack_bits_cpu_split_ranges_write_exactly_their_bytes) {
  std::mt19937 rng(3);
  for (int64_t rows : kRows)
    for (int64_t n : kSizes) {
      const Bytes mask = random_bytes(rows * n, rng, 1);
      const Bytes want = reference_pack(mask, rows, n);
      const std::vector<int64_t> cuts = random_cuts(static_cast<int64_t>(want.size()), rng);
      Bytes out(want.size(), 0xAB);
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        fastdist::pack_bits_cpu(mask.data(), rows, n, out.data(), cuts[i], cuts[i + 1]);
        for (int64_t b = 0; b < static_cast<int64_t>(out.size()); ++b) {
          const bool written = b < cuts[i + 1];
          EXPECT_TRUE(out[b] == (written ? want[b] : 0xAB))
              << "rows=" << rows << " n=" << n << " range [" << cuts[i] << ", " << cuts[i + 1] << ") byte " << b;
        }
      }
    }
}

TEST(Bitpack, unpack_bits_cpu_matches_reference_and_ignores_padding_bits) {
  std::mt19937 rng(4);
  for (int64_t rows : kRows)
    for (int64_t n : kSizes) {
      const Bytes packed = random_bytes(rows * packed_bytes(n), rng, 255);  // padding bits set at random
      Bytes out(rows * n, 0xAB);
      fastdist::unpack_bits_cpu(packed.data(), rows, n, out.data(), 0, static_cast<int64_t>(packed.size()));
      const int64_t bad = first_mismatch(out, reference_unpack(packed, rows, n));
      EXPECT_TRUE(bad == -1) << "rows=" << rows << " n=" << n << " first wrong element " << bad;
    }
}

TEST(Bitpack, unpack_bits_cpu_split_ranges_write_exactly_their_elements) {
  std::mt19937 rng(5);
  for (int64_t rows : kRows)
    for (int64_t n : kSizes) {
      if (n == 0) continue;
      const int64_t bpr = packed_bytes(n);
      const Bytes packed = random_bytes(rows * bpr, rng, 255);
      const Bytes want = reference_unpack(packed, rows, n);
      const std::vector<int64_t> cuts = random_cuts(static_cast<int64_t>(packed.size()), rng);
      Bytes out(want.size(), 0xAB);
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        fastdist::unpack_bits_cpu(packed.data(), rows, n, out.data(), cuts[i], cuts[i + 1]);
        for (int64_t e = 0; e < static_cast<int64_t>(out.size()); ++e) {
          const bool written = (e / n) * bpr + (e % n) / 8 < cuts[i + 1];  // its packed byte is done
          EXPECT_TRUE(out[e] == (written ? want[e] : 0xAB))
              << "rows=" << rows << " n=" << n << " range [" << cuts[i] << ", " << cuts[i + 1] << ") element " << e;
        }
      }
    }
}

TEST(Bitpack, unpack_of_pack_is_the_identity) {
  std::mt19937 rng(6);
  for (int64_t rows : kRows)
    for (int64_t n : kSizes) {
      const Bytes mask = random_bytes(rows * n, rng, 1);
      Bytes packed(rows * packed_bytes(n)), back(rows * n);
      fastdist::pack_bits_cpu(mask.data(), rows, n, packed.data(), 0, static_cast<int64_t>(packed.size()));
      fastdist::unpack_bits_cpu(packed.data(), rows, n, back.data(), 0, static_cast<int64_t>(packed.size()));
      EXPECT_TRUE(back == mask) << "rows=" << rows << " n=" << n;
    }
}

TEST(Bitpack, bitwise_or_reduce_cpu_matches_reference_over_split_ranges) {
  std::mt19937 rng(7);
  for (int64_t p : {0, 1, 2, 3, 7})
    for (int64_t b : {0, 1, 7, 8, 9, 100, 8191, 8192, 8193, 20000}) {
      const Bytes packed = random_bytes(p * b, rng, 255);
      Bytes want(b, 0);
      for (int64_t r = 0; r < p; ++r)
        for (int64_t k = 0; k < b; ++k) want[k] |= packed[r * b + k];
      Bytes out(b, 0xAB);
      const std::vector<int64_t> cuts = random_cuts(b, rng);
      for (size_t i = 0; i + 1 < cuts.size(); ++i)
        fastdist::bitwise_or_reduce_cpu(packed.data(), p, b, out.data(), cuts[i], cuts[i + 1]);
      const int64_t bad = first_mismatch(out, want);
      EXPECT_TRUE(bad == -1) << "p=" << p << " b=" << b << " first wrong byte " << bad;
    }
}

TEST(Bitpack, bitmap_from_indices_cpu_sets_the_listed_units_for_any_order_repeats_and_split) {
  std::mt19937 rng(8);
  for (int64_t n : kSizes) {
    for (int64_t k : {0, 1, 5, 64, 300}) {
      if (n == 0 && k > 0) continue;
      std::vector<int64_t> indices(k);
      std::uniform_int_distribution<int64_t> unit(0, std::max<int64_t>(n - 1, 0));
      for (auto& i : indices) i = unit(rng);  // unsorted, repeats likely for small n
      Bytes mask(n, 0);
      for (int64_t i : indices) mask[i] = 1;
      const Bytes want = reference_pack(mask, 1, n);
      const std::vector<int64_t> cuts = random_cuts(k, rng);
      Bytes out(packed_bytes(n), 0);
      for (size_t c = 0; c + 1 < cuts.size(); ++c)
        fastdist::bitmap_from_indices_cpu(indices.data(), n, out.data(), cuts[c], cuts[c + 1]);
      EXPECT_TRUE(first_mismatch(out, want) == -1) << "n=" << n << " k=" << k;
      EXPECT_EQ(fastdist::first_index_out_of_range(indices.data(), k, n), -1) << "n=" << n << " k=" << k;
    }
  }
}

TEST(Bitpack, bitmap_from_indices_cpu_skips_and_first_index_out_of_range_finds_indices_outside) {
  const std::vector<int64_t> indices = {3, -1, 9, 10, 0, INT64_MIN, INT64_MAX, 2};
  Bytes out(packed_bytes(10), 0);
  fastdist::bitmap_from_indices_cpu(indices.data(), 10, out.data(), 0, static_cast<int64_t>(indices.size()));
  Bytes mask(10, 0);
  for (int64_t u : {3, 9, 0, 2}) mask[u] = 1;
  EXPECT_TRUE(first_mismatch(out, reference_pack(mask, 1, 10)) == -1);
  EXPECT_EQ(fastdist::first_index_out_of_range(indices.data(), static_cast<int64_t>(indices.size()), 10), 1);
  EXPECT_EQ(fastdist::first_index_out_of_range(indices.data() + 2, 2, 10), 1);  // 10 == n is outside
  EXPECT_EQ(fastdist::first_index_out_of_range(indices.data(), 1, 10), -1);
}
