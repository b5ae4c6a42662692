// Argument checks and shapes of the quantization ops, shared by the CPU glue (quantize.cpp) and the CUDA glue
// (quantize_cuda.cu) so that both devices reject the same inputs with the same messages. The Python fake kernels
// (python/fastdist/ops/quantize.py) repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <string>

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
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "fastdist: 'x' must have dtype torch.float32, torch.float16 or torch.bfloat16, got ", dtype_name(dt));
  check_bits(bits);
  const QuantScheme s = scheme_of(scheme);
  check_group(x.numel(), group_size);
  TORCH_CHECK(seed >= 0, "fastdist: 'seed' must be in [0, 2^63), got ", seed);
  return s;
}

// dequantize(packed, scales, zeros, bits, scheme, group_size, shape) -> float32 [shape]
inline QuantScheme check_dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                                    int64_t bits, const std::string& scheme, int64_t group_size, at::IntArrayRef shape) {
  check_bits(bits);
  const QuantScheme s = scheme_of(scheme);
  for (const int64_t size : shape) TORCH_CHECK(size >= 0, "fastdist: 'shape' must not be negative, got ", shape);
  const int64_t n = c10::multiply_integers(shape);
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
  return s;
}

}  // namespace fastdist::quantize
