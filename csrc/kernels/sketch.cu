// CUDA count-sketch. Hashes are computed with the header's functions (64-bit multiplies via __umul64hi), so they are
// the CPU's bit for bit; grid-stride loops cover any size with a bounded grid.
//
// Units of many values (m >= kRowKernelMinValues, row granularity) go one unit at a time per block: a block takes a
// tile of units, reads the tile's support bits once and visits the supported units only; each is hashed once per
// row (into shared memory) and read with coalesced loads into consecutive buckets (its window, sketch.h), with the
// column signs hashed once per block (shared memory, units up to kCachedColumns values). Otherwise one thread per
// value, which reads its unit's bit (m == 1: the value's own bit) and hashes the value in full.
// count_sketch accumulates with float atomicAdd (see sketch.h for the resulting tolerance, and for subnormals, which
// the atomics flush to zero); zeros are skipped.
#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/sketch.h"

namespace fastdist {
namespace {

constexpr int kThreads = 256;
// Below this many values per unit, one thread per value beats one block per unit.
constexpr int64_t kRowKernelMinValues = 64;

__device__ __forceinline__ bool unit_bit(const uint8_t* __restrict__ support, int64_t u) {
  return (support[u >> 3] >> (u & 7)) & 1;
}

// Value i of x, stored in Format, as float32 (float64 rounded to nearest, as on the CPU).
template <typename Format>
__device__ __forceinline__ float load_value(const void* __restrict__ x, int64_t i) {
  return static_cast<float>(Format::load(static_cast<const typename Format::Storage*>(x)[i]));
}

// ---- nonzero bitmap ----

template <typename U>
__device__ __forceinline__ bool nonzero(U u) {
  return static_cast<U>(u << 1) != 0;
}

// m == 1: one packed byte (8 values) per thread.
template <typename U>
__global__ void nonzero_elements_kernel(const U* __restrict__ x, int64_t n, uint8_t* __restrict__ out) {
  const int64_t bytes = packed_bytes(n);
  for (int64_t k = global_thread(); k < bytes; k += grid_threads()) {
    const int64_t begin = 8 * k;
    const int count = n - begin < 8 ? static_cast<int>(n - begin) : 8;
    uint32_t byte = 0;
    for (int j = 0; j < count; ++j) byte |= static_cast<uint32_t>(nonzero(x[begin + j])) << j;
    out[k] = static_cast<uint8_t>(byte);
  }
}

// m > 1: one packed byte (8 units) per block of 8 warps, one warp per unit.
template <typename U>
__global__ void nonzero_rows_kernel(const U* __restrict__ x, int64_t n, int64_t m, uint8_t* __restrict__ out) {
  __shared__ uint32_t bits[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bytes = packed_bytes(n);
  for (int64_t k = blockIdx.x; k < bytes; k += gridDim.x) {
    const int64_t u = 8 * k + warp;
    U acc = 0;
    if (u < n) {
      const U* row = x + u * m;
      for (int64_t e = lane; e < m; e += 32) acc |= static_cast<U>(row[e] << 1);
    }
    const bool any = __any_sync(0xFFFFFFFFu, acc != 0);
    if (lane == 0) bits[warp] = any ? 1u << warp : 0u;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t byte = 0;
      for (int w = 0; w < kThreads / 32; ++w) byte |= bits[w];
      out[k] = static_cast<uint8_t>(byte);
    }
    __syncthreads();
  }
}
static_assert(kThreads == 8 * 32, "nonzero_rows_kernel: one warp per unit of a packed byte");

template <typename U>
cudaError_t launch_nonzero(const void* x, int64_t n, int64_t m, uint8_t* out, cudaStream_t stream) {
  const U* values = static_cast<const U*>(x);
  const int64_t bytes = packed_bytes(n);
  if (m == 1) {
    nonzero_elements_kernel<U><<<grid_for(bytes, kThreads), kThreads, 0, stream>>>(values, n, out);
  } else {
    nonzero_rows_kernel<U><<<grid_for(bytes, 1), kThreads, 0, stream>>>(values, n, m, out);
  }
  return cudaGetLastError();
}

// ---- count sketch ----

// v with its sign flipped when `negative`, by the CPU's XOR (xor_sign), so that a NaN keeps its payload as there.
__device__ __forceinline__ float flip_sign(float v, bool negative) { return xor_sign(v, negative ? 0x80000000u : 0u); }

// Value col of unit u, hashed in full (one thread per value).
__device__ __forceinline__ void add_value(const SketchHash& h, float* __restrict__ table, uint64_t u, uint64_t col,
                                          float v) {
  for (int j = 0; j < h.rows; ++j) {
    atomicAdd(table + j * h.cols + h.bucket(j, u, col), flip_sign(v, h.negative(j, u, col)));
  }
}

// Units of up to this many values keep their column signs in shared memory, one bit per column and sketch row
// (7.5 KiB at 15 rows): a column sign is a 64-bit multiply mod p, which per value and row would cost more
// instructions than the value's load and atomic add.
constexpr int64_t kCachedColumns = 4096;
constexpr int kColumnWords = static_cast<int>(kCachedColumns / 32);

// A unit's window starts and signs per sketch row, hashed once per block into shared memory, and the column signs of
// units of m values, hashed once per block when m <= kCachedColumns. Every thread of the block must call place() (it
// synchronizes).
struct UnitWindows {
  int64_t start[kSketchMaxRows];
  bool negative[kSketchMaxRows];
  bool columns_cached;  // column_bits holds the column signs (set by the first place())
  uint32_t column_bits[kSketchMaxRows * kColumnWords];

