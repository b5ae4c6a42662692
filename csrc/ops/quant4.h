// Argument checks, shapes and the device-independent parts of the 4-bit ops, shared by the CPU glue (quant4.cpp)
// and the CUDA glue (quant4_cuda.cu) so that both devices reject the same inputs with the same messages. The Python
// fake kernels (python/fastdist/ops/quant4.py) repeat the checks with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/quant4.h"
#include "ops/checks.h"

namespace fastdist::quant4 {

// A quantized weight [n, k]: k = 2 * packed.size(1), block = k / scales.size(1) (2 when k == 0),
// block_rows = n / scales.size(0) (1 when n == 0).
struct Layout {
  Quant4Scheme scheme;
  int64_t n, k, block, block_rows;
};

// Decoding qlinear (the fused kernel) for at most this many rows of x; above it the weight is dequantized a tile of
// output rows at a time and multiplied by the BLAS (compute-bound there, and the tile is small).
constexpr int64_t kDecodeRowsCpu = 32;
// Bytes of float32 weight per dequantized tile: large enough that the BLAS runs at its full rate on each tile and
// the tiles are few, a small fraction of a large layer's float32 weight.
constexpr int64_t kTileBytes = 16 << 20;

inline Quant4Scheme scheme_of(const std::string& scheme) {
  TORCH_CHECK(scheme == "nf4" || scheme == "int4", "fastdist: 'scheme' must be \"nf4\" or \"int4\", got \"", scheme,
              "\"");
  return scheme == "nf4" ? Quant4Scheme::kNF4 : Quant4Scheme::kInt4;
}

// quant4_quantize(w, scheme, block, block_rows) -> (packed uint8 [n, k / 2], scales float32
// [n / block_rows, k / block], zeros float32 of the scales' shape for int4, [0] for nf4)
inline Quant4Scheme check_quantize(const at::Tensor& w, const std::string& scheme, int64_t block,
                                   int64_t block_rows) {
  check_dtype_in(w, "w", kFloat32Or16BitDtypes);
  FD_CHECK_DIM(w, 2);
  const Quant4Scheme parsed = scheme_of(scheme);
  TORCH_CHECK(block >= 2 && block % 2 == 0, "fastdist: 'block' must be even and >= 2, got ", block);
  TORCH_CHECK(w.size(1) % block == 0, "fastdist: 'block' must divide the input dimension (w.shape[1]), got block = ",
              block, " for w of shape ", w.sizes());
  TORCH_CHECK(block_rows >= 1, "fastdist: 'block_rows' must be >= 1, got ", block_rows);
  TORCH_CHECK(w.size(0) % block_rows == 0,
              "fastdist: 'block_rows' must divide the output dimension (w.shape[0]), got block_rows = ", block_rows,
              " for w of shape ", w.sizes());
  check_allocatable(w.sizes(), at::kFloat, "the float32 copy of 'w'");
  return parsed;
}

// The quantized weight's layout from packed / scales / zeros.
inline Layout check_layout(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                           const std::string& scheme) {
  const Quant4Scheme parsed = scheme_of(scheme);
  FD_CHECK_DTYPE(packed, at::kByte);
  FD_CHECK_DIM(packed, 2);
  FD_CHECK_DTYPE(scales, at::kFloat);
  FD_CHECK_DIM(scales, 2);
  FD_CHECK_SAME_DEVICE(packed, scales);
  const int64_t n = packed.size(0), k = checked_mul(packed.size(1), 2, "the input dimension 2 * packed.shape[1]");
  const int64_t groups = scales.size(1), row_blocks = scales.size(0);
  const bool rows_ok = n == 0 ? row_blocks == 0 : row_blocks >= 1 && n % row_blocks == 0;
  const bool cols_ok = k == 0 ? groups == 0 : groups >= 1 && k % groups == 0 && (k / groups) % 2 == 0;
  TORCH_CHECK(rows_ok && cols_ok, "fastdist: 'scales' must have shape [n / block_rows, k / block] with block_rows "
              "dividing n = ", n, " and an even block dividing k = ", k, " (2 * packed.shape[1]), got shape ",
              scales.sizes());
  if (parsed == Quant4Scheme::kInt4) {
    TORCH_CHECK(zeros.has_value(), "fastdist: 'zeros' must be given for scheme \"int4\"");
    const at::Tensor& z = *zeros;
    FD_CHECK_DTYPE(z, at::kFloat);
    FD_CHECK_SAME_DEVICE(packed, z);
    TORCH_CHECK(z.sizes() == scales.sizes(), "fastdist: 'zeros' must have the shape of 'scales' (", scales.sizes(),
                "), got shape ", z.sizes());
  } else {
    TORCH_CHECK(!zeros.has_value(), "fastdist: 'zeros' must be None for scheme \"nf4\"");
  }
  return {parsed, n, k, groups == 0 ? 2 : k / groups, row_blocks == 0 ? 1 : n / row_blocks};
}

// The rows of a [..., last] tensor.
inline int64_t leading_rows(const at::Tensor& t) {
  return checked_product(t.sizes().slice(0, t.dim() - 1), "the leading dimensions of the input");
}

// The output's shape: x's with the last dimension replaced by `last`.
inline std::vector<int64_t> with_last(const at::Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// An activation [..., last] (x of qlinear, grad of qlinear_grad_input) on packed's device, and its output
// [..., out_last] allocatable.
inline void check_input(const at::Tensor& t, const char* name, const at::Tensor& packed, int64_t last,
                        const char* what, int64_t out_last) {
  check_dtype_in(t, name, kFloat32Or16BitDtypes);
  TORCH_CHECK(t.dim() >= 1, "fastdist: '", name, "' must have at least 1 dimension(s), got shape ", t.sizes());
  TORCH_CHECK(t.device() == packed.device(), "fastdist: '", name, "' and 'packed' must be on the same device, got ",
              t.device(), " and ", packed.device());
  TORCH_CHECK(t.size(-1) == last, "fastdist: '", name, "' must have last dimension ", last, " (", what,
              "), got shape ", t.sizes());
  check_allocatable(with_last(t, out_last), at::kFloat, "the output");
}

// qlinear(x, packed, scales, zeros, scheme, bias) -> [..., n] of x's dtype
inline Layout check_qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zeros, const std::string& scheme,
                            const std::optional<at::Tensor>& bias) {
  const Layout layout = check_layout(packed, scales, zeros, scheme);
  check_input(x, "x", packed, layout.k, "the weight's input dimension", layout.n);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    check_dtype_in(b, "bias", kFloat32Or16BitDtypes);
    FD_CHECK_SAME_DEVICE(x, b);
    TORCH_CHECK(b.dim() == 1 && b.size(0) == layout.n, "fastdist: 'bias' must have shape [", layout.n,
                "] (the weight's output dimension), got shape ", b.sizes());
  }
  return layout;
}

