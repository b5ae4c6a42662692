// Randomized cases of every kernel family: random shapes with zeros among them, values with NaN (quiet, signalling,
// either sign), +-inf, -0.0, subnormals and the largest floats, ranges split as threads would run them; a fixed
// number of cases per family from a fixed seed. Each case checks a property the family's header documents, so the
// file fails like any test on a wrong result; built with -DFASTDIST_SANITIZE=ON (make sanitize-check) it also fails
// on any out-of-bounds access or undefined behaviour those inputs reach. An empty array is passed as nullptr, as the
// glue passes an empty tensor's data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/bitpack.h"
#include "kernels/epilogue.h"
#include "kernels/moe.h"
#include "kernels/quantize.h"
#include "kernels/sketch.h"
#include "kernels/topk.h"

namespace {

using Rng = std::mt19937_64;
constexpr int kCases = 40;  // per family

template <typename T>
T* data_or_null(std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}
template <typename T>
const T* data_or_null(const std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}

int64_t uniform(Rng& rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

// A size in [0, max]: zero one time in six, else mostly small.
int64_t random_size(Rng& rng, int64_t max) {
  if (uniform(rng, 0, 5) == 0) return 0;
  return uniform(rng, 0, 3) == 0 ? uniform(rng, 1, max) : uniform(rng, 1, std::min<int64_t>(max, 17));
}

// Where a range [0, total) is cut in two, as two threads would run it.
int64_t random_cut(Rng& rng, int64_t total) { return uniform(rng, 0, total); }

float float_with_bits(uint32_t u) { return fastdist::float_from_bits(u); }

// A value that is special with probability `special`: NaN of any sign and payload, +-inf, +-0, subnormal, +-max.
float random_float(Rng& rng, double special) {
  if (std::uniform_real_distribution<double>(0, 1)(rng) >= special) {
    return std::normal_distribution<float>(0.0f, 1.0f)(rng) * std::pow(10.0f, static_cast<float>(uniform(rng, -3, 3)));
  }
  switch (uniform(rng, 0, 9)) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return float_with_bits(0xFF800000u | static_cast<uint32_t>(uniform(rng, 1, 0x7FFFFF)));  // any payload
    case 2: return float_with_bits(0x7F800001u);                                                       // signalling
    case 3: return std::numeric_limits<float>::infinity();
    case 4: return -std::numeric_limits<float>::infinity();
    case 5: return -0.0f;
    case 6: return 0.0f;
    case 7: return std::numeric_limits<float>::denorm_min() * static_cast<float>(uniform(rng, 1, 1000));
    case 8: return std::numeric_limits<float>::max();
    default: return -1e38f;
  }
}

std::vector<float> random_floats(Rng& rng, int64_t count, double special) {
  std::vector<float> v(count);
  for (float& x : v) x = random_float(rng, special);
  return v;
}

bool same_float(float a, float b) {
  return fastdist::bits_of_float(a) == fastdist::bits_of_float(b) || (std::isnan(a) && std::isnan(b));
}

}  // namespace

TEST(Fuzz, bitpack_round_trips_and_or_reduces_any_shape) {
  Rng rng(101);
  for (int c = 0; c < kCases; ++c) {
    const int64_t rows = random_size(rng, 4), n = random_size(rng, 300), bytes = fastdist::packed_bytes(n);
    std::vector<uint8_t> mask(rows * n), packed(rows * bytes), back(rows * n);
    for (uint8_t& m : mask) m = static_cast<uint8_t>(uniform(rng, 0, 1));
    const int64_t cut = random_cut(rng, rows * bytes);
    fastdist::pack_bits_cpu(data_or_null(mask), rows, n, data_or_null(packed), 0, cut);
    fastdist::pack_bits_cpu(data_or_null(mask), rows, n, data_or_null(packed), cut, rows * bytes);
    fastdist::unpack_bits_cpu(data_or_null(packed), rows, n, data_or_null(back), 0, rows * bytes);
    ASSERT_EQ(back, mask) << "rows " << rows << " n " << n;

    const int64_t p = random_size(rng, 5);
    std::vector<uint8_t> bitmaps(p * bytes), unioned(bytes), want(bytes, 0);
    for (uint8_t& b : bitmaps) b = static_cast<uint8_t>(uniform(rng, 0, 255));
    for (int64_t r = 0; r < p; ++r) {
      for (int64_t b = 0; b < bytes; ++b) want[b] |= bitmaps[r * bytes + b];
    }
    const int64_t col_cut = random_cut(rng, bytes);
    fastdist::bitwise_or_reduce_cpu(data_or_null(bitmaps), p, bytes, data_or_null(unioned), 0, col_cut);
    fastdist::bitwise_or_reduce_cpu(data_or_null(bitmaps), p, bytes, data_or_null(unioned), col_cut, bytes);
    ASSERT_EQ(unioned, want) << "p " << p << " bytes " << bytes;
  }
}