  __device__ void init() {
    if (threadIdx.x == 0) columns_cached = false;
  }

  __device__ void place(const SketchHash& h, uint64_t u, int64_t m) {
    __syncthreads();  // the previous unit's readers are done (and init() is seen)
    if (!columns_cached && m <= kCachedColumns) cache_columns(h, m);  // uniform: the first unit of the block
    if (threadIdx.x < h.rows) {
      start[threadIdx.x] = h.start(threadIdx.x, u);
      negative[threadIdx.x] = h.unit_negative(threadIdx.x, u);
    }
    __syncthreads();
  }

  // h_j(u, col) for the placed unit u.
  __device__ int64_t bucket(const SketchHash& h, int j, uint64_t col) const { return h.window_bucket(start[j], col); }
  __device__ bool sign_negative(const SketchHash& h, int j, uint64_t col) const {
    const bool column = columns_cached ? (column_bits[j * kColumnWords + (col >> 5)] >> (col & 31)) & 1
                                       : h.column_negative(j, col);
    return negative[j] != column;
  }

 private:
  // One ballot per 32 columns. The loop bound is a multiple of 32 and so is blockDim.x, so every warp runs whole
  // iterations and the ballot sees all its lanes.
  __device__ void cache_columns(const SketchHash& h, int64_t m) {
    const int per_row = static_cast<int>((m + 31) / 32) * 32;
    for (int i = threadIdx.x; i < h.rows * per_row; i += blockDim.x) {
      const int j = i / per_row, col = i - j * per_row;
      const uint32_t bits = __ballot_sync(0xffffffffu, col < m && h.column_negative(j, static_cast<uint64_t>(col)));
      if ((threadIdx.x & 31) == 0) column_bits[j * kColumnWords + col / 32] = bits;
    }
    __syncthreads();
    if (threadIdx.x == 0) columns_cached = true;
  }
};
static_assert(kThreads % 32 == 0, "UnitWindows::cache_columns: whole warps");

// The support bits of the tile of units [u0, u0 + 32 * words) into shared memory, bit b of word w = unit u0 + 32 w + b;
// units at or past n read 0; a null support is every unit. All threads call it (it synchronizes).
__device__ void load_tile_bits(const uint8_t* __restrict__ support, int64_t n, int64_t u0, int words,
                               uint32_t* tile_bits) {
  __syncthreads();  // the previous tile's readers are done
  for (int w = threadIdx.x; w < words; w += blockDim.x) {
    const int64_t first = u0 + 32 * static_cast<int64_t>(w);
    uint32_t bits = 0;
    if (first < n) {
      if (support == nullptr) {
        bits = ~0u;
      } else {
        const int64_t byte0 = first >> 3, bytes = packed_bytes(n);  // first is a multiple of 8
        for (int b = 0; b < 4 && byte0 + b < bytes; ++b) bits |= static_cast<uint32_t>(support[byte0 + b]) << (8 * b);
      }
      if (n - first < 32) bits &= (1u << (n - first)) - 1;
    }
    tile_bits[w] = bits;
  }
  __syncthreads();
}

// One thread per value. support may be null (every value); otherwise value i belongs to unit i / m.
template <typename Format>
__global__ void sketch_elements_kernel(const void* __restrict__ x, int64_t total, int64_t m,
                                       const uint8_t* __restrict__ support, const SketchHash h,
                                       float* __restrict__ table) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t u = m == 1 ? i : i / m;
    if (support != nullptr && !unit_bit(support, u)) continue;
    const float v = load_value<Format>(x, i);
    if (v != 0.0f) add_value(h, table, static_cast<uint64_t>(u), static_cast<uint64_t>(i - u * m), v);  // NaN: added
  }
}