// qlinear_grad_input(grad, packed, scales, zeros, scheme) -> [..., k] of grad's dtype
inline Layout check_grad_input(const at::Tensor& grad, const at::Tensor& packed, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, const std::string& scheme) {
  const Layout layout = check_layout(packed, scales, zeros, scheme);
  check_input(grad, "grad", packed, layout.n, "the weight's output dimension", layout.k);
  return layout;
}

// quant4_quantize refuses non-finite weights.
inline void check_finite_blocks(int64_t bad_blocks, int64_t blocks) {
  TORCH_CHECK(bad_blocks == 0, "fastdist: 'w' must be finite: ", bad_blocks, " of ", blocks,
              " block(s) hold NaN or +-inf (or a range that overflows float32)");
}

// quant4_quantize's operand and outputs on w's device: the float32 weight, packed codes, scales and zeros (written
// for both schemes; nf4's come back as an empty tensor).
struct QuantizeBuffers {
  Quant4Scheme scheme;
  int64_t n, k, block, block_rows, groups, row_blocks;
  at::Tensor values, packed, scales, zeros;

  QuantizeBuffers(const at::Tensor& w, const std::string& scheme_name, int64_t block_in, int64_t block_rows_in)
      : scheme(check_quantize(w, scheme_name, block_in, block_rows_in)),
        n(w.size(0)),
        k(w.size(1)),
        block(block_in),
        block_rows(block_rows_in),
        groups(k / block),
        row_blocks(n / block_rows),
        values(w.to(at::kFloat).contiguous()),
        packed(at::empty({n, k / 2}, values.options().dtype(at::kByte))),
        scales(at::empty({row_blocks, groups}, values.options())),
        zeros(at::empty({row_blocks, groups}, values.options())) {}

  // (packed, scales, zeros) once the kernel counted `bad_blocks` non-finite blocks.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result(int64_t bad_blocks) const {
    check_finite_blocks(bad_blocks, row_blocks * groups);
    return {packed, scales, scheme == Quant4Scheme::kNF4 ? at::empty({0}, values.options()) : zeros};
  }
};

// The zero points' data (nullptr for nf4) and an optional tensor made contiguous.
inline const float* zeros_ptr(const std::optional<at::Tensor>& zeros) {
  return zeros.has_value() ? zeros->const_data_ptr<float>() : nullptr;
}

inline std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// The operands as the kernels read them: the input's rows in float32, the quantized weight and the bias contiguous.
struct Operands {
  at::Tensor input;  // float32 [rows, last]
  at::Tensor packed, scales;
  std::optional<at::Tensor> zeros, bias;

