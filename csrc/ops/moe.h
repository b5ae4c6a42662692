// Argument checks of the MoE routing ops, shared by the CPU glue (moe.cpp) and the CUDA glue (moe_cuda.cu) so that
// both devices reject the same inputs with the same messages. The Python fake kernels (python/fastdist/ops/moe.py)
// repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels/moe.h"
#include "ops/checks.h"

namespace fastdist::moe {

constexpr int64_t kMaxK = 16;
constexpr int64_t kMaxExpertsCuda = 4096;

// Gate logits: float32 or float64. Row data of permute / unpermute: every floating dtype (in this order in messages).
constexpr at::ScalarType kLogitDtypes[] = {at::kFloat, at::kDouble};
constexpr at::ScalarType kRowDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// moe_route(logits [T, E], k)
inline void check_route(const at::Tensor& logits, int64_t k) {
  check_dtype_in(logits, "logits", kLogitDtypes);
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
  check_allocatable({num_experts}, at::kLong, "the output 'counts'");
  check_allocatable({num_experts + 1}, at::kLong, "the output 'offsets'");
  check_allocatable({topk_idx.size(1), num_experts}, at::kLong, "the layout's histogram (choices x experts)");
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
  check_dtype_in(x, "x", kRowDtypes);
  FD_CHECK_DIM(x, 2);
  FD_CHECK_NONNEGATIVE(num_rows);
  check_slots(x, "x", row_of_slot, weight, x.size(0));
  check_allocatable({num_rows, x.size(1)}, x.scalar_type(), "the output");
}

// moe_unpermute(y [N, d], row_of_slot [T, k], weight?)
inline void check_unpermute(const at::Tensor& y, const at::Tensor& row_of_slot,
                            const std::optional<at::Tensor>& weight) {
  check_dtype_in(y, "y", kRowDtypes);
  FD_CHECK_DIM(y, 2);
  FD_CHECK_DIM(row_of_slot, 2);
  check_slots(y, "y", row_of_slot, weight, row_of_slot.size(0));
  check_allocatable({row_of_slot.size(0), y.size(1)}, y.scalar_type(), "the output");
}

// moe_route's outputs for logits [T, E]: probs float32 [T, E], lse float32 [T], topk_idx int64 [T, k], topk_weight
// float32 [T, k], on the logits' device.
struct RouteOutputs {
  at::Tensor probs, lse, topk_idx, topk_weight;

  RouteOutputs(const at::Tensor& logits, int64_t k) {
    const int64_t tokens = logits.size(0), experts = logits.size(1);
    const auto f32 = logits.options().dtype(at::kFloat);
    probs = at::empty({tokens, experts}, f32);
    lse = at::empty({tokens}, f32);
    topk_idx = at::empty({tokens, k}, logits.options().dtype(at::kLong));
    topk_weight = at::empty({tokens, k}, f32);
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> as_tuple() const {
    return {probs, lse, topk_idx, topk_weight};
  }
};

// moe_layout's outputs for topk_idx [T, k], on its device (kernels/moe.h): int64 tensors, and keep as bool.
struct LayoutOutputs {
  at::Tensor counts, offsets, rank_counts, permutation, row_of_slot, position, keep;

  LayoutOutputs(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
    const int64_t tokens = topk_idx.size(0), k = topk_idx.size(1);
    const auto i64 = topk_idx.options().dtype(at::kLong);
    counts = at::empty({num_experts}, i64);
    offsets = at::empty({num_experts + 1}, i64);
    rank_counts = at::empty({num_ranks}, i64);
    permutation = at::empty({tokens * k}, i64);
    row_of_slot = at::empty({tokens, k}, i64);
    position = at::empty({tokens, k}, i64);
    keep = at::empty({tokens, k}, i64.dtype(at::kBool));
  }
  uint8_t* keep_bytes() { return reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()); }
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> as_tuple() const {
    return {counts, offsets, rank_counts, permutation, row_of_slot, position, keep};
  }
};

// Rows named by row_of_slot must be in [-1, num_rows), and where `distinct` (moe_permute, which writes each row from
// one slot) name each row at most once. The data decide, so the fake kernels cannot check this; here it costs a pass
// (and a sort of the slots for `distinct`), and on CUDA one device-to-host copy of the results, a synchronization.
inline void check_rows_of_slot(const at::Tensor& row_of_slot, int64_t num_rows, bool distinct) {
  if (row_of_slot.numel() == 0) return;
  const at::Tensor flat = row_of_slot.flatten();
  const auto [lo, hi] = at::aminmax(flat);
  std::vector<at::Tensor> found{lo, hi};
  if (distinct && flat.numel() >= 2) {
    // Sorted, a row named twice is a kept entry equal to its predecessor: the smallest such row (num_rows if none).
    const at::Tensor sorted = std::get<0>(flat.sort());
    const at::Tensor next = sorted.slice(0, 1), previous = sorted.slice(0, 0, -1);
    found.push_back(at::where((next == previous) & (next >= 0), next, num_rows).amin());
  }
  const at::Tensor values = at::stack(found).cpu();
  const int64_t* value = values.const_data_ptr<int64_t>();
  TORCH_CHECK(value[0] >= -1 && value[1] < num_rows, "fastdist: 'row_of_slot' entries must be in [-1, ", num_rows,
              ") (-1: dropped), got values in [", value[0], ", ", value[1], "]");
  TORCH_CHECK(values.numel() < 3 || value[2] == num_rows, "fastdist: 'row_of_slot' must name each row at most once "
              "(moe_permute writes a row from one slot), got row ", value[2], " more than once");
}

}  // namespace fastdist::moe
