// torch.ops.fastdist 4-bit ops: schemas and CPU kernels. See csrc/kernels/quant4.h for the schemes and the packing.
//
// Every pass runs parallel over output rows of the weight; each value and each output is computed by one thread in a
// fixed order, so results are bit-identical whatever the thread count. float16 / bfloat16 inputs are used through
// their exact float32 image; outputs come back in the input's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "ops/parallel.h"
#include "ops/quant4.h"

namespace fastdist::quant4 {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu_op(const at::Tensor& w, c10::string_view scheme,
                                                               int64_t block, int64_t block_rows) {
  const QuantizeBuffers q(w, std::string(scheme), block, block_rows);
  const float* in = q.values.const_data_ptr<float>();
  uint8_t* packed_ptr = q.packed.data_ptr<uint8_t>();
  float* scales_ptr = q.scales.data_ptr<float>();
  float* zeros_ptr_out = q.zeros.data_ptr<float>();
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, q.row_blocks, grain_for({block_rows, q.k, 4}), [&](int64_t begin, int64_t end) {
    bad += fastdist::quant4_quantize_cpu(in, q.k, block, block_rows, q.scheme, packed_ptr, scales_ptr, zeros_ptr_out,
                                         begin, end);
  });
  return q.result(bad.load());
}

// Rows [r0, r1) of w' into tile ([r1 - r0, k] float32 contiguous), parallel over rows.
void dequantize_rows(const Operands& ops, const Layout& layout, int64_t r0, int64_t r1, at::Tensor& tile) {
  const uint8_t* packed_ptr = ops.packed.const_data_ptr<uint8_t>();
  const float* scales_ptr = ops.scales.const_data_ptr<float>();
  const float* zero_values = zeros_ptr(ops.zeros);
  float* out = tile.data_ptr<float>();
  at::parallel_for(r0, r1, grain_for({layout.k, 4}), [&](int64_t begin, int64_t end) {
    fastdist::quant4_dequantize_cpu(packed_ptr, scales_ptr, zero_values, layout.k, layout.block, layout.block_rows,
                                    layout.scheme, out + (begin - r0) * layout.k, begin, end);
  });
}

// The decoding qlinear, parallel over output rows.
void decode_linear(const Operands& ops, const Layout& layout, at::Tensor& out) {
  const float* x_ptr = ops.input.const_data_ptr<float>();
  const int64_t rows = ops.input.size(0);
  const uint8_t* packed_ptr = ops.packed.const_data_ptr<uint8_t>();
  const float* scales_ptr = ops.scales.const_data_ptr<float>();
  const float* zero_values = zeros_ptr(ops.zeros);
  const float* bias_ptr = ops.bias.has_value() ? ops.bias->const_data_ptr<float>() : nullptr;
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, layout.n, grain_for({std::max<int64_t>(layout.k / 2, 1)}), [&](int64_t begin, int64_t end) {
    fastdist::qlinear_cpu(x_ptr, rows, layout.k, packed_ptr, scales_ptr, zero_values, layout.n, layout.block,
                          layout.block_rows, layout.scheme, bias_ptr, out_ptr, begin, end);
  });
}

at::Tensor dequantize_cpu_op(const at::Tensor& packed, const at::Tensor& scales,
                             const std::optional<at::Tensor>& zeros, c10::string_view scheme) {
  return dequantize_with(packed, scales, zeros, std::string(scheme), dequantize_rows);
}

at::Tensor qlinear_cpu_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros, c10::string_view scheme,
                          const std::optional<at::Tensor>& bias) {
  return qlinear_with(x, packed, scales, zeros, std::string(scheme), bias, kDecodeRowsCpu, decode_linear,
                      dequantize_rows);
}

at::Tensor qlinear_grad_input_cpu_op(const at::Tensor& grad, const at::Tensor& packed, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& zeros, c10::string_view scheme) {
  return grad_input_with(grad, packed, scales, zeros, std::string(scheme), dequantize_rows);
}

}  // namespace
}  // namespace fastdist::quant4

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("quant4_quantize(Tensor w, str scheme, int block, int block_rows=1) -> (Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("quant4_dequantize(Tensor packed, Tensor scales, Tensor? zeros, str scheme) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("qlinear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, str scheme, Tensor? bias) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("qlinear_grad_input(Tensor grad, Tensor packed, Tensor scales, Tensor? zeros, str scheme) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("quant4_quantize", &fastdist::quant4::quantize_cpu_op);
  m.impl("quant4_dequantize", &fastdist::quant4::dequantize_cpu_op);
  m.impl("qlinear", &fastdist::quant4::qlinear_cpu_op);
  m.impl("qlinear_grad_input", &fastdist::quant4::qlinear_grad_input_cpu_op);
}