TEST(Fuzz, topk_keeps_the_largest_keys_ties_to_the_lower_index_and_round_trips) {
  Rng rng(202);
  for (int c = 0; c < kCases; ++c) {
    const int64_t rows = random_size(rng, 3);
    const int64_t d = uniform(rng, 0, 9) == 0 ? uniform(rng, 8192, 12000) : uniform(rng, 1, 300);
    const int64_t k = uniform(rng, 1, d);
    const std::vector<float> x = random_floats(rng, rows * d, std::uniform_real_distribution<double>(0, 1)(rng));
    std::vector<float> values(rows * k);
    std::vector<int32_t> indices(rows * k);
    std::vector<uint64_t> scratch((fastdist::topk_cpu_scratch_bytes(d) + 7) / 8);
    const int64_t cut = random_cut(rng, rows);
    fastdist::topk_compress_cpu(data_or_null(x), rows, d, k, data_or_null(values), data_or_null(indices), 0, cut,
                                scratch.data());
    fastdist::topk_compress_cpu(data_or_null(x), rows, d, k, data_or_null(values), data_or_null(indices), cut, rows,
                                scratch.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x.data() + r * d;
      auto key = [&](int64_t i) { return fastdist::topk_key(fastdist::bits_of_float(row[i])); };
      std::vector<uint8_t> kept(d, 0);
      uint32_t threshold = ~0u;
      int64_t last_at_threshold = -1;  // the kept value of key T with the largest index
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = indices[r * k + j];
        ASSERT_TRUE(i >= 0 && i < d && (j == 0 || i > indices[r * k + j - 1])) << "row " << r << " slot " << j;
        ASSERT_TRUE(same_float(values[r * k + j], row[i]));
        kept[i] = 1;
        if (key(i) < threshold) threshold = key(i), last_at_threshold = -1;
        if (key(i) == threshold) last_at_threshold = std::max(last_at_threshold, i);
      }
      for (int64_t i = 0; i < d; ++i) {
        if (kept[i]) continue;
        ASSERT_TRUE(key(i) < threshold || (key(i) == threshold && i > last_at_threshold))
            << "d " << d << " k " << k << ": dropped " << i << " outranks a kept value";
      }
    }
    // Back to dense rows (values at their indices, zeros elsewhere), and to the bitmap form and back.
    std::vector<float> dense(rows * d);
    ASSERT_EQ(fastdist::topk_decompress_cpu(data_or_null(values), data_or_null(indices), rows, k, d,
                                            data_or_null(dense), 0, rows), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < k; ++j) ASSERT_TRUE(same_float(dense[r * d + indices[r * k + j]], values[r * k + j]));
    }
    const int64_t bytes = fastdist::packed_bytes(d);
    std::vector<uint8_t> bitmap(rows * bytes);
    std::vector<int32_t> decoded(rows * k);
    ASSERT_EQ(fastdist::topk_indices_to_bitmap_cpu(data_or_null(indices), rows, k, d, data_or_null(bitmap), 0, rows),
              0);
    ASSERT_EQ(fastdist::topk_bitmap_to_indices_cpu(data_or_null(bitmap), rows, k, d, data_or_null(decoded), 0, rows),
              0);
    ASSERT_EQ(decoded, indices);
  }
}

TEST(Fuzz, row_kernels_given_empty_rows_touch_nothing_and_return_at_once) {
  // d == 0 and k == 0: the arrays of an empty tensor have no storage at all, and may claim any number of rows
  // (torch.empty(2**62, 0)): a loop over them would not end.
  for (const int64_t rows : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1} << 62}) {
    EXPECT_EQ(fastdist::topk_indices_to_bitmap_cpu(nullptr, rows, 0, 0, nullptr, 0, rows), 0);
    EXPECT_EQ(fastdist::topk_bitmap_to_indices_cpu(nullptr, rows, 0, 0, nullptr, 0, rows), 0);
    EXPECT_EQ(fastdist::topk_decompress_cpu(nullptr, nullptr, rows, 0, 0, nullptr, 0, rows), 0);
    fastdist::moe_permute_cpu(nullptr, fastdist::StorageType::kFloat32, 0, 0, nullptr, nullptr, nullptr, 0, rows);
    fastdist::moe_unpermute_cpu(nullptr, fastdist::StorageType::kBFloat16, 0, 0, nullptr, nullptr, nullptr, 0, rows);
  }
}

