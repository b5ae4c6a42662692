// Argument checks and shapes of the quantization ops, shared by the CPU glue (quantize.cpp) and the CUDA glue
// (quantize_cuda.cu) so that both devices reject the same inputs with the same messages. The Python fake kernels
// (python/fastdist/ops/quantize.py) repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <string>
#include <tuple>

#include "kernels/quantize.h"
#include "ops/checks.h"

namespace fastdist::quantize {

inline QuantScheme scheme_of(const std::string& scheme) {
  TORCH_CHECK(scheme == "minmax" || scheme == "absmax", "fastdist: 'scheme' must be \"minmax\" or \"absmax\", got \"",
              scheme, "\"");
  return scheme == "minmax" ? QuantScheme::kMinMax : QuantScheme::kAbsMax;
}

inline void check_bits(int64_t bits) {
  TORCH_CHECK(quant_bits_supported(bits), "fastdist: 'bits' must be 1, 2, 4 or 8, got ", bits);
}

inline void check_group(int64_t numel, int64_t group_size) {
  TORCH_CHECK(group_size >= 1, "fastdist: 'group_size' must be >= 1, got ", group_size);
  TORCH_CHECK(numel % group_size == 0, "fastdist: 'group_size' must divide the number of values, got group_size = ",
              group_size, " for ", numel, " values");
}

// quantize(x, bits, scheme, group_size, stochastic, seed) -> (packed uint8 [ceil(n bits / 8)], scales float32
// [n / group_size], zeros float32 [n / group_size])
inline QuantScheme check_quantize(const at::Tensor& x, int64_t bits, const std::string& scheme, int64_t group_size,
                                  int64_t seed) {
  check_dtype_in(x, "x", kFloat32Or16BitDtypes);
  check_bits(bits);
  const QuantScheme parsed = scheme_of(scheme);
  check_group(x.numel(), group_size);
  check_seed(seed);
  check_allocatable({x.numel()}, at::kFloat, "the float32 copy of 'x'");
  checked_mul(x.numel(), bits, "the number of values * 'bits'");  // the codes' bit offsets
  return parsed;
}

// dequantize(packed, scales, zeros, bits, scheme, group_size, shape) -> float32 [shape]
inline QuantScheme check_dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                                    int64_t bits, const std::string& scheme, int64_t group_size, at::IntArrayRef shape) {
  check_bits(bits);
  const QuantScheme parsed = scheme_of(scheme);
  for (const int64_t size : shape) TORCH_CHECK(size >= 0, "fastdist: 'shape' must not be negative, got ", shape);
  check_allocatable(shape, at::kFloat, "the output");
  const int64_t n = c10::multiply_integers(shape);
  checked_mul(n, bits, "the number of values * 'bits'");
  check_group(n, group_size);
  FD_CHECK_DTYPE(packed, at::kByte);
  FD_CHECK_DTYPE(scales, at::kFloat);
  FD_CHECK_DTYPE(zeros, at::kFloat);
  FD_CHECK_SAME_DEVICE(packed, scales);
  FD_CHECK_SAME_DEVICE(packed, zeros);
  const int64_t bytes = quant_packed_bytes(n, static_cast<int>(bits));
  TORCH_CHECK(packed.dim() == 1 && packed.size(0) == bytes, "fastdist: 'packed' must have shape [", bytes,
              "] (ceil(n * bits / 8) for n = ", n, ", bits = ", bits, "), got shape ", packed.sizes());
  const int64_t groups = n / group_size;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == groups, "fastdist: 'scales' must have shape [", groups,
              "] (one per group), got shape ", scales.sizes());
  TORCH_CHECK(zeros.dim() == 1 && zeros.size(0) == groups, "fastdist: 'zeros' must have shape [", groups,
              "] (one per group), got shape ", zeros.sizes());
  return parsed;
}

// quantize's input as the kernels read it (float32, contiguous) and its outputs, on x's device.
struct QuantizeBuffers {
  at::Tensor values;                  // float32 [n]
  at::Tensor packed, scales, zeros;  // uint8 [ceil(n bits / 8)], float32 [n / group_size] twice

  QuantizeBuffers(const at::Tensor& x, int64_t bits, int64_t group_size) : values(x.to(at::kFloat).contiguous()) {
    const int64_t groups = values.numel() / group_size;
    packed = at::empty({quant_packed_bytes(values.numel(), static_cast<int>(bits))}, values.options().dtype(at::kByte));
    scales = at::empty({groups}, values.options());
    zeros = at::empty({groups}, values.options());
  }
  int64_t groups() const { return scales.numel(); }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> as_tuple() const { return {packed, scales, zeros}; }
};

// quantize refuses non-finite input: `bad_groups` of the groups held NaN or +-inf (or a range that overflows float32).
inline void check_finite_groups(int64_t bad_groups, int64_t groups) {
  TORCH_CHECK(bad_groups == 0, "fastdist: 'x' must be finite: ", bad_groups, " of ", groups,
              " group(s) hold NaN or +-inf (or a range that overflows float32)");
}

}  // namespace fastdist::quantize
