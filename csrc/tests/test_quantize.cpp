// The CPU quantization kernels: codes against a scalar reference of the definition, packing against a bit-at-a-time
// reference, split ranges equal to one range, and the error bounds of dequantization.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/bitpack.h"
#include "kernels/quantize.h"
#include "tests/quantized.h"

namespace {

using fastdist::QuantScheme;
using fastdist::testing::Quantized;

Quantized run(const std::vector<float>& x, int64_t group, int bits, QuantScheme scheme, bool stochastic,
              int64_t split) {
  const int64_t n = static_cast<int64_t>(x.size()), groups = n / group;
  Quantized q(fastdist::quant_packed_bytes(n, bits), groups);
  fastdist::quantize_stats_cpu(x.data(), group, bits, scheme, q.scales.data(), q.zeros.data(), 0, groups);
  const int64_t bytes = static_cast<int64_t>(q.packed.size());
  const int64_t cut = std::min(split, bytes);
  fastdist::quantize_pack_cpu(x.data(), n, group, bits, scheme, q.scales.data(), q.zeros.data(), stochastic, 11,
                              q.packed.data(), 0, cut);
  fastdist::quantize_pack_cpu(x.data(), n, group, bits, scheme, q.scales.data(), q.zeros.data(), stochastic, 11,
                              q.packed.data(), cut, bytes);
  return q;
}

uint32_t code_at(const std::vector<uint8_t>& packed, int64_t i, int bits) {
  uint32_t code = 0;
  for (int b = 0; b < bits; ++b) {
    const int64_t bit = i * bits + b;
    code |= static_cast<uint32_t>((packed[bit / 8] >> (bit % 8)) & 1) << b;
  }
  return code;
}

}  // namespace

TEST(Quantize, quantize_codes_are_within_range_and_dequantize_within_the_bound) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const int64_t n = 3 * 1000 + 0;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng) * 3.0f;
  for (const int bits : {1, 2, 4, 8}) {
    for (const QuantScheme scheme : {QuantScheme::kMinMax, QuantScheme::kAbsMax}) {
      for (const bool stochastic : {false, true}) {
        for (const int64_t group : {int64_t{1}, int64_t{10}, int64_t{1000}, n}) {
          const Quantized a = run(x, group, bits, scheme, stochastic, 0);
          const Quantized b = run(x, group, bits, scheme, stochastic, 137);
          EXPECT_TRUE(a.packed == b.packed) << "split ranges give the same bytes, bits " << bits;
          const fastdist::QuantLevels lv = fastdist::quant_levels(scheme, bits);
          std::vector<float> y(n);
          fastdist::dequantize_cpu(a.packed.data(), n, group, bits, scheme, a.scales.data(), a.zeros.data(), y.data(),
                                   0, n);
          for (int64_t i = 0; i < n; ++i) {
            const uint32_t q = code_at(a.packed, i, bits);
            EXPECT_TRUE(static_cast<int32_t>(q) >= lv.qmin && static_cast<int32_t>(q) <= lv.qmax) << "code " << q;
            const float scale = a.scales[i / group];
            const float bound = (stochastic ? 1.0f : 0.5f) * scale + 1e-5f * std::fabs(x[i]) + 1e-6f;
            EXPECT_TRUE(std::fabs(y[i] - x[i]) <= bound) << "bits " << bits << " group " << group << " i " << i << " x "
                                                         << x[i] << " y " << y[i] << " scale " << scale;
          }
        }
      }
    }
  }
}

TEST(Quantize, quantize_stats_count_non_finite_groups) {
  std::vector<float> x(40, 1.0f);
  x[5] = NAN;
  x[33] = INFINITY;
  std::vector<float> scales(4), zeros(4);
  EXPECT_TRUE(fastdist::quantize_stats_cpu(x.data(), 10, 8, QuantScheme::kMinMax, scales.data(), zeros.data(), 0, 4) ==
              2)
      << "two of four groups are non-finite";
}

TEST(Quantize, quant_uniform_is_in_unit_interval_and_depends_on_seed_and_index) {
  double sum = 0;
  for (uint64_t i = 0; i < 10000; ++i) {
    const float u = fastdist::quant_uniform(3, i);
    EXPECT_TRUE(u >= 0.0f && u < 1.0f) << "u " << u;
    sum += u;
  }
  EXPECT_TRUE(std::fabs(sum / 10000 - 0.5) < 0.02) << "mean " << sum / 10000;
  EXPECT_TRUE(fastdist::quant_uniform(3, 7) != fastdist::quant_uniform(4, 7)) << "seed matters";
}

