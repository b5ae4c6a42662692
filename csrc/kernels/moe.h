// Mixture-of-experts token routing: the gate (softmax + top-k), the layout (a stable counting sort of the
// token-to-expert assignments) and the permutation of token rows into expert order and back.
//
// ---- Assignments and their priority ----
// T tokens each pick k experts: topk_idx[t, j] (int64, row-major [T, k]) is token t's j-th choice. Assignment
// (t, j) is called slot s = t * k + j. Priority order is choice-major: q(t, j) = j * T + t, so every first choice
// comes before any second choice, and within a choice tokens come in order (DeepSpeed-MoE / GShard semantics).
//
// ---- The layout (moe_layout_*) ----
// position[t, j] = number of assignments to the same expert with a smaller priority (0-based position inside the
// expert). With capacity C (C < 0: dropless), slot (t, j) is kept when position < C. Rows of the expert-ordered
// buffer: kept assignments first, grouped by expert in increasing id and by priority inside an expert; then the
// dropped ones, in the same order. So
//     kept_e   = min(count_e, C)           offsets[e] = sum_{e' < e} kept_e'        (offsets[E] = kept total)
//     row(t,j) = offsets[e] + position              if kept
//              = offsets[E] + dropped_before_e + position - C    otherwise
//     permutation[row(t, j)] = t * k + j,   row_of_slot[t, j] = row(t, j) if kept else -1.
// Experts are owned contiguously by R ranks, E / R each: rank_counts[r] = sum of kept_e over r's experts.
// This is the unique stable sort of the slots by expert, so any correct algorithm, any chunking and any thread
// count give the same bits. CPU: the tokens are cut into chunks of consecutive tokens, each histogrammed per
// (choice, expert) in parallel; an exclusive scan per expert over (choice, chunk) — priority order — gives each
// chunk its start inside each expert for each choice, and the chunks scatter in parallel. A chunk owns whole token
// rows, so the per-slot outputs each thread writes are contiguous (chunking by priority would interleave the
// threads' writes slot by slot and share every cache line between threads).
//
// ---- Permute / unpermute ----
// permute:   out[row_of_slot[t, j], :] = x[t, :] (* weight[t, j] when weights are given), for kept slots; rows
//            that no slot names stay zero. Each row is written by one slot (row_of_slot is injective on kept
//            slots), so tokens can run in parallel without races.
// unpermute: out[t, :] = sum over kept j, in increasing j, of weight[t, j] * y[row_of_slot[t, j], :] — a gather
//            per token, not an atomic scatter-add: deterministic whatever the thread or block count.
//
// Torch-free: raw pointers and sizes only. Arrays are contiguous and row-major.
#pragma once
#include <cstdint>

#include "kernels/float_bits.h"

