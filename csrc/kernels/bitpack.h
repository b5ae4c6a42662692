// Bit packing: bool masks <-> packed bytes, and OR over packed rows.
//
// Layout shared by every function here: a mask is `rows` rows of `n` bytes, each 0 or 1 (only bit 0
// of a mask byte is read); its packed form is `rows` rows of `packed_bytes(n) = ceil(n / 8)` bytes.
// Bit j of packed byte i of a row is mask element 8 * i + j of that row (little-endian within a byte,
// as numpy.packbits(..., bitorder="little")). The padding bits of a row's last byte are written as
// zero by pack and ignored by unpack.
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous and row-major.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace fastdist {

// Bytes that hold `bits` bits packed eight to a byte, ceil(bits / 8): a packed mask row of that many elements, and
// every other bitmap and bit stream of the kernels (count-sketch supports, TopK bitmaps, quantized codes). Written
// so that it cannot overflow for any bits >= 0 ((bits + 7) / 8 would near 2^63).
FASTDIST_HOST_DEVICE inline constexpr int64_t packed_bytes(int64_t bits) { return bits / 8 + (bits % 8 != 0); }

// ---- CPU: single-threaded over a sub-range, so the caller can run disjoint ranges in parallel. ----
//
// pack and unpack index their range by packed byte: the range [byte_begin, byte_end) is a slice of
// the packed array viewed flat, 0 <= byte_begin <= byte_end <= rows * packed_bytes(n). Each packed byte
// maps to its own mask bytes, so disjoint ranges touch disjoint memory.

// mask: uint8 [rows, n], values 0/1.  out: uint8 [rows, packed_bytes(n)]; writes out[byte_begin, byte_end).
void pack_bits_cpu(const uint8_t* mask, int64_t rows, int64_t n, uint8_t* out, int64_t byte_begin,
                   int64_t byte_end);

// packed: uint8 [rows, packed_bytes(n)].  out: uint8 [rows, n], values 0/1; writes the mask elements
// of packed bytes [byte_begin, byte_end).
void unpack_bits_cpu(const uint8_t* packed, int64_t rows, int64_t n, uint8_t* out, int64_t byte_begin,
                     int64_t byte_end);

// packed: uint8 [p, b].  out: uint8 [b], out[k] = OR over r of packed[r, k] (0 when p == 0); writes
// out[col_begin, col_end), 0 <= col_begin <= col_end <= b.
void bitwise_or_reduce_cpu(const uint8_t* packed, int64_t p, int64_t b, uint8_t* out, int64_t col_begin,
                           int64_t col_end);

// indices: k unit numbers, in any order, repeats allowed (a sparse gradient's row indices, coalesced or not).
// out: the packed bitmap of n units, zeroed by the caller; sets bit u for every listed u in [0, n), for the indices
// [begin, end) (0 <= begin <= end <= k). Bits are set with atomic ORs, so disjoint index ranges may run on several
// threads at once; the bitmap is the same for any split. Indices outside [0, n) are skipped (the glue rejects them
// first with first_index_out_of_range).
void bitmap_from_indices_cpu(const int64_t* indices, int64_t n, uint8_t* out, int64_t begin, int64_t end);

// The position of the first of the k indices outside [0, n), or -1 when all are inside.
int64_t first_index_out_of_range(const int64_t* indices, int64_t k, int64_t n);

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launch. ----
// Declared only for nvcc-compiled sources (the kernels and the CUDA glue) so that plain C++ can include
// this header without the CUDA toolkit.
#ifdef __CUDACC__

// Same shapes and contract as the CPU functions above, over the whole array. Empty inputs launch nothing.
cudaError_t pack_bits_cuda(const uint8_t* mask, int64_t rows, int64_t n, uint8_t* out, cudaStream_t stream);
cudaError_t unpack_bits_cuda(const uint8_t* packed, int64_t rows, int64_t n, uint8_t* out, cudaStream_t stream);
cudaError_t bitwise_or_reduce_cuda(const uint8_t* packed, int64_t p, int64_t b, uint8_t* out,
                                   cudaStream_t stream);
// out: zeroed, 4-byte aligned and padded to a multiple of 4 bytes (the bits are set with 32-bit atomicOr). Indices
// outside [0, n) are skipped: the CUDA glue does not check them (that would need a device-to-host copy).
cudaError_t bitmap_from_indices_cuda(const int64_t* indices, int64_t k, int64_t n, uint8_t* out, cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
