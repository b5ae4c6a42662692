// The CPU fused epilogue against a double-precision reference, the 16-bit conversions against bit-exact
// references (every half / bfloat16 value round-trips; float -> 16-bit rounds to nearest-even), the float32
// approximations against the C library, and split row ranges against one call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/epilogue.h"

namespace {

using fastdist::EpilogueActivation;
using fastdist::StorageType;

double reference_act(double u, EpilogueActivation act) {
  if (act == EpilogueActivation::kGeluTanh) {
    return 0.5 * u * (1.0 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
  }
  if (act == EpilogueActivation::kGeluErf) return 0.5 * u * (1.0 + std::erf(u / std::sqrt(2.0)));
  return u;
}

// Reference float -> bfloat16 / half by exhaustive search of the nearest representable value of f's sign (ties
// to the even mantissa, so a tie at zero keeps the sign).
template <typename ToFloat>
uint16_t nearest_even(float f, ToFloat to_float) {
  const uint32_t sign = std::signbit(f) ? 0x8000u : 0u;
  uint16_t best = 0;
  double best_err = INFINITY;
  for (uint32_t h = sign; h < sign + 0x8000u; ++h) {
    const float v = to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    const double err = std::fabs(static_cast<double>(v) - static_cast<double>(f));
    if (err < best_err || (err == best_err && (h & 1) == 0)) {
      best = static_cast<uint16_t>(h);
      best_err = err;
    }
  }
  return best;
}

TEST(Epilogue, every_half_and_bfloat16_value_round_trips_through_float) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    const float fh = fastdist::half_to_float(v);
    const float fb = fastdist::bfloat16_to_float(v);
    if (std::isnan(fh)) {
      EXPECT_TRUE(std::isnan(fastdist::half_to_float(fastdist::float_to_half(fh)))) << "half " << h;
    } else {
      EXPECT_TRUE(fastdist::float_to_half(fh) == v) << "half " << h;
    }
    if (std::isnan(fb)) {
      EXPECT_TRUE(std::isnan(fastdist::bfloat16_to_float(fastdist::float_to_bfloat16(fb)))) << "bf16 " << h;
    } else {
      EXPECT_TRUE(fastdist::float_to_bfloat16(fb) == v) << "bf16 " << h;
    }
  }
}

TEST(Epilogue, float_to_16_bit_rounds_to_nearest_even) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mag(-20.0f, 20.0f);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f + 1.0f / 2048,
                               1.0f + 3.0f / 2048,
                               1.0f + 1.0f / 256,
                               1.0f + 3.0f / 256,
                               65504.0f,
                               65519.0f,
                               5.9604645e-8f,
                               2.9802322e-8f,
                               1e-9f};
  for (int i = 0; i < 200; ++i) {
    values.push_back(std::ldexp(1.0f + std::fabs(mag(rng)) / 20.0f, static_cast<int>(mag(rng))));
  }
  for (float f : values) {
    const float g = -f;
    for (float x : {f, g}) {
      if (std::fabs(x) < 65520.0f) {  // the reference searches finite values; overflow is checked below
        EXPECT_TRUE(fastdist::float_to_half(x) == nearest_even(x, fastdist::half_to_float)) << "x=" << x;
      }
      if (std::fabs(x) < 3e38f) {
        EXPECT_TRUE(fastdist::float_to_bfloat16(x) == nearest_even(x, fastdist::bfloat16_to_float)) << "x=" << x;
      }
    }
  }
  EXPECT_TRUE(fastdist::float_to_half(65520.0f) == 0x7C00) << "65520 rounds to +inf";
  EXPECT_TRUE(fastdist::float_to_half(-1e6f) == 0xFC00) << "-1e6 rounds to -inf";
}

