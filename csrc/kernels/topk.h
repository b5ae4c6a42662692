// Magnitude TopK: per-row selection of the k largest |x|, the dense form back, and the bitmap form of the mask.
//
// Selection. x is `rows` rows of `d` float32 values. Each value's key is the order-preserving integer image of
// its magnitude: key(v) = bits(v) & 0x7FFFFFFF (clearing the sign bit; for non-negative IEEE floats the unsigned
// bit pattern orders like the value), except that every NaN has the one key 0x7F800001, just above +-inf's
// (0x7F800000), which sorts above every finite magnitude: a NaN is always kept (torch.topk treats NaN as largest
// too), and NaNs tie with each other whatever their sign and payload. Row r keeps the k values with the largest
// keys; among equal keys the lower index wins, so the result is a function of the input alone. -0.0 and +0.0 have
// the same key.
//
// The k-th largest key T is found by radix select, not a sort: a histogram of the key's top 11 bits (bits 20..30)
// picks the bucket holding the k-th key; the values of that bucket are gathered into a small candidate list, whose
// histograms over bits 10..19 and then 0..9 pin T exactly. A last pass writes every value with key > T and the
// first (k - #{key > T}) values with key == T.
//
// Output order: ascending index within each row, so values[r] lists the kept values in their order in x[r] and a
// bitmap of the kept positions plus values[r] is a complete encoding (topk_indices_to_bitmap below).
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous and row-major. Indices are int32 (d < 2^31).
#pragma once
#include <cstdint>

#include "kernels/bitpack.h"

namespace fastdist {

constexpr uint32_t kTopkMagnitudeMask = 0x7FFFFFFFu;
constexpr uint32_t kTopkNanKey = 0x7F800001u;  // every NaN's key: the smallest NaN magnitude

// The selection key of a float32 value, from its bits (see the top of this file).
FASTDIST_HOST_DEVICE inline uint32_t topk_key(uint32_t bits) {
  const uint32_t magnitude = bits & kTopkMagnitudeMask;
  return magnitude > kTopkNanKey ? kTopkNanKey : magnitude;
}
// The radix passes: bits [20, 31), [10, 20), [0, 10) of the 31-bit key.
constexpr int kTopkPass1Shift = 20;
constexpr int kTopkPass1Buckets = 1 << 11;
constexpr int kTopkPass2Shift = 10;
constexpr int kTopkPass23Buckets = 1 << 10;

// ---- CPU: single-threaded over a range of rows, so the caller can run disjoint ranges in parallel. ----

// Scratch a thread needs for rows of `d` values (bytes): the candidate list of the chosen bucket.
int64_t topk_cpu_scratch_bytes(int64_t d);

// x: float32 [rows, d]; 1 <= k <= d. values: float32 [rows, k], indices: int32 [rows, k] (ascending per row).
// Writes rows [row_begin, row_end). scratch: topk_cpu_scratch_bytes(d) bytes, 8-byte aligned, owned by the caller.
void topk_compress_cpu(const float* x, int64_t rows, int64_t d, int64_t k, float* values, int32_t* indices,
                       int64_t row_begin, int64_t row_end, void* scratch);

// The steps of one row's selection, exposed so that the caller can run the two streaming passes of a single long
// row (per-tensor TopK) over disjoint chunks in parallel; topk_compress_cpu runs them over whole rows.
//  1. topk_histogram_cpu: adds the histogram of key bits [20, 31) of x[begin, end) into hist[kTopkPass1Buckets].
//  2. topk_pick_bucket: the bucket holding the k-th largest key of the summed histogram; *need = how many of its
//     values are kept.
//  3. topk_partition_cpu: for x[begin, end), writes the positions of values in higher buckets to above[0, *n_above)
//     and the keys and positions of the bucket's values to keys/pos[0, *n_candidates), in ascending order.
//  4. topk_finish_cpu: given both lists for the whole row (each ascending), writes values/indices [k]. Reorders
//     keys/pos.
void topk_histogram_cpu(const float* x, int64_t begin, int64_t end, uint32_t* hist);
uint32_t topk_pick_bucket(const uint32_t* hist, int64_t k, int64_t* need);
void topk_partition_cpu(const float* x, int64_t begin, int64_t end, uint32_t bucket, int32_t* above,
                        int64_t* n_above, uint32_t* keys, int32_t* pos, int64_t* n_candidates);
void topk_finish_cpu(const float* x, int64_t k, int64_t need, uint32_t bucket, const int32_t* above, int64_t n_above,
                     uint32_t* keys, int32_t* pos, int64_t n_candidates, float* values, int32_t* indices);

// out: float32 [rows, d] = 0 except out[r, indices[r, j]] = values[r, j]. Writes rows [row_begin, row_end).
// Returns the number of indices outside [0, d) in those rows (they are skipped); a repeated index keeps the value
// of its last occurrence.
int64_t topk_decompress_cpu(const float* values, const int32_t* indices, int64_t rows, int64_t k, int64_t d,
                            float* out, int64_t row_begin, int64_t row_end);

// bitmap: uint8 [rows, ceil(d / 8)] in pack_bits order (bit j of byte b is position 8b + j), bit set for each
// index of the row. Writes rows [row_begin, row_end). Returns the number of rows in the range whose indices are
// not strictly ascending within [0, d) (such rows are written as far as they are valid).
int64_t topk_indices_to_bitmap_cpu(const int32_t* indices, int64_t rows, int64_t k, int64_t d, uint8_t* bitmap,
                                   int64_t row_begin, int64_t row_end);

// Inverse: the positions of the set bits of each row, ascending, into indices [rows, k]. Padding bits past d are
// ignored. Returns the number of rows in the range whose count of set bits is not k (their indices are left
// partially written).
int64_t topk_bitmap_to_indices_cpu(const uint8_t* bitmap, int64_t rows, int64_t k, int64_t d, int32_t* indices,
                                   int64_t row_begin, int64_t row_end);

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
// Same layouts and results as the CPU functions (bit-identical: the selection is exact integer work). Inputs of
// the decompress and bitmap kernels are assumed valid (the CUDA glue does not check index ranges, which would need
// a device-to-host copy); invalid indices are skipped, never written out of bounds.
#ifdef __CUDACC__

cudaError_t topk_compress_cuda(const float* x, int64_t rows, int64_t d, int64_t k, float* values, int32_t* indices,
                               cudaStream_t stream);
cudaError_t topk_decompress_cuda(const float* values, const int32_t* indices, int64_t rows, int64_t k, int64_t d,
                                 float* out, cudaStream_t stream);
cudaError_t topk_indices_to_bitmap_cuda(const int32_t* indices, int64_t rows, int64_t k, int64_t d, uint8_t* bitmap,
                                        cudaStream_t stream);
cudaError_t topk_bitmap_to_indices_cuda(const uint8_t* bitmap, int64_t rows, int64_t k, int64_t d, int32_t* indices,
                                        cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
