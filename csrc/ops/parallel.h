// How the CPU glue cuts work for at::parallel_for. Every CPU kernel's result is the same for any cut, so the grain
// decides only how many threads a call uses.
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "ops/checks.h"

namespace fastdist {

// A chunk below this many bytes of memory traffic is not worth a thread: small inputs run on the calling thread.
constexpr int64_t kMinBytesPerThread = 256 * 1024;

// at::parallel_for's grain for work items that each move the product of `bytes_per_item` bytes (factors, e.g.
// {2, k, d, element size}): at least kMinBytesPerThread bytes per chunk, and at least one item. An item whose bytes
// pass int64 is a grain of one: the checks bound every size that work touches, but not the items of an empty range
// (the rows of a [0, 2^62] tensor).
inline int64_t grain_for(std::initializer_list<int64_t> bytes_per_item) {
  int64_t bytes = 1;
  for (const int64_t factor : bytes_per_item) {
    if (!mul_fits(bytes, std::max<int64_t>(factor, 0), &bytes)) return 1;
  }
  return std::max<int64_t>(kMinBytesPerThread / std::max<int64_t>(bytes, 1), 1);
}

}  // namespace fastdist
