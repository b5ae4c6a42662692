// CUDA MoE routing kernels (contract in moe.h).
//
// Layout: a deterministic stable counting sort without global atomics on positions. The T * k assignments, in
// priority order, are cut into warp chunks of kChunk = 32 * kItems consecutive priorities.
//   1. histogram: each warp counts its chunk per expert in shared memory (atomics on counts only: a count does not
//      depend on the order of the adds) and writes hist[e * chunks + c].
//   2. scan: one block per expert turns its row hist[e, :] into an exclusive prefix (chunk c's first position
//      inside expert e) and writes counts[e].
//   3. offsets: one thread walks the experts (E <= kMoeMaxExpertsCuda) for the kept / dropped row offsets and the
//      per-rank counts.
//   4. scatter: each warp re-reads its chunk 32 assignments at a time, in priority order. __match_any_sync groups
//      the lanes with the same expert; a lane's rank among them is the popcount of the lower lanes in its group,
//      so position = the warp's running cursor for the expert (shared memory) + rank, and the group's lowest lane
//      advances the cursor by the group size. Every position is therefore the one the sequential stable sort
//      assigns, on any GPU and any launch configuration.
// Permute and unpermute: one block per token (grid-stride), threads over the row's columns; unpermute gathers the
// token's k rows in increasing j, so it needs no atomics either.
#include <cstdint>

#include "kernels/cuda_launch.cuh"
#include "kernels/moe.h"

namespace fastdist {
namespace {

constexpr int kWarp = 32;
constexpr int kItems = 16;                 // assignments per lane per chunk
constexpr int64_t kChunk = kWarp * kItems;  // priorities per warp chunk
constexpr int kMaxK = 16;
constexpr int kSharedBudgetBytes = 40 * 1024;

int warps_per_block_for(int64_t num_experts) {
  const int64_t per_warp = num_experts * static_cast<int64_t>(sizeof(int64_t));
  const int64_t fit = kSharedBudgetBytes / (per_warp > 0 ? per_warp : 1);
  return static_cast<int>(fit < 1 ? 1 : fit > 8 ? 8 : fit);
}

int64_t chunks_for(int64_t tokens, int64_t k) { return (tokens * k + kChunk - 1) / kChunk; }

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

template <typename T>
__global__ void route_kernel(const T* __restrict__ logits, int64_t tokens, int64_t num_experts, int64_t k,
                             float* __restrict__ probs, float* __restrict__ lse, int64_t* __restrict__ topk_idx,
                             float* __restrict__ topk_weight) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < tokens;
       t += warps) {
    const T* row = logits + t * num_experts;
    float* p = probs + t * num_experts;
    using Acc = T;  // float for float32, double for float64, as on the CPU
    Acc mx = -INFINITY;
    for (int64_t e = lane; e < num_experts; e += kWarp) mx = fmax(mx, row[e]);
    for (int off = kWarp / 2; off > 0; off /= 2) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    Acc sum = 0;
    for (int64_t e = lane; e < num_experts; e += kWarp) sum += exp(row[e] - mx);
    for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv = static_cast<float>(Acc(1) / sum);
    for (int64_t e = lane; e < num_experts; e += kWarp) p[e] = static_cast<float>(exp(row[e] - mx)) * inv;
    if (lane == 0) lse[t] = static_cast<float>(mx + log(sum));
    __syncwarp();
    int64_t chosen[kMaxK];
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      float best_p = -1.0f;
      for (int64_t e = lane; e < num_experts; e += kWarp) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= chosen[i] == e;
        const float v = p[e];
        if (!taken && (best < 0 || v > best_p)) {
          best = e;
          best_p = v;
        }
      }
      // Warp arg-max; a tie goes to the lower expert id, an empty lane (best < 0) loses to any other. Two NaNs tie
      // (a row whose logits hold +inf or are all -inf has NaN probabilities, unchecked on CUDA), and lane 0's pick is
      // then broadcast: NaN comparisons can leave lanes disagreeing, and chosen[] must be the same on every lane.
      for (int off = kWarp / 2; off > 0; off /= 2) {
        const int64_t other = __shfl_xor_sync(0xffffffffu, best, off);
        const float other_p = __shfl_xor_sync(0xffffffffu, best_p, off);
        const bool tie = other_p == best_p || (isnan(other_p) && isnan(best_p));
        const bool take = other >= 0 && (best < 0 || other_p > best_p || (tie && other < best));
        best = take ? other : best;
        best_p = take ? other_p : best_p;
      }
      best = __shfl_sync(0xffffffffu, best, 0);
      best_p = __shfl_sync(0xffffffffu, best_p, 0);
      chosen[j] = best;
      if (lane == 0) {
        topk_idx[t * k + j] = best;
        topk_weight[t * k + j] = best_p;
      }
    }
  }
}

