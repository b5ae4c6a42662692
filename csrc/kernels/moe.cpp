// CPU MoE routing kernels (contract in moe.h). Each function covers a sub-range so that the glue can hand
// disjoint ranges to threads; the results never depend on how the ranges are cut.
#include "kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/float_bits.h"

namespace fastdist {
namespace {

template <typename T>
int64_t route_rows(const T* logits, int64_t num_experts, int64_t k, float* probs, float* lse, int64_t* topk_idx,
                   float* topk_weight, int64_t t_begin, int64_t t_end) {
  int64_t bad_rows = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const T* row = logits + t * num_experts;
    float* p = probs + t * num_experts;
    // Softmax in double for float64 input, float otherwise: max, then exp and sum, then scale.
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    Acc mx = -std::numeric_limits<Acc>::infinity();
    bool has_nan = false;
    for (int64_t e = 0; e < num_experts; ++e) {
      const Acc v = static_cast<Acc>(row[e]);
      has_nan |= std::isnan(v);
      mx = v > mx ? v : mx;
    }
    // +inf, or every logit -inf, leaves no softmax (inf - inf): NaN probabilities, as a NaN logit does
    bad_rows += has_nan || !std::isfinite(mx);
    Acc sum = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const Acc v = std::exp(static_cast<Acc>(row[e]) - mx);
      p[e] = static_cast<float>(v);
      sum += v;
    }
    const float inv = static_cast<float>(Acc(1) / sum);
    for (int64_t e = 0; e < num_experts; ++e) p[e] *= inv;
    lse[t] = static_cast<float>(mx + std::log(sum));
    // k passes of a strict arg-max over the probabilities not yet taken: the first (lowest) id wins a tie.
    int64_t* idx = topk_idx + t * k;
    float* w = topk_weight + t * k;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      float best_p = -1.0f;
      for (int64_t e = 0; e < num_experts; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
        if (!taken && (best < 0 || p[e] > best_p)) {
          best = e;
          best_p = p[e];
        }
      }
      idx[j] = best;
      w[j] = best_p;
    }
  }
  return bad_rows;
}

template <typename Format>
void permute_rows(const void* x_raw, int64_t d, int64_t k, const int64_t* row_of_slot, const void* weight_raw,
                  void* out_raw, int64_t t_begin, int64_t t_end) {
  using S = typename Format::Storage;
  using Acc = typename Format::Compute;
  const S* x = static_cast<const S*>(x_raw);
  const S* weight = static_cast<const S*>(weight_raw);
  S* out = static_cast<S*>(out_raw);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const S* src = x + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = row_of_slot[t * k + j];
      if (r < 0) continue;
      S* dst = out + r * d;
      if (weight == nullptr) {
        std::copy(src, src + d, dst);
      } else {
        const Acc w = Format::load(weight[t * k + j]);
        for (int64_t c = 0; c < d; ++c) dst[c] = Format::store(w * Format::load(src[c]));
      }
    }
  }
}

template <typename Format>
void unpermute_rows(const void* y_raw, int64_t d, int64_t k, const int64_t* row_of_slot, const void* weight_raw,
                    void* out_raw, int64_t t_begin, int64_t t_end) {
  using S = typename Format::Storage;
  using Acc = typename Format::Compute;
  const S* y = static_cast<const S*>(y_raw);
  const S* weight = static_cast<const S*>(weight_raw);
  S* out = static_cast<S*>(out_raw);
  std::vector<Acc> acc(static_cast<size_t>(std::is_same_v<S, Acc> ? 0 : d));
  for (int64_t t = t_begin; t < t_end; ++t) {
    S* dst = out + t * d;
    if constexpr (std::is_same_v<S, Acc>) {  // float32 / float64: accumulate in place
      std::fill(dst, dst + d, Acc(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_slot[t * k + j];
        if (r < 0) continue;
        const S* src = y + r * d;
        const Acc w = weight == nullptr ? Acc(1) : weight[t * k + j];
        for (int64_t c = 0; c < d; ++c) dst[c] += w * src[c];
      }
    } else {  // 16-bit rows: accumulate in float32, round once
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_slot[t * k + j];
        if (r < 0) continue;
        const S* src = y + r * d;
        const Acc w = weight == nullptr ? Acc(1) : Format::load(weight[t * k + j]);
        for (int64_t c = 0; c < d; ++c) acc[c] += w * Format::load(src[c]);
      }
      for (int64_t c = 0; c < d; ++c) dst[c] = Format::store(acc[c]);
    }
  }
}

}  // namespace

