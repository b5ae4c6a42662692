// torch.ops.fastdist quantization ops: schemas and CPU kernels. See csrc/kernels/quantize.h for the schemes, the
// rounding, the random numbers and the packing.
//
// Two parallel passes: the group statistics (parallel over groups), then the codes (parallel over packed bytes, so
// threads never share a byte). Every code depends on its value, its group's scale and (seed, index) only, so results
// are bit-identical whatever the thread count. float16 / bfloat16 inputs are quantized from their exact float32 image.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "ops/quantize.h"

namespace fastdist::quantize {
namespace {

constexpr int64_t kGrainTrafficBytes = 256 * 1024;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(kGrainTrafficBytes / std::max<int64_t>(bytes_per_item, 1), 1);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu_op(const at::Tensor& x, int64_t bits,
                                                               c10::string_view scheme, int64_t group_size,
                                                               bool stochastic, int64_t seed) {
  const QuantScheme s = check_quantize(x, bits, std::string(scheme), group_size, seed);
  const at::Tensor src = x.to(at::kFloat).contiguous();
  const int64_t n = src.numel(), groups = n / group_size;
  const int b = static_cast<int>(bits);
  at::Tensor packed = at::empty({quant_packed_bytes(n, b)}, src.options().dtype(at::kByte));
  at::Tensor scales = at::empty({groups}, src.options());
  at::Tensor zeros = at::empty({groups}, src.options());
  const float* in = src.const_data_ptr<float>();
  float* sc = scales.data_ptr<float>();
  float* zp = zeros.data_ptr<float>();
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, groups, grain_for(group_size * 4), [&](int64_t begin, int64_t end) {
    bad += fastdist::quantize_stats_cpu(in, group_size, b, s, sc, zp, begin, end);
  });
  TORCH_CHECK(bad.load() == 0, "fastdist: 'x' must be finite: ", bad.load(), " of ", groups,
              " group(s) hold NaN or +-inf (or a range that overflows float32)");
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, packed.numel(), grain_for(4 * 8 / b), [&](int64_t begin, int64_t end) {
    fastdist::quantize_pack_cpu(in, n, group_size, b, s, sc, zp, stochastic, static_cast<uint64_t>(seed), dst, begin,
                                end);
  });
  return {packed, scales, zeros};
}

at::Tensor dequantize_cpu_op(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                             c10::string_view scheme, int64_t group_size, at::IntArrayRef shape) {
  const QuantScheme s = check_dequantize(packed, scales, zeros, bits, std::string(scheme), group_size, shape);
  const at::Tensor p = packed.contiguous(), sc = scales.contiguous(), zp = zeros.contiguous();
  at::Tensor out = at::empty(shape, sc.options());
  const int64_t n = out.numel();
  const uint8_t* in = p.const_data_ptr<uint8_t>();
  const float* scp = sc.const_data_ptr<float>();
  const float* zpp = zp.const_data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, grain_for(4), [&](int64_t begin, int64_t end) {
    fastdist::dequantize_cpu(in, n, group_size, static_cast<int>(bits), s, scp, zpp, dst, begin, end);
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
