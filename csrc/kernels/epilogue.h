// The fused epilogue of a tensor-parallel linear: what runs on a GEMM's output once its reduction is done.
//
//   out = act(x + bias) + residual          (bias and residual optional, act = identity | GeLU tanh | GeLU erf)
//
// x, residual and out are `rows` rows of `cols` values; bias is `cols` values broadcast over the rows. One read of
// x (and residual), one write of out: the three elementwise passes torch would run become one memory pass.
// The backward of the activation: grad_x = grad * act'(x + bias) (the bias gradient is that summed over rows, the
// residual gradient is grad itself, so neither needs its own kernel).
//
// Arithmetic: float16 and bfloat16 values are computed in float32 and rounded to nearest-even once, at the store;
// float32 in float32; float64 in float64 with the C library's tanh/erf/exp. The float32 GeLU uses the rational
// approximations below (erf within 5e-7 absolute, exp within 2e-7 relative, GeLU tanh built from exp), written so
// that a CPU loop over them vectorizes; the device evaluates the same formulas, so CPU and CUDA agree to rounding.
//
//   gelu_tanh(u) = 0.5 u (1 + tanh(k (u + 0.044715 u^3))),   k = sqrt(2 / pi)
//   gelu_erf(u)  = 0.5 u (1 + erf(u / sqrt(2)))
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous and row-major.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/float_bits.h"

