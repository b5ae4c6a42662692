// CPU fused epilogue. Single-threaded over the rows it is given; the glue runs disjoint row ranges in parallel, and
// every value depends only on its own inputs, so results do not depend on the thread count.
//
// Each row is processed in blocks of kBlock values: the block is widened to the compute type in a local buffer,
// the bias add, activation and residual add run on the buffer, then it is rounded back. The activation and the
// element type are template parameters, so each inner loop is straight-line arithmetic that the compiler
// vectorizes (AVX2 picked at run time, so the build needs no -mavx2).
//
// GCC keeps a loop with floating-point comparisons feeding selects (the clamps and sign selects of the GeLU) scalar
// under its default -ftrapping-math, which forbids evaluating both sides of a select; nothing here relies on FP
// exception flags, so this file (the header's inline functions included, hence before the #include) is compiled
// without it. Results are unchanged: only which instructions compute them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kernels/epilogue.h"

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTDIST_EPILOGUE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FASTDIST_EPILOGUE_CLONES
#endif
// The row loops are inlined into each clone, so that the AVX2 clone's loops are AVX2 code.
#define FASTDIST_EPILOGUE_INLINE __attribute__((always_inline)) inline

namespace fastdist {
namespace {

constexpr int64_t kBlock = 256;

// Storage type <-> compute type.
struct F32 {
  using Storage = float;
  using Compute = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F64 {
  using Storage = double;
  using Compute = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t v) { return epilogue_half_to_float(v); }
  static uint16_t store(float v) { return epilogue_float_to_half(v); }
};
struct BF16 {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t v) { return epilogue_bf16_to_float(v); }
  static uint16_t store(float v) { return epilogue_float_to_bf16(v); }
};

template <typename T>
FASTDIST_EPILOGUE_INLINE void load_block(const typename T::Storage* __restrict__ src,
                                         typename T::Compute* __restrict__ dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = T::load(src[j]);
}

template <typename T, EpilogueActivation A>
FASTDIST_EPILOGUE_INLINE void forward_rows(const void* x_, const void* bias_, const void* residual_, void* out_,
                                           int64_t cols, int64_t row_begin, int64_t row_end) {
  using S = typename T::Storage;
  using C = typename T::Compute;
  const S* x = static_cast<const S*>(x_);
  const S* bias = static_cast<const S*>(bias_);
  const S* residual = static_cast<const S*>(residual_);
  S* out = static_cast<S*>(out_);
  C u[kBlock];
  C b[kBlock];
  C r[kBlock];
  // Row-major walk (each row's values once, in order: streaming reads and writes); the bias block is widened
  // again per row, which costs a copy within L1.
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t col0 = 0; col0 < cols; col0 += kBlock) {
      const int64_t n = std::min(kBlock, cols - col0);
      const int64_t at = row * cols + col0;
      load_block<T>(x + at, u, n);
      if (bias) {
        load_block<T>(bias + col0, b, n);
        for (int64_t j = 0; j < n; ++j) u[j] += b[j];
      }
      for (int64_t j = 0; j < n; ++j) u[j] = epilogue_act(u[j], A);
      if (residual) {
        load_block<T>(residual + at, r, n);
        for (int64_t j = 0; j < n; ++j) u[j] += r[j];
      }
      S* dst = out + at;
      for (int64_t j = 0; j < n; ++j) dst[j] = T::store(u[j]);
    }
  }
}

