// Argument checks of the MoE routing ops, shared by the CPU glue (moe.cpp) and the CUDA glue (moe_cuda.cu) so that
// both devices reject the same inputs with the same messages. The Python fake kernels (python/fastdist/ops/moe.py)
// repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "kernels/moe.h"
#include "ops/checks.h"

namespace fastdist::moe {

constexpr int64_t kMaxK = 16;
constexpr int64_t kMaxExpertsCuda = 4096;

// Gate logits: float32 or float64.
inline MoeValueType value_type_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return MoeValueType::kFloat32;
    case at::kDouble: return MoeValueType::kFloat64;
    default:
      TORCH_CHECK(false, "fastdist: '", name, "' must have dtype torch.float32 or torch.float64, got ",
                  dtype_name(t.scalar_type()));
  }
}

// Row data of permute / unpermute: float32, float64, float16 or bfloat16.
inline MoeValueType row_type_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return MoeValueType::kFloat32;
    case at::kDouble: return MoeValueType::kFloat64;
    case at::kHalf: return MoeValueType::kFloat16;
    case at::kBFloat16: return MoeValueType::kBFloat16;
    default:
      TORCH_CHECK(false, "fastdist: '", name, "' must have a floating dtype (torch.float32, torch.float64, "
                  "torch.float16 or torch.bfloat16), got ", dtype_name(t.scalar_type()));
  }
}

// moe_route(logits [T, E], k)
inline void check_route(const at::Tensor& logits, int64_t k) {
  value_type_of(logits, "logits");
  FD_CHECK_DIM(logits, 2);
  TORCH_CHECK(logits.size(1) >= 1, "fastdist: 'logits' must have at least 1 expert (column), got shape ",
              logits.sizes());
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= logits.size(1), "fastdist: 'k' must be in [1, min(", kMaxK,
              ", num_experts = ", logits.size(1), ")], got ", k);
}

// moe_layout(topk_idx [T, k], num_experts, num_ranks, capacity)
inline void check_layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks, int64_t capacity) {
  FD_CHECK_DTYPE(topk_idx, at::kLong);
  FD_CHECK_DIM(topk_idx, 2);
  TORCH_CHECK(num_experts >= 1, "fastdist: 'num_experts' must be >= 1, got ", num_experts);
  TORCH_CHECK(num_ranks >= 1 && num_experts % num_ranks == 0, "fastdist: 'num_ranks' must be >= 1 and divide "
              "num_experts = ", num_experts, ", got ", num_ranks);
  TORCH_CHECK(capacity >= -1, "fastdist: 'capacity' must be >= 0, or -1 for dropless, got ", capacity);
}

// row_of_slot [T, k] int64 and optional weight [T, k] of x's dtype, on x's device.
inline void check_slots(const at::Tensor& x, const char* x_name, const at::Tensor& row_of_slot,
                        const std::optional<at::Tensor>& weight, int64_t tokens) {
  FD_CHECK_DTYPE(row_of_slot, at::kLong);
  FD_CHECK_DIM(row_of_slot, 2);
  TORCH_CHECK(row_of_slot.size(0) == tokens, "fastdist: 'row_of_slot' must have ", tokens,
              " rows (one per token), got shape ", row_of_slot.sizes());
  TORCH_CHECK(row_of_slot.device() == x.device(), "fastdist: 'row_of_slot' and '", x_name,
              "' must be on the same device, got ", row_of_slot.device(), " and ", x.device());
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == x.scalar_type(), "fastdist: 'weight' must have the dtype of '", x_name,
                "' (", dtype_name(x.scalar_type()), "), got ", dtype_name(weight->scalar_type()));
    TORCH_CHECK(weight->sizes() == row_of_slot.sizes(), "fastdist: 'weight' must have the shape of 'row_of_slot' (",
                row_of_slot.sizes(), "), got shape ", weight->sizes());
    TORCH_CHECK(weight->device() == x.device(), "fastdist: 'weight' and '", x_name,
                "' must be on the same device, got ", weight->device(), " and ", x.device());
  }
}

// moe_permute(x [T, d], row_of_slot [T, k], num_rows, weight?)
inline void check_permute(const at::Tensor& x, const at::Tensor& row_of_slot, int64_t num_rows,
                          const std::optional<at::Tensor>& weight) {
  row_type_of(x, "x");
  FD_CHECK_DIM(x, 2);
  FD_CHECK_NONNEGATIVE(num_rows);
  check_slots(x, "x", row_of_slot, weight, x.size(0));
}

// moe_unpermute(y [N, d], row_of_slot [T, k], weight?)
inline void check_unpermute(const at::Tensor& y, const at::Tensor& row_of_slot,
                            const std::optional<at::Tensor>& weight) {
  row_type_of(y, "y");
  FD_CHECK_DIM(y, 2);
  FD_CHECK_DIM(row_of_slot, 2);
  check_slots(y, "y", row_of_slot, weight, row_of_slot.size(0));
}

// Rows named by row_of_slot must be in [-1, num_rows) (one pass; CPU glue only, the CUDA glue syncs for it).
inline void check_rows_in_range(const at::Tensor& row_of_slot, int64_t num_rows) {
  if (row_of_slot.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(row_of_slot);
  const int64_t min_row = lo.item<int64_t>();
  const int64_t max_row = hi.item<int64_t>();
  TORCH_CHECK(min_row >= -1 && max_row < num_rows, "fastdist: 'row_of_slot' entries must be in [-1, ", num_rows,
              ") (-1: dropped), got values in [", min_row, ", ", max_row, "]");
}

}  // namespace fastdist::moe
