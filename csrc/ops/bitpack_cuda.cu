// CUDA kernels of the torch.ops.fastdist bit-packing ops (schemas in bitpack.cpp). Work runs on the current
// stream of the input's device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/bitpack.h"

namespace fastdist::bitpack {
namespace {

at::Tensor pack_bits_cuda_op(const at::Tensor& mask) {
  const RowLayout layout = check_pack_bits(mask);
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::Tensor src = mask.contiguous();
  at::Tensor out = at::empty(layout.out_shape, src.options().dtype(at::kByte));
  C10_CUDA_CHECK(fastdist::pack_bits_cuda(bytes_of(src), layout.rows, layout.n, out.data_ptr<uint8_t>(),
                                          c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor unpack_bits_cuda_op(const at::Tensor& packed, int64_t n) {
  const RowLayout layout = check_unpack_bits(packed, n);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor src = packed.contiguous();
  at::Tensor out = at::empty(layout.out_shape, src.options().dtype(at::kBool));
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  C10_CUDA_CHECK(
      fastdist::unpack_bits_cuda(bytes_of(src), layout.rows, layout.n, dst, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor bitwise_or_reduce_cuda_op(const at::Tensor& packed) {
  check_bitwise_or_reduce(packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor src = packed.contiguous();
  at::Tensor out = at::empty({src.size(1)}, src.options());
  C10_CUDA_CHECK(fastdist::bitwise_or_reduce_cuda(bytes_of(src), src.size(0), src.size(1), out.data_ptr<uint8_t>(),
                                                  c10::cuda::getCurrentCUDAStream()));
  return out;
}

// Indices outside [0, n) are skipped, not checked (see kernels/bitpack.h). The bitmap is allocated in whole 32-bit
// words for the kernel's atomicOr and returned as its first ceil(n / 8) bytes.
at::Tensor bitmap_from_indices_cuda_op(const at::Tensor& indices, int64_t n) {
  check_bitmap_from_indices(indices, n);
  const c10::cuda::CUDAGuard guard(indices.device());
  const at::Tensor idx = indices.contiguous();
  const int64_t bytes = packed_bytes(n);
  const int64_t padded = bytes / 4 * 4 + (bytes % 4 != 0 ? 4 : 0);
  at::Tensor words = at::zeros({padded}, idx.options().dtype(at::kByte));
  C10_CUDA_CHECK(fastdist::bitmap_from_indices_cuda(idx.const_data_ptr<int64_t>(), idx.numel(), n,
                                                    words.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()));
  return words.narrow(0, 0, bytes);
}

}  // namespace
}  // namespace fastdist::bitpack

TORCH_LIBRARY_IMPL(fastdist, CUDA, m) {
  m.impl("pack_bits", &fastdist::bitpack::pack_bits_cuda_op);
  m.impl("unpack_bits", &fastdist::bitpack::unpack_bits_cuda_op);
  m.impl("bitwise_or_reduce", &fastdist::bitpack::bitwise_or_reduce_cuda_op);
  m.impl("bitmap_from_indices", &fastdist::bitpack::bitmap_from_indices_cuda_op);
}