__global__ void layout_histogram_kernel(const int64_t* __restrict__ topk_idx, int64_t tokens, int64_t k,
                                        int64_t num_experts, int64_t chunks, int64_t* __restrict__ hist) {
  extern __shared__ int64_t shared[];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  int64_t* local = shared + warp * num_experts;
  const int64_t n = tokens * k;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp; c < chunks; c += warps) {
    for (int64_t e = lane; e < num_experts; e += kWarp) local[e] = 0;
    __syncwarp();
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    for (int64_t q = c * kChunk + lane; q < end; q += kWarp) {
      const int64_t j = q / tokens;
      const int64_t t = q - j * tokens;
      atomicAdd(reinterpret_cast<unsigned long long*>(local + topk_idx[t * k + j]), 1ull);
    }
    __syncwarp();
    for (int64_t e = lane; e < num_experts; e += kWarp) hist[e * chunks + c] = local[e];
    __syncwarp();
  }
}

// One block per expert (grid-stride): exclusive scan of hist[e, :] in tiles of blockDim.x with a carry.
__global__ void layout_scan_kernel(int64_t* __restrict__ hist, int64_t num_experts, int64_t chunks,
                                   int64_t* __restrict__ counts) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  for (int64_t e = blockIdx.x; e < num_experts; e += gridDim.x) {
    int64_t* row = hist + e * chunks;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < chunks; base += blockDim.x) {
      const int64_t c = base + threadIdx.x;
      const int64_t v = c < chunks ? row[c] : 0;
      int64_t inclusive = v;
      for (int off = 1; off < kWarp; off *= 2) {
        const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, off);
        if (lane >= off) inclusive += up;
      }
      if (lane == kWarp - 1) warp_sums[warp] = inclusive;
      __syncthreads();
      if (warp == 0) {
        int64_t s = lane < warps ? warp_sums[lane] : 0;
        for (int off = 1; off < kWarp; off *= 2) {
          const int64_t up = __shfl_up_sync(0xffffffffu, s, off);
          if (lane >= off) s += up;
        }
        if (lane < warps) warp_sums[lane] = s;  // inclusive over warps
      }
      __syncthreads();
      const int64_t before_warp = warp > 0 ? warp_sums[warp - 1] : 0;
      if (c < chunks) row[c] = carry + before_warp + inclusive - v;
      __syncthreads();
      if (threadIdx.x == 0) carry += warp_sums[warps - 1];
      __syncthreads();
    }
    if (threadIdx.x == 0) counts[e] = carry;
    __syncthreads();
  }
}

__global__ void layout_offsets_kernel(const int64_t* __restrict__ counts, int64_t num_experts, int64_t num_ranks,
                                      int64_t capacity, int64_t* __restrict__ offsets,
                                      int64_t* __restrict__ dropped_offsets, int64_t* __restrict__ rank_counts) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t kept = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    offsets[e] = kept;
    kept += capacity < 0 ? counts[e] : (counts[e] < capacity ? counts[e] : capacity);
  }
  offsets[num_experts] = kept;
  int64_t dropped = kept;
  for (int64_t e = 0; e < num_experts; ++e) {
    dropped_offsets[e] = dropped;
    dropped += capacity < 0 || counts[e] <= capacity ? 0 : counts[e] - capacity;
  }
  const int64_t per_rank = num_experts / num_ranks;
  for (int64_t r = 0; r < num_ranks; ++r) rank_counts[r] = offsets[(r + 1) * per_rank] - offsets[r * per_rank];
}

