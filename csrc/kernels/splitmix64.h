// The splitmix64 generator (Steele, Lea and Flood), the one source of pseudo-random bits of the kernels: the
// count-sketch draws its hash coefficients from its stream (sketch.h) and stochastic rounding its uniforms from its
// output function at a counter (quantize.h), the same bits on host and device. Torch-free.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace fastdist {

// The stream's increment (2^64 / golden ratio, odd).
constexpr uint64_t kSplitmix64Gamma = 0x9E3779B97F4A7C15ULL;

// The output function: a bijective mix of all 64 bits of z.
FASTDIST_HOST_DEVICE inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// One step of the stream: state += gamma, then the output function of the new state (all arithmetic mod 2^64).
FASTDIST_HOST_DEVICE inline uint64_t splitmix64_next(uint64_t& state) {
  state += kSplitmix64Gamma;
  return splitmix64_mix(state);
}

}  // namespace fastdist