TEST(Fuzz, count_sketch_agrees_with_its_support_and_unit_forms_and_decodes_alike) {
  Rng rng(303);
  const fastdist::StorageType types[] = {fastdist::StorageType::kFloat32, fastdist::StorageType::kFloat64,
                                         fastdist::StorageType::kFloat16, fastdist::StorageType::kBFloat16};
  for (int c = 0; c < kCases; ++c) {
    const fastdist::StorageType type = types[uniform(rng, 0, 3)];
    const int64_t n = random_size(rng, 200), m = random_size(rng, 9), rows = uniform(rng, 1, 7);
    const int64_t cols = uniform(rng, 1, 64);
    const fastdist::SketchHash hash = fastdist::make_sketch_hash(rng(), static_cast<int>(rows), cols);
    // Values in the storage type, about half the units all zero.
    const int elem = type == fastdist::StorageType::kFloat64 ? 8 : type == fastdist::StorageType::kFloat32 ? 4 : 2;
    std::vector<uint8_t> x(n * m * elem);
    for (int64_t u = 0; u < n; ++u) {
      const bool zero_unit = uniform(rng, 0, 1) == 0;
      for (int64_t col = 0; col < m; ++col) {
        const float v = zero_unit ? 0.0f : random_float(rng, 0.2);
        uint8_t* at = x.data() + (u * m + col) * elem;
        fastdist::dispatch_storage(type, [&](auto format) {
          const typename decltype(format)::Storage stored = format.store(v);
          std::memcpy(at, &stored, sizeof stored);
        });
      }
    }
    const int64_t bytes = fastdist::packed_bytes(n), positions = rows * cols;
    std::vector<uint8_t> support(bytes);
    const int64_t byte_cut = random_cut(rng, bytes);
    fastdist::nonzero_bitmap_cpu(data_or_null(x), elem, n, m, data_or_null(support), 0, byte_cut);
    fastdist::nonzero_bitmap_cpu(data_or_null(x), elem, n, m, data_or_null(support), byte_cut, bytes);
    std::vector<int64_t> units;
    for (int64_t u = 0; u < n; ++u) {
      if ((support[u >> 3] >> (u & 7)) & 1) units.push_back(u);
    }
    // Without a support the non-zero values are summed; with the support of the non-zero units, every value of
    // those units; from the units' rows alone, the same: three routes to one table, bit for bit.
    std::vector<float> plain(positions), supported(positions), from_units(positions);
    const int64_t cut = random_cut(rng, positions);
    for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, cut}, {cut, positions}}) {
      fastdist::count_sketch_cpu(data_or_null(x), type, n, m, nullptr, hash, plain.data(), begin, end);
      fastdist::count_sketch_cpu(data_or_null(x), type, n, m, data_or_null(support), hash, supported.data(), begin,
                                 end);
    }
    std::vector<uint8_t> rows_of_units(units.size() * m * elem);
    for (size_t t = 0; t < units.size() && m > 0; ++t) {
      std::memcpy(rows_of_units.data() + t * m * elem, x.data() + units[t] * m * elem, m * elem);
    }
    fastdist::count_sketch_units_cpu(data_or_null(rows_of_units), type, data_or_null(units),
                                     static_cast<int64_t>(units.size()), m, hash, from_units.data(), 0, positions);
    for (int64_t p = 0; p < positions; ++p) {
      ASSERT_TRUE(same_float(plain[p], supported[p]) && same_float(plain[p], from_units[p]))
          << "n " << n << " m " << m << " position " << p << ": " << plain[p] << " " << supported[p] << " "
          << from_units[p];
    }
    // Decoding the supported units in full and by their list gives the same estimates; other units are zero.
    std::vector<float> decoded(n * m), listed(units.size() * m);
    const int64_t unit_cut = random_cut(rng, n);
    fastdist::count_sketch_decode_cpu(plain.data(), data_or_null(support), n, m, hash, data_or_null(decoded), 0,
                                      unit_cut);
    fastdist::count_sketch_decode_cpu(plain.data(), data_or_null(support), n, m, hash, data_or_null(decoded), unit_cut,
                                      n);
    fastdist::count_sketch_decode_units_cpu(plain.data(), data_or_null(units), m, hash, data_or_null(listed), 0,
                                            static_cast<int64_t>(units.size()));
    size_t t = 0;
    for (int64_t u = 0; u < n; ++u) {
      const bool listed_unit = t < units.size() && units[t] == u;
      for (int64_t col = 0; col < m; ++col) {
        const float want = listed_unit ? listed[t * m + col] : 0.0f;
        ASSERT_TRUE(same_float(decoded[u * m + col], want)) << "unit " << u << " col " << col;
      }
      t += listed_unit;
    }
    // The hash itself: buckets in [0, cols), signs +-1, for any index (negative ones are large unsigned ones).
    const int64_t len = random_size(rng, 50);
    std::vector<int64_t> idx(len), bucket(rows * len);
    std::vector<int8_t> sign(rows * len);
    for (int64_t& i : idx) i = static_cast<int64_t>(rng());
    fastdist::sketch_hash_cpu(data_or_null(idx), len, uniform(rng, 1, 5), hash, data_or_null(bucket),
                              data_or_null(sign), 0, len);
    for (int64_t i = 0; i < rows * len; ++i) {
      ASSERT_TRUE(bucket[i] >= 0 && bucket[i] < cols && (sign[i] == 1 || sign[i] == -1));
    }
  }
}

