// The CPU 4-bit kernels: codes against a scalar reference of the definitions, error bounds, split row ranges equal
// to one range, and qlinear (both paths) against a double-precision product with the dequantized weight.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/quant4.h"
#include "tests/quantized.h"

namespace {

using fastdist::Quant4Scheme;
using fastdist::testing::Quantized;

// Quantized in two calls over the row blocks [0, split) and [split, n / block_rows).
Quantized quantize(const std::vector<float>& w, int64_t n, int64_t k, int64_t block, Quant4Scheme scheme,
                   int64_t split, int64_t block_rows = 1) {
  const int64_t blocks = n / block_rows * (k / block);
  Quantized q(n * k / 2, blocks);
  const int64_t cut = std::min(split, n / block_rows);
  EXPECT_EQ(fastdist::quant4_quantize_cpu(w.data(), k, block, block_rows, scheme, q.packed.data(), q.scales.data(),
                                          q.zeros.data(), 0, cut), 0);
  EXPECT_EQ(fastdist::quant4_quantize_cpu(w.data(), k, block, block_rows, scheme, q.packed.data(), q.scales.data(),
                                          q.zeros.data(), cut, n / block_rows), 0);
  return q;
}

uint32_t code_at(const std::vector<uint8_t>& packed, int64_t i) {
  const uint8_t byte = packed[i / 2];
  return i % 2 == 0 ? byte >> 4 : byte & 15u;
}

std::vector<float> random_weight(int64_t size, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> w(size);
  for (auto& v : w) v = normal(rng) * 0.05f;
  return w;
}

}  // namespace

TEST(Quant4, nf4_codes_are_the_nearest_codebook_level_and_split_rows_agree) {
  const int64_t n = 7, k = 192, block = 64;
  const std::vector<float> w = random_weight(n * k, 3);
  const Quantized a = quantize(w, n, k, block, Quant4Scheme::kNF4, 0);
  const Quantized b = quantize(w, n, k, block, Quant4Scheme::kNF4, 4);
  EXPECT_TRUE(a.packed == b.packed && a.scales == b.scales) << "split row ranges give the same result";
  for (int64_t i = 0; i < n * k; ++i) {
    const float s = a.scales[i / block];
    const float v = w[i] / s;
    int best = 0;
    for (int q = 1; q < 16; ++q) {
      if (std::fabs(fastdist::nf4_code(q) - v) < std::fabs(fastdist::nf4_code(best) - v)) best = q;
    }
    const float got = fastdist::nf4_code(static_cast<int>(code_at(a.packed, i)));
    EXPECT_LE(std::fabs(got - v), std::fabs(fastdist::nf4_code(best) - v) + 1e-6f) << "value " << i;
  }
}

TEST(Quant4, int4_dequantize_is_within_half_a_step) {
  const int64_t n = 5, k = 96, block = 32;
  const std::vector<float> w = random_weight(n * k, 4);
  const Quantized q = quantize(w, n, k, block, Quant4Scheme::kInt4, 2);
  std::vector<float> out(n * k);
  fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), q.zeros.data(), k, block, 1, Quant4Scheme::kInt4,
                                  out.data(), 0, n);
  for (int64_t i = 0; i < n * k; ++i) {
    const float scale = q.scales[i / block];
    EXPECT_LE(std::fabs(out[i] - w[i]), 0.5f * scale + 1e-6f) << "value " << i;
    EXPECT_EQ(out[i], static_cast<float>(code_at(q.packed, i)) * scale + q.zeros[i / block]) << "w' = q s + z";
  }
}

TEST(Quant4, constant_blocks_come_back_exact) {
  const int64_t n = 2, k = 8, block = 4;
  std::vector<float> w(n * k, 0.25f);
  std::fill(w.begin(), w.begin() + 4, 0.0f);
  for (const Quant4Scheme scheme : {Quant4Scheme::kNF4, Quant4Scheme::kInt4}) {
    const Quantized q = quantize(w, n, k, block, scheme, 1);
    std::vector<float> out(n * k);
    fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), q.zeros.data(), k, block, 1, scheme, out.data(),
                                    0, n);
    EXPECT_TRUE(out == w) << "scheme " << static_cast<int>(scheme);
  }
}

