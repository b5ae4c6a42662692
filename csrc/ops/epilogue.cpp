// torch.ops.fastdist fused-epilogue ops: schemas and CPU kernels. See csrc/kernels/epilogue.h for the arithmetic.
// Parallel over rows (at::parallel_for); every value depends only on its own row, so results are bit-identical
// whatever the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/epilogue.h"

namespace fastdist::epilogue {
namespace {

// A range below this many bytes of memory traffic is not worth a thread.
constexpr int64_t kGrainTrafficBytes = 256 * 1024;

int64_t grain_rows(int64_t bytes_per_row) {
  return std::max<int64_t>(kGrainTrafficBytes / std::max<int64_t>(bytes_per_row, 1), 1);
}

at::Tensor bias_epilogue_cpu_op(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, c10::string_view activation) {
  const Rows r = check_bias_epilogue(x, bias, residual, std::string(activation));
  const EpilogueActivation act = activation_of(std::string(activation));
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor out = at::empty(src.sizes(), src.options());
  const EpilogueType type = type_of(src);
  const void* in = src.const_data_ptr();
  const void* bp = data_or_null(b);
  const void* rp = data_or_null(res);
  void* dst = out.data_ptr();
  const int64_t row_bytes = r.cols * src.element_size() * (res.defined() ? 3 : 2);
  at::parallel_for(0, r.rows, grain_rows(row_bytes), [&](int64_t begin, int64_t end) {
    fastdist::bias_epilogue_cpu(in, bp, rp, dst, type, act, r.rows, r.cols, begin, end);
  });
  return out;
}

at::Tensor bias_epilogue_backward_cpu_op(const at::Tensor& grad, const at::Tensor& x,
                                         const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const Rows r = check_bias_epilogue_backward(grad, x, bias, std::string(activation));
  const EpilogueActivation act = activation_of(std::string(activation));
  const at::Tensor g = grad.contiguous();
  const at::Tensor src = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor grad_x = at::empty(src.sizes(), src.options());
  const EpilogueType type = type_of(src);
  const void* gp = g.const_data_ptr();
  const void* in = src.const_data_ptr();
  const void* bp = data_or_null(b);
  void* dst = grad_x.data_ptr();
  at::parallel_for(0, r.rows, grain_rows(3 * r.cols * src.element_size()), [&](int64_t begin, int64_t end) {
    fastdist::bias_epilogue_backward_cpu(gp, in, bp, dst, type, act, r.rows, r.cols, begin, end);
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