TEST(Fuzz, quantize_refuses_exactly_the_non_finite_groups_and_dequantizes_the_rest_within_the_bound) {
  Rng rng(404);
  const int bit_widths[] = {1, 2, 4, 8};
  for (int c = 0; c < kCases; ++c) {
    const int64_t groups = random_size(rng, 12), group = uniform(rng, 1, 40), n = groups * group;
    const int bits = bit_widths[uniform(rng, 0, 3)];
    const fastdist::QuantScheme scheme = uniform(rng, 0, 1) ? fastdist::QuantScheme::kMinMax
                                                            : fastdist::QuantScheme::kAbsMax;
    const bool stochastic = uniform(rng, 0, 1) == 1;
    std::vector<float> x(n);
    std::vector<uint8_t> refused(groups, 0);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        float v = random_float(rng, 0.02);
        if (std::isfinite(v) && std::fabs(v) > 1e30f) v = 1.0f;  // a range past float32 also counts: kept out here
        x[i] = v;
        refused[g] |= !std::isfinite(v);
      }
    }
    const int64_t want_bad = std::count(refused.begin(), refused.end(), 1);
    std::vector<float> scales(groups), zeros(groups), back(n);
    std::vector<uint8_t> packed(fastdist::quant_packed_bytes(n, bits));
    const int64_t group_cut = random_cut(rng, groups);
    const int64_t bad = fastdist::quantize_stats_cpu(data_or_null(x), group, bits, scheme, data_or_null(scales),
                                                     data_or_null(zeros), 0, group_cut) +
                        fastdist::quantize_stats_cpu(data_or_null(x), group, bits, scheme, data_or_null(scales),
                                                     data_or_null(zeros), group_cut, groups);
    ASSERT_EQ(bad, want_bad);
    const int64_t byte_cut = random_cut(rng, fastdist::quant_packed_bytes(n, bits));
    const int64_t packed_bytes = static_cast<int64_t>(packed.size());
    for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, byte_cut}, {byte_cut, packed_bytes}}) {
      fastdist::quantize_pack_cpu(data_or_null(x), n, group, bits, scheme, data_or_null(scales), data_or_null(zeros),
                                  stochastic, 7, data_or_null(packed), begin, end);
    }
    fastdist::dequantize_cpu(data_or_null(packed), n, group, bits, scheme, data_or_null(scales), data_or_null(zeros),
                             data_or_null(back), 0, n);
    for (int64_t g = 0; g < groups; ++g) {
      if (refused[g]) continue;  // its codes mean nothing
      const float bound = (stochastic ? 1.0f : 0.5f) * scales[g] * (1 + 1e-5f) + 1e-30f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        ASSERT_LE(std::fabs(back[i] - x[i]), bound) << "bits " << bits << " value " << x[i];
      }
    }
  }
}