TEST(Quant4, quantize_counts_non_finite_blocks) {
  std::vector<float> w(4 * 8, 1.0f);
  w[3] = NAN;
  w[20] = INFINITY;
  std::vector<uint8_t> packed(16);
  std::vector<float> scales(8), zeros(8);
  EXPECT_EQ(fastdist::quant4_quantize_cpu(w.data(), 8, 4, 1, Quant4Scheme::kInt4, packed.data(), scales.data(),
                                          zeros.data(), 0, 4), 2);
}

TEST(Quant4, two_dimensional_blocks_share_one_scale_and_zero_over_their_rows) {
  const int64_t n = 16, k = 32, block = 4, block_rows = 8;
  const std::vector<float> w = random_weight(n * k, 7);
  const Quantized q = quantize(w, n, k, block, Quant4Scheme::kInt4, 1, block_rows);
  std::vector<float> out(n * k);
  fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), q.zeros.data(), k, block, block_rows,
                                  Quant4Scheme::kInt4, out.data(), 0, n);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const int64_t at = (r / block_rows) * (k / block) + c / block;
      float lo = w[(r / block_rows) * block_rows * k + c / block * block], hi = lo;
      for (int64_t rr = 0; rr < block_rows; ++rr) {
        for (int64_t cc = 0; cc < block; ++cc) {
          const float v = w[((r / block_rows) * block_rows + rr) * k + c / block * block + cc];
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
      }
      EXPECT_EQ(q.zeros[at], lo);
      EXPECT_EQ(q.scales[at], (hi - lo) / 15.0f);
      EXPECT_LE(std::fabs(out[r * k + c] - w[r * k + c]), 0.5f * q.scales[at] + 1e-6f);
    }
  }
}

TEST(Quant4, qlinear_matches_the_product_with_the_dequantized_weight_on_both_paths) {
  for (const Quant4Scheme scheme : {Quant4Scheme::kNF4, Quant4Scheme::kInt4}) {
    for (const int64_t block : {int64_t{2}, int64_t{4}, int64_t{6}, int64_t{64}}) {
      for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{9}}) {
        const int64_t block_rows = block == 2 ? 3 : block == 4 ? 7 : 1;
        const int64_t n = 21, k = block == 6 ? 318 : 320;
        const std::vector<float> w = random_weight(n * k, 5);
        const std::vector<float> x = random_weight(rows * k, 6);
        std::vector<float> bias(n);
        for (int64_t r = 0; r < n; ++r) bias[r] = 0.1f * static_cast<float>(r);
        const Quantized q = quantize(w, n, k, block, scheme, 2, block_rows);
        std::vector<float> dq(n * k);
        fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), q.zeros.data(), k, block, block_rows, scheme,
                                        dq.data(), 0, n);
        std::vector<float> fast(rows * n), portable(rows * n);
        const float* zeros = scheme == Quant4Scheme::kInt4 ? q.zeros.data() : nullptr;
        fastdist::qlinear_cpu(x.data(), rows, k, q.packed.data(), q.scales.data(), zeros, n, block, block_rows, scheme,
                              bias.data(), fast.data(), 0, 10);
        fastdist::qlinear_cpu(x.data(), rows, k, q.packed.data(), q.scales.data(), zeros, n, block, block_rows, scheme,
                              bias.data(), fast.data(), 10, n);
        fastdist::qlinear_cpu(x.data(), rows, k, q.packed.data(), q.scales.data(), zeros, n, block, block_rows, scheme,
                              bias.data(), portable.data(), 0, n, fastdist::Quant4Path::kPortable);
        for (int64_t m = 0; m < rows; ++m) {
          for (int64_t r = 0; r < n; ++r) {
            double want = bias[r], magnitude = std::fabs(bias[r]);
            for (int64_t c = 0; c < k; ++c) {
              want += static_cast<double>(x[m * k + c]) * dq[r * k + c];
              magnitude += std::fabs(static_cast<double>(x[m * k + c]) * dq[r * k + c]);
            }
            const double tol = 1e-6 * magnitude + 1e-7;
            EXPECT_NEAR(fast[m * n + r], want, tol) << "block " << block << " rows " << rows << " at " << m << "," << r;
            EXPECT_NEAR(portable[m * n + r], want, tol) << "portable, block " << block << " rows " << rows;
          }
        }
      }
    }
  }
}

