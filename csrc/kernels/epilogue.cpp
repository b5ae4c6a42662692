// CPU fused epilogue. Single-threaded over the rows it is given; the glue runs disjoint row ranges in parallel, and
// every value depends only on its own inputs, so results do not depend on the thread count.
//
// Each row is one loop: widen to the compute type, add the bias, activate, add the residual, round back. The
// element type, the activation and which optional inputs exist are template parameters, so each inner loop is
// straight-line arithmetic that the compiler vectorizes (AVX2 picked at run time, so the build needs no -mavx2).
//
// GCC keeps a loop with floating-point comparisons feeding selects (the clamps and sign selects of the GeLU) scalar
// under its default -ftrapping-math, which forbids evaluating both sides of a select; nothing here relies on FP
// exception flags, so this file (the header's inline functions included, hence before the #include) is compiled
// without it. Results are unchanged: only which instructions compute them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kernels/epilogue.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTDIST_EPILOGUE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FASTDIST_EPILOGUE_CLONES
#endif
// The row loops are inlined into each clone, so that the AVX2 clone's loops are AVX2 code.
#define FASTDIST_EPILOGUE_INLINE __attribute__((always_inline)) inline

namespace fastdist {
namespace {

// One row: every value read, transformed and written in one pass (no staging buffers: three arrays at the same
// offset modulo 4 KiB plus staging buffers overfill L1 cache sets). Bias and residual presence are template
// parameters, so each instantiation is one straight loop.
template <typename T, EpilogueActivation A, bool kBias, bool kResidual>
FASTDIST_EPILOGUE_INLINE void forward_row(const typename T::Storage* __restrict__ x,
                                          const typename T::Storage* __restrict__ bias,
                                          const typename T::Storage* __restrict__ residual,
                                          typename T::Storage* __restrict__ out, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    typename T::Compute u = T::load(x[j]);
    if (kBias) u += T::load(bias[j]);
    u = epilogue_act(u, A);
    if (kResidual) u += T::load(residual[j]);
    out[j] = T::store(u);
  }
}

template <typename T, EpilogueActivation A, bool kBias, bool kResidual>
FASTDIST_EPILOGUE_INLINE void forward_rows_with(const void* x_, const void* bias_, const void* residual_,
                                                void* out_, int64_t cols, int64_t row_begin, int64_t row_end) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  const S* bias = static_cast<const S*>(bias_);
  const S* residual = static_cast<const S*>(residual_);
  S* out = static_cast<S*>(out_);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t at = row * cols;
    forward_row<T, A, kBias, kResidual>(x + at, bias, kResidual ? residual + at : nullptr, out + at, cols);
  }
}

template <typename T, EpilogueActivation A>
FASTDIST_EPILOGUE_INLINE void forward_rows(const void* x, const void* bias, const void* residual, void* out,
                                           int64_t cols, int64_t row_begin, int64_t row_end) {
  if (bias && residual) return forward_rows_with<T, A, true, true>(x, bias, residual, out, cols, row_begin, row_end);
  if (bias) return forward_rows_with<T, A, true, false>(x, bias, residual, out, cols, row_begin, row_end);
  if (residual) return forward_rows_with<T, A, false, true>(x, bias, residual, out, cols, row_begin, row_end);
  forward_rows_with<T, A, false, false>(x, bias, residual, out, cols, row_begin, row_end);
}

template <typename T, EpilogueActivation A, bool kBias>
FASTDIST_EPILOGUE_INLINE void backward_rows_with(const void* grad_, const void* x_, const void* bias_,
                                                 void* grad_x_, int64_t cols, int64_t row_begin, int64_t row_end) {
  using S = typename T::Storage;
  const S* __restrict__ grad = static_cast<const S*>(grad_);
  const S* __restrict__ x = static_cast<const S*>(x_);
  const S* __restrict__ bias = static_cast<const S*>(bias_);
  S* __restrict__ grad_x = static_cast<S*>(grad_x_);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t at = row * cols;
    for (int64_t j = 0; j < cols; ++j) {
      typename T::Compute u = T::load(x[at + j]);
      if (kBias) u += T::load(bias[j]);
      grad_x[at + j] = T::store(T::load(grad[at + j]) * epilogue_act_grad(u, A));
    }
  }
}

template <typename T, EpilogueActivation A>
FASTDIST_EPILOGUE_INLINE void backward_rows(const void* grad, const void* x, const void* bias, void* grad_x,
                                            int64_t cols, int64_t row_begin, int64_t row_end) {
  if (bias) return backward_rows_with<T, A, true>(grad, x, bias, grad_x, cols, row_begin, row_end);
  backward_rows_with<T, A, false>(grad, x, bias, grad_x, cols, row_begin, row_end);
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

void bias_epilogue_cpu(const void* x, const void* bias, const void* residual, void* out, StorageType type,
                       EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end) {
  (void)rows;
  if (row_begin >= row_end || cols == 0) return;
  dispatch_storage(type, [&](auto format) {
    forward_typed<decltype(format)>(x, bias, residual, out, act, cols, row_begin, row_end);
  });
}

void bias_epilogue_backward_cpu(const void* grad, const void* x, const void* bias, void* grad_x, StorageType type,
                                EpilogueActivation act, int64_t rows, int64_t cols, int64_t row_begin,
                                int64_t row_end) {
  (void)rows;
  if (row_begin >= row_end || cols == 0) return;
  dispatch_storage(type, [&](auto format) {
    backward_typed<decltype(format)>(grad, x, bias, grad_x, act, cols, row_begin, row_end);
  });
}

}  // namespace fastdist