// Adds the placed unit's m values, starting at values[0], to its windows: consecutive threads, consecutive buckets.
template <typename Format>
__device__ void add_unit(const void* __restrict__ values, int64_t offset, int64_t m, const SketchHash& h,
                         const UnitWindows& w, float* __restrict__ table) {
  for (int64_t e = threadIdx.x; e < m; e += blockDim.x) {
    const float v = load_value<Format>(values, offset + e);
    if (v == 0.0f) continue;
    for (int j = 0; j < h.rows; ++j) {
      atomicAdd(table + j * h.cols + w.bucket(h, j, e), flip_sign(v, w.sign_negative(h, j, e)));
    }
  }
}

// Tiles of 32 * tile_words units per block (grid-stride); a block reads its tile's support bits once and visits the
// supported units only, one after the other (null support: every unit), so that a sparse support costs a bit per
// unit, not a block iteration.
constexpr int kMaxTileWords = 32;  // 1024 units

template <typename Format>
__global__ void sketch_rows_kernel(const void* __restrict__ x, int64_t n, int64_t m,
                                   const uint8_t* __restrict__ support, int tile_words, const SketchHash h,
                                   float* __restrict__ table) {
  __shared__ UnitWindows w;
  __shared__ uint32_t tile_bits[kMaxTileWords];
  w.init();
  const int64_t tile_units = 32 * static_cast<int64_t>(tile_words);
  for (int64_t u0 = blockIdx.x * tile_units; u0 < n; u0 += gridDim.x * tile_units) {
    load_tile_bits(support, n, u0, tile_words, tile_bits);
    for (int word = 0; word < tile_words; ++word) {
      for (uint32_t bits = tile_bits[word]; bits != 0; bits &= bits - 1) {  // uniform over the block
        const int64_t u = u0 + 32 * word + (__ffs(bits) - 1);
        w.place(h, static_cast<uint64_t>(u), m);
        add_unit<Format>(x, u * m, m, h, w, table);
      }
    }
  }
}

// Words of 32 units per tile: enough tiles for about kMaxBlocks / 8 blocks (a few per multiprocessor), each tile
// at most kMaxTileWords words.
int tile_words_for(int64_t n) {
  const int64_t words = (n + 31) / 32, per_tile = (words + kMaxBlocks / 8 - 1) / (kMaxBlocks / 8);
  return static_cast<int>(per_tile < 1 ? 1 : per_tile < kMaxTileWords ? per_tile : kMaxTileWords);
}

