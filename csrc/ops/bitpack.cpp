// torch.ops.fastdist bit-packing ops: schemas and CPU kernels. See csrc/kernels/bitpack.h for the layout.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/bitpack.h"
#include "ops/parallel.h"

namespace fastdist::bitpack {
namespace {

// Work items are packed bytes, each moving itself and its 8 mask bytes (columns for the OR reduction).
constexpr int64_t kPackedByteTraffic = 9;

at::Tensor pack_bits_cpu_op(const at::Tensor& mask) {
  const RowLayout layout = check_pack_bits(mask);
  const at::Tensor src = mask.contiguous();
  at::Tensor out = at::empty(layout.out_shape, src.options().dtype(at::kByte));
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), grain_for({kPackedByteTraffic}), [&](int64_t begin, int64_t end) {
    fastdist::pack_bits_cpu(in, layout.rows, layout.n, dst, begin, end);
  });
  return out;
}

at::Tensor unpack_bits_cpu_op(const at::Tensor& packed, int64_t n) {
  const RowLayout layout = check_unpack_bits(packed, n);
  const at::Tensor src = packed.contiguous();
  at::Tensor out = at::empty(layout.out_shape, src.options().dtype(at::kBool));
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  at::parallel_for(0, src.numel(), grain_for({kPackedByteTraffic}), [&](int64_t begin, int64_t end) {
    fastdist::unpack_bits_cpu(in, layout.rows, layout.n, dst, begin, end);
  });
  return out;
}

at::Tensor bitwise_or_reduce_cpu_op(const at::Tensor& packed) {
  check_bitwise_or_reduce(packed);
  const at::Tensor src = packed.contiguous();
  const int64_t bitmaps = src.size(0), bytes = src.size(1);
  at::Tensor out = at::empty({bytes}, src.options());
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = out.data_ptr<uint8_t>();
  // A column moves one byte of every bitmap (and one of the result).
  at::parallel_for(0, bytes, grain_for({bitmaps}), [&](int64_t begin, int64_t end) {
    fastdist::bitwise_or_reduce_cpu(in, bitmaps, bytes, dst, begin, end);
  });
  return out;
}

// Indices set bits with atomic ORs (see the kernel), so the bitmap is the same for any split between threads.
at::Tensor bitmap_from_indices_cpu_op(const at::Tensor& indices, int64_t n) {
  check_bitmap_from_indices(indices, n);
  const at::Tensor idx = indices.contiguous();
  const int64_t k = idx.numel();
  const int64_t* in = idx.const_data_ptr<int64_t>();
  const int64_t bad = fastdist::first_index_out_of_range(in, k, n);
  TORCH_CHECK(bad < 0, "fastdist: 'indices' must be in [0, ", n, ") (n = ", n, "), got ", bad < 0 ? 0 : in[bad],
              " at position ", bad);
  at::Tensor out = at::zeros({packed_bytes(n)}, idx.options().dtype(at::kByte));
  uint8_t* dst = out.data_ptr<uint8_t>();
  // An index reads 8 bytes and updates one byte of the bitmap (at random: count it as a cache line).
  at::parallel_for(0, k, grain_for({8 + 64}), [&](int64_t begin, int64_t end) {
    fastdist::bitmap_from_indices_cpu(in, n, dst, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace fastdist::bitpack

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("pack_bits(Tensor mask) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("unpack_bits(Tensor packed, int n) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("bitwise_or_reduce(Tensor packed) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("bitmap_from_indices(Tensor indices, int n) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("pack_bits", &fastdist::bitpack::pack_bits_cpu_op);
  m.impl("unpack_bits", &fastdist::bitpack::unpack_bits_cpu_op);
  m.impl("bitwise_or_reduce", &fastdist::bitpack::bitwise_or_reduce_cpu_op);
  m.impl("bitmap_from_indices", &fastdist::bitpack::bitmap_from_indices_cpu_op);
}