namespace fastdist {

// Storage types of the row data (StorageType, float_bits.h). The gate logits are float32 or float64; permute /
// unpermute also move float16 and bfloat16 rows (16-bit storage): they compute in float32 (float64 for float64 rows)
// and round to nearest even once per output value, so unpermute's k-way sum is rounded once, not k times.

// ---- CPU: single-threaded over a sub-range, so the caller can run disjoint ranges in parallel ----

// Gate over tokens [t_begin, t_end): probs[t] = softmax(logits[t]) in float32 (float64 for float64 logits is
// rounded to float32 after the softmax in double), lse[t] = logsumexp(logits[t]); topk_idx[t, :] the k largest
// probabilities in decreasing order, ties to the lower expert id; topk_weight[t, j] = probs[t, topk_idx[t, j]].
// Returns the number of rows in the range with no softmax -- holding a NaN or +inf, or all -inf -- (their outputs
// are unspecified; the glue raises).
int64_t moe_route_cpu(const void* logits, StorageType type, int64_t num_experts, int64_t k, float* probs,
                      float* lse, int64_t* topk_idx, float* topk_weight, int64_t t_begin, int64_t t_end);

// Tokens [t_begin, t_end): adds how many of their j-th choices go to each expert to hist[j * num_experts + e]
// (hist is [k, num_experts], zeroed by the caller). Returns how many ids are outside [0, num_experts) (they are
// not counted).
int64_t moe_layout_histogram_cpu(const int64_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                                 int64_t t_begin, int64_t t_end, int64_t* hist);

// After the histograms of `chunks` token chunks (hist[(c * k + j) * E + e]): turns hist into each (chunk, choice)'s
// first position inside every expert (exclusive scan per expert in priority order: choice-major, then chunk) and
// writes counts[E], offsets[E + 1] (kept, see above), dropped_offsets[E] (first dropped row of each expert) and
// rank_counts[R]. capacity < 0: dropless.
void moe_layout_scan_cpu(int64_t* hist, int64_t chunks, int64_t k, int64_t num_experts, int64_t num_ranks,
                         int64_t capacity, int64_t* counts, int64_t* offsets, int64_t* dropped_offsets,
                         int64_t* rank_counts);

// Scatters the slots of tokens [t_begin, t_end) (one chunk), starting at cursor[k * E] = that chunk's scanned hist
// rows (advanced). Writes permutation[T * k], row_of_slot[T, k], position[T, k], keep[T, k] (0/1) for its slots.
void moe_layout_scatter_cpu(const int64_t* topk_idx, int64_t k, int64_t num_experts, int64_t capacity,
                            const int64_t* offsets, const int64_t* dropped_offsets, int64_t t_begin, int64_t t_end,
                            int64_t* cursor, int64_t* permutation, int64_t* row_of_slot, int64_t* position,
                            uint8_t* keep);

// permute over tokens [t_begin, t_end): x [T, d], row_of_slot [T, k], weight [T, k] or nullptr, out [rows, d]
// (the caller zeroes rows no slot names).
void moe_permute_cpu(const void* x, StorageType type, int64_t d, int64_t k, const int64_t* row_of_slot,
                     const void* weight, void* out, int64_t t_begin, int64_t t_end);

// unpermute over tokens [t_begin, t_end): y [rows, d], row_of_slot [T, k], weight [T, k] or nullptr (ones),
// out [T, d].
void moe_unpermute_cpu(const void* y, StorageType type, int64_t d, int64_t k, const int64_t* row_of_slot,
                       const void* weight, void* out, int64_t t_begin, int64_t t_end);

// ---- CUDA: whole arrays, asynchronous on `stream`; return cudaGetLastError() after the launches ----
#ifdef __CUDACC__

// One warp per token row. Rows with no softmax (see moe_route_cpu) give unspecified choices of distinct valid ids
// (the CUDA glue does not sync to check).
cudaError_t moe_route_cuda(const void* logits, StorageType type, int64_t tokens, int64_t num_experts, int64_t k,
                           float* probs, float* lse, int64_t* topk_idx, float* topk_weight, cudaStream_t stream);

// Bytes of scratch moe_layout_cuda needs (per-warp-chunk histograms).
int64_t moe_layout_cuda_workspace_bytes(int64_t tokens, int64_t k, int64_t num_experts);

// Same outputs as the CPU functions together. ids must be in [0, num_experts) (the glue checks).
// workspace: moe_layout_cuda_workspace_bytes bytes, 8-byte aligned.
cudaError_t moe_layout_cuda(const int64_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                            int64_t num_ranks, int64_t capacity, int64_t* counts, int64_t* offsets,
                            int64_t* rank_counts, int64_t* permutation, int64_t* row_of_slot, int64_t* position,
                            uint8_t* keep, void* workspace, cudaStream_t stream);

cudaError_t moe_permute_cuda(const void* x, StorageType type, int64_t tokens, int64_t d, int64_t k,
                             const int64_t* row_of_slot, const void* weight, void* out, cudaStream_t stream);

cudaError_t moe_unpermute_cuda(const void* y, StorageType type, int64_t tokens, int64_t d, int64_t k,
                               const int64_t* row_of_slot, const void* weight, void* out, cudaStream_t stream);

#endif  // __CUDACC__

}  // namespace fastdist