template <typename Format>
void launch_sketch(const void* x, int64_t n, int64_t m, const uint8_t* support, const SketchHash& hash,
                   float* table, cudaStream_t stream) {
  if (m >= kRowKernelMinValues) {
    const int tile_words = tile_words_for(n);
    const int grid = grid_for(n, 32 * tile_words);
    sketch_rows_kernel<Format><<<grid, kThreads, 0, stream>>>(x, n, m, support, tile_words, hash, table);
  } else {
    sketch_elements_kernel<Format>
        <<<grid_for(n * m, kThreads), kThreads, 0, stream>>>(x, n * m, m, support, hash, table);
  }
}

// Listed units, one block per unit (long units): the unit is hashed once per block, as in sketch_rows_kernel.
template <typename Format>
__global__ void sketch_units_rows_kernel(const void* __restrict__ values, const int64_t* __restrict__ units,
                                         int64_t k, int64_t m, const SketchHash h, float* __restrict__ table) {
  __shared__ UnitWindows w;
  w.init();
  for (int64_t t = blockIdx.x; t < k; t += gridDim.x) {
    w.place(h, static_cast<uint64_t>(units[t]), m);
    add_unit<Format>(values, t * m, m, h, w, table);
  }
}

// Listed units, one thread per value (short units); value i is value i % m of unit units[i / m].
template <typename Format>
__global__ void sketch_units_kernel(const void* __restrict__ values, const int64_t* __restrict__ units, int64_t total,
                                    int64_t m, const SketchHash h, float* __restrict__ table) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const float v = load_value<Format>(values, i);
    if (v == 0.0f) continue;
    const int64_t t = m == 1 ? i : i / m;
    add_value(h, table, static_cast<uint64_t>(units[t]), static_cast<uint64_t>(i - t * m), v);
  }
}

template <typename Format>
void launch_sketch_units(const void* values, const int64_t* units, int64_t k, int64_t m, const SketchHash& hash,
                         float* table, cudaStream_t stream) {
  if (m >= kRowKernelMinValues) {
    sketch_units_rows_kernel<Format><<<grid_for(k, 1), kThreads, 0, stream>>>(values, units, k, m, hash, table);
  } else {
    sketch_units_kernel<Format>
        <<<grid_for(k * m, kThreads), kThreads, 0, stream>>>(values, units, k * m, m, hash, table);
  }
}

// Clears the table, then (unless there are no values) calls launch(Format{}) with the values' storage format.
template <typename Launch>
cudaError_t sketch_into_cleared_table(const SketchHash& hash, float* table, int64_t values, StorageType type,
                                      cudaStream_t stream, Launch launch) {
  const cudaError_t cleared = cudaMemsetAsync(table, 0, hash.rows * hash.cols * sizeof(float), stream);
  if (cleared != cudaSuccess || values == 0) return cleared;
  dispatch_storage(type, launch);
  return cudaGetLastError();
}

// ---- decode ----

__device__ __forceinline__ float estimate(const SketchHash& h, const float* __restrict__ table, uint64_t u,
                                          uint64_t col) {
  float v[kSketchMaxRows];
  for (int j = 0; j < h.rows; ++j) {
    const float t = table[j * h.cols + h.bucket(j, u, col)];
    v[j] = flip_sign(t, h.negative(j, u, col));
  }
  return sketch_median(v, h.rows);
}

__device__ __forceinline__ float window_estimate(const SketchHash& h, const UnitWindows& w,
                                                 const float* __restrict__ table, uint64_t col) {
  float v[kSketchMaxRows];
  for (int j = 0; j < h.rows; ++j) {
    const float t = table[j * h.cols + w.bucket(h, j, col)];
    v[j] = flip_sign(t, w.sign_negative(h, j, col));
  }
  return sketch_median(v, h.rows);
}

