// CUDA bit packing. Memory-bound kernels: each thread moves 16 mask bytes per step with one vector load or
// store, consecutive threads touch consecutive memory, and grid-stride loops cover any size with a bounded
// grid. A byte-at-a-time path handles what the vector path cannot: rows that do not end on a byte boundary
// (n % 8 != 0 with several rows), misaligned pointers, and the last partial group of the flat case.
#include <cstdint>

#include "kernels/bitpack.h"
#include "kernels/cuda_launch.cuh"

namespace fastdist {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kLowBits = 0x0101010101010101ULL;

bool aligned(const void* p, uintptr_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

// 8 mask bytes (little-endian word) -> 1 packed byte; bit 0 of byte k goes to bit k.
__device__ __forceinline__ uint32_t pack8(uint64_t x) {
  return static_cast<uint32_t>(((x & kLowBits) * 0x0102040810204080ULL) >> 56);
}

// 1 packed byte -> 8 mask bytes (little-endian word). Broadcast the byte, keep bit k in byte k, then turn each
// non-zero byte into 1: adding 0x7F sets bit 7 exactly when the byte was non-zero and never carries out.
__device__ __forceinline__ uint64_t unpack8(uint32_t byte) {
  const uint64_t x = (byte * kLowBits) & 0x8040201008040201ULL;
  return ((x + 0x7F7F7F7F7F7F7F7FULL) >> 7) & kLowBits;
}

// Packed byte j of a row of `nbits` mask bytes, one byte at a time (handles a partial last byte).
__device__ __forceinline__ uint8_t pack_byte(const uint8_t* __restrict__ row, int64_t nbits, int64_t j) {
  const int64_t begin = 8 * j;
  const int64_t count = nbits - begin < 8 ? nbits - begin : 8;
  uint32_t byte = 0;
  for (int64_t k = 0; k < count; ++k) byte |= static_cast<uint32_t>(row[begin + k] & 1) << k;
  return static_cast<uint8_t>(byte);
}

__device__ __forceinline__ void unpack_byte(const uint8_t* __restrict__ packed_row, int64_t nbits, int64_t j,
                                            uint8_t* __restrict__ out_row) {
  const int64_t begin = 8 * j;
  const int64_t count = nbits - begin < 8 ? nbits - begin : 8;
  const uint32_t byte = packed_row[j];
  for (int64_t k = 0; k < count; ++k) out_row[begin + k] = static_cast<uint8_t>((byte >> k) & 1);
}

// Flat layout (one row of nbits), mask 16-byte aligned, out 2-byte aligned: 16 mask bytes -> 2 packed bytes per
// step. Block 0 also packs the at most two bytes after the last whole group (grid_for launches at least one block,
// so it runs even when there is no whole group).
__global__ void pack_flat16_kernel(const uint8_t* __restrict__ mask, int64_t nbits, uint8_t* __restrict__ out) {
  const int64_t groups = nbits / 16;
  for (int64_t i = global_thread(); i < groups; i += grid_threads()) {
    const uint4 v = reinterpret_cast<const uint4*>(mask)[i];
    const uint64_t lo = (static_cast<uint64_t>(v.y) << 32) | v.x;
    const uint64_t hi = (static_cast<uint64_t>(v.w) << 32) | v.z;
    reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(pack8(lo) | (pack8(hi) << 8));
  }
  const int64_t tail_byte = 2 * groups + threadIdx.x;
  if (blockIdx.x == 0 && tail_byte < packed_bytes(nbits)) out[tail_byte] = pack_byte(mask, nbits, tail_byte);
}

// Any layout: one packed byte per step.
__global__ void pack_bytes_kernel(const uint8_t* __restrict__ mask, int64_t rows, int64_t n,
                                  uint8_t* __restrict__ out) {
  const int64_t row_bytes = packed_bytes(n);
  const int64_t total = rows * row_bytes;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / row_bytes;
    out[i] = pack_byte(mask + r * n, n, i - r * row_bytes);
  }
}

// Flat layout, packed 2-byte aligned, out 16-byte aligned: 2 packed bytes -> 16 mask bytes per step.
__global__ void unpack_flat16_kernel(const uint8_t* __restrict__ packed, int64_t nbits, uint8_t* __restrict__ out) {
  const int64_t groups = nbits / 16;
  for (int64_t i = global_thread(); i < groups; i += grid_threads()) {
    const uint32_t two = reinterpret_cast<const uint16_t*>(packed)[i];
    const uint64_t lo = unpack8(two & 0xFF);
    const uint64_t hi = unpack8(two >> 8);
    reinterpret_cast<uint4*>(out)[i] = make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                                                  static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
  }
  const int64_t tail_byte = 2 * groups + threadIdx.x;
  if (blockIdx.x == 0 && tail_byte < packed_bytes(nbits)) unpack_byte(packed, nbits, tail_byte, out);
}

__global__ void unpack_bytes_kernel(const uint8_t* __restrict__ packed, int64_t rows, int64_t n,
                                    uint8_t* __restrict__ out) {
  const int64_t row_bytes = packed_bytes(n);
  const int64_t total = rows * row_bytes;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / row_bytes;
    unpack_byte(packed + r * row_bytes, n, i - r * row_bytes, out + r * n);
  }
}

