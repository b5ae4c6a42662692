// torch.ops.fastdist bit-packing ops: schemas and CPU kernels. See csrc/kernels/bitpack.h for the layout.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/bitpack.h"

namespace fastdist::bitpack {
namespace {

// Work items are packed bytes (columns for the OR reduction). A chunk below this many bytes of memory
// traffic is not worth a thread: small inputs run on the calling thread.
constexpr int64_t kGrainTrafficBytes = 256 * 1024;
constexpr int64_t kPackedByteGrain = kGrainTrafficBytes / 9;  // a packed byte moves itself and 8 mask bytes

at::Tensor pack_bits_cpu_op(const at::Tensor& mask) {
  const RowsOf v = check_pack_bits(mask);
  const at::Tensor src = mask.contiguous();
  at::Tensor out = at::empty(v.out_shape, src.options().dtype(at::kByte));
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), kPackedByteGrain, [&](int64_t begin, int64_t end) {
    fastdist::pack_bits_cpu(in, v.rows, v.n, dst, begin, end);
  });
  return out;
}

at::Tensor unpack_bits_cpu_op(const at::Tensor& packed, int64_t n) {
  const RowsOf v = check_unpack_bits(packed, n);
  const at::Tensor src = packed.contiguous();
  at::Tensor out = at::empty(v.out_shape, src.options().dtype(at::kBool));
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  at::parallel_for(0, src.numel(), kPackedByteGrain, [&](int64_t begin, int64_t end) {
    fastdist::unpack_bits_cpu(in, v.rows, v.n, dst, begin, end);
  });
  return out;
}

at::Tensor bitwise_or_reduce_cpu_op(const at::Tensor& packed) {
  check_bitwise_or_reduce(packed);
  const at::Tensor src = packed.contiguous();
  const int64_t p = src.size(0), b = src.size(1);
  at::Tensor out = at::empty({b}, src.options());
  const uint8_t* in = bytes_of(src);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, b, std::max<int64_t>(kGrainTrafficBytes / (p + 1), 1), [&](int64_t begin, int64_t end) {
    fastdist::bitwise_or_reduce_cpu(in, p, b, dst, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace fastdist::bitpack

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("pack_bits(Tensor mask) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("unpack_bits(Tensor packed, int n) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("bitwise_or_reduce(Tensor packed) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("pack_bits", &fastdist::bitpack::pack_bits_cpu_op);
  m.impl("unpack_bits", &fastdist::bitpack::unpack_bits_cpu_op);
  m.impl("bitwise_or_reduce", &fastdist::bitpack::bitwise_or_reduce_cpu_op);
}
