// Argument checks shared by the op glue: each error names the argument, what was expected and what came. The Python
// fake kernels repeat them with the same wording (python/fastdist/ops/_checks.py).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "kernels/float_bits.h"

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

// The dtypes the kernels store (StorageType, kernels/float_bits.h), in the order the messages list them.
constexpr at::ScalarType kFloatingDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
// The dtypes of the ops that compute in float32: float32 itself and the 16-bit formats it holds exactly.
constexpr at::ScalarType kFloat32Or16BitDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16};

// "torch.float32, torch.float16 or torch.bfloat16": the dtypes in the order given.
inline std::string dtype_list(at::ArrayRef<at::ScalarType> dtypes) {
  std::string list;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i > 0) list += i + 1 == dtypes.size() ? " or " : ", ";
    list += dtype_name(dtypes[i]);
  }
  return list;
}

// t (named `name`) must have one of the dtypes `allowed`. The message lists them in the order given, as "a floating
// dtype (...)" when they are every dtype the kernels store.
inline void check_dtype_in(const at::Tensor& t, const char* name, at::ArrayRef<at::ScalarType> allowed) {
  const at::ScalarType dtype = t.scalar_type();
  const auto allows = [&](at::ScalarType candidate) {
    return std::find(allowed.begin(), allowed.end(), candidate) != allowed.end();
  };
  if (allows(dtype)) return;
  const bool every_floating = std::all_of(std::begin(kFloatingDtypes), std::end(kFloatingDtypes), allows);
  TORCH_CHECK(false, "fastdist: '", name, "' must have ",
              every_floating ? "a floating dtype (" + dtype_list(allowed) + ")" : "dtype " + dtype_list(allowed),
              ", got ", dtype_name(dtype));
}

// The kernels' StorageType of t, which must have one of the dtypes `allowed` (a subset of kFloatingDtypes): the one
// place where torch dtypes become the kernels' storage formats.
inline StorageType storage_type_of(const at::Tensor& t, const char* name,
                                   at::ArrayRef<at::ScalarType> allowed = kFloatingDtypes) {
  check_dtype_in(t, name, allowed);
  switch (t.scalar_type()) {
    case at::kDouble: return StorageType::kFloat64;
    case at::kHalf: return StorageType::kFloat16;
    case at::kBFloat16: return StorageType::kBFloat16;
    default: return StorageType::kFloat32;
  }
}

inline void check_seed(int64_t seed) { TORCH_CHECK(seed >= 0, "fastdist: 'seed' must be in [0, 2^63), got ", seed); }

// ---- sizes: every product of sizes that the glue or the kernels form is checked here first, so that none wraps ----

// *product = a * b; false when it does not fit in int64 (the one overflow-safe multiply of the checks).
inline bool mul_fits(int64_t a, int64_t b, int64_t* product) { return !__builtin_mul_overflow(a, b, product); }

// a * b, where `what` names the two factors ("'n' * 'm'"); a product past int64 raises an error that states both.
inline int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t product = 0;
  TORCH_CHECK(mul_fits(a, b, &product), "fastdist: ", what, " = ", a, " * ", b, " does not fit in int64");
  return product;
}

// The product of `sizes` (part of a tensor's shape, named by `what`); past int64 it raises an error that states them.
inline int64_t checked_product(at::IntArrayRef sizes, const std::string& what) {
  if (std::find(sizes.begin(), sizes.end(), int64_t{0}) != sizes.end()) return 0;
  int64_t product = 1;
  bool fits = true;
  for (const int64_t size : sizes) fits = fits && mul_fits(product, size, &product);
  TORCH_CHECK(fits, "fastdist: ", what, " ", sizes, " multiply past int64");
  return product;
}

// A tensor of `sizes` and `dtype` that the op is about to make (`what` names it): as torch requires, its strides
// (the products of the sizes after each, zeros counted as ones) and its size in bytes must fit in int64. Checked
// before the allocation, so that the error states the shape where torch would say "Stride calculation overflowed".
inline void check_allocatable(at::IntArrayRef sizes, at::ScalarType dtype, const std::string& what) {
  bool fits = true;
  int64_t stride = 1;  // the first dimension's, the largest
  for (size_t i = 1; i < sizes.size(); ++i) fits = fits && mul_fits(stride, std::max<int64_t>(sizes[i], 1), &stride);
  const bool empty = std::find(sizes.begin(), sizes.end(), int64_t{0}) != sizes.end();
  int64_t bytes = empty ? 0 : static_cast<int64_t>(c10::elementSize(dtype));
  for (const int64_t size : sizes) fits = fits && mul_fits(bytes, size, &bytes);
  TORCH_CHECK(fits, "fastdist: ", what, " would have shape ", sizes, " of ", dtype_name(dtype),
              ": its strides or its size in bytes pass int64");
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