__device__ __forceinline__ void or_into(uint4& acc, const uint4& v) {
  acc.x |= v.x;
  acc.y |= v.y;
  acc.z |= v.z;
  acc.w |= v.w;
}
__device__ __forceinline__ void or_into(uint32_t& acc, uint32_t v) { acc |= v; }
__device__ __forceinline__ void or_into(uint8_t& acc, uint8_t v) { acc |= v; }

// packed [p, words] of Word -> out [words]: each thread owns a column and walks down the rows, so every row
// read is coalesced across the warp.
template <typename Word>
__global__ void or_reduce_kernel(const Word* __restrict__ packed, int64_t p, int64_t words, Word* __restrict__ out) {
  for (int64_t k = global_thread(); k < words; k += grid_threads()) {
    Word acc{};
#pragma unroll 4  // several rows' loads in flight per thread
    for (int64_t r = 0; r < p; ++r) or_into(acc, packed[r * words + k]);
    out[k] = acc;
  }
}

template <typename Word>
void launch_or_reduce(const uint8_t* packed, int64_t p, int64_t b, uint8_t* out, cudaStream_t stream) {
  const int64_t words = b / static_cast<int64_t>(sizeof(Word));
  or_reduce_kernel<Word><<<grid_for(words, kThreads), kThreads, 0, stream>>>(reinterpret_cast<const Word*>(packed), p,
                                                                             words, reinterpret_cast<Word*>(out));
}

// The widest word that divides a row and fits the alignment of both pointers.
template <typename Word>
bool fits(const uint8_t* packed, int64_t b, const uint8_t* out) {
  return b % static_cast<int64_t>(sizeof(Word)) == 0 && aligned(packed, sizeof(Word)) && aligned(out, sizeof(Word));
}

// One thread per index: sets its unit's bit with an atomicOr on the 32-bit word that holds it (out is padded to whole
// words, so the word is in bounds even for the last byte).
__global__ void bitmap_from_indices_kernel(const int64_t* __restrict__ indices, int64_t k, int64_t n,
                                           uint32_t* __restrict__ out) {
  for (int64_t i = global_thread(); i < k; i += grid_threads()) {
    const uint64_t u = static_cast<uint64_t>(indices[i]);
    if (u < static_cast<uint64_t>(n)) atomicOr(out + (u >> 5), 1u << (u & 31));  // little-endian: bit u % 32 of word
  }
}

}  // namespace

cudaError_t pack_bits_cuda(const uint8_t* mask, int64_t rows, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const bool flat = n % 8 == 0 || rows == 1;  // rows end on byte boundaries: one row of rows * n bits
  if (flat && aligned(mask, 16) && aligned(out, 2)) {
    const int64_t nbits = rows * n;
    pack_flat16_kernel<<<grid_for(nbits / 16, kThreads), kThreads, 0, stream>>>(mask, nbits, out);
  } else {
    pack_bytes_kernel<<<grid_for(rows * packed_bytes(n), kThreads), kThreads, 0, stream>>>(mask, rows, n, out);
  }
  return cudaGetLastError();
}

cudaError_t unpack_bits_cuda(const uint8_t* packed, int64_t rows, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const bool flat = n % 8 == 0 || rows == 1;
  if (flat && aligned(packed, 2) && aligned(out, 16)) {
    const int64_t nbits = rows * n;
    unpack_flat16_kernel<<<grid_for(nbits / 16, kThreads), kThreads, 0, stream>>>(packed, nbits, out);
  } else {
    unpack_bytes_kernel<<<grid_for(rows * packed_bytes(n), kThreads), kThreads, 0, stream>>>(packed, rows, n, out);
  }
  return cudaGetLastError();
}

cudaError_t bitwise_or_reduce_cuda(const uint8_t* packed, int64_t p, int64_t b, uint8_t* out, cudaStream_t stream) {
  if (b == 0) return cudaSuccess;
  if (fits<uint4>(packed, b, out)) {
    launch_or_reduce<uint4>(packed, p, b, out, stream);
  } else if (fits<uint32_t>(packed, b, out)) {
    launch_or_reduce<uint32_t>(packed, p, b, out, stream);
  } else {
    launch_or_reduce<uint8_t>(packed, p, b, out, stream);
  }
  return cudaGetLastError();
}

cudaError_t bitmap_from_indices_cuda(const int64_t* indices, int64_t k, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (k == 0 || n == 0) return cudaSuccess;
  bitmap_from_indices_kernel<<<grid_for(k, kThreads), kThreads, 0, stream>>>(indices, k, n,
                                                                            reinterpret_cast<uint32_t*>(out));
  return cudaGetLastError();
}

}  // namespace fastdist
