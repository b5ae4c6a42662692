// Argument checks and shapes of the TopK ops, shared by the CPU glue (topk.cpp) and the CUDA glue (topk_cuda.cu)
// so that both devices reject the same inputs with the same messages. The Python fake kernels
// (python/fastdist/ops/topk.py) repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <limits>

#include "kernels/topk.h"
#include "ops/checks.h"

namespace fastdist::topk {

inline void check_d(int64_t d) {
  TORCH_CHECK(d >= 0 && d <= std::numeric_limits<int32_t>::max(), "fastdist: 'd' must be in [0, 2^31 - 1], got ", d);
}

inline void check_k(int64_t k, int64_t d) {
  TORCH_CHECK(k >= 1 && k <= d, "fastdist: 'k' must be in [1, d] with d = ", d, " (the row length), got ", k);
}

// topk_compress(x [B, D], k) -> (values [B, k] x.dtype, indices [B, k] int32)
inline void check_topk_compress(const at::Tensor& x, int64_t k) {
  check_dtype_in(x, "x", kFloat32Or16BitDtypes);
  FD_CHECK_DIM(x, 2);
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(),
              "fastdist: 'x' rows must have at most 2^31 - 1 values (indices are int32), got shape ", x.sizes());
  check_k(k, x.size(1));
  check_allocatable(x.sizes(), at::kFloat, "the float32 copy of 'x'");
}

// topk_decompress(values [B, k], indices [B, k] int32, d) -> [B, d] values.dtype
inline void check_topk_decompress(const at::Tensor& values, const at::Tensor& indices, int64_t d) {
  check_dtype_in(values, "values", kFloat32Or16BitDtypes);
  FD_CHECK_DTYPE(indices, at::kInt);
  FD_CHECK_DIM(values, 2);
  FD_CHECK_DIM(indices, 2);
  FD_CHECK_SAME_DEVICE(values, indices);
  TORCH_CHECK(values.sizes() == indices.sizes(), "fastdist: 'values' and 'indices' must have the same shape, got ",
              values.sizes(), " and ", indices.sizes());
  check_d(d);
  TORCH_CHECK(values.size(1) <= d, "fastdist: 'values' must have at most d = ", d, " columns, got shape ",
              values.sizes());
  check_allocatable({values.size(0), d}, at::kFloat, "the output");
}

// topk_indices_to_bitmap(indices [B, k] int32, d) -> uint8 [B, ceil(d / 8)]
inline void check_indices_to_bitmap(const at::Tensor& indices, int64_t d) {
  FD_CHECK_DTYPE(indices, at::kInt);
  FD_CHECK_DIM(indices, 2);
  check_d(d);
  TORCH_CHECK(indices.size(1) <= d, "fastdist: 'indices' must have at most d = ", d, " columns, got shape ",
              indices.sizes());
  check_allocatable({indices.size(0), packed_bytes(d)}, at::kByte, "the output");
}

// topk_bitmap_to_indices(bitmap uint8 [B, ceil(d / 8)], d, k) -> int32 [B, k]
inline void check_bitmap_to_indices(const at::Tensor& bitmap, int64_t d, int64_t k) {
  FD_CHECK_DTYPE(bitmap, at::kByte);
  FD_CHECK_DIM(bitmap, 2);
  check_d(d);
  FD_CHECK_LAST_DIM(bitmap, packed_bytes(d), "ceil(d / 8) for d = " + std::to_string(d));
  TORCH_CHECK(k >= 0 && k <= d, "fastdist: 'k' must be in [0, d] with d = ", d, ", got ", k);
  check_allocatable({bitmap.size(0), k}, at::kInt, "the output");
}

}  // namespace fastdist::topk
