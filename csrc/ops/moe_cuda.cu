// CUDA kernels of the torch.ops.fastdist MoE routing ops (schemas in moe.cpp). Work runs on the current stream of
// the input's device. Two checks need the data on the host and therefore one device sync each: expert ids in range
// (moe_layout) and rows in range (moe_permute / moe_unpermute; for moe_permute also each named once, in the same
// sync). The MoE layer syncs once per layer anyway for the all-to-all split sizes. NaN or infinite logits are not
// checked on CUDA (a row with no softmax gets distinct valid experts, otherwise unspecified).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/moe.h"

namespace fastdist::moe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_cuda_op(const at::Tensor& logits, int64_t k) {
  check_route(logits, k);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor src = logits.contiguous();
  RouteOutputs out(src, k);
  C10_CUDA_CHECK(fastdist::moe_route_cuda(src.const_data_ptr(), storage_type_of(src, "logits", kLogitDtypes),
                                          src.size(0), src.size(1), k, out.probs.data_ptr<float>(),
                                          out.lse.data_ptr<float>(), out.topk_idx.data_ptr<int64_t>(),
                                          out.topk_weight.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return out.as_tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_layout_cuda_op(
    const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks, int64_t capacity) {
  check_layout(topk_idx, num_experts, num_ranks, capacity);
  TORCH_CHECK(num_experts <= kMaxExpertsCuda, "fastdist: 'num_experts' must be <= ", kMaxExpertsCuda,
              " on CUDA (per-warp shared-memory histograms), got ", num_experts);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const at::Tensor idx = topk_idx.contiguous();
  const int64_t tokens = idx.size(0);
  const int64_t k = idx.size(1);
  if (idx.numel() > 0) {
    const auto [lo, hi] = at::aminmax(idx);
    const int64_t min_id = lo.item<int64_t>();
    const int64_t max_id = hi.item<int64_t>();
    TORCH_CHECK(min_id >= 0 && max_id < num_experts, "fastdist: 'topk_idx' entries must be in [0, num_experts = ",
                num_experts, "), got values in [", min_id, ", ", max_id, "]");
  }
  LayoutOutputs out(idx, num_experts, num_ranks);
  at::Tensor workspace =
      at::empty({fastdist::moe_layout_cuda_workspace_bytes(tokens, k, num_experts) / 8}, idx.options());
  C10_CUDA_CHECK(fastdist::moe_layout_cuda(
      idx.const_data_ptr<int64_t>(), tokens, k, num_experts, num_ranks, capacity, out.counts.data_ptr<int64_t>(),
      out.offsets.data_ptr<int64_t>(), out.rank_counts.data_ptr<int64_t>(), out.permutation.data_ptr<int64_t>(),
      out.row_of_slot.data_ptr<int64_t>(), out.position.data_ptr<int64_t>(), out.keep_bytes(), workspace.data_ptr(),
      c10::cuda::getCurrentCUDAStream()));
  return out.as_tuple();
}

at::Tensor moe_permute_cuda_op(const at::Tensor& x, const at::Tensor& row_of_slot, int64_t num_rows,
                               const std::optional<at::Tensor>& weight) {
  check_permute(x, row_of_slot, num_rows, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  check_rows_of_slot(row_of_slot, num_rows, /*distinct=*/true);
  const at::Tensor src = x.contiguous();
  const at::Tensor rows = row_of_slot.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  at::Tensor out = at::zeros({num_rows, src.size(1)}, src.options());
  C10_CUDA_CHECK(fastdist::moe_permute_cuda(src.const_data_ptr(), storage_type_of(src, "x", kRowDtypes), src.size(0),
                                            src.size(1), rows.size(1), rows.const_data_ptr<int64_t>(),
                                            w.defined() ? w.const_data_ptr() : nullptr, out.data_ptr(),
                                            c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor moe_unpermute_cuda_op(const at::Tensor& y, const at::Tensor& row_of_slot,
                                 const std::optional<at::Tensor>& weight) {
  check_unpermute(y, row_of_slot, weight);
  const c10::cuda::CUDAGuard guard(y.device());
  check_rows_of_slot(row_of_slot, y.size(0), /*distinct=*/false);
  const at::Tensor src = y.contiguous();
  const at::Tensor rows = row_of_slot.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  at::Tensor out = at::empty({rows.size(0), src.size(1)}, src.options());
  C10_CUDA_CHECK(fastdist::moe_unpermute_cuda(src.const_data_ptr(), storage_type_of(src, "y", kRowDtypes),
                                              rows.size(0), src.size(1), rows.size(1), rows.const_data_ptr<int64_t>(),
                                              w.defined() ? w.const_data_ptr() : nullptr, out.data_ptr(),
                                              c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace fastdist::moe

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("moe_route", &fastdist::moe::moe_route_cuda_op);
  m.impl("moe_layout", &fastdist::moe::moe_layout_cuda_op);
  m.impl("moe_permute", &fastdist::moe::moe_permute_cuda_op);
  m.impl("moe_unpermute", &fastdist::moe::moe_unpermute_cuda_op);
}