TEST(Epilogue, float32_erf_and_exp_are_close_to_the_c_library) {
  double erf_err = 0, exp_err = 0;
  for (int i = -200000; i <= 200000; ++i) {
    const float x = static_cast<float>(i) * 5e-5f;
    erf_err = std::fmax(erf_err, std::fabs(fastdist::epilogue_erff(x) - std::erf(static_cast<double>(x))));
    const float y = -std::fabs(x) * 8.0f;
    const double e = std::exp(static_cast<double>(y));
    exp_err = std::fmax(exp_err, std::fabs(fastdist::epilogue_exp_nonpositive(y) - e) / e);
  }
  EXPECT_TRUE(erf_err < 5e-7) << "erf abs error " << erf_err;
  EXPECT_TRUE(exp_err < 3e-7) << "exp rel error " << exp_err;
}

TEST(Epilogue, forward_and_backward_match_a_double_reference_and_split_ranges_match_one_call) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = 13, cols = 517;  // cols > one 256-value block, not a multiple of it
  std::vector<float> x(rows * cols), bias(cols), residual(rows * cols), grad(rows * cols);
  for (auto* v : {&x, &residual, &grad})
    for (auto& e : *v) e = normal(rng);
  for (auto& e : bias) e = normal(rng);
  for (auto act : {EpilogueActivation::kNone, EpilogueActivation::kGeluTanh, EpilogueActivation::kGeluErf}) {
    std::vector<float> out(rows * cols), split(rows * cols), gx(rows * cols);
    fastdist::bias_epilogue_cpu(x.data(), bias.data(), residual.data(), out.data(), StorageType::kFloat32, act, rows,
                                cols, 0, rows);
    fastdist::bias_epilogue_cpu(x.data(), bias.data(), residual.data(), split.data(), StorageType::kFloat32, act, rows,
                                cols, 0, 5);
    fastdist::bias_epilogue_cpu(x.data(), bias.data(), residual.data(), split.data(), StorageType::kFloat32, act, rows,
                                cols, 5, rows);
    fastdist::bias_epilogue_backward_cpu(grad.data(), x.data(), bias.data(), gx.data(), StorageType::kFloat32, act,
                                         rows, cols, 0, rows);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const double u = static_cast<double>(x[i]) + bias[i % cols];
      const double want = reference_act(u, act) + residual[i];
      EXPECT_TRUE(std::fabs(out[i] - want) <= 2e-6 * std::fmax(1.0, std::fabs(want)) + 1e-6 * std::fabs(u))
          << "act " << static_cast<int>(act) << " i " << i << " got " << out[i] << " want " << want;
      EXPECT_TRUE(split[i] == out[i]) << "split ranges differ at " << i;
      const double h = 1e-4;
      const double dact = (reference_act(u + h, act) - reference_act(u - h, act)) / (2 * h);
      EXPECT_TRUE(std::fabs(gx[i] - grad[i] * dact) <= 1e-5 * std::fmax(1.0, std::fabs(grad[i])))
          << "grad act " << static_cast<int>(act) << " i " << i << " got " << gx[i] << " want " << grad[i] * dact;
    }
  }
}

TEST(Epilogue, bfloat16_forward_is_the_float32_result_rounded_once) {
  const int64_t rows = 3, cols = 300;
  std::vector<uint16_t> x(rows * cols), bias(cols), out(rows * cols);
  std::vector<float> xf(rows * cols), bf(cols), outf(rows * cols);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = fastdist::float_to_bfloat16(normal(rng));
    xf[i] = fastdist::bfloat16_to_float(x[i]);
  }
  for (int64_t j = 0; j < cols; ++j) {
    bias[j] = fastdist::float_to_bfloat16(normal(rng));
    bf[j] = fastdist::bfloat16_to_float(bias[j]);
  }
  fastdist::bias_epilogue_cpu(x.data(), bias.data(), nullptr, out.data(), StorageType::kBFloat16,
                              EpilogueActivation::kGeluErf, rows, cols, 0, rows);
  fastdist::bias_epilogue_cpu(xf.data(), bf.data(), nullptr, outf.data(), StorageType::kFloat32,
                              EpilogueActivation::kGeluErf, rows, cols, 0, rows);
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_TRUE(out[i] == fastdist::float_to_bfloat16(outf[i])) << "i " << i;
  }
}

}  // namespace
