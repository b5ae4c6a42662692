// Argument checks of the fused-epilogue ops, shared by the CPU glue (epilogue.cpp) and the CUDA glue
// (epilogue_cuda.cu) so that both devices reject the same inputs with the same messages. The Python fake kernels
// (python/fastdist/ops/epilogue.py) repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "kernels/epilogue.h"
#include "ops/checks.h"

namespace fastdist::epilogue {

// x viewed as rows x cols, cols = its last dimension.
struct RowShape {
  int64_t rows;
  int64_t cols;
};

inline EpilogueActivation activation_of(const std::string& activation) {
  if (activation == "none") return EpilogueActivation::kNone;
  if (activation == "gelu_tanh") return EpilogueActivation::kGeluTanh;
  if (activation == "gelu_erf") return EpilogueActivation::kGeluErf;
  TORCH_CHECK(false, "fastdist: 'activation' must be \"none\", \"gelu_tanh\" or \"gelu_erf\", got \"", activation,
              "\"");
}

// `t` (named `name`) must match x's dtype and device.
inline void check_like_x(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "fastdist: '", name, "' must have the dtype of 'x' (",
              dtype_name(x.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == x.device(), "fastdist: '", name, "' and 'x' must be on the same device, got ", t.device(),
              " and ", x.device());
}

inline RowShape check_x_and_bias(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  check_dtype_in(x, "x", kFloatingDtypes);
  FD_CHECK_DIM_AT_LEAST(x, 1);
  check_allocatable(x.sizes(), x.scalar_type(), "the output");
  const int64_t cols = x.size(-1);
  const RowShape shape{cols == 0 ? 0 : x.numel() / cols, cols};
  if (bias.has_value()) {
    check_like_x(*bias, "bias", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cols, "fastdist: 'bias' must have shape [", cols,
                "] (the last dimension of 'x'), got shape ", bias->sizes());
  }
  return shape;
}

// bias_epilogue(x, bias, residual, activation) -> act(x + bias) + residual, x's shape and dtype
inline RowShape check_bias_epilogue(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                    const std::optional<at::Tensor>& residual, const std::string& activation) {
  const RowShape shape = check_x_and_bias(x, bias);
  if (residual.has_value()) {
    check_like_x(*residual, "residual", x);
    TORCH_CHECK(residual->sizes() == x.sizes(), "fastdist: 'residual' must have the shape of 'x' (", x.sizes(),
                "), got shape ", residual->sizes());
  }
  activation_of(activation);
  return shape;
}

// bias_epilogue_backward(grad, x, bias, activation) -> grad * act'(x + bias)
inline RowShape check_bias_epilogue_backward(const at::Tensor& grad, const at::Tensor& x,
                                             const std::optional<at::Tensor>& bias, const std::string& activation) {
  const RowShape shape = check_x_and_bias(x, bias);
  check_like_x(grad, "grad", x);
  TORCH_CHECK(grad.sizes() == x.sizes(), "fastdist: 'grad' must have the shape of 'x' (", x.sizes(), "), got shape ",
              grad.sizes());
  activation_of(activation);
  return shape;
}

inline const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

}  // namespace fastdist::epilogue