template <typename T, EpilogueActivation A>
FASTDIST_EPILOGUE_INLINE void backward_rows(const void* grad_, const void* x_, const void* bias_, void* grad_x_,
                                            int64_t cols, int64_t row_begin, int64_t row_end) {
  using S = typename T::Storage;
  using C = typename T::Compute;
  const S* grad = static_cast<const S*>(grad_);
  const S* x = static_cast<const S*>(x_);
  const S* bias = static_cast<const S*>(bias_);
  S* grad_x = static_cast<S*>(grad_x_);
  C u[kBlock];
  C b[kBlock];
  C g[kBlock];
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t col0 = 0; col0 < cols; col0 += kBlock) {
      const int64_t n = std::min(kBlock, cols - col0);
      const int64_t at = row * cols + col0;
      load_block<T>(x + at, u, n);
      load_block<T>(grad + at, g, n);
      if (bias) {
        load_block<T>(bias + col0, b, n);
        for (int64_t j = 0; j < n; ++j) u[j] += b[j];
      }
      for (int64_t j = 0; j < n; ++j) g[j] *= epilogue_act_grad(u[j], A);
      S* dst = grad_x + at;
      for (int64_t j = 0; j < n; ++j) dst[j] = T::store(g[j]);
    }
  }
}

template <typename T>
FASTDIST_EPILOGUE_CLONES void forward_typed(const void* x, const void* bias, const void* residual, void* out,
                                            EpilogueActivation act, int64_t cols, int64_t row_begin,
                                            int64_t row_end) {
  switch (act) {
    case EpilogueActivation::kGeluTanh:
      return forward_rows<T, EpilogueActivation::kGeluTanh>(x, bias, residual, out, cols, row_begin, row_end);
    case EpilogueActivation::kGeluErf:
      return forward_rows<T, EpilogueActivation::kGeluErf>(x, bias, residual, out, cols, row_begin, row_end);
    case EpilogueActivation::kNone:
      return forward_rows<T, EpilogueActivation::kNone>(x, bias, residual, out, cols, row_begin, row_end);
  }
}

template <typename T>
FASTDIST_EPILOGUE_CLONES void backward_typed(const void* grad, const void* x, const void* bias, void* grad_x,
                                             EpilogueActivation act, int64_t cols, int64_t row_begin,
                                             int64_t row_end) {
  switch (act) {
    case EpilogueActivation::kGeluTanh:
      return backward_rows<T, EpilogueActivation::kGeluTanh>(grad, x, bias, grad_x, cols, row_begin, row_end);
    case EpilogueActivation::kGeluErf:
      return backward_rows<T, EpilogueActivation::kGeluErf>(grad, x, bias, grad_x, cols, row_begin, row_end);
    case EpilogueActivation::kNone:
      return backward_rows<T, EpilogueActivation::kNone>(grad, x, bias, grad_x, cols, row_begin, row_end);
  }
}

}  // namespace

void bias_epilogue_cpu(const void* x, const void* bias, const void* residual, void* out, EpilogueType type,
                       EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end) {
  (void)rows;
  if (row_begin >= row_end || cols == 0) return;
  switch (type) {
    case EpilogueType::kFloat32: return forward_typed<F32>(x, bias, residual, out, act, cols, row_begin, row_end);
    case EpilogueType::kFloat64: return forward_typed<F64>(x, bias, residual, out, act, cols, row_begin, row_end);
    case EpilogueType::kFloat16: return forward_typed<F16>(x, bias, residual, out, act, cols, row_begin, row_end);
    case EpilogueType::kBFloat16: return forward_typed<BF16>(x, bias, residual, out, act, cols, row_begin, row_end);
  }
}

void bias_epilogue_backward_cpu(const void* grad, const void* x, const void* bias, void* grad_x, EpilogueType type,
                                EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin,
                                int64_t row_end) {
  (void)rows;
  if (row_begin >= row_end || cols == 0) return;
  switch (type) {
    case EpilogueType::kFloat32: return backward_typed<F32>(grad, x, bias, grad_x, act, cols, row_begin, row_end);
    case EpilogueType::kFloat64: return backward_typed<F64>(grad, x, bias, grad_x, act, cols, row_begin, row_end);
    case EpilogueType::kFloat16: return backward_typed<F16>(grad, x, bias, grad_x, act, cols, row_begin, row_end);
    case EpilogueType::kBFloat16:
      return backward_typed<BF16>(grad, x, bias, grad_x, act, cols, row_begin, row_end);
  }
}

}  // namespace fastdist
