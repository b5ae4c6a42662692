// CUDA kernels of the torch.ops.fastdist count-sketch ops (schemas in sketch.cpp). Work runs on the current stream of
// the input's device. The hash coefficients are computed on the host and passed to the kernels by value.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/sketch.h"

namespace fastdist::sketch {
namespace {

at::Tensor nonzero_bitmap_cuda_op(const at::Tensor& x, c10::string_view granularity) {
  const UnitShape shape = check_nonzero_bitmap(x, std::string(granularity));
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty({packed_bytes(shape.n)}, src.options().dtype(at::kByte));
  C10_CUDA_CHECK(fastdist::nonzero_bitmap_cuda(src.const_data_ptr(), static_cast<int>(src.element_size()), shape.n,
                                               shape.m, out.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor count_sketch_cuda_op(const at::Tensor& x, int64_t rows, int64_t cols, int64_t seed,
                                const std::optional<at::Tensor>& support, c10::string_view granularity) {
  const UnitShape shape = check_count_sketch(x, rows, cols, seed, support, std::string(granularity));
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  const at::Tensor sup = support.has_value() ? support->contiguous() : at::Tensor();
  at::Tensor table = at::empty({rows, cols}, src.options().dtype(at::kFloat));
  C10_CUDA_CHECK(fastdist::count_sketch_cuda(src.const_data_ptr(), storage_type_of(src, "x"), shape.n, shape.m,
                                             sup.defined() ? support_bytes(sup) : nullptr, hash_for(seed, rows, cols),
                                             table.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return table;
}

at::Tensor count_sketch_decode_cuda_op(const at::Tensor& table, const at::Tensor& support, int64_t n, int64_t m,
                                       int64_t seed) {
  const UnitShape shape = check_count_sketch_decode(table, support, n, m, seed);
  const c10::cuda::CUDAGuard guard(table.device());
  const at::Tensor tab = table.contiguous();
  const at::Tensor sup = support.contiguous();
  at::Tensor out = at::empty({shape.n, shape.m}, tab.options());
  C10_CUDA_CHECK(fastdist::count_sketch_decode_cuda(tab.const_data_ptr<float>(), support_bytes(sup), shape.n, shape.m,
                                                    hash_for(seed, tab.size(0), tab.size(1)), out.data_ptr<float>(),
                                                    c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor count_sketch_units_cuda_op(const at::Tensor& values, const at::Tensor& units, int64_t rows, int64_t cols,
                                      int64_t seed) {
  const UnitShape shape = check_count_sketch_units(values, units, rows, cols, seed);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor src = values.contiguous();
  const at::Tensor idx = units.contiguous();
  at::Tensor table = at::empty({rows, cols}, src.options().dtype(at::kFloat));
  C10_CUDA_CHECK(fastdist::count_sketch_units_cuda(src.const_data_ptr(), storage_type_of(src, "values"),
                                                   idx.const_data_ptr<int64_t>(), shape.n, shape.m,
                                                   hash_for(seed, rows, cols), table.data_ptr<float>(),
                                                   c10::cuda::getCurrentCUDAStream()));
  return table;
}

at::Tensor count_sketch_decode_units_cuda_op(const at::Tensor& table, const at::Tensor& units, int64_t m,
                                             int64_t seed) {
  const int64_t k = check_count_sketch_decode_units(table, units, m, seed);
  const c10::cuda::CUDAGuard guard(table.device());
  const at::Tensor tab = table.contiguous();
  const at::Tensor idx = units.contiguous();
  at::Tensor out = at::empty({k, m}, tab.options());
  C10_CUDA_CHECK(fastdist::count_sketch_decode_units_cuda(tab.const_data_ptr<float>(), idx.const_data_ptr<int64_t>(),
                                                          k, m, hash_for(seed, tab.size(0), tab.size(1)),
                                                          out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> sketch_hash_cuda_op(const at::Tensor& idx, int64_t rows, int64_t cols,
                                                       int64_t seed, int64_t m) {
  check_sketch_hash(idx, rows, cols, seed, m);
  const c10::cuda::CUDAGuard guard(idx.device());
  const at::Tensor src = idx.contiguous();
  const int64_t len = src.numel();
  at::Tensor bucket = at::empty({rows, len}, src.options());
  at::Tensor sign = at::empty({rows, len}, src.options().dtype(at::kChar));
  C10_CUDA_CHECK(fastdist::sketch_hash_cuda(src.const_data_ptr<int64_t>(), len, m, hash_for(seed, rows, cols),
                                            bucket.data_ptr<int64_t>(), sign.data_ptr<int8_t>(),
                                            c10::cuda::getCurrentCUDAStream()));
  return {bucket, sign};
}

// The output's size depends on the bitmaps: the chunk counts are summed on the device and copied to the host once (a
// synchronization, as torch's nonzero has), which also checks that every support fits in its rows.
std::tuple<at::Tensor, at::Tensor> union_sum_rows_cuda_op(const at::Tensor& bitmaps, const at::Tensor& rows,
                                                          int64_t n, int64_t divisor) {
  const UnionRowsShape shape = check_union_sum_rows(bitmaps, rows, n, divisor);
  TORCH_CHECK(shape.p <= kUnionMaxRanksCuda, "fastdist: 'bitmaps' may have at most ", kUnionMaxRanksCuda,
              " rows on CUDA, got shape ", bitmaps.sizes());
  const c10::cuda::CUDAGuard guard(bitmaps.device());
  const std::pair<at::Tensor, int64_t> bits_and_stride = with_contiguous_blocks(bitmaps);
  const std::pair<at::Tensor, int64_t> rows_and_stride = with_contiguous_blocks(rows);
  const at::Tensor& bits = bits_and_stride.first;
  const at::Tensor& src = rows_and_stride.first;
  const int64_t p = shape.p, bytes = packed_bytes(n);
  const int64_t chunks = bytes / kUnionChunkBytes + (bytes % kUnionChunkBytes != 0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor counts = at::zeros({chunks, p + 1}, bits.options().dtype(at::kLong));
  C10_CUDA_CHECK(fastdist::union_rows_count_cuda(support_bytes(bits), p, bits_and_stride.second, n,
                                                 counts.data_ptr<int64_t>(), stream));
  const at::Tensor totals = counts.sum(0).cpu();
  check_union_rows_fit(totals.const_data_ptr<int64_t>(), p, shape.k);
  const int64_t total = totals.const_data_ptr<int64_t>()[p];
  const at::Tensor first = (counts.cumsum(0) - counts).contiguous();  // what the chunks before each hold
  at::Tensor units = at::empty({total}, bits.options().dtype(at::kLong));
  at::Tensor sums = at::empty({total, shape.m}, src.options());
  if (total > 0) {
    C10_CUDA_CHECK(fastdist::union_sum_rows_cuda(support_bytes(bits), p, bits_and_stride.second, n,
                                                 src.const_data_ptr(), storage_type_of(src, "rows"),
                                                 rows_and_stride.second, shape.m, divisor,
                                                 first.const_data_ptr<int64_t>(), units.data_ptr<int64_t>(),
                                                 sums.data_ptr(), stream));
  }
  return {units, sums};
}

}  // namespace
}  // namespace fastdist::sketch

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("nonzero_bitmap", &fastdist::sketch::nonzero_bitmap_cuda_op);
  m.impl("count_sketch", &fastdist::sketch::count_sketch_cuda_op);
  m.impl("count_sketch_decode", &fastdist::sketch::count_sketch_decode_cuda_op);
  m.impl("count_sketch_units", &fastdist::sketch::count_sketch_units_cuda_op);
  m.impl("count_sketch_decode_units", &fastdist::sketch::count_sketch_decode_units_cuda_op);
  m.impl("sketch_hash", &fastdist::sketch::sketch_hash_cuda_op);
  m.impl("union_sum_rows", &fastdist::sketch::union_sum_rows_cuda_op);
}
