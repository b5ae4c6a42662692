// Argument checks and output shapes of the bit-packing ops, shared by the CPU glue (bitpack.cpp) and the CUDA
// glue (bitpack_cuda.cu) so that both devices reject the same inputs with the same messages.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <string>
#include <vector>

#include "kernels/bitpack.h"
#include "ops/checks.h"

namespace fastdist::bitpack {

// A [..., n] mask (or its packed form) seen as `rows` rows of `n` mask elements, and the shape of the op's result.
struct RowLayout {
  int64_t rows;
  int64_t n;
  std::vector<int64_t> out_shape;
};

// The tensor's storage as bytes (bool is one byte holding 0 or 1).
inline const uint8_t* bytes_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.const_data_ptr()); }

inline int64_t leading_rows(const at::Tensor& t) {
  return c10::multiply_integers(t.sizes().begin(), t.sizes().end() - 1);
}

// mask: bool [..., n] -> uint8 [..., ceil(n / 8)]
inline RowLayout check_pack_bits(const at::Tensor& mask) {
  FD_CHECK_DTYPE(mask, at::kBool);
  FD_CHECK_DIM_AT_LEAST(mask, 1);
  std::vector<int64_t> shape = mask.sizes().vec();
  const int64_t n = shape.back();
  shape.back() = packed_bytes(n);
  check_allocatable(shape, at::kByte, "the output");
  return {leading_rows(mask), n, shape};
}

// packed: uint8 [..., ceil(n / 8)] -> bool [..., n]
inline RowLayout check_unpack_bits(const at::Tensor& packed, int64_t n) {
  FD_CHECK_DTYPE(packed, at::kByte);
  FD_CHECK_DIM_AT_LEAST(packed, 1);
  FD_CHECK_NONNEGATIVE(n);
  FD_CHECK_LAST_DIM(packed, packed_bytes(n), "ceil(n / 8) for n = " + std::to_string(n));
  std::vector<int64_t> shape = packed.sizes().vec();
  shape.back() = n;
  check_allocatable(shape, at::kBool, "the output");
  return {leading_rows(packed), n, shape};
}

// packed: uint8 [p, b] -> uint8 [b]
inline void check_bitwise_or_reduce(const at::Tensor& packed) {
  FD_CHECK_DTYPE(packed, at::kByte);
  FD_CHECK_DIM(packed, 2);
}

// indices: int64 [k] -> uint8 [ceil(n / 8)]
inline void check_bitmap_from_indices(const at::Tensor& indices, int64_t n) {
  FD_CHECK_DTYPE(indices, at::kLong);
  FD_CHECK_DIM(indices, 1);
  FD_CHECK_NONNEGATIVE(n);
}

}  // namespace fastdist::bitpack