__global__ void layout_scatter_kernel(const int64_t* __restrict__ topk_idx, int64_t tokens, int64_t k,
                                      int64_t num_experts, int64_t chunks, int64_t capacity,
                                      const int64_t* __restrict__ hist, const int64_t* __restrict__ offsets,
                                      const int64_t* __restrict__ dropped_offsets, int64_t* __restrict__ permutation,
                                      int64_t* __restrict__ row_of_slot, int64_t* __restrict__ position,
                                      uint8_t* __restrict__ keep) {
  extern __shared__ int64_t shared[];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  int64_t* cursor = shared + warp * num_experts;
  const int64_t n = tokens * k;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const unsigned lower = lanemask_lt();
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp; c < chunks; c += warps) {
    for (int64_t e = lane; e < num_experts; e += kWarp) cursor[e] = hist[e * chunks + c];
    __syncwarp();
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    for (int64_t q0 = c * kChunk; q0 < end; q0 += kWarp) {
      const int64_t q = q0 + lane;
      const bool valid = q < end;
      const int64_t j = valid ? q / tokens : 0;
      const int64_t t = valid ? q - j * tokens : 0;
      const int64_t slot = t * k + j;
      // Lanes past the end get a distinct negative key so they never join a real expert's group.
      const int64_t e = valid ? topk_idx[slot] : -1 - lane;
      const unsigned peers = __match_any_sync(0xffffffffu, static_cast<unsigned long long>(e));
      const int64_t pos = valid ? cursor[e] + __popc(peers & lower) : 0;
      __syncwarp();
      if (valid && (peers & lower) == 0) cursor[e] += __popc(peers);
      __syncwarp();
      if (valid) {
        const bool kept = capacity < 0 || pos < capacity;
        const int64_t row = kept ? offsets[e] + pos : dropped_offsets[e] + (pos - capacity);
        permutation[row] = slot;
        row_of_slot[slot] = kept ? row : -1;
        position[slot] = pos;
        keep[slot] = kept ? 1 : 0;
      }
    }
    __syncwarp();
  }
}

template <typename Format>
__global__ void permute_kernel(const typename Format::Storage* __restrict__ x, int64_t tokens, int64_t d, int64_t k,
                               const int64_t* __restrict__ row_of_slot,
                               const typename Format::Storage* __restrict__ weight,
                               typename Format::Storage* __restrict__ out) {
  using Acc = typename Format::Compute;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const typename Format::Storage* src = x + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = row_of_slot[t * k + j];
      if (r < 0) continue;
      typename Format::Storage* dst = out + r * d;
      if (weight == nullptr) {
        for (int64_t col = threadIdx.x; col < d; col += blockDim.x) dst[col] = src[col];
      } else {
        const Acc w = Format::load(weight[t * k + j]);
        for (int64_t col = threadIdx.x; col < d; col += blockDim.x) {
          dst[col] = Format::store(w * Format::load(src[col]));
        }
      }
    }
  }
}

// acc + w * v with the product rounded before the add, as the CPU computes it: nvcc would contract it into one
// fused multiply-add, whose single rounding differs from the CPU's in the last bit for about a quarter of values.
__device__ __forceinline__ float mul_add_rounded(float acc, float w, float v) {
  return __fadd_rn(acc, __fmul_rn(w, v));
}
__device__ __forceinline__ double mul_add_rounded(double acc, double w, double v) {
  return __dadd_rn(acc, __dmul_rn(w, v));
}

template <typename Format>
__global__ void unpermute_kernel(const typename Format::Storage* __restrict__ y, int64_t tokens, int64_t d,
                                 int64_t k, const int64_t* __restrict__ row_of_slot,
                                 const typename Format::Storage* __restrict__ weight,
                                 typename Format::Storage* __restrict__ out) {
  using Acc = typename Format::Compute;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    typename Format::Storage* dst = out + t * d;
    for (int64_t col = threadIdx.x; col < d; col += blockDim.x) {
      Acc acc = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_slot[t * k + j];
        if (r < 0) continue;
        const Acc w = weight == nullptr ? Acc(1) : Format::load(weight[t * k + j]);
        acc = mul_add_rounded(acc, w, Format::load(y[r * d + col]));
      }
      dst[col] = Format::store(acc);
    }
  }
}

template <typename Format>
cudaError_t launch_permute(const void* x, int64_t tokens, int64_t d, int64_t k, const int64_t* row_of_slot,
                           const void* weight, void* out, int grid, int threads, cudaStream_t stream) {
  using S = typename Format::Storage;
  permute_kernel<Format><<<grid, threads, 0, stream>>>(static_cast<const S*>(x), tokens, d, k, row_of_slot,
                                                       static_cast<const S*>(weight), static_cast<S*>(out));
  return cudaGetLastError();
}