TEST(Fuzz, epilogue_matches_the_double_formula_rounded_to_the_storage_type_at_any_value) {
  Rng rng(505);
  const fastdist::EpilogueActivation acts[] = {fastdist::EpilogueActivation::kNone,
                                               fastdist::EpilogueActivation::kGeluTanh,
                                               fastdist::EpilogueActivation::kGeluErf};
  const fastdist::StorageType types[] = {fastdist::StorageType::kFloat32, fastdist::StorageType::kFloat64,
                                         fastdist::StorageType::kFloat16, fastdist::StorageType::kBFloat16};
  for (int c = 0; c < kCases; ++c) {
    const int64_t rows = random_size(rng, 4), cols = random_size(rng, 70);
    const fastdist::EpilogueActivation act = acts[uniform(rng, 0, 2)];
    const fastdist::StorageType type = types[uniform(rng, 0, 3)];
    const bool with_bias = uniform(rng, 0, 1) == 1, with_residual = uniform(rng, 0, 1) == 1;
    fastdist::dispatch_storage(type, [&](auto format) {
      using Format = decltype(format);
      using S = typename Format::Storage;
      auto stored = [&](int64_t count, double special) {
        std::vector<S> v(count);
        for (S& s : v) s = Format::store(random_float(rng, special));
        return v;
      };
      const std::vector<S> x = stored(rows * cols, 0.3), bias = stored(with_bias ? cols : 0, 0.1);
      const std::vector<S> residual = stored(with_residual ? rows * cols : 0, 0.1), grad = stored(rows * cols, 0.1);
      std::vector<S> out(rows * cols), grad_x(rows * cols);
      const int64_t cut = random_cut(rng, rows);
      for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, cut}, {cut, rows}}) {
        fastdist::bias_epilogue_cpu(data_or_null(x), data_or_null(bias), data_or_null(residual), data_or_null(out),
                                    type, act, rows, cols, begin, end);
        fastdist::bias_epilogue_backward_cpu(data_or_null(grad), data_or_null(x), data_or_null(bias),
                                             data_or_null(grad_x), type, act, rows, cols, begin, end);
      }
      // The compute type's x + bias, the activation (or derivative) in double, the residual (or grad) applied in
      // the compute type, one rounding to the storage type. Within the float32 approximations' error, relative to the
      // terms' size; float32 flushes derivatives under 1e-35 to 0, which a huge grad can magnify.
      const double tolerance = type == fastdist::StorageType::kFloat16    ? 2e-3
                               : type == fastdist::StorageType::kBFloat16 ? 1.6e-2
                                                                          : 2e-6;
      using Compute = typename Format::Compute;
      auto close = [&](S got_bits, Compute want_compute, double scale) {
        const double got = static_cast<double>(Format::load(got_bits));
        const double want = static_cast<double>(Format::load(Format::store(want_compute)));
        if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
        if (std::isinf(want) || std::isinf(got)) return want == got;
        return std::fabs(got - want) <= tolerance * (1 + scale);
      };
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t i = r * cols + j;
          Compute u = Format::load(x[i]);
          if (with_bias) u += Format::load(bias[j]);
          const Compute activated = static_cast<Compute>(fastdist::epilogue_act(static_cast<double>(u), act));
          const Compute res = with_residual ? Format::load(residual[i]) : Compute(0);
          ASSERT_TRUE(close(out[i], activated + res, std::fabs(activated) + std::fabs(res)))
              << "act " << static_cast<int>(act) << " u " << u << ": got " << Format::load(out[i]) << ", want "
              << activated + res;
          const Compute g = Format::load(grad[i]);
          const Compute slope = static_cast<Compute>(fastdist::epilogue_act_grad(static_cast<double>(u), act));
          const double flushed = 1e-35 * std::fabs(g) / tolerance;
          ASSERT_TRUE(close(grad_x[i], g * slope, std::fabs(g * slope) + flushed))
              << "act " << static_cast<int>(act) << " u " << u << ": got " << Format::load(grad_x[i]) << ", want "
              << g * slope;
        }
      }
    });
  }
}