  Operands(const at::Tensor& t, int64_t last, const at::Tensor& packed_in, const at::Tensor& scales_in,
           const std::optional<at::Tensor>& zeros_in, const std::optional<at::Tensor>& bias_in = std::nullopt)
      : input(t.reshape({leading_rows(t), last}).to(at::kFloat).contiguous()),
        packed(packed_in.contiguous()),
        scales(scales_in.contiguous()),
        zeros(contiguous(zeros_in)),
        bias(bias_in.has_value() ? std::optional<at::Tensor>(bias_in->to(at::kFloat).contiguous()) : std::nullopt) {}
};

// The device's kernels: w' of rows [r0, r1) into tile ([r1 - r0, k] float32), and the decoding qlinear into out.
using DequantizeRows = std::function<void(const Operands&, const Layout&, int64_t, int64_t, at::Tensor&)>;
using DecodeLinear = std::function<void(const Operands&, const Layout&, at::Tensor&)>;

// For the BLAS path: a tile of output rows (kTileBytes of float32) at a time. A weight of one tile is dequantized
// whole and multiplied straight into the output (input @ tile^T forward, input @ tile backward). Larger weights,
// forward: the output's columns of the tile out[:, tile] = input @ tile^T (the BLAS writes the strided slice in
// place); backward: out += input[:, tile] @ tile, summed in tile order.
inline at::Tensor over_tiles(const Operands& ops, const Layout& layout, bool backward,
                             const DequantizeRows& dequantize_rows) {
  const at::Tensor& input = ops.input;
  const int64_t rows_per_tile = std::max<int64_t>(1, kTileBytes / std::max<int64_t>(4 * layout.k, 1));
  at::Tensor buffer = at::empty({std::min(rows_per_tile, layout.n), layout.k}, input.options());
  if (layout.n <= rows_per_tile) {
    dequantize_rows(ops, layout, 0, layout.n, buffer);
    return backward ? at::mm(input, buffer) : at::mm(input, buffer.t());
  }
  at::Tensor out = backward ? at::zeros({input.size(0), layout.k}, input.options())
                            : at::empty({input.size(0), layout.n}, input.options());
  for (int64_t r0 = 0; r0 < layout.n; r0 += rows_per_tile) {
    const int64_t r1 = std::min(layout.n, r0 + rows_per_tile);
    at::Tensor tile = buffer.narrow(0, 0, r1 - r0);
    dequantize_rows(ops, layout, r0, r1, tile);
    if (backward) {
      out.addmm_(input.narrow(1, r0, r1 - r0), tile);
    } else {
      at::Tensor columns = out.narrow(1, r0, r1 - r0);
      at::mm_out(columns, input, tile.t());
    }
  }
  return out;
}

// qlinear on a device: the decoding kernel for up to `decode_rows` rows of x, else the tiles and the BLAS.
inline at::Tensor qlinear_with(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, const std::string& scheme,
                               const std::optional<at::Tensor>& bias, int64_t decode_rows, const DecodeLinear& decode,
                               const DequantizeRows& dequantize_rows) {
  const Layout layout = check_qlinear(x, packed, scales, zeros, scheme, bias);
  const Operands ops(x, layout.k, packed, scales, zeros, bias);
  at::Tensor out;
  if (ops.input.size(0) <= decode_rows) {
    out = at::empty({ops.input.size(0), layout.n}, ops.input.options());
    decode(ops, layout, out);
  } else {
    out = over_tiles(ops, layout, false, dequantize_rows);
    if (ops.bias.has_value()) out.add_(*ops.bias);
  }
  return out.reshape(with_last(x, layout.n)).to(x.scalar_type());
}

// qlinear_grad_input on a device.
inline at::Tensor grad_input_with(const at::Tensor& grad, const at::Tensor& packed, const at::Tensor& scales,
                                  const std::optional<at::Tensor>& zeros, const std::string& scheme,
                                  const DequantizeRows& dequantize_rows) {
  const Layout layout = check_grad_input(grad, packed, scales, zeros, scheme);
  const Operands ops(grad, layout.n, packed, scales, zeros);
  return over_tiles(ops, layout, true, dequantize_rows).reshape(with_last(grad, layout.k)).to(grad.scalar_type());
}

// quant4_dequantize on a device: w' [n, k] float32.
inline at::Tensor dequantize_with(const at::Tensor& packed, const at::Tensor& scales,
                                  const std::optional<at::Tensor>& zeros, const std::string& scheme,
                                  const DequantizeRows& dequantize_rows) {
  const Layout layout = check_layout(packed, scales, zeros, scheme);
  const Operands ops(at::empty({0, 0}, scales.options()), 0, packed, scales, zeros);
  at::Tensor out = at::empty({layout.n, layout.k}, scales.options());
  dequantize_rows(ops, layout, 0, layout.n, out);
  return out;
}

}  // namespace fastdist::quant4
