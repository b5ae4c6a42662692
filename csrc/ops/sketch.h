// Argument checks and shapes of the count-sketch ops, shared by the CPU glue (sketch.cpp) and the CUDA glue
// (sketch_cuda.cu) so that both devices reject the same inputs with the same messages. The Python fake kernels
// (python/fastdist/ops/sketch.py) repeat them with the same wording.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "kernels/sketch.h"
#include "ops/checks.h"

namespace fastdist::sketch {

// x viewed as n units of m values.
struct UnitShape {
  int64_t n;
  int64_t m;
};

inline bool is_row_granularity(const std::string& granularity) {
  TORCH_CHECK(granularity == "row" || granularity == "element",
              "fastdist: 'granularity' must be \"element\" or \"row\", got \"", granularity, "\"");
  return granularity == "row";
}

// Row granularity: n = x.shape[0], m = the product of the other dimensions; element granularity: n = numel, m = 1
// (a 0-d tensor is one element). `name` is x's argument name.
inline UnitShape units_of(const at::Tensor& x, const std::string& granularity, const std::string& name = "x") {
  if (is_row_granularity(granularity)) {
    TORCH_CHECK(x.dim() >= 1, "fastdist: '", name, "' must have at least 1 dimension(s) for granularity \"row\", got "
                "shape ", x.sizes());
    return {x.size(0), checked_product(x.sizes().slice(1), "the sizes of '" + name + "' after the first")};
  }
  return {x.numel(), 1};
}

inline void check_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= kSketchMaxRows, "fastdist: 'rows' must be in [1, ", kSketchMaxRows, "], got ", rows);
}

inline void check_cols(int64_t cols) {
  TORCH_CHECK(cols >= 1 && cols <= kSketchMaxCols, "fastdist: 'cols' must be in [1, ", kSketchMaxCols, "], got ", cols);
}

// support: uint8 [ceil(n / 8)], on the device of `other` (named other_name); units_name says what the n units are.
inline void check_support(const at::Tensor& support, const at::Tensor& other, const char* other_name,
                          const UnitShape& shape, const char* units_name) {
  FD_CHECK_DTYPE(support, at::kByte);
  TORCH_CHECK(support.device() == other.device(), "fastdist: 'support' and '", other_name,
              "' must be on the same device, got ", support.device(), " and ", other.device());
  const int64_t bytes = packed_bytes(shape.n);
  TORCH_CHECK(support.dim() == 1 && support.size(0) == bytes, "fastdist: 'support' must have shape [", bytes,
              "] (ceil(n / 8) for n = ", shape.n, " ", units_name, "), got shape ", support.sizes());
}

// nonzero_bitmap(x, granularity) -> uint8 [ceil(n / 8)]
inline UnitShape check_nonzero_bitmap(const at::Tensor& x, const std::string& granularity) {
  check_dtype_in(x, "x", kFloatingDtypes);
  return units_of(x, granularity);
}

// count_sketch(x, rows, cols, seed, support, granularity) -> float32 [rows, cols]
inline UnitShape check_count_sketch(const at::Tensor& x, int64_t rows, int64_t cols, int64_t seed,
                                    const std::optional<at::Tensor>& support, const std::string& granularity) {
  check_dtype_in(x, "x", kFloatingDtypes);
  check_rows(rows);
  check_cols(cols);
  check_seed(seed);
  const UnitShape shape = units_of(x, granularity);
  if (support.has_value()) {
    check_support(*support, x, "x", shape, granularity == "row" ? "rows of x" : "elements of x");
  }
  return shape;
}

// table: float32 [rows, cols] within the sketch's limits.
inline void check_table(const at::Tensor& table) {
  FD_CHECK_DTYPE(table, at::kFloat);
  FD_CHECK_DIM(table, 2);
  TORCH_CHECK(table.size(0) >= 1 && table.size(0) <= kSketchMaxRows, "fastdist: 'table' must have 1 to ",
              kSketchMaxRows, " rows, got shape ", table.sizes());
  TORCH_CHECK(table.size(1) >= 1 && table.size(1) <= kSketchMaxCols, "fastdist: 'table' must have 1 to ",
              kSketchMaxCols, " columns, got shape ", table.sizes());
}

// count_sketch_decode(table, support, n, m, seed) -> float32 [n, m]
inline UnitShape check_count_sketch_decode(const at::Tensor& table, const at::Tensor& support, int64_t n, int64_t m,
                                           int64_t seed) {
  check_table(table);
  FD_CHECK_NONNEGATIVE(n);
  FD_CHECK_NONNEGATIVE(m);
  check_allocatable({n, m}, at::kFloat, "the output");
  check_seed(seed);
  const UnitShape shape{n, m};
  check_support(support, table, "table", shape, "units");
  return shape;
}