namespace fastdist {

enum class EpilogueActivation : int32_t { kNone = 0, kGeluTanh = 1, kGeluErf = 2 };

// ---- float32 transcendental functions, vectorizable (no calls, no branches) ----

// erf(x): odd rational approximation of degree 13/8 on [-4, 4] (erf rounds to +-1 outside).
FASTDIST_HOST_DEVICE inline float epilogue_erff(float x) {
  x = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  const float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 + -2.10102402082508e-06f;
  p = p * x2 + -5.69250639462346e-05f;
  p = p * x2 + -7.34990630326855e-04f;
  p = p * x2 + -2.95459980854025e-03f;
  p = p * x2 + -1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 + -2.13374055278905e-04f;
  q = q * x2 + -1.68282697438203e-03f;
  q = q * x2 + -7.37332916720468e-03f;
  q = q * x2 + -1.42647390514189e-02f;
  return (p * x) / q;
}

// exp(x) for x <= 0 (all GeLU needs): x = n ln2 + r, |r| <= ln2 / 2, 2^n by building the exponent
// bits, e^r by its degree-7 Taylor polynomial (relative error < 2e-7). Below -87 (results under 2^-125) it
// flushes to 0, so that a huge factor times it stays 0; NaN gives 0 too (GeLU's NaN comes through u itself).
FASTDIST_HOST_DEVICE inline float epilogue_exp_nonpositive(float x_in) {
  const bool underflows = !(x_in >= -87.0f);  // NaN included
  const float x = underflows ? -87.0f : (x_in > 0.0f ? 0.0f : x_in);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t scale = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return underflows ? 0.0f : p * float_from_bits(scale);
}

// ---- the activation and its derivative, in float32 and float64 ----

constexpr double kEpilogueSqrt2OverPi = 0.79788456080286535588;
constexpr double kEpilogueInvSqrt2 = 0.70710678118654752440;
constexpr double kEpilogueInvSqrt2Pi = 0.39894228040143267794;
constexpr double kEpilogueGeluCubic = 0.044715;

// GeLU tanh through e = exp(-2|z|), z = k (u + 0.044715 u^3): 1 + tanh(z) = 2 e / (1 + e) for z < 0 and
// 2 / (1 + e) otherwise, and 1 - tanh(z)^2 = 4 e / (1 + e)^2. Unlike 1 + t with t = tanh(z) rounded, these keep
// their relative accuracy where tanh saturates, so the value and the derivative of GeLU for very negative u (where
// both are tiny) are as accurate as elsewhere.
// Saturation: z is taken at u clamped to [-kEpilogueGeluTanhClamp, kEpilogueGeluTanhClamp], so that u^3 cannot
// overflow; at the clamp |z| > 3e10, where tanh z is exactly +-1 (e exactly 0) in float32 and float64 alike, so GeLU
// is u or -0 and its derivative 1 or 0 past it, as the exact function rounds. Infinities and NaN give torch's results:
// gelu(-inf) is NaN (0.5 u (1 + tanh z) is -inf * 0) and so is the derivative at +-inf.
constexpr double kEpilogueGeluTanhClamp = 1e4;

template <typename T>
FASTDIST_HOST_DEVICE inline T epilogue_gelu_tanh_clamp(T u) {
  const T limit = static_cast<T>(kEpilogueGeluTanhClamp);
  return u < -limit ? -limit : (u > limit ? limit : u);  // NaN stays NaN
}

FASTDIST_HOST_DEVICE inline float epilogue_gelu_tanh_inner(float u) {
  return static_cast<float>(kEpilogueSqrt2OverPi) * (u + static_cast<float>(kEpilogueGeluCubic) * u * u * u);
}

FASTDIST_HOST_DEVICE inline float epilogue_act(float u, EpilogueActivation act) {
  if (act == EpilogueActivation::kGeluTanh) {
    const float z = epilogue_gelu_tanh_inner(epilogue_gelu_tanh_clamp(u));
    const float e = epilogue_exp_nonpositive(z < 0.0f ? 2.0f * z : -2.0f * z);
    return u * (z < 0.0f ? e : 1.0f) / (1.0f + e);  // 0.5 u (1 + tanh z)
  }
  if (act == EpilogueActivation::kGeluErf) {
    return 0.5f * u * (1.0f + epilogue_erff(u * static_cast<float>(kEpilogueInvSqrt2)));
  }
  return u;
}

FASTDIST_HOST_DEVICE inline float epilogue_act_grad(float u, EpilogueActivation act) {
  if (act == EpilogueActivation::kGeluTanh) {
    const float k = static_cast<float>(kEpilogueSqrt2OverPi);
    const float a = static_cast<float>(kEpilogueGeluCubic);
    const float v = epilogue_gelu_tanh_clamp(u);
    const float z = epilogue_gelu_tanh_inner(v);
    const float e = epilogue_exp_nonpositive(z < 0.0f ? 2.0f * z : -2.0f * z);
    const float inv = 1.0f / (1.0f + e);
    const float half_one_plus_t = (z < 0.0f ? e : 1.0f) * inv;
    const float one_minus_t2 = 4.0f * e * inv * inv;
    return half_one_plus_t + 0.5f * u * one_minus_t2 * k * (1.0f + 3.0f * a * v * v);
  }
  if (act == EpilogueActivation::kGeluErf) {
    const float cdf = 0.5f * (1.0f + epilogue_erff(u * static_cast<float>(kEpilogueInvSqrt2)));
    return cdf + u * static_cast<float>(kEpilogueInvSqrt2Pi) * epilogue_exp_nonpositive(-0.5f * u * u);
  }
  return 1.0f;
}

FASTDIST_HOST_DEVICE inline double epilogue_act(double u, EpilogueActivation act) {
  if (act == EpilogueActivation::kGeluTanh) {
    const double v = epilogue_gelu_tanh_clamp(u);
    return 0.5 * u * (1.0 + tanh(kEpilogueSqrt2OverPi * (v + kEpilogueGeluCubic * v * v * v)));
  }
  if (act == EpilogueActivation::kGeluErf) return 0.5 * u * (1.0 + erf(u * kEpilogueInvSqrt2));
  return u;
}

FASTDIST_HOST_DEVICE inline double epilogue_act_grad(double u, EpilogueActivation act) {
  if (act == EpilogueActivation::kGeluTanh) {
    const double v = epilogue_gelu_tanh_clamp(u);
    const double t = tanh(kEpilogueSqrt2OverPi * (v + kEpilogueGeluCubic * v * v * v));
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * kEpilogueSqrt2OverPi * (1.0 + 3.0 * kEpilogueGeluCubic * v * v);
  }
  if (act == EpilogueActivation::kGeluErf) {
    return 0.5 * (1.0 + erf(u * kEpilogueInvSqrt2)) + u * kEpilogueInvSqrt2Pi * exp(-0.5 * u * u);
  }
  return 1.0;
}

// ---- CPU: single-threaded over rows [row_begin, row_end), so the caller can run disjoint ranges in parallel ----

// out = act(x + bias) + residual. bias (cols values) and residual (rows x cols) may be nullptr. out must not
// overlap the inputs.
void bias_epilogue_cpu(const void* x, const void* bias, const void* residual, void* out, StorageType type,
                       EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end);

// grad_x = grad * act'(x + bias). bias may be nullptr. grad_x must not overlap the inputs.
void bias_epilogue_backward_cpu(const void* grad, const void* x, const void* bias, void* grad_x, StorageType type,
                                EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin,
                                int64_t row_end);

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
#ifdef __CUDACC__

cudaError_t bias_epilogue_cuda(const void* x, const void* bias, const void* residual, void* out, StorageType type,
                               EpilogueActivation act, int64_t rows, int64_t cols, cudaStream_t stream);
cudaError_t bias_epilogue_backward_cuda(const void* grad, const void* x, const void* bias, void* grad_x,
                                        StorageType type, EpilogueActivation act, int64_t rows, int64_t cols,
                                        cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
