// torch.ops.fastdist quantization ops: schemas and CPU kernels. See csrc/kernels/quantize.h for the schemes, the
// rounding, the random numbers and the packing.
//
// Two parallel passes: the group statistics (parallel over groups), then the codes (parallel over packed bytes, so
// threads never share a byte). Every code depends on its value, its group's scale and (seed, index) only, so results
// are bit-identical whatever the thread count. float16 / bfloat16 inputs are quantized from their exact float32 image.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "ops/parallel.h"
#include "ops/quantize.h"

namespace fastdist::quantize {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu_op(const at::Tensor& x, int64_t bits,
                                                               c10::string_view scheme, int64_t group_size,
                                                               bool stochastic, int64_t seed) {
  const QuantScheme kind = check_quantize(x, bits, std::string(scheme), group_size, seed);
  QuantizeBuffers buffers(x, bits, group_size);
  const int64_t n = buffers.values.numel();
  const int bit_width = static_cast<int>(bits);
  const float* in = buffers.values.const_data_ptr<float>();
  float* scales = buffers.scales.data_ptr<float>();
  float* zeros = buffers.zeros.data_ptr<float>();
  std::atomic<int64_t> bad_groups{0};
  at::parallel_for(0, buffers.groups(), grain_for({group_size, 4}), [&](int64_t begin, int64_t end) {
    bad_groups += fastdist::quantize_stats_cpu(in, group_size, bit_width, kind, scales, zeros, begin, end);
  });
  check_finite_groups(bad_groups.load(), buffers.groups());
  uint8_t* packed = buffers.packed.data_ptr<uint8_t>();
  at::parallel_for(0, buffers.packed.numel(), grain_for({4 * 8 / bit_width}), [&](int64_t begin, int64_t end) {
    fastdist::quantize_pack_cpu(in, n, group_size, bit_width, kind, scales, zeros, stochastic,
                                static_cast<uint64_t>(seed), packed, begin, end);
  });
  return buffers.as_tuple();
}

at::Tensor dequantize_cpu_op(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                             c10::string_view scheme, int64_t group_size, at::IntArrayRef shape) {
  const QuantScheme kind = check_dequantize(packed, scales, zeros, bits, std::string(scheme), group_size, shape);
  const at::Tensor codes = packed.contiguous(), group_scales = scales.contiguous(), group_zeros = zeros.contiguous();
  at::Tensor out = at::empty(shape, group_scales.options());
  const int64_t n = out.numel();
  const uint8_t* in = codes.const_data_ptr<uint8_t>();
  const float* scale_values = group_scales.const_data_ptr<float>();
  const float* zero_values = group_zeros.const_data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, grain_for({4}), [&](int64_t begin, int64_t end) {
    fastdist::dequantize_cpu(in, n, group_size, static_cast<int>(bits), kind, scale_values, zero_values, dst, begin,
                             end);
  });
  return out;
}

}  // namespace
}  // namespace fastdist::quantize

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("quantize(Tensor x, int bits, str scheme, int group_size, bool stochastic, int seed) -> (Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("dequantize(Tensor packed, Tensor scales, Tensor zeros, int bits, str scheme, int group_size, int[] shape) -> "
        "Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("quantize", &fastdist::quantize::quantize_cpu_op);
  m.impl("dequantize", &fastdist::quantize::dequantize_cpu_op);
}