int64_t moe_route_cpu(const void* logits, StorageType type, int64_t num_experts, int64_t k, float* probs,
                      float* lse, int64_t* topk_idx, float* topk_weight, int64_t t_begin, int64_t t_end) {
  if (type == StorageType::kFloat64) {
    return route_rows(static_cast<const double*>(logits), num_experts, k, probs, lse, topk_idx, topk_weight, t_begin,
                      t_end);
  }
  return route_rows(static_cast<const float*>(logits), num_experts, k, probs, lse, topk_idx, topk_weight, t_begin,
                    t_end);
}

int64_t moe_layout_histogram_cpu(const int64_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                                 int64_t t_begin, int64_t t_end, int64_t* hist) {
  (void)tokens;
  int64_t invalid = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk_idx[t * k + j];
      const bool ok = e >= 0 && e < num_experts;
      invalid += !ok;
      if (ok) ++hist[j * num_experts + e];
    }
  }
  return invalid;
}

void moe_layout_scan_cpu(int64_t* hist, int64_t chunks, int64_t k, int64_t num_experts, int64_t num_ranks,
                         int64_t capacity, int64_t* counts, int64_t* offsets, int64_t* dropped_offsets,
                         int64_t* rank_counts) {
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t running = 0;
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t c = 0; c < chunks; ++c) {
        int64_t& h = hist[(c * k + j) * num_experts + e];
        const int64_t n = h;
        h = running;
        running += n;
      }
    }
    counts[e] = running;
  }
  int64_t kept_total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    offsets[e] = kept_total;
    kept_total += capacity < 0 ? counts[e] : std::min(counts[e], capacity);
  }
  offsets[num_experts] = kept_total;
  int64_t dropped_total = kept_total;
  for (int64_t e = 0; e < num_experts; ++e) {
    dropped_offsets[e] = dropped_total;
    dropped_total += capacity < 0 ? 0 : std::max<int64_t>(counts[e] - capacity, 0);
  }
  const int64_t per_rank = num_experts / num_ranks;
  for (int64_t r = 0; r < num_ranks; ++r) rank_counts[r] = offsets[(r + 1) * per_rank] - offsets[r * per_rank];
}

void moe_layout_scatter_cpu(const int64_t* topk_idx, int64_t k, int64_t num_experts, int64_t capacity,
                            const int64_t* offsets, const int64_t* dropped_offsets, int64_t t_begin, int64_t t_end,
                            int64_t* cursor, int64_t* permutation, int64_t* row_of_slot, int64_t* position,
                            uint8_t* keep) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = t * k + j;
      const int64_t e = topk_idx[slot];
      const int64_t pos = cursor[j * num_experts + e]++;
      const bool kept = capacity < 0 || pos < capacity;
      const int64_t row = kept ? offsets[e] + pos : dropped_offsets[e] + (pos - capacity);
      permutation[row] = slot;
      row_of_slot[slot] = kept ? row : -1;
      position[slot] = pos;
      keep[slot] = kept;
    }
  }
}

void moe_permute_cpu(const void* x, StorageType type, int64_t d, int64_t k, const int64_t* row_of_slot,
                     const void* weight, void* out, int64_t t_begin, int64_t t_end) {
  if (d == 0 || k == 0) return;  // nothing to copy, however many tokens an empty tensor claims
  dispatch_storage(type, [&](auto format) {
    permute_rows<decltype(format)>(x, d, k, row_of_slot, weight, out, t_begin, t_end);
  });
}

void moe_unpermute_cpu(const void* y, StorageType type, int64_t d, int64_t k, const int64_t* row_of_slot,
                       const void* weight, void* out, int64_t t_begin, int64_t t_end) {
  if (d == 0) return;  // no values to write, however many tokens an empty tensor claims
  dispatch_storage(type, [&](auto format) {
    unpermute_rows<decltype(format)>(y, d, k, row_of_slot, weight, out, t_begin, t_end);
  });
}

}  // namespace fastdist