template <typename Format>
cudaError_t launch_unpermute(const void* y, int64_t tokens, int64_t d, int64_t k, const int64_t* row_of_slot,
                             const void* weight, void* out, int grid, int threads, cudaStream_t stream) {
  using S = typename Format::Storage;
  unpermute_kernel<Format><<<grid, threads, 0, stream>>>(static_cast<const S*>(y), tokens, d, k, row_of_slot,
                                                         static_cast<const S*>(weight), static_cast<S*>(out));
  return cudaGetLastError();
}

int row_threads(int64_t d) { return d >= 256 ? 256 : d >= 128 ? 128 : 64; }

}  // namespace

cudaError_t moe_route_cuda(const void* logits, StorageType type, int64_t tokens, int64_t num_experts, int64_t k,
                           float* probs, float* lse, int64_t* topk_idx, float* topk_weight, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int grid = grid_for(tokens, kThreads / kWarp);
  if (type == StorageType::kFloat64) {
    route_kernel<double><<<grid, kThreads, 0, stream>>>(static_cast<const double*>(logits), tokens, num_experts, k,
                                                         probs, lse, topk_idx, topk_weight);
  } else {
    route_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(logits), tokens, num_experts, k,
                                                        probs, lse, topk_idx, topk_weight);
  }
  return cudaGetLastError();
}

int64_t moe_layout_cuda_workspace_bytes(int64_t tokens, int64_t k, int64_t num_experts) {
  return (num_experts * chunks_for(tokens, k) + num_experts) * static_cast<int64_t>(sizeof(int64_t));
}

cudaError_t moe_layout_cuda(const int64_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                            int64_t num_ranks, int64_t capacity, int64_t* counts, int64_t* offsets,
                            int64_t* rank_counts, int64_t* permutation, int64_t* row_of_slot, int64_t* position,
                            uint8_t* keep, void* workspace, cudaStream_t stream) {
  const int64_t chunks = chunks_for(tokens, k);
  int64_t* hist = static_cast<int64_t*>(workspace);
  int64_t* dropped_offsets = hist + num_experts * chunks;
  const int warps = warps_per_block_for(num_experts);
  const int threads = warps * kWarp;
  const size_t shared = static_cast<size_t>(warps) * num_experts * sizeof(int64_t);
  if (chunks > 0) {
    layout_histogram_kernel<<<grid_for(chunks, warps), threads, shared, stream>>>(topk_idx, tokens, k, num_experts,
                                                                                   chunks, hist);
    layout_scan_kernel<<<grid_for(num_experts, 1), 1024, 0, stream>>>(hist, num_experts, chunks, counts);
  } else {
    const cudaError_t err = cudaMemsetAsync(counts, 0, num_experts * sizeof(int64_t), stream);
    if (err != cudaSuccess) return err;
  }
  layout_offsets_kernel<<<1, 1, 0, stream>>>(counts, num_experts, num_ranks, capacity, offsets, dropped_offsets,
                                             rank_counts);
  if (chunks > 0) {
    layout_scatter_kernel<<<grid_for(chunks, warps), threads, shared, stream>>>(
        topk_idx, tokens, k, num_experts, chunks, capacity, hist, offsets, dropped_offsets, permutation, row_of_slot,
        position, keep);
  }
  return cudaGetLastError();
}

cudaError_t moe_permute_cuda(const void* x, StorageType type, int64_t tokens, int64_t d, int64_t k,
                             const int64_t* row_of_slot, const void* weight, void* out, cudaStream_t stream) {
  if (tokens == 0 || d == 0) return cudaSuccess;
  const int grid = grid_for(tokens, 1);
  const int threads = row_threads(d);
  return dispatch_storage(type, [&](auto format) {
    return launch_permute<decltype(format)>(x, tokens, d, k, row_of_slot, weight, out, grid, threads, stream);
  });
}

cudaError_t moe_unpermute_cuda(const void* y, StorageType type, int64_t tokens, int64_t d, int64_t k,
                               const int64_t* row_of_slot, const void* weight, void* out, cudaStream_t stream) {
  if (tokens == 0 || d == 0) return cudaSuccess;
  const int grid = grid_for(tokens, 1);
  const int threads = row_threads(d);
  return dispatch_storage(type, [&](auto format) {
    return launch_unpermute<decltype(format)>(y, tokens, d, k, row_of_slot, weight, out, grid, threads, stream);
  });
}

}  // namespace fastdist
