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
  const QuantScheme s = check_quantize(x, bits, std::string(scheme), group_size, seed);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.to(at::kFloat).contiguous();
  const int64_t n = src.numel(), groups = n / group_size;
  const int b = static_cast<int>(bits);
  at::Tensor packed = at::empty({quant_packed_bytes(n, b)}, src.options().dtype(at::kByte));
  at::Tensor scales = at::empty({groups}, src.options());
  at::Tensor zeros = at::empty({groups}, src.options());
  at::Tensor bad = at::empty({1}, src.options().dtype(at::kLong));
  C10_CUDA_CHECK(fastdist::quantize_cuda(src.const_data_ptr<float>(), n, group_size, b, s, stochastic,
                                         static_cast<uint64_t>(seed), scales.data_ptr<float>(),
                                         zeros.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                                         bad.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  const int64_t bad_groups = bad.item<int64_t>();
  TORCH_CHECK(bad_groups == 0, "fastdist: 'x' must be finite: ", bad_groups, " of ", groups,
              " group(s) hold NaN or +-inf (or a range that overflows float32)");
  return {packed, scales, zeros};
}

at::Tensor dequantize_cuda_op(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                              int64_t bits, c10::string_view scheme, int64_t group_size, at::IntArrayRef shape) {
  const QuantScheme s = check_dequantize(packed, scales, zeros, bits, std::string(scheme), group_size, shape);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor p = packed.contiguous(), sc = scales.contiguous(), zp = zeros.contiguous();
  at::Tensor out = at::empty(shape, sc.options());
  C10_CUDA_CHECK(fastdist::dequantize_cuda(p.const_data_ptr<uint8_t>(), out.numel(), group_size,
                                           static_cast<int>(bits), s, sc.const_data_ptr<float>(),
                                           zp.const_data_ptr<float>(), out.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace fastdist::quantize

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("quantize", &fastdist::quantize::quantize_cuda_op);
  m.impl("dequantize", &fastdist::quantize::dequantize_cuda_op);
}
