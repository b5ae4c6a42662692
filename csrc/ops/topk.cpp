// torch.ops.fastdist TopK ops: schemas and CPU kernels. See csrc/kernels/topk.h for the selection rule, the tie
// break and the output order.
//
// Rows are independent: at::parallel_for hands each thread a range of rows, and every row's result depends on that
// row alone, so results are bit-identical whatever the thread count. float16 / bfloat16 inputs are selected on
// their exact float32 image; the kept values are cast back (exactly).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "ops/parallel.h"
#include "ops/topk.h"

namespace fastdist::topk {
namespace {

// One long row (per-tensor TopK) split into chunks: the histogram and the partition run over the chunks in parallel,
// each chunk writing its lists at its own offset of the scratch arrays; the lists are then closed up in chunk order
// (so they stay ascending) and the small candidate passes and the merge run on the calling thread. The result is
// the same whatever the number of chunks: the selection rule defines it.
void select_long_row(const float* x, int64_t d, int64_t k, float* values, int32_t* indices, int64_t chunks) {
  const int64_t chunk = (d + chunks - 1) / chunks;
  std::vector<uint32_t> hists(chunks * kTopkPass1Buckets, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      fastdist::topk_histogram_cpu(x, c * chunk, std::min(d, (c + 1) * chunk), hists.data() + c * kTopkPass1Buckets);
    }
  });
  std::vector<uint32_t> hist(kTopkPass1Buckets, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int b = 0; b < kTopkPass1Buckets; ++b) hist[b] += hists[c * kTopkPass1Buckets + b];
  }
  int64_t need = 0;
  const uint32_t bucket = fastdist::topk_pick_bucket(hist.data(), k, &need);
  // Uninitialized scratch (std::vector would zero 12 bytes per value first).
  const std::unique_ptr<int32_t[]> above(new int32_t[d]), pos(new int32_t[d]);
  const std::unique_ptr<uint32_t[]> keys(new uint32_t[d]);
  std::vector<int64_t> n_above(chunks, 0), n_cand(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = std::min(d, c * chunk);
      fastdist::topk_partition_cpu(x, lo, std::min(d, (c + 1) * chunk), bucket, above.get() + lo, &n_above[c],
                                   keys.get() + lo, pos.get() + lo, &n_cand[c]);
    }
  });
  int64_t total_above = 0, total_cand = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = std::min(d, c * chunk);
    std::memmove(above.get() + total_above, above.get() + lo, n_above[c] * sizeof(int32_t));
    std::memmove(keys.get() + total_cand, keys.get() + lo, n_cand[c] * sizeof(uint32_t));
    std::memmove(pos.get() + total_cand, pos.get() + lo, n_cand[c] * sizeof(int32_t));
    total_above += n_above[c];
    total_cand += n_cand[c];
  }
  fastdist::topk_finish_cpu(x, k, need, bucket, above.get(), total_above, keys.get(), pos.get(), total_cand, values,
                            indices);
}

// A single row at least this long is split between threads (below it, one thread is as fast).
constexpr int64_t kLongRow = int64_t{1} << 20;

std::tuple<at::Tensor, at::Tensor> topk_compress_cpu_op(const at::Tensor& x, int64_t k) {
  check_topk_compress(x, k);
  const at::Tensor src = x.to(at::kFloat).contiguous();
  const int64_t rows = src.size(0), d = src.size(1);
  at::Tensor values = at::empty({rows, k}, src.options());
  at::Tensor indices = at::empty({rows, k}, src.options().dtype(at::kInt));
  const float* in = src.const_data_ptr<float>();
  float* kept_values = values.data_ptr<float>();
  int32_t* kept_indices = indices.data_ptr<int32_t>();
  if (rows == 1 && d >= kLongRow && at::get_num_threads() > 1) {
    select_long_row(in, d, k, kept_values, kept_indices,
                    std::min<int64_t>(4 * at::get_num_threads(), d / (kLongRow / 16)));
  } else {
    at::parallel_for(0, rows, grain_for({3, d, sizeof(float)}), [&](int64_t begin, int64_t end) {
      const int64_t scratch_words = (fastdist::topk_cpu_scratch_bytes(d) + 7) / 8;  // 8-byte aligned
      const std::unique_ptr<uint64_t[]> scratch(new uint64_t[scratch_words]);
      fastdist::topk_compress_cpu(in, rows, d, k, kept_values, kept_indices, begin, end, scratch.get());
    });
  }
  return {values.to(x.scalar_type()), indices};
}

