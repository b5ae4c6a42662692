// CUDA kernels of the torch.ops.fastdist fused-epilogue ops (schemas in epilogue.cpp). Work runs on the current
// stream of the input's device: a tensor-parallel linear that wants its epilogue on its communication stream makes
// that stream current around the call (torch.cuda.stream(...)), as fastdist.tp does.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/epilogue.h"

namespace fastdist::epilogue {
namespace {

at::Tensor bias_epilogue_cuda_op(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual, c10::string_view activation) {
  const RowShape shape = check_bias_epilogue(x, bias, residual, std::string(activation));
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor out = at::empty(src.sizes(), src.options());
  C10_CUDA_CHECK(fastdist::bias_epilogue_cuda(src.const_data_ptr(), data_or_null(b), data_or_null(res),
                                              out.data_ptr(), storage_type_of(src, "x"),
                                              activation_of(std::string(activation)), shape.rows, shape.cols,
                                              c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor bias_epilogue_backward_cuda_op(const at::Tensor& grad, const at::Tensor& x,
                                          const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const RowShape shape = check_bias_epilogue_backward(grad, x, bias, std::string(activation));
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor g = grad.contiguous();
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor grad_x = at::empty(src.sizes(), src.options());
  C10_CUDA_CHECK(fastdist::bias_epilogue_backward_cuda(g.const_data_ptr(), src.const_data_ptr(), data_or_null(b),
                                                       grad_x.data_ptr(), storage_type_of(src, "x"),
                                                       activation_of(std::string(activation)), shape.rows, shape.cols,
                                                       c10::cuda::getCurrentCUDAStream()));
  return grad_x;
}

}  // namespace
}  // namespace fastdist::epilogue

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("bias_epilogue", &fastdist::epilogue::bias_epilogue_cuda_op);
  m.impl("bias_epilogue_backward", &fastdist::epilogue::bias_epilogue_backward_cuda_op);
}
