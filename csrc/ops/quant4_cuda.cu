// CUDA kernels of the torch.ops.fastdist 4-bit ops (schemas in quant4.cpp). Work runs on the current stream of the
// input's device. quant4_quantize refuses non-finite weights as the CPU does, which costs one 8-byte device-to-host
// copy (a synchronization) per call. qlinear decodes with one warp per output row for up to kQlinearCudaMaxRows rows
// of x; above that a tile of output rows is dequantized at a time and multiplied by cuBLAS.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/quant4.h"

namespace fastdist::quant4 {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda_op(const at::Tensor& w, c10::string_view scheme,
                                                                int64_t block, int64_t block_rows) {
  const Quant4Scheme kind = check_quantize(w, std::string(scheme), block, block_rows);
  const c10::cuda::CUDAGuard guard(w.device());
  const at::Tensor values = w.to(at::kFloat).contiguous();
  const int64_t n = values.size(0), k = values.size(1), groups = k / block, row_blocks = n / block_rows;
  at::Tensor packed = at::empty({n, k / 2}, values.options().dtype(at::kByte));
  at::Tensor scales = at::empty({row_blocks, groups}, values.options());
  at::Tensor zeros = at::empty({row_blocks, groups}, values.options());  // nf4 writes zeros it does not return
  at::Tensor bad = at::empty({1}, values.options().dtype(at::kLong));
  C10_CUDA_CHECK(fastdist::quant4_quantize_cuda(values.const_data_ptr<float>(), n, k, block, block_rows, kind,
                                                packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                                zeros.data_ptr<float>(), bad.data_ptr<int64_t>(),
                                                c10::cuda::getCurrentCUDAStream()));
  check_finite_blocks(bad.item<int64_t>(), row_blocks * groups);
  if (kind == Quant4Scheme::kNF4) zeros = at::empty({0}, values.options());
  return {packed, scales, zeros};
}

void dequantize_rows(const Operands& ops, const Layout& layout, int64_t r0, int64_t r1, at::Tensor& tile) {
  C10_CUDA_CHECK(fastdist::quant4_dequantize_cuda(ops.packed.const_data_ptr<uint8_t>(),
                                                  ops.scales.const_data_ptr<float>(), zeros_ptr(ops.zeros), layout.k,
                                                  layout.block, layout.block_rows, layout.scheme,
                                                  tile.data_ptr<float>(), r0, r1, c10::cuda::getCurrentCUDAStream()));
}

void decode_linear(const Operands& ops, const Layout& layout, at::Tensor& out) {
  C10_CUDA_CHECK(fastdist::qlinear_cuda(ops.input.const_data_ptr<float>(), ops.input.size(0), layout.k,
                                        ops.packed.const_data_ptr<uint8_t>(), ops.scales.const_data_ptr<float>(),
                                        zeros_ptr(ops.zeros), layout.n, layout.block, layout.block_rows,
                                        layout.scheme,
                                        ops.bias.has_value() ? ops.bias->const_data_ptr<float>() : nullptr,
                                        out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
}

at::Tensor dequantize_cuda_op(const at::Tensor& packed, const at::Tensor& scales,
                              const std::optional<at::Tensor>& zeros, c10::string_view scheme) {
  const Layout layout = check_layout(packed, scales, zeros, std::string(scheme));
  const c10::cuda::CUDAGuard guard(packed.device());
  const Operands ops(at::empty({0, 0}, scales.options()), 0, packed, scales, zeros);
  at::Tensor out = at::empty({layout.n, layout.k}, scales.options());
  dequantize_rows(ops, layout, 0, layout.n, out);
  return out;
}

at::Tensor qlinear_cuda_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, c10::string_view scheme,
                           const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  return qlinear_with(x, packed, scales, zeros, std::string(scheme), bias, fastdist::kQlinearCudaMaxRows,
                      decode_linear, dequantize_rows);
}

at::Tensor qlinear_grad_input_cuda_op(const at::Tensor& grad, const at::Tensor& packed, const at::Tensor& scales,
                                      const std::optional<at::Tensor>& zeros, c10::string_view scheme) {
  const c10::cuda::CUDAGuard guard(grad.device());
  return grad_input_with(grad, packed, scales, zeros, std::string(scheme), dequantize_rows);
}

}  // namespace
}  // namespace fastdist::quant4

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("quant4_quantize", &fastdist::quant4::quantize_cuda_op);
  m.impl("quant4_dequantize", &fastdist::quant4::dequantize_cuda_op);
  m.impl("qlinear", &fastdist::quant4::qlinear_cuda_op);
  m.impl("qlinear_grad_input", &fastdist::quant4::qlinear_grad_input_cuda_op);
}