__global__ void decode_elements_kernel(const float* __restrict__ table, const uint8_t* __restrict__ support,
                                       int64_t total, int64_t m, const SketchHash h, float* __restrict__ out) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t u = m == 1 ? i : i / m;
    out[i] = unit_bit(support, u) ? estimate(h, table, static_cast<uint64_t>(u), static_cast<uint64_t>(i - u * m))
                                  : 0.0f;
  }
}

__global__ void decode_rows_kernel(const float* __restrict__ table, const uint8_t* __restrict__ support, int64_t n,
                                   int64_t m, const SketchHash h, float* __restrict__ out) {
  __shared__ UnitWindows w;
  w.init();
  for (int64_t u = blockIdx.x; u < n; u += gridDim.x) {
    if (!unit_bit(support, u)) {  // uniform over the block
      for (int64_t e = threadIdx.x; e < m; e += blockDim.x) out[u * m + e] = 0.0f;
      continue;
    }
    w.place(h, static_cast<uint64_t>(u), m);
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x) out[u * m + e] = window_estimate(h, w, table, e);
  }
}

// Listed units: one unit per block when units are long, else one value per thread.
__global__ void decode_units_rows_kernel(const float* __restrict__ table, const int64_t* __restrict__ units,
                                         int64_t k, int64_t m, const SketchHash h, float* __restrict__ out) {
  __shared__ UnitWindows w;
  w.init();
  for (int64_t t = blockIdx.x; t < k; t += gridDim.x) {
    w.place(h, static_cast<uint64_t>(units[t]), m);
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x) out[t * m + e] = window_estimate(h, w, table, e);
  }
}

__global__ void decode_units_elements_kernel(const float* __restrict__ table, const int64_t* __restrict__ units,
                                             int64_t total, int64_t m, const SketchHash h, float* __restrict__ out) {
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t t = m == 1 ? i : i / m;
    out[i] = estimate(h, table, static_cast<uint64_t>(units[t]), static_cast<uint64_t>(i - t * m));
  }
}

__global__ void hash_kernel(const int64_t* __restrict__ idx, int64_t len, uint64_t m, const SketchHash h,
                            int64_t* __restrict__ bucket, int8_t* __restrict__ sign) {
  for (int64_t t = global_thread(); t < len; t += grid_threads()) {
    const uint64_t i = static_cast<uint64_t>(idx[t]), u = i / m, col = i - u * m;
    for (int j = 0; j < h.rows; ++j) {
      bucket[j * len + t] = h.bucket(j, u, col);
      sign[j * len + t] = h.negative(j, u, col) ? -1 : 1;
    }
  }
}

}  // namespace

