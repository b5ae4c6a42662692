// CUDA kernels of the torch.ops.fastdist quantization ops (schemas in quantize.cpp). Work runs on the current stream
// of the input's device. quantize refuses non-finite input as the CPU does, which costs one 8-byte device-to-host
// copy (a synchronization) per call.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/quantize.h"

namespace fastdist::quantize {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda_op(const at::Tensor& x, int64_t bits,
                                                                c10::string_view scheme, int64_t group_size,
                                                                bool stochastic, int64_t seed) {
  const QuantScheme kind = check_quantize(x, bits, std::string(scheme), group_size, seed);
  const c10::cuda::CUDAGuard guard(x.device());
  QuantizeBuffers buffers(x, bits, group_size);
  at::Tensor bad_groups = at::empty({1}, buffers.values.options().dtype(at::kLong));
  C10_CUDA_CHECK(fastdist::quantize_cuda(buffers.values.const_data_ptr<float>(), buffers.values.numel(), group_size,
                                         static_cast<int>(bits), kind, stochastic, static_cast<uint64_t>(seed),
                                         buffers.scales.data_ptr<float>(), buffers.zeros.data_ptr<float>(),
                                         buffers.packed.data_ptr<uint8_t>(), bad_groups.data_ptr<int64_t>(),
                                         c10::cuda::getCurrentCUDAStream()));
  check_finite_groups(bad_groups.item<int64_t>(), buffers.groups());
  return buffers.as_tuple();
}

at::Tensor dequantize_cuda_op(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                              int64_t bits, c10::string_view scheme, int64_t group_size, at::IntArrayRef shape) {
  const QuantScheme kind = check_dequantize(packed, scales, zeros, bits, std::string(scheme), group_size, shape);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor codes = packed.contiguous(), group_scales = scales.contiguous(), group_zeros = zeros.contiguous();
  at::Tensor out = at::empty(shape, group_scales.options());
  C10_CUDA_CHECK(fastdist::dequantize_cuda(codes.const_data_ptr<uint8_t>(), out.numel(), group_size,
                                           static_cast<int>(bits), kind, group_scales.const_data_ptr<float>(),
                                           group_zeros.const_data_ptr<float>(), out.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace fastdist::quantize

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("quantize", &fastdist::quantize::quantize_cuda_op);
  m.impl("dequantize", &fastdist::quantize::dequantize_cuda_op);
}
