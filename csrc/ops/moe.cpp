// torch.ops.fastdist MoE routing ops: schemas and CPU kernels. See csrc/kernels/moe.h for the layouts.
//
// Determinism: route, permute and unpermute run in parallel over tokens and each token's outputs are computed by one
// thread from its own inputs (unpermute gathers a token's k rows in increasing j instead of scatter-adding into
// it). The layout's chunks are histogrammed and scattered in parallel, but it computes the unique stable sort, so
// its outputs do not depend on the chunking. Every result is bit-identical from 1 thread to many.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "ops/moe.h"
#include "ops/parallel.h"

namespace fastdist::moe {
namespace {

constexpr int64_t kLayoutChunk = 32 * 1024;  // assignments per layout chunk, at least

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_cpu_op(const at::Tensor& logits, int64_t k) {
  check_route(logits, k);
  const at::Tensor src = logits.contiguous();
  const int64_t tokens = src.size(0);
  const int64_t experts = src.size(1);
  RouteOutputs out(src, k);
  const StorageType type = storage_type_of(src, "logits", kLogitDtypes);
  std::atomic<int64_t> bad_rows{0};
  at::parallel_for(0, tokens, grain_for({experts, 8 + 4 * k}), [&](int64_t begin, int64_t end) {
    bad_rows += fastdist::moe_route_cpu(src.const_data_ptr(), type, experts, k, out.probs.data_ptr<float>(),
                                        out.lse.data_ptr<float>(), out.topk_idx.data_ptr<int64_t>(),
                                        out.topk_weight.data_ptr<float>(), begin, end);
  });
  TORCH_CHECK(bad_rows.load() == 0, "fastdist: 'logits' rows must hold no NaN and a finite maximum (no +inf, not "
              "all -inf: such a row has no softmax), got ", bad_rows.load(), " row(s) without one");
  return out.as_tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_layout_cpu_op(
    const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks, int64_t capacity) {
  check_layout(topk_idx, num_experts, num_ranks, capacity);
  const at::Tensor idx = topk_idx.contiguous();
  const int64_t tokens = idx.size(0);
  const int64_t k = idx.size(1);
  const int64_t n = tokens * k;
  LayoutOutputs out(idx, num_experts, num_ranks);
  if (n == 0) {  // no assignments: every count is zero (and no histogram of the k choices is needed)
    out.counts.zero_();
    out.offsets.zero_();
    out.rank_counts.zero_();
    return out.as_tuple();
  }
  // Chunks of consecutive tokens; how many changes nothing in the result (moe.h), only the parallelism.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kLayoutChunk));
  std::vector<int64_t> hist(
      static_cast<size_t>(checked_mul(chunks, k * num_experts, "layout chunks * histogram entries")), 0);
  std::vector<int64_t> dropped_offsets(static_cast<size_t>(num_experts));
  const int64_t* in = idx.const_data_ptr<int64_t>();
  auto chunk_begin = [&](int64_t c) { return c * tokens / chunks; };
  std::atomic<int64_t> invalid{0};
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      invalid += fastdist::moe_layout_histogram_cpu(in, tokens, k, num_experts, chunk_begin(c), chunk_begin(c + 1),
                                                    hist.data() + c * k * num_experts);
    }
  });
  TORCH_CHECK(invalid.load() == 0, "fastdist: 'topk_idx' entries must be in [0, num_experts = ", num_experts,
              "), got ", invalid.load(), " outside");
  fastdist::moe_layout_scan_cpu(hist.data(), chunks, k, num_experts, num_ranks, capacity,
                                out.counts.data_ptr<int64_t>(), out.offsets.data_ptr<int64_t>(),
                                dropped_offsets.data(), out.rank_counts.data_ptr<int64_t>());
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      fastdist::moe_layout_scatter_cpu(in, k, num_experts, capacity, out.offsets.const_data_ptr<int64_t>(),
                                       dropped_offsets.data(), chunk_begin(c), chunk_begin(c + 1),
                                       hist.data() + c * k * num_experts, out.permutation.data_ptr<int64_t>(),
                                       out.row_of_slot.data_ptr<int64_t>(), out.position.data_ptr<int64_t>(),
                                       out.keep_bytes());
    }
  });
  return out.as_tuple();
}

at::Tensor moe_permute_cpu_op(const at::Tensor& x, const at::Tensor& row_of_slot, int64_t num_rows,
                              const std::optional<at::Tensor>& weight) {
  check_permute(x, row_of_slot, num_rows, weight);
  check_rows_of_slot(row_of_slot, num_rows, /*distinct=*/true);
  const at::Tensor src = x.contiguous();
  const at::Tensor rows = row_of_slot.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const int64_t d = src.size(1);
  const int64_t k = rows.size(1);
  at::Tensor out = at::zeros({num_rows, d}, src.options());
  const StorageType type = storage_type_of(src, "x", kRowDtypes);
  at::parallel_for(0, src.size(0), grain_for({2, k, d, src.element_size()}), [&](int64_t begin, int64_t end) {
    fastdist::moe_permute_cpu(src.const_data_ptr(), type, d, k, rows.const_data_ptr<int64_t>(),
                              w.defined() ? w.const_data_ptr() : nullptr, out.data_ptr(), begin, end);
  });
  return out;
}

at::Tensor moe_unpermute_cpu_op(const at::Tensor& y, const at::Tensor& row_of_slot,
                                const std::optional<at::Tensor>& weight) {
  check_unpermute(y, row_of_slot, weight);
  check_rows_of_slot(row_of_slot, y.size(0), /*distinct=*/false);
  const at::Tensor src = y.contiguous();
  const at::Tensor rows = row_of_slot.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const int64_t tokens = rows.size(0);
  const int64_t d = src.size(1);
  const int64_t k = rows.size(1);
  at::Tensor out = at::empty({tokens, d}, src.options());
  const StorageType type = storage_type_of(src, "y", kRowDtypes);
  at::parallel_for(0, tokens, grain_for({2, k, d, src.element_size()}), [&](int64_t begin, int64_t end) {
    fastdist::moe_unpermute_cpu(src.const_data_ptr(), type, d, k, rows.const_data_ptr<int64_t>(),
                                w.defined() ? w.const_data_ptr() : nullptr, out.data_ptr(), begin, end);
  });
  return out;
}

}  // namespace
}  // namespace fastdist::moe

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("moe_route(Tensor logits, int k) -> (Tensor, Tensor, Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("moe_layout(Tensor topk_idx, int num_experts, int num_ranks, int capacity) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("moe_permute(Tensor x, Tensor row_of_slot, int num_rows, Tensor? weight) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("moe_unpermute(Tensor y, Tensor row_of_slot, Tensor? weight) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("moe_route", &fastdist::moe::moe_route_cpu_op);
  m.impl("moe_layout", &fastdist::moe::moe_layout_cpu_op);
  m.impl("moe_permute", &fastdist::moe::moe_permute_cpu_op);
  m.impl("moe_unpermute", &fastdist::moe::moe_unpermute_cpu_op);
}
