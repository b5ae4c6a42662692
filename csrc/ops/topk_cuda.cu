// CUDA kernels of the torch.ops.fastdist TopK ops (schemas in topk.cpp). Work runs on the current stream of the
// input's device. Unlike the CPU glue, index validity is not checked here (that would need a device-to-host copy
// per call): out-of-range indices are skipped, never written out of bounds (see csrc/kernels/topk.h).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/topk.h"

namespace fastdist::topk {
namespace {

// The row kernels launch one block per row: a grid holds at most 2^31 - 1 of them.
void check_rows_fit_a_grid(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int32_t>::max(), "fastdist: '", name,
              "' must have at most 2^31 - 1 rows on CUDA (one block per row), got shape ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor> topk_compress_cuda_op(const at::Tensor& x, int64_t k) {
  check_topk_compress(x, k);
  check_rows_fit_a_grid(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.to(at::kFloat).contiguous();
  const int64_t rows = src.size(0), d = src.size(1);
  at::Tensor values = at::empty({rows, k}, src.options());
  at::Tensor indices = at::empty({rows, k}, src.options().dtype(at::kInt));
  C10_CUDA_CHECK(fastdist::topk_compress_cuda(src.const_data_ptr<float>(), rows, d, k, values.data_ptr<float>(),
                                              indices.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
  return {values.to(x.scalar_type()), indices};
}

at::Tensor topk_decompress_cuda_op(const at::Tensor& values, const at::Tensor& indices, int64_t d) {
  check_topk_decompress(values, indices, d);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor val = values.to(at::kFloat).contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t rows = val.size(0), k = val.size(1);
  at::Tensor out = at::empty({rows, d}, val.options());
  C10_CUDA_CHECK(fastdist::topk_decompress_cuda(val.const_data_ptr<float>(), idx.const_data_ptr<int32_t>(), rows, k,
                                                d, out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return out.to(values.scalar_type());
}

at::Tensor topk_indices_to_bitmap_cuda_op(const at::Tensor& indices, int64_t d) {
  check_indices_to_bitmap(indices, d);
  const c10::cuda::CUDAGuard guard(indices.device());
  const at::Tensor idx = indices.contiguous();
  at::Tensor out = at::empty({idx.size(0), packed_bytes(d)}, idx.options().dtype(at::kByte));
  C10_CUDA_CHECK(fastdist::topk_indices_to_bitmap_cuda(idx.const_data_ptr<int32_t>(), idx.size(0), idx.size(1), d,
                                                       out.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor topk_bitmap_to_indices_cuda_op(const at::Tensor& bitmap, int64_t d, int64_t k) {
  check_bitmap_to_indices(bitmap, d, k);
  check_rows_fit_a_grid(bitmap, "bitmap");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  const at::Tensor bm = bitmap.contiguous();
  at::Tensor out = at::empty({bm.size(0), k}, bm.options().dtype(at::kInt));
  C10_CUDA_CHECK(fastdist::topk_bitmap_to_indices_cuda(bm.const_data_ptr<uint8_t>(), bm.size(0), k, d,
                                                       out.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace fastdist::topk

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("topk_compress", &fastdist::topk::topk_compress_cuda_op);
  m.impl("topk_decompress", &fastdist::topk::topk_decompress_cuda_op);
  m.impl("topk_indices_to_bitmap", &fastdist::topk::topk_indices_to_bitmap_cuda_op);
  m.impl("topk_bitmap_to_indices", &fastdist::topk::topk_bitmap_to_indices_cuda_op);
}
