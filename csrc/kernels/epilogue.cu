// CUDA fused epilogue: one memory-bound elementwise pass. Grid-stride loops over the flat index with a bounded grid;
// consecutive threads touch consecutive values. The arithmetic is the header's, shared with the CPU kernel, with
// float16 / bfloat16 converted by the CUDA intrinsics (the same round-to-nearest-even as the CPU's).
#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/epilogue.h"

namespace fastdist {
namespace {

constexpr int kThreads = 256;

template <typename T, EpilogueActivation A>
__global__ void forward_kernel(const typename T::Storage* __restrict__ x, const typename T::Storage* __restrict__ bias,
                               const typename T::Storage* residual, typename T::Storage* out, int64_t total,
                               int64_t cols) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    typename T::Compute u = T::load(x[i]);
    if (bias) u += T::load(bias[i % cols]);
    u = epilogue_act(u, A);
    if (residual) u += T::load(residual[i]);
    out[i] = T::store(u);
  }
}

template <typename T, EpilogueActivation A>
__global__ void backward_kernel(const typename T::Storage* grad, const typename T::Storage* __restrict__ x,
                                const typename T::Storage* __restrict__ bias, typename T::Storage* grad_x,
                                int64_t total, int64_t cols) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    typename T::Compute u = T::load(x[i]);
    if (bias) u += T::load(bias[i % cols]);
    grad_x[i] = T::store(T::load(grad[i]) * epilogue_act_grad(u, A));
  }
}

template <typename T, EpilogueActivation A>
cudaError_t launch_forward(const void* x, const void* bias, const void* residual, void* out, int64_t total,
                           int64_t cols, cudaStream_t stream) {
  using S = typename T::Storage;
  forward_kernel<T, A><<<grid_for(total, kThreads), kThreads, 0, stream>>>(
      static_cast<const S*>(x), static_cast<const S*>(bias), static_cast<const S*>(residual), static_cast<S*>(out),
      total, cols);
  return cudaGetLastError();
}

template <typename T, EpilogueActivation A>
cudaError_t launch_backward(const void* grad, const void* x, const void* bias, void* grad_x, int64_t total,
                            int64_t cols, cudaStream_t stream) {
  using S = typename T::Storage;
  backward_kernel<T, A><<<grid_for(total, kThreads), kThreads, 0, stream>>>(
      static_cast<const S*>(grad), static_cast<const S*>(x), static_cast<const S*>(bias), static_cast<S*>(grad_x),
      total, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_typed(const void* x, const void* bias, const void* residual, void* out, EpilogueActivation act,
                          int64_t total, int64_t cols, cudaStream_t stream) {
  switch (act) {
    case EpilogueActivation::kGeluTanh:
      return launch_forward<T, EpilogueActivation::kGeluTanh>(x, bias, residual, out, total, cols, stream);
    case EpilogueActivation::kGeluErf:
      return launch_forward<T, EpilogueActivation::kGeluErf>(x, bias, residual, out, total, cols, stream);
    case EpilogueActivation::kNone:
      break;
  }
  return launch_forward<T, EpilogueActivation::kNone>(x, bias, residual, out, total, cols, stream);
}

template <typename T>
cudaError_t backward_typed(const void* grad, const void* x, const void* bias, void* grad_x, EpilogueActivation act,
                           int64_t total, int64_t cols, cudaStream_t stream) {
  switch (act) {
    case EpilogueActivation::kGeluTanh:
      return launch_backward<T, EpilogueActivation::kGeluTanh>(grad, x, bias, grad_x, total, cols, stream);
    case EpilogueActivation::kGeluErf:
      return launch_backward<T, EpilogueActivation::kGeluErf>(grad, x, bias, grad_x, total, cols, stream);
    case EpilogueActivation::kNone:
      break;
  }
  return launch_backward<T, EpilogueActivation::kNone>(grad, x, bias, grad_x, total, cols, stream);
}

}  // namespace

cudaError_t bias_epilogue_cuda(const void* x, const void* bias, const void* residual, void* out, StorageType type,
                               EpilogueActivation act, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total == 0) return cudaSuccess;
  return dispatch_storage(type, [&](auto format) {
    return forward_typed<decltype(format)>(x, bias, residual, out, act, total, cols, stream);
  });
}

cudaError_t bias_epilogue_backward_cuda(const void* grad, const void* x, const void* bias, void* grad_x,
                                        StorageType type, EpilogueActivation act, int64_t rows, int64_t cols,
                                        cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total == 0) return cudaSuccess;
  return dispatch_storage(type, [&](auto format) {
    return backward_typed<decltype(format)>(grad, x, bias, grad_x, act, total, cols, stream);
  });
}

}  // namespace fastdist
