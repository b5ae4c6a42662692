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
  const c10::cuda::CUDAGuard guard(w.device());
  const QuantizeBuffers q(w, std::string(scheme), block, block_rows);
  at::Tensor bad = at::empty({1}, q.values.options().dtype(at::kLong));
  C10_CUDA_CHECK(fastdist::quant4_quantize_cuda(q.values.const_data_ptr<float>(), q.n, q.k, block, block_rows,
                                                q.scheme, q.packed.data_ptr<uint8_t>(), q.scales.data_ptr<float>(),
                                                q.zeros.data_ptr<float>(), bad.data_ptr<int64_t>(),
                                                c10::cuda::getCurrentCUDAStream()));
  return q.result(bad.item<int64_t>());
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
  const c10::cuda::CUDAGuard guard(packed.device());
  return dequantize_with(packed, scales, zeros, std::string(scheme), dequantize_rows);
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
