// Float formats shared by every op family: float32 <-> bits, IEEE binary16 and bfloat16 <-> float32, the same bits
// on host and device. Branch-free, so CPU loops of them vectorize. Torch-free.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace fastdist {

FASTDIST_HOST_DEVICE inline float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FASTDIST_HOST_DEVICE inline uint32_t bits_of_float(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// IEEE binary16 -> binary32, exact, NaN payloads kept.
FASTDIST_HOST_DEVICE inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t inf_nan = 0u - static_cast<uint32_t>(em >= 0x7C00u);  // all ones or zero: masks, not branches
  const uint32_t small = 0u - static_cast<uint32_t>(em < 0x0400u);
  // Normal: rebias the exponent 15 -> 127; infinity and NaN: exponent all ones (rebias twice), payload kept.
  const uint32_t normal = (em << 13) + 0x38000000u + (inf_nan & 0x38000000u);
  // Zero and subnormals: em * 2^-24, exact (em < 2^10).
  const float scaled = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;
  const uint32_t subnormal = bits_of_float(scaled);
  return float_from_bits(((normal & ~small) | (subnormal & small)) | sign);
}

// binary32 -> binary16, round to nearest-even, overflow to infinity, NaN to a quiet NaN. The float additions do
// the rounding (the classic FP16 library construction: scale so that the float adder rounds at the binary16
// mantissa's last place, then read the bits).
FASTDIST_HOST_DEVICE inline uint16_t float_to_half(float f) {
  const float scale_to_inf = 5.192296858534828e+33f;   // 2^112
  const float scale_to_zero = 7.703719777548943e-34f;  // 2^-110
  const uint32_t w = bits_of_float(f);
  float base = (float_from_bits(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = float_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of_float(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

FASTDIST_HOST_DEVICE inline float bfloat16_to_float(uint16_t h) { return float_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest-even; a NaN stays a (quiet) NaN.
FASTDIST_HOST_DEVICE inline uint16_t float_to_bfloat16(float f) {
  const uint32_t u = bits_of_float(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  return static_cast<uint16_t>((rounded & ~is_nan) | (((u >> 16) | 0x40u) & is_nan));
}

// Storage formats of the rows the kernels move: load to the compute type, store with one rounding to nearest even.
// One definition for host and device, so that CPU and CUDA results agree bit for bit.
struct Float32Format {
  using Storage = float;
  using Compute = float;
  FASTDIST_HOST_DEVICE static float load(float v) { return v; }
  FASTDIST_HOST_DEVICE static float store(float v) { return v; }
};

struct Float64Format {
  using Storage = double;
  using Compute = double;
  FASTDIST_HOST_DEVICE static double load(double v) { return v; }
  FASTDIST_HOST_DEVICE static double store(double v) { return v; }
};

struct Float16Format {
  using Storage = uint16_t;
  using Compute = float;
  FASTDIST_HOST_DEVICE static float load(uint16_t v) { return half_to_float(v); }
  FASTDIST_HOST_DEVICE static uint16_t store(float v) { return float_to_half(v); }
};

struct BFloat16Format {
  using Storage = uint16_t;
  using Compute = float;
  FASTDIST_HOST_DEVICE static float load(uint16_t v) { return bfloat16_to_float(v); }
  FASTDIST_HOST_DEVICE static uint16_t store(float v) { return float_to_bfloat16(v); }
};

// Which of those formats a tensor is stored in: one enum for every op family (the glue maps torch dtypes to it).
enum class StorageType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// fn(Format{}) with the format of `type`: the one switch of the kernels templated on their storage format.
template <typename Fn>
decltype(auto) dispatch_storage(StorageType type, Fn&& fn) {
  switch (type) {
    case StorageType::kFloat64: return fn(Float64Format{});
    case StorageType::kFloat16: return fn(Float16Format{});
    case StorageType::kBFloat16: return fn(BFloat16Format{});
    default: return fn(Float32Format{});
  }
}

}  // namespace fastdist
