// What the quantization tests hold for a quantized tensor (csrc/tests/test_quantize.cpp, test_quant4.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace fastdist::testing {

// Packed codes, and one scale and one zero point per group (block).
struct Quantized {
  std::vector<uint8_t> packed;
  std::vector<float> scales, zeros;

  Quantized(int64_t packed_bytes, int64_t groups)
      : packed(static_cast<size_t>(packed_bytes)), scales(static_cast<size_t>(groups)),
        zeros(static_cast<size_t>(groups)) {}
};

}  // namespace fastdist::testing
