// Launch shapes shared by the CUDA kernels: grid-stride loops over a bounded grid. Include only from .cu files.
#pragma once
#include <cstdint>

namespace fastdist {

// The most blocks a launch asks for; grid-stride loops cover larger inputs. 8192 blocks are about twice what any
// current GPU keeps resident at once (an H100 holds at most 132 SMs x 32 blocks = 4224), so every SM stays busy and a
// larger grid would add only block scheduling; it also keeps every grid within gridDim.x's range on any GPU.
constexpr int64_t kMaxBlocks = 8192;

// Blocks for `items` work items at `per_block` items per block (per_block >= 1): at least 1, at most kMaxBlocks.
inline int grid_for(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// This thread's index in the flat grid, and the grid's thread count (the stride of a grid-stride loop).
__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace fastdist
