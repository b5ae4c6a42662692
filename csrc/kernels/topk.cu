// CUDA magnitude TopK by radix select (see topk.h for the definition and the output order).
//
// topk_compress: one block per row. Three histogram passes over the row in shared memory (bits 20..30, then bits
// 10..19 of the values in the chosen bucket, then bits 0..9 of those in the chosen sub-bucket) pin the threshold key
// T; each pick is a block-wide suffix scan of the histogram. A last pass over the row in tiles writes the kept
// values in ascending index order: one block scan per tile of the packed pair (#key > T, #key == T) gives every
// kept value its output slot, and the first (k - #{key > T}) values equal to T are the ones kept. Exact integer
// work, so the result is bit-identical to the CPU's.
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/topk.h"

namespace fastdist {
namespace {

constexpr int kThreads = 512;         // the row kernels: one block per row
constexpr int kElementThreads = 256;  // the elementwise kernels: one thread per value or bitmap byte
constexpr int kItems = 4;             // values per thread per tile of the last pass
constexpr int kTile = kThreads * kItems;
using BlockScan = cub::BlockScan<uint32_t, kThreads>;

__device__ __forceinline__ uint32_t magnitude_key(float v) { return topk_key(__float_as_uint(v)); }

// The bucket of `hist` (shared, `buckets` a multiple of kThreads) holding the need-th largest element, and how many
// of that bucket's elements are needed once every larger bucket is taken. Block-wide; every thread gets the answer.
__device__ void pick_from_top(const uint32_t* hist, int buckets, uint32_t need, typename BlockScan::TempStorage& scan,
                              uint32_t* pick_bucket, uint32_t* pick_need) {
  const int per = buckets / kThreads;
  // Thread t owns the per buckets starting at the top: t = 0 owns the largest ones.
  const int first = buckets - (threadIdx.x + 1) * per;
  uint32_t mine = 0;
  for (int b = 0; b < per; ++b) mine += hist[first + b];
  uint32_t before;  // elements in the buckets above this thread's
  BlockScan(scan).ExclusiveSum(mine, before);
  if (before < need && need <= before + mine) {
    uint32_t acc = before;
    for (int b = per - 1; b >= 0; --b) {
      const uint32_t h = hist[first + b];
      if (need <= acc + h) {
        *pick_bucket = static_cast<uint32_t>(first + b);
        *pick_need = need - acc;
        break;
      }
      acc += h;
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) topk_compress_kernel(const float* __restrict__ x, int64_t d, int64_t k,
                                                                 float* __restrict__ values,
                                                                 int32_t* __restrict__ indices) {
  __shared__ uint32_t hist[kTopkPass1Buckets];
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ uint32_t pick_bucket, pick_need;
  const int64_t r = blockIdx.x;
  const float* row = x + r * d;
  float* out_v = values + r * k;
  int32_t* out_i = indices + r * k;

  // Pass 1: bits [20, 31).
  for (int b = threadIdx.x; b < kTopkPass1Buckets; b += kThreads) hist[b] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d; i += kThreads) atomicAdd(&hist[magnitude_key(row[i]) >> kTopkPass1Shift], 1u);
  __syncthreads();
  pick_from_top(hist, kTopkPass1Buckets, static_cast<uint32_t>(k), scan, &pick_bucket, &pick_need);
  const uint32_t b1 = pick_bucket, need1 = pick_need;

  // Pass 2: bits [10, 20) of the values in bucket b1.
  for (int b = threadIdx.x; b < kTopkPass23Buckets; b += kThreads) hist[b] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const uint32_t key = magnitude_key(row[i]);
    if ((key >> kTopkPass1Shift) == b1) atomicAdd(&hist[(key >> kTopkPass2Shift) & (kTopkPass23Buckets - 1)], 1u);
  }
  __syncthreads();
  pick_from_top(hist, kTopkPass23Buckets, need1, scan, &pick_bucket, &pick_need);
  const uint32_t prefix2 = (b1 << (kTopkPass1Shift - kTopkPass2Shift)) | pick_bucket, need2 = pick_need;

  // Pass 3: bits [0, 10) of the values whose bits [10, 31) are prefix2.
  for (int b = threadIdx.x; b < kTopkPass23Buckets; b += kThreads) hist[b] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const uint32_t key = magnitude_key(row[i]);
    if ((key >> kTopkPass2Shift) == prefix2) atomicAdd(&hist[key & (kTopkPass23Buckets - 1)], 1u);
  }
  __syncthreads();
  pick_from_top(hist, kTopkPass23Buckets, need2, scan, &pick_bucket, &pick_need);
  const uint32_t threshold = (prefix2 << kTopkPass2Shift) | pick_bucket;
  const uint32_t need_equal = pick_need;