TEST(Quantize, nearest_rounding_sends_ties_to_the_even_code) {
  // minmax over [0, 3] in 2 bits: scale 1, so each value's code is the value itself, rounded half to even.
  const std::vector<float> x = {0.0f, 3.0f, 0.5f, 1.5f, 2.5f, 0.49f, 1.51f, 2.0f};
  const Quantized q = run(x, static_cast<int64_t>(x.size()), 2, QuantScheme::kMinMax, false, 0);
  std::vector<uint32_t> codes;
  for (size_t i = 0; i < x.size(); ++i) codes.push_back(code_at(q.packed, static_cast<int64_t>(i), 2));
  EXPECT_EQ(codes, (std::vector<uint32_t>{0, 3, 0, 2, 2, 0, 2, 2}));
}

TEST(Quantize, one_bit_codes_are_packed_in_pack_bits_order) {
  std::mt19937 rng(9);
  std::bernoulli_distribution positive(0.5);
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{1000}, int64_t{4099}}) {
    std::vector<float> x(n);
    std::vector<uint8_t> mask(n);
    for (int64_t i = 0; i < n; ++i) {
      mask[i] = positive(rng);
      x[i] = mask[i] ? 1.0f : -1.0f;
    }
    x[0] = -1.0f;  // both levels present, so the group's range is [-1, 1] and +1 is code 1
    mask[0] = 0;
    if (n > 1) {
      x[n - 1] = 1.0f;
      mask[n - 1] = 1;
    }
    const Quantized q = run(x, n, 1, QuantScheme::kMinMax, false, 0);
    std::vector<uint8_t> packed(fastdist::packed_bytes(n));
    fastdist::pack_bits_cpu(mask.data(), 1, n, packed.data(), 0, static_cast<int64_t>(packed.size()));
    EXPECT_EQ(q.packed, packed) << "n " << n;
  }
}

TEST(Quantize, a_constant_group_comes_back_exactly) {
  // A group with no range has scale 0: every code sits at the zero level and dequantizes to the group's value.
  const std::vector<float> x = {2.5f, 2.5f, 2.5f, 2.5f, -7.0f, -7.0f, -7.0f, -7.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (const int bits : {1, 2, 4, 8}) {
    for (const QuantScheme scheme : {QuantScheme::kMinMax, QuantScheme::kAbsMax}) {
      const Quantized q = run(x, 4, bits, scheme, false, 0);
      std::vector<float> y(x.size());
      fastdist::dequantize_cpu(q.packed.data(), 12, 4, bits, scheme, q.scales.data(), q.zeros.data(), y.data(), 0, 12);
      for (size_t i = 0; i < x.size(); ++i) {
        // absmax keeps only the all-zero group exact (a non-zero constant is a full-scale level, up to rounding)
        if (scheme == QuantScheme::kMinMax || x[i] == 0.0f) {
          EXPECT_EQ(y[i], x[i]) << "bits " << bits << " scheme " << static_cast<int>(scheme) << " i " << i;
        }
      }
    }
  }
}

TEST(Quantize, stochastic_rounding_is_unbiased) {
  // minmax over [0, 1] in 1 bit: 0.3 becomes 1 with probability 0.3, so the dequantized mean is 0.3.
  const int64_t n = 200000;
  std::vector<float> x(n, 0.3f);
  x[0] = 0.0f;
  x[1] = 1.0f;
  const Quantized q = run(x, n, 1, QuantScheme::kMinMax, true, 0);
  std::vector<float> y(n);
  fastdist::dequantize_cpu(q.packed.data(), n, n, 1, QuantScheme::kMinMax, q.scales.data(), q.zeros.data(), y.data(), 0,
                           n);
  double sum = 0;
  for (int64_t i = 2; i < n; ++i) sum += y[i];
  const double mean = sum / static_cast<double>(n - 2);
  EXPECT_NEAR(mean, 0.3, 0.005);  // the standard error is about 0.001
  const Quantized nearest = run(x, n, 1, QuantScheme::kMinMax, false, 0);
  EXPECT_EQ(code_at(nearest.packed, 2, 1), 0u) << "nearest rounding sends 0.3 to 0 every time";
}