// count_sketch_units(values, units, rows, cols, seed) -> float32 [rows, cols]; returns (k, m) of values
inline UnitShape check_count_sketch_units(const at::Tensor& values, const at::Tensor& units, int64_t rows,
                                          int64_t cols, int64_t seed) {
  FD_CHECK_DIM_AT_LEAST(values, 1);
  check_dtype_in(values, "values", kFloatingDtypes);
  check_rows(rows);
  check_cols(cols);
  check_seed(seed);
  FD_CHECK_DTYPE(units, at::kLong);
  FD_CHECK_DIM(units, 1);
  TORCH_CHECK(units.device() == values.device(), "fastdist: 'units' and 'values' must be on the same device, got ",
              units.device(), " and ", values.device());
  TORCH_CHECK(units.size(0) == values.size(0), "fastdist: 'units' must have one entry per row of 'values' (",
              values.size(0), "), got shape ", units.sizes());
  return units_of(values, "row", "values");
}

// count_sketch_decode_units(table, units, m, seed) -> float32 [k, m]; returns k
inline int64_t check_count_sketch_decode_units(const at::Tensor& table, const at::Tensor& units, int64_t m,
                                               int64_t seed) {
  check_table(table);
  FD_CHECK_NONNEGATIVE(m);
  check_seed(seed);
  FD_CHECK_DTYPE(units, at::kLong);
  FD_CHECK_DIM(units, 1);
  TORCH_CHECK(units.device() == table.device(), "fastdist: 'units' and 'table' must be on the same device, got ",
              units.device(), " and ", table.device());
  check_allocatable({units.size(0), m}, at::kFloat, "the output");
  return units.size(0);
}

// sketch_hash(idx, rows, cols, seed) -> (int64 [rows, len], int8 [rows, len])
inline void check_sketch_hash(const at::Tensor& idx, int64_t rows, int64_t cols, int64_t seed, int64_t m) {
  FD_CHECK_DTYPE(idx, at::kLong);
  FD_CHECK_DIM(idx, 1);
  check_rows(rows);
  check_cols(cols);
  check_seed(seed);
  TORCH_CHECK(m >= 1, "fastdist: 'm' must be >= 1, got ", m);
  check_allocatable({rows, idx.numel()}, at::kLong, "the output 'bucket'");
}

// union_sum_rows(bitmaps, rows, n, divisor): bitmaps uint8 [p, ceil(n / 8)], rows [p, k, m] of a floating dtype
// on the same device; returns (p, k, m). Whether each support fits in its k rows is checked once counted; then the
// output, at most p * k rows of m values, is no larger than rows.
struct UnionRowsShape {
  int64_t p;
  int64_t k;
  int64_t m;
};

inline UnionRowsShape check_union_sum_rows(const at::Tensor& bitmaps, const at::Tensor& rows, int64_t n,
                                           int64_t divisor) {
  FD_CHECK_DTYPE(bitmaps, at::kByte);
  FD_CHECK_DIM(bitmaps, 2);
  FD_CHECK_NONNEGATIVE(n);
  FD_CHECK_LAST_DIM(bitmaps, packed_bytes(n), "ceil(n / 8) for n = " + std::to_string(n));
  check_dtype_in(rows, "rows", kFloatingDtypes);
  FD_CHECK_DIM(rows, 3);
  FD_CHECK_SAME_DEVICE(rows, bitmaps);
  TORCH_CHECK(rows.size(0) == bitmaps.size(0), "fastdist: 'rows' must have one block of rows per bitmap (",
              bitmaps.size(0), "), got shape ", rows.sizes());
  TORCH_CHECK(divisor >= 1, "fastdist: 'divisor' must be >= 1, got ", divisor);
  return {rows.size(0), rows.size(1), rows.size(2)};
}

// Support r holds counts[r] units (r < p): each must fit in the k rows given for it.
inline void check_union_rows_fit(const int64_t* counts, int64_t p, int64_t k) {
  for (int64_t r = 0; r < p; ++r) {
    TORCH_CHECK(counts[r] <= k, "fastdist: bitmap ", r, " of 'bitmaps' has ", counts[r],
                " units, more than the rows 'rows' gives each (", k, ")");
  }
}

// A [p, ...] tensor whose blocks r may be apart (a view of one buffer per rank) but whose block is contiguous: itself,
// else a contiguous copy. Returns it and the elements from one block to the next.
inline std::pair<at::Tensor, int64_t> with_contiguous_blocks(const at::Tensor& t) {
  if (t.size(0) == 0) return {t, 0};
  const at::Tensor blocks = t[0].is_contiguous() ? t : t.contiguous();
  return {blocks, blocks.stride(0)};
}

inline SketchHash hash_for(int64_t seed, int64_t rows, int64_t cols) {
  return make_sketch_hash(static_cast<uint64_t>(seed), static_cast<int>(rows), cols);
}

inline const uint8_t* support_bytes(const at::Tensor& support) {
  return static_cast<const uint8_t*>(support.const_data_ptr());
}

}  // namespace fastdist::sketch