cudaError_t nonzero_bitmap_cuda(const void* x, int elem_bytes, int64_t n, int64_t m, uint8_t* out,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (elem_bytes) {
    case 2: return launch_nonzero<uint16_t>(x, n, m, out, stream);
    case 4: return launch_nonzero<uint32_t>(x, n, m, out, stream);
    case 8: return launch_nonzero<uint64_t>(x, n, m, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t count_sketch_cuda(const void* x, StorageType type, int64_t n, int64_t m, const uint8_t* support,
                              const SketchHash& hash, float* table, cudaStream_t stream) {
  return sketch_into_cleared_table(hash, table, n * m, type, stream, [&](auto format) {
    launch_sketch<decltype(format)>(x, n, m, support, hash, table, stream);
  });
}

cudaError_t count_sketch_decode_cuda(const float* table, const uint8_t* support, int64_t n, int64_t m,
                                     const SketchHash& hash, float* out, cudaStream_t stream) {
  if (n * m == 0) return cudaSuccess;
  if (m >= kRowKernelMinValues) {
    decode_rows_kernel<<<grid_for(n, 1), kThreads, 0, stream>>>(table, support, n, m, hash, out);
  } else {
    decode_elements_kernel<<<grid_for(n * m, kThreads), kThreads, 0, stream>>>(table, support, n * m, m, hash, out);
  }
  return cudaGetLastError();
}

cudaError_t count_sketch_units_cuda(const void* values, StorageType type, const int64_t* units, int64_t k,
                                    int64_t m, const SketchHash& hash, float* table, cudaStream_t stream) {
  return sketch_into_cleared_table(hash, table, k * m, type, stream, [&](auto format) {
    launch_sketch_units<decltype(format)>(values, units, k, m, hash, table, stream);
  });
}

cudaError_t count_sketch_decode_units_cuda(const float* table, const int64_t* units, int64_t k, int64_t m,
                                           const SketchHash& hash, float* out, cudaStream_t stream) {
  if (k * m == 0) return cudaSuccess;
  if (m >= kRowKernelMinValues) {
    decode_units_rows_kernel<<<grid_for(k, 1), kThreads, 0, stream>>>(table, units, k, m, hash, out);
  } else {
    decode_units_elements_kernel<<<grid_for(k * m, kThreads), kThreads, 0, stream>>>(table, units, k * m, m, hash, out);
  }
  return cudaGetLastError();
}

cudaError_t sketch_hash_cuda(const int64_t* idx, int64_t len, int64_t m, const SketchHash& hash, int64_t* bucket,
                             int8_t* sign, cudaStream_t stream) {
  if (len == 0) return cudaSuccess;
  hash_kernel<<<grid_for(len, kThreads), kThreads, 0, stream>>>(idx, len, static_cast<uint64_t>(m), hash, bucket, sign);
  return cudaGetLastError();
}

// ---- union sum: chunks of kUnionChunkBytes packed bytes, one block per chunk ----
namespace {

constexpr int kUnionThreads = 128;

__device__ __forceinline__ uint32_t union_support_byte(const uint8_t* __restrict__ bitmaps, int64_t r,
                                                       int64_t bitmap_stride, int64_t n, int64_t b) {
  const uint32_t byte = bitmaps[r * bitmap_stride + b];
  const int64_t past = 8 * (b + 1) - n;
  return past > 0 ? byte & (0xFFu >> past) : byte;
}

// One thread per (chunk, rank or union): counts[chunk * (p + 1) + r].
__global__ void union_rows_count_kernel(const uint8_t* __restrict__ bitmaps, int64_t p, int64_t bitmap_stride,
                                        int64_t n, int64_t chunks, int64_t* __restrict__ counts) {
  const int64_t bytes = packed_bytes(n);
  for (int64_t i = global_thread(); i < chunks * (p + 1); i += grid_threads()) {
    const int64_t chunk = i / (p + 1), r = i - chunk * (p + 1);
    const int64_t b1 = min(bytes, (chunk + 1) * kUnionChunkBytes);
    int64_t count = 0;
    for (int64_t b = chunk * kUnionChunkBytes; b < b1; ++b) {
      uint32_t byte = 0;
      if (r < p) {
        byte = union_support_byte(bitmaps, r, bitmap_stride, n, b);
      } else {
        for (int64_t q = 0; q < p; ++q) byte |= union_support_byte(bitmaps, q, bitmap_stride, n, b);
      }
      count += __popc(byte);
    }
    counts[i] = count;
  }
}

// A block per chunk (grid-stride over chunks): its threads walk the chunk's units in order together, each thread
// summing its own columns; the ranks' row cursors live in shared memory (p <= kUnionMaxRanksCuda) and move after
// each unit, between barriers. Each value gets the CPU's adds in the CPU's order, so the same bits.
template <typename Format>
__global__ void union_sum_rows_kernel(const uint8_t* __restrict__ bitmaps, int64_t p, int64_t bitmap_stride, int64_t n,
                                      const typename Format::Storage* __restrict__ rows, int64_t rank_stride,
                                      int64_t m, int64_t divisor, int64_t chunks, const int64_t* __restrict__ first,
                                      int64_t* __restrict__ units, typename Format::Storage* __restrict__ sums) {
  using C = typename Format::Compute;
  using S = typename Format::Storage;
  extern __shared__ int64_t next[];  // [p]
  const int64_t bytes = packed_bytes(n);
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int64_t* chunk_first = first + chunk * (p + 1);
    for (int64_t r = threadIdx.x; r < p; r += blockDim.x) next[r] = chunk_first[r];
    __syncthreads();
    int64_t t = chunk_first[p];
    const int64_t b1 = min(bytes, (chunk + 1) * kUnionChunkBytes);
    for (int64_t b = chunk * kUnionChunkBytes; b < b1; ++b) {
      uint32_t any = 0;
      for (int64_t r = 0; r < p; ++r) any |= union_support_byte(bitmaps, r, bitmap_stride, n, b);
      while (any) {  // the same value in every thread of the block: the barriers below are reached by all
        const int j = __ffs(any) - 1;
        any &= any - 1;
        if (threadIdx.x == 0) units[t] = 8 * b + j;
        S* out = sums + t * m;
        bool none_yet = true;
        for (int64_t r = 0; r < p; ++r) {
          if (!((union_support_byte(bitmaps, r, bitmap_stride, n, b) >> j) & 1)) continue;
          const S* x = rows + r * rank_stride + next[r] * m;
          for (int64_t col = threadIdx.x; col < m; col += blockDim.x) {
            out[col] = none_yet ? Format::store(C(0) + Format::load(x[col]))
                                : Format::store(Format::load(out[col]) + Format::load(x[col]));
          }
          none_yet = false;
        }
        if (divisor != 1) {
          for (int64_t col = threadIdx.x; col < m; col += blockDim.x) {
            out[col] = Format::store(Format::load(out[col]) / static_cast<C>(divisor));
          }
        }
        __syncthreads();  // every thread has read next[] for this unit
        for (int64_t r = threadIdx.x; r < p; r += blockDim.x) {
          next[r] += (union_support_byte(bitmaps, r, bitmap_stride, n, b) >> j) & 1;
        }
        __syncthreads();
        ++t;
      }
    }
  }
}

}  // namespace

cudaError_t union_rows_count_cuda(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n,
                                  int64_t* chunk_counts, cudaStream_t stream) {
  const int64_t chunks = (packed_bytes(n) + kUnionChunkBytes - 1) / kUnionChunkBytes;
  if (chunks == 0) return cudaSuccess;
  union_rows_count_kernel<<<grid_for(chunks * (p + 1), kThreads), kThreads, 0, stream>>>(bitmaps, p, bitmap_stride, n,
                                                                                         chunks, chunk_counts);
  return cudaGetLastError();
}

cudaError_t union_sum_rows_cuda(const uint8_t* bitmaps, int64_t p, int64_t bitmap_stride, int64_t n, const void* rows,
                                StorageType type, int64_t rank_stride, int64_t m, int64_t divisor,
                                const int64_t* chunk_first, int64_t* units, void* sums, cudaStream_t stream) {
  const int64_t chunks = (packed_bytes(n) + kUnionChunkBytes - 1) / kUnionChunkBytes;
  if (chunks == 0 || p == 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(p) * sizeof(int64_t);
  dispatch_storage(type, [&](auto format) {
    using Format = decltype(format);
    using S = typename Format::Storage;
    union_sum_rows_kernel<Format><<<grid_for(chunks, 1), kUnionThreads, shared, stream>>>(
        bitmaps, p, bitmap_stride, n, static_cast<const S*>(rows), rank_stride, m, divisor, chunks, chunk_first, units,
        static_cast<S*>(sums));
  });
  return cudaGetLastError();
}

}  // namespace fastdist
