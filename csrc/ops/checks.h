// Argument checks shared by the op glue: each error names the argument, what was expected and what came.
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace fastdist {

// The dtype as Python users write it ("torch.uint8", not ATen's "Byte").
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

}  // namespace fastdist

#define FD_CHECK_DTYPE(t, dt)                                                                     \
  TORCH_CHECK((t).scalar_type() == (dt), "fastdist: '" #t "' must have dtype ",                   \
              ::fastdist::dtype_name(dt), ", got ", ::fastdist::dtype_name((t).scalar_type()))
#define FD_CHECK_DIM_AT_LEAST(t, d)                                                                   \
  TORCH_CHECK((t).dim() >= (d), "fastdist: '" #t "' must have at least ", (d), " dimension(s), got shape ", \
              (t).sizes())
#define FD_CHECK_DIM(t, d) \
  TORCH_CHECK((t).dim() == (d), "fastdist: '" #t "' must have ", (d), " dimension(s), got shape ", (t).sizes())
#define FD_CHECK_SAME_DEVICE(a, b)                                                                           \
  TORCH_CHECK((a).device() == (b).device(), "fastdist: '" #a "' and '" #b "' must be on the same device, got ", \
              (a).device(), " and ", (b).device())
#define FD_CHECK_NONNEGATIVE(v) TORCH_CHECK((v) >= 0, "fastdist: '" #v "' must be >= 0, got ", (v))
// `why` says where the expected size comes from, e.g. "ceil(n / 8) for n = 9".
#define FD_CHECK_LAST_DIM(t, expected, why)                                                                \
  TORCH_CHECK((t).dim() >= 1 && (t).size(-1) == (expected), "fastdist: '" #t "' must have last dimension ", \
              (expected), " (", why, "), got shape ", (t).sizes())