at::Tensor topk_decompress_cpu_op(const at::Tensor& values, const at::Tensor& indices, int64_t d) {
  check_topk_decompress(values, indices, d);
  const at::Tensor val = values.to(at::kFloat).contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t rows = val.size(0), k = val.size(1);
  at::Tensor out = at::empty({rows, d}, val.options());
  const float* kept_values = val.const_data_ptr<float>();
  const int32_t* kept_indices = idx.const_data_ptr<int32_t>();
  float* dst = out.data_ptr<float>();
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, rows, grain_for({d, sizeof(float)}), [&](int64_t begin, int64_t end) {
    bad += fastdist::topk_decompress_cpu(kept_values, kept_indices, rows, k, d, dst, begin, end);
  });
  TORCH_CHECK(bad.load() == 0, "fastdist: 'indices' must be in [0, d) with d = ", d, ", got ", bad.load(),
              " out of range");
  return out.to(values.scalar_type());
}

at::Tensor topk_indices_to_bitmap_cpu_op(const at::Tensor& indices, int64_t d) {
  check_indices_to_bitmap(indices, d);
  const at::Tensor idx = indices.contiguous();
  const int64_t rows = idx.size(0), k = idx.size(1);
  at::Tensor out = at::empty({rows, packed_bytes(d)}, idx.options().dtype(at::kByte));
  const int32_t* kept_indices = idx.const_data_ptr<int32_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, rows, grain_for({4 * k + d / 8}), [&](int64_t begin, int64_t end) {
    bad += fastdist::topk_indices_to_bitmap_cpu(kept_indices, rows, k, d, dst, begin, end);
  });
  TORCH_CHECK(bad.load() == 0, "fastdist: 'indices' must be strictly ascending within [0, d) in every row, with d = ",
              d, "; ", bad.load(), " row(s) are not");
  return out;
}

at::Tensor topk_bitmap_to_indices_cpu_op(const at::Tensor& bitmap, int64_t d, int64_t k) {
  check_bitmap_to_indices(bitmap, d, k);
  const at::Tensor bm = bitmap.contiguous();
  const int64_t rows = bm.size(0);
  at::Tensor out = at::empty({rows, k}, bm.options().dtype(at::kInt));
  const uint8_t* bits = bm.const_data_ptr<uint8_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, rows, grain_for({4 * k + d / 8}), [&](int64_t begin, int64_t end) {
    bad += fastdist::topk_bitmap_to_indices_cpu(bits, rows, k, d, dst, begin, end);
  });
  TORCH_CHECK(bad.load() == 0, "fastdist: 'bitmap' must have exactly k = ", k, " bits set among the first d = ", d,
              " of every row; ", bad.load(), " row(s) do not");
  return out;
}

}  // namespace
}  // namespace fastdist::topk

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("topk_compress(Tensor x, int k) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("topk_decompress(Tensor values, Tensor indices, int d) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("topk_indices_to_bitmap(Tensor indices, int d) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("topk_bitmap_to_indices(Tensor bitmap, int d, int k) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("topk_compress", &fastdist::topk::topk_compress_cpu_op);
  m.impl("topk_decompress", &fastdist::topk::topk_decompress_cpu_op);
  m.impl("topk_indices_to_bitmap", &fastdist::topk::topk_indices_to_bitmap_cpu_op);
  m.impl("topk_bitmap_to_indices", &fastdist::topk::topk_bitmap_to_indices_cpu_op);
}