TEST(Quant4, dequantize_paths_agree_bit_for_bit_on_every_block_width) {
  // The AVX-512 decode (tables for blocks of a multiple of 16 columns, each lane's scale picked from the blocks its
  // 16 columns touch for any other width) against the portable per-block table and the definition, with a tail
  // shorter than 16 columns and a row range that does not start at 0.
  for (const Quant4Scheme scheme : {Quant4Scheme::kNF4, Quant4Scheme::kInt4}) {
    for (const int64_t block : {int64_t{2}, int64_t{4}, int64_t{6}, int64_t{8}, int64_t{12}, int64_t{16}, int64_t{24},
                                int64_t{32}, int64_t{48}, int64_t{100}}) {
      for (const int64_t block_rows : {int64_t{1}, int64_t{8}}) {
        const int64_t n = 16, k = block <= 8 ? 72 : 7 * block;
        const std::vector<float> w = random_weight(n * k, 11);
        const Quantized q = quantize(w, n, k, block, scheme, 1, block_rows);
        const float* zeros = scheme == Quant4Scheme::kInt4 ? q.zeros.data() : nullptr;
        std::vector<float> fast(n * k), portable(n * k);
        fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), zeros, k, block, block_rows, scheme,
                                        fast.data(), 0, 5);
        fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), zeros, k, block, block_rows, scheme,
                                        fast.data() + 5 * k, 5, n);
        fastdist::quant4_dequantize_cpu(q.packed.data(), q.scales.data(), zeros, k, block, block_rows, scheme,
                                        portable.data(), 0, n, fastdist::Quant4Path::kPortable);
        for (int64_t i = 0; i < n * k; ++i) {
          const int64_t at = (i / k / block_rows) * (k / block) + (i % k) / block;
          const float code = static_cast<float>(code_at(q.packed, i));
          const float want = scheme == Quant4Scheme::kNF4 ? fastdist::nf4_code(static_cast<int>(code)) * q.scales[at]
                                                          : code * q.scales[at] + q.zeros[at];
          ASSERT_EQ(portable[i], want) << "portable, block " << block << " x " << block_rows << " at " << i;
          ASSERT_EQ(fast[i], want) << "block " << block << " x " << block_rows << " at " << i;
        }
      }
    }
  }
}

TEST(Quant4, qlinear_gives_the_same_bits_for_a_row_of_x_alone_or_among_others_on_every_block_width) {
  // Few rows of x decode straight into registers, more go through a buffer of decoded rows; blocks of 2-16 columns,
  // of multiples of 32 and of other widths, and k with a last partial group of 32 columns: the sums are the same.
  for (const Quant4Scheme scheme : {Quant4Scheme::kNF4, Quant4Scheme::kInt4}) {
    for (const int64_t block : {int64_t{2}, int64_t{6}, int64_t{8}, int64_t{16}, int64_t{24}, int64_t{64},
                                int64_t{96}}) {
      const int64_t n = 16, k = block * ((300 + block - 1) / block), all_rows = 11;
      const Quantized q = quantize(random_weight(n * k, 21), n, k, block, scheme, 3);
      const float* zeros = scheme == Quant4Scheme::kInt4 ? q.zeros.data() : nullptr;
      const std::vector<float> x = random_weight(all_rows * k, 22);
      std::vector<float> together(all_rows * n);
      fastdist::qlinear_cpu(x.data(), all_rows, k, q.packed.data(), q.scales.data(), zeros, n, block, 1, scheme,
                            nullptr, together.data(), 0, n);
      for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{5}}) {
        std::vector<float> some(rows * n);
        fastdist::qlinear_cpu(x.data(), rows, k, q.packed.data(), q.scales.data(), zeros, n, block, 1, scheme,
                              nullptr, some.data(), 0, 5);
        fastdist::qlinear_cpu(x.data(), rows, k, q.packed.data(), q.scales.data(), zeros, n, block, 1, scheme,
                              nullptr, some.data(), 5, n);
        for (int64_t i = 0; i < rows * n; ++i) {
          ASSERT_EQ(some[i], together[i]) << "block " << block << ", " << rows << " rows, at " << i;
        }
      }
    }
  }
}