  // Last pass: tiles of kTile consecutive values, kItems consecutive ones per thread. Each value contributes the pair
  // (key > T, key == T) packed as (greater << 16) | equal (a tile has at most kTile < 2^16 of each).
  uint32_t written = 0, equal_before = 0;  // over the previous tiles; uniform across the block
  for (int64_t t0 = 0; t0 < d && written < k; t0 += kTile) {
    const int64_t base = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
    uint32_t keys[kItems];
    uint32_t packed = 0;
    for (int j = 0; j < kItems; ++j) {
      keys[j] = base + j < d ? magnitude_key(row[base + j]) : 0u;
      const bool valid = base + j < d;
      packed += valid ? ((static_cast<uint32_t>(keys[j] > threshold) << 16) | (keys[j] == threshold)) : 0u;
    }
    uint32_t prefix, total;
    BlockScan(scan).ExclusiveSum(packed, prefix, total);
    uint32_t greater = prefix >> 16, equal = prefix & 0xFFFFu;
    for (int j = 0; j < kItems; ++j) {
      if (base + j >= d) break;
      const uint32_t eq_rank = equal_before + equal;  // equal values before this one in the row
      const bool is_greater = keys[j] > threshold, is_equal = keys[j] == threshold;
      if (is_greater || (is_equal && eq_rank < need_equal)) {
        const uint32_t taken_equal = min(eq_rank, need_equal) - min(equal_before, need_equal);
        const uint32_t slot = written + greater + taken_equal;
        out_v[slot] = row[base + j];
        out_i[slot] = static_cast<int32_t>(base + j);
      }
      greater += is_greater;
      equal += is_equal;
    }
    const uint32_t tile_equal = total & 0xFFFFu;
    written += (total >> 16) + min(equal_before + tile_equal, need_equal) - min(equal_before, need_equal);
    equal_before += tile_equal;
    __syncthreads();  // the scan storage is reused by the next tile
  }
}

__global__ void scatter_kernel(const float* __restrict__ values, const int32_t* __restrict__ indices, int64_t rows,
                               int64_t k, int64_t d, float* __restrict__ out) {
  const int64_t total = rows * k;
  for (int64_t t = global_thread(); t < total; t += grid_threads()) {
    const int64_t p = indices[t];
    if (p >= 0 && p < d) out[(t / k) * d + p] = values[t];
  }
}

// One thread per bitmap byte: the row's indices are ascending, so the ones in [8j, 8j + 8) are found by a binary
// search for the first index >= 8j.
__global__ void indices_to_bitmap_kernel(const int32_t* __restrict__ indices, int64_t rows, int64_t k, int64_t d,
                                         uint8_t* __restrict__ bitmap) {
  const int64_t bytes = packed_bytes(d);
  const int64_t total = rows * bytes;
  for (int64_t t = global_thread(); t < total; t += grid_threads()) {
    const int64_t r = t / bytes, j = t % bytes;
    const int32_t* idx = indices + r * k;
    int64_t lo = 0, hi = k;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (idx[mid] < 8 * j) lo = mid + 1; else hi = mid;
    }
    uint32_t byte = 0;
    for (int64_t s = lo; s < k && idx[s] < 8 * j + 8 && idx[s] < d; ++s) byte |= 1u << (idx[s] - 8 * j);
    bitmap[t] = static_cast<uint8_t>(byte);
  }
}

// One block per row; tiles of kTile bytes, kItems consecutive bytes per thread; a block scan of the bytes' popcounts
// gives each set bit its slot.
__global__ void __launch_bounds__(kThreads) bitmap_to_indices_kernel(const uint8_t* __restrict__ bitmap, int64_t k,
                                                                     int64_t d, int32_t* __restrict__ indices) {
  __shared__ typename BlockScan::TempStorage scan;
  const int64_t bytes = packed_bytes(d);
  const uint8_t* row = bitmap + blockIdx.x * bytes;
  int32_t* out = indices + blockIdx.x * k;
  uint32_t written = 0;
  for (int64_t t0 = 0; t0 < bytes && written < k; t0 += kTile) {
    const int64_t base = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
    uint32_t bits[kItems];
    uint32_t count = 0;
    for (int j = 0; j < kItems; ++j) {
      const int64_t b = base + j;
      uint32_t v = b < bytes ? row[b] : 0u;
      const int64_t valid = d - 8 * b;  // positions of this byte below d
      if (valid < 8) v &= valid > 0 ? (1u << valid) - 1 : 0u;
      bits[j] = v;
      count += __popc(v);
    }
    uint32_t slot, total;
    BlockScan(scan).ExclusiveSum(count, slot, total);
    slot += written;
    for (int j = 0; j < kItems; ++j) {
      uint32_t v = bits[j];
      while (v) {
        if (slot < k) out[slot] = static_cast<int32_t>(8 * (base + j) + __ffs(v) - 1);
        ++slot;
        v &= v - 1;
      }
    }
    written += total;
    __syncthreads();
  }
}

}  // namespace

cudaError_t topk_compress_cuda(const float* x, int64_t rows, int64_t d, int64_t k, float* values, int32_t* indices,
                               cudaStream_t stream) {
  if (rows > 0 && k > 0) topk_compress_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, d, k, values,
                                                                                                     indices);
  return cudaGetLastError();
}

cudaError_t topk_decompress_cuda(const float* values, const int32_t* indices, int64_t rows, int64_t k, int64_t d,
                                 float* out, cudaStream_t stream) {
  if (rows * d == 0) return cudaSuccess;
  const cudaError_t err = cudaMemsetAsync(out, 0, static_cast<size_t>(rows * d) * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (rows * k > 0) {
    scatter_kernel<<<grid_for(rows * k, kElementThreads), kElementThreads, 0, stream>>>(values, indices, rows, k, d,
                                                                                        out);
  }
  return cudaGetLastError();
}

cudaError_t topk_indices_to_bitmap_cuda(const int32_t* indices, int64_t rows, int64_t k, int64_t d, uint8_t* bitmap,
                                        cudaStream_t stream) {
  const int64_t total = rows * packed_bytes(d);
  if (total > 0) {
    indices_to_bitmap_kernel<<<grid_for(total, kElementThreads), kElementThreads, 0, stream>>>(indices, rows, k, d,
                                                                                              bitmap);
  }
  return cudaGetLastError();
}

cudaError_t topk_bitmap_to_indices_cuda(const uint8_t* bitmap, int64_t rows, int64_t k, int64_t d, int32_t* indices,
                                        cudaStream_t stream) {
  if (rows > 0 && k > 0) {
    bitmap_to_indices_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(bitmap, k, d, indices);
  }
  return cudaGetLastError();
}

}  // namespace fastdist