TEST(Fuzz, moe_route_layout_and_permutation_hold_their_definitions_on_any_ids_and_values) {
  Rng rng(606);
  for (int c = 0; c < kCases; ++c) {
    const int64_t tokens = random_size(rng, 60), experts = uniform(rng, 1, 9), k = uniform(rng, 1, experts);
    // Route: rows with NaN, +inf or only -inf have no softmax and are counted; the others pick distinct experts.
    const std::vector<float> logits = random_floats(rng, tokens * experts, 0.05);
    std::vector<float> probs(tokens * experts), lse(tokens), weight(tokens * k);
    std::vector<int64_t> topk(tokens * k);
    int64_t want_bad = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      bool nan_or_plus_inf = false, all_minus_inf = true;
      for (int64_t e = 0; e < experts; ++e) {
        const float v = logits[t * experts + e];
        nan_or_plus_inf = nan_or_plus_inf || std::isnan(v) || v == std::numeric_limits<float>::infinity();
        all_minus_inf = all_minus_inf && v == -std::numeric_limits<float>::infinity();
      }
      want_bad += nan_or_plus_inf || all_minus_inf;
    }
    ASSERT_EQ(fastdist::moe_route_cpu(data_or_null(logits), fastdist::StorageType::kFloat32, experts, k,
                                      data_or_null(probs), data_or_null(lse), data_or_null(topk), data_or_null(weight),
                                      0, tokens),
              want_bad);
    // Layout of random ids (a few out of range, which the histogram counts and the glue refuses).
    std::vector<int64_t> ids(tokens * k);
    for (int64_t& e : ids) e = uniform(rng, 0, experts - 1);
    std::vector<int64_t> hist(k * experts, 0);
    ASSERT_EQ(fastdist::moe_layout_histogram_cpu(data_or_null(ids), tokens, k, experts, 0, tokens, hist.data()), 0);
    if (!ids.empty()) {
      std::vector<int64_t> bad_ids = ids, scratch(k * experts, 0);
      bad_ids[uniform(rng, 0, tokens * k - 1)] = uniform(rng, 0, 1) ? -1 : experts;
      ASSERT_EQ(fastdist::moe_layout_histogram_cpu(bad_ids.data(), tokens, k, experts, 0, tokens, scratch.data()), 1);
    }
    const int64_t capacity = uniform(rng, -1, tokens), n = tokens * k;
    std::vector<int64_t> counts(experts), offsets(experts + 1), dropped(experts), rank_counts(1);
    std::vector<int64_t> permutation(n), row_of_slot(n), position(n);
    std::vector<uint8_t> keep(n);
    fastdist::moe_layout_scan_cpu(hist.data(), 1, k, experts, 1, capacity, counts.data(), offsets.data(),
                                  dropped.data(), rank_counts.data());
    fastdist::moe_layout_scatter_cpu(data_or_null(ids), k, experts, capacity, offsets.data(), dropped.data(), 0,
                                     tokens, hist.data(), data_or_null(permutation), data_or_null(row_of_slot),
                                     data_or_null(position), data_or_null(keep));
    std::vector<int64_t> sorted = permutation;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t s = 0; s < n; ++s) {
      ASSERT_EQ(sorted[s], s);  // a permutation of the slots
      ASSERT_EQ(keep[s], capacity < 0 || position[s] < capacity);
      if (keep[s]) {
        ASSERT_EQ(permutation[row_of_slot[s]], s);
      } else {
        ASSERT_EQ(row_of_slot[s], -1);
      }
    }
    // Permute then unpermute without weights: every token's row comes back once per kept slot, summed in order.
    const int64_t d = random_size(rng, 20), rows = offsets[experts];
    const std::vector<float> x = random_floats(rng, tokens * d, 0.1);
    std::vector<float> expert_rows(rows * d, 0.0f), combined(tokens * d);
    fastdist::moe_permute_cpu(data_or_null(x), fastdist::StorageType::kFloat32, d, k, data_or_null(row_of_slot),
                              nullptr, data_or_null(expert_rows), 0, tokens);
    fastdist::moe_unpermute_cpu(data_or_null(expert_rows), fastdist::StorageType::kFloat32, d, k,
                                data_or_null(row_of_slot), nullptr, data_or_null(combined), 0, tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t col = 0; col < d; ++col) {
        float want = 0.0f;
        for (int64_t j = 0; j < k; ++j) want += row_of_slot[t * k + j] >= 0 ? x[t * d + col] : 0.0f;
        ASSERT_TRUE(same_float(combined[t * d + col], want)) << "token " << t << " col " << col;
      }
    }
  }
}
