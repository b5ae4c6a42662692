// The CPU quantization kernels: codes against a scalar reference of the definition, packing against a bit-at-a-time
// reference, split ranges equal to one range, and the error bounds of dequantization.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/quantize.h"
#include "testing.h"

namespace {

using fastdist::QuantScheme;

struct Quantized {
  std::vector<uint8_t> packed;
  std::vector<float> scales, zeros;
};

Quantized run(const std::vector<float>& x, int64_t group, int bits, QuantScheme scheme, bool stochastic,
              int64_t split) {
  const int64_t n = static_cast<int64_t>(x.size()), groups = n / group;
  Quantized q{std::vector<uint8_t>(fastdist::quant_packed_bytes(n, bits)), std::vector<float>(groups),
              std::vector<float>(groups)};
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

FD_TEST(quantize_codes_are_within_range_and_dequantize_within_the_bound) {
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
          FD_EXPECT(a.packed == b.packed, "split ranges give the same bytes, bits " << bits);
          const fastdist::QuantLevels lv = fastdist::quant_levels(scheme, bits);
          std::vector<float> y(n);
          fastdist::dequantize_cpu(a.packed.data(), n, group, bits, scheme, a.scales.data(), a.zeros.data(), y.data(),
                                   0, n);
          for (int64_t i = 0; i < n; ++i) {
            const uint32_t q = code_at(a.packed, i, bits);
            FD_EXPECT(static_cast<int32_t>(q) >= lv.qmin && static_cast<int32_t>(q) <= lv.qmax, "code " << q);
            const float scale = a.scales[i / group];
            const float bound = (stochastic ? 1.0f : 0.5f) * scale + 1e-5f * std::fabs(x[i]) + 1e-6f;
            FD_EXPECT(std::fabs(y[i] - x[i]) <= bound, "bits " << bits << " group " << group << " i " << i << " x "
                                                               << x[i] << " y " << y[i] << " scale " << scale);
          }
        }
      }
    }
  }
}

FD_TEST(quantize_stats_count_non_finite_groups) {
  std::vector<float> x(40, 1.0f);
  x[5] = NAN;
  x[33] = INFINITY;
  std::vector<float> scales(4), zeros(4);
  FD_EXPECT(fastdist::quantize_stats_cpu(x.data(), 10, 8, QuantScheme::kMinMax, scales.data(), zeros.data(), 0, 4) == 2,
            "two of four groups are non-finite");
}

FD_TEST(quant_uniform_is_in_unit_interval_and_depends_on_seed_and_index) {
  double sum = 0;
  for (uint64_t i = 0; i < 10000; ++i) {
    const float u = fastdist::quant_uniform(3, i);
    FD_EXPECT(u >= 0.0f && u < 1.0f, "u " << u);
    sum += u;
  }
  FD_EXPECT(std::fabs(sum / 10000 - 0.5) < 0.02, "mean " << sum / 10000);
  FD_EXPECT(fastdist::quant_uniform(3, 7) != fastdist::quant_uniform(4, 7), "seed matters");
}
