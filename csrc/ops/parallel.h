// How the CPU glue cuts work for at::parallel_for. Every CPU kernel's result is the same for any cut, so the grain
// decides only how many threads a call uses.
#pragma once
#include <algorithm>
#include <cstdint>

namespace fastdist {

// A chunk below this many bytes of memory traffic is not worth a thread: small inputs run on the calling thread.
constexpr int64_t kMinBytesPerThread = 256 * 1024;

// at::parallel_for's grain for work items that each move `bytes_per_item` bytes: at least kMinBytesPerThread bytes
// per chunk, and at least one item.
inline int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(kMinBytesPerThread / std::max<int64_t>(bytes_per_item, 1), 1);
}

}  // namespace fastdist
