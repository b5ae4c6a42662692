// torch.ops.fastdist fused-epilogue ops: schemas and CPU kernels. See csrc/kernels/epilogue.h for the arithmetic.
// Parallel over rows (at::parallel_for); every value depends only on its own row, so results are bit-identical
// whatever the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/epilogue.h"
#include "ops/parallel.h"

namespace fastdist::epilogue {
namespace {

at::Tensor bias_epilogue_cpu_op(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, c10::string_view activation) {
  const RowShape shape = check_bias_epilogue(x, bias, residual, std::string(activation));
  const EpilogueActivation act = activation_of(std::string(activation));
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor out = at::empty(src.sizes(), src.options());
  const StorageType type = storage_type_of(src, "x");
  const void* in = src.const_data_ptr();
  const void* bias_data = data_or_null(b);
  const void* residual_data = data_or_null(res);
  void* dst = out.data_ptr();
  const int64_t arrays = res.defined() ? 3 : 2;
  at::parallel_for(0, shape.rows, grain_for({arrays, shape.cols, src.element_size()}), [&](int64_t begin, int64_t end) {
    fastdist::bias_epilogue_cpu(in, bias_data, residual_data, dst, type, act, shape.rows, shape.cols, begin, end);
  });
  return out;
}

at::Tensor bias_epilogue_backward_cpu_op(const at::Tensor& grad, const at::Tensor& x,
                                         const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const RowShape shape = check_bias_epilogue_backward(grad, x, bias, std::string(activation));
  const EpilogueActivation act = activation_of(std::string(activation));
  const at::Tensor g = grad.contiguous();
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor grad_x = at::empty(src.sizes(), src.options());
  const StorageType type = storage_type_of(src, "x");
  const void* grad_data = g.const_data_ptr();
  const void* in = src.const_data_ptr();
  const void* bias_data = data_or_null(b);
  void* dst = grad_x.data_ptr();
  at::parallel_for(0, shape.rows, grain_for({3, shape.cols, src.element_size()}), [&](int64_t begin, int64_t end) {
    fastdist::bias_epilogue_backward_cpu(grad_data, in, bias_data, dst, type, act, shape.rows, shape.cols, begin, end);
  });
  return grad_x;
}

}  // namespace
}  // namespace fastdist::epilogue

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("bias_epilogue(Tensor x, Tensor? bias, Tensor? residual, str activation) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("bias_epilogue_backward(Tensor grad, Tensor x, Tensor? bias, str activation) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("bias_epilogue", &fastdist::epilogue::bias_epilogue_cpu_op);
  m.impl("bias_epilogue_backward", &fastdist::epilogue::bias_epilogue_backward_cpu_op);
}
