// The CPU MoE kernels against naive references: the layout (run in several chunk splits, which must not change a
// bit), permute/unpermute, and the route's softmax, top-k and tie-breaking.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/moe.h"

namespace {

using I64 = std::vector<int64_t>;

struct Layout {
  I64 counts, offsets, rank_counts, permutation, row_of_slot, position;
  std::vector<uint8_t> keep;
};

// The kernels, with the tokens cut into `chunks` pieces as the glue does.
Layout run_layout(const I64& ids, int64_t tokens, int64_t k, int64_t experts, int64_t ranks, int64_t capacity,
                  int64_t chunks) {
  const int64_t n = tokens * k;
  Layout out{I64(experts), I64(experts + 1), I64(ranks), I64(n), I64(n), I64(n), std::vector<uint8_t>(n)};
  I64 hist(chunks * k * experts, 0), dropped(experts);
  auto begin = [&](int64_t c) { return c * tokens / chunks; };
  for (int64_t c = 0; c < chunks; ++c)
    fastdist::moe_layout_histogram_cpu(ids.data(), tokens, k, experts, begin(c), begin(c + 1), &hist[c * k * experts]);
  fastdist::moe_layout_scan_cpu(hist.data(), chunks, k, experts, ranks, capacity, out.counts.data(), out.offsets.data(),
                                dropped.data(), out.rank_counts.data());
  for (int64_t c = chunks - 1; c >= 0; --c)  // any order: chunks are independent after the scan
    fastdist::moe_layout_scatter_cpu(ids.data(), k, experts, capacity, out.offsets.data(), dropped.data(), begin(c),
                                     begin(c + 1), &hist[c * k * experts], out.permutation.data(),
                                     out.row_of_slot.data(), out.position.data(), out.keep.data());
  return out;
}

// std::stable_sort of the slots in priority order by expert.
Layout reference_layout(const I64& ids, int64_t tokens, int64_t k, int64_t experts, int64_t ranks, int64_t capacity) {
  const int64_t n = tokens * k;
  I64 order;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < tokens; ++t) order.push_back(t * k + j);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  Layout out{I64(experts, 0), I64(experts + 1, 0), I64(ranks, 0), I64(), I64(n), I64(n), std::vector<uint8_t>(n)};
  for (int64_t s : order) ++out.counts[ids[s]];
  I64 start(experts, 0);
  for (int64_t e = 1; e < experts; ++e) start[e] = start[e - 1] + out.counts[e - 1];
  I64 kept, dropped;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = order[i], e = ids[s], pos = i - start[e];
    out.position[s] = pos;
    const bool keep = capacity < 0 || pos < capacity;
    out.keep[s] = keep;
    (keep ? kept : dropped).push_back(s);
  }
  for (int64_t e = 0; e < experts; ++e)
    out.offsets[e + 1] = out.offsets[e] + (capacity < 0 ? out.counts[e] : std::min(out.counts[e], capacity));
  out.permutation = kept;
  out.permutation.insert(out.permutation.end(), dropped.begin(), dropped.end());
  for (int64_t i = 0; i < n; ++i) out.row_of_slot[out.permutation[i]] = i < out.offsets[experts] ? i : -1;
  const int64_t per = experts / ranks;
  for (int64_t r = 0; r < ranks; ++r) out.rank_counts[r] = out.offsets[(r + 1) * per] - out.offsets[r * per];
  return out;
}

bool same(const Layout& a, const Layout& b) {
  return a.counts == b.counts && a.offsets == b.offsets && a.rank_counts == b.rank_counts &&
         a.permutation == b.permutation && a.row_of_slot == b.row_of_slot && a.position == b.position &&
         a.keep == b.keep;
}

}  // namespace

TEST(Moe, moe_layout_cpu_is_the_stable_sort_for_every_chunking) {
  std::mt19937 rng(7);
  const int64_t shapes[][4] = {{0, 2, 4, 2}, {1, 1, 1, 1}, {13, 2, 4, 2}, {257, 3, 16, 4}, {1000, 2, 8, 8}};
  for (const auto& s : shapes) {
    const int64_t tokens = s[0], k = s[1], experts = s[2], ranks = s[3];
    I64 ids(tokens * k);
    std::uniform_int_distribution<int64_t> pick(0, experts - 1);
    for (auto& v : ids) v = pick(rng) % (1 + pick(rng));  // skewed toward low ids
    for (int64_t capacity : {-1, 0, 1, 7, 100000}) {
      const Layout want = reference_layout(ids, tokens, k, experts, ranks, capacity);
      for (int64_t chunks : {1, 2, 3, 8}) {
        EXPECT_TRUE(same(run_layout(ids, tokens, k, experts, ranks, capacity, chunks), want))
            << "tokens=" << tokens << " k=" << k << " E=" << experts << " C=" << capacity << " chunks=" << chunks;
      }
    }
  }
}

TEST(Moe, moe_layout_histogram_counts_ids_out_of_range) {
  const I64 ids = {0, 3, -1, 4, 2, 1};
  I64 hist(2 * 4, 0);
  const int64_t invalid = fastdist::moe_layout_histogram_cpu(ids.data(), 3, 2, 4, 0, 3, hist.data());
  EXPECT_TRUE(invalid == 2) << "invalid=" << invalid;
  EXPECT_EQ(hist, (I64{1, 0, 1, 0, 0, 1, 0, 1}));
}

TEST(Moe, moe_permute_and_unpermute_cpu_match_the_definition) {
  const int64_t tokens = 5, k = 2, d = 3;
  const I64 row_of_slot = {3, -1, 0, 4, 1, -1, 2, 5, -1, 6};
  std::vector<float> x(tokens * d), w(tokens * k), y(7 * d);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.5f * static_cast<float>(i) - 3.0f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i + 1);
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(i % 5) - 1.5f;
  std::vector<float> permuted(7 * d, 0.0f), combined(tokens * d);
  fastdist::moe_permute_cpu(x.data(), fastdist::StorageType::kFloat32, d, k, row_of_slot.data(), w.data(),
                            permuted.data(), 0, 2);
  fastdist::moe_permute_cpu(x.data(), fastdist::StorageType::kFloat32, d, k, row_of_slot.data(), w.data(),
                            permuted.data(), 2, tokens);
  fastdist::moe_unpermute_cpu(y.data(), fastdist::StorageType::kFloat32, d, k, row_of_slot.data(), w.data(),
                              combined.data(), 0, tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < d; ++c) {
      float want = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_slot[t * k + j];
        if (r < 0) continue;
        want += w[t * k + j] * y[r * d + c];
        EXPECT_TRUE(permuted[r * d + c] == w[t * k + j] * x[t * d + c]) << "t=" << t << " j=" << j;
      }
      EXPECT_TRUE(combined[t * d + c] == want) << "t=" << t << " c=" << c;
    }
  }
}

TEST(Moe, moe_route_cpu_softmax_topk_and_ties) {
  const int64_t experts = 4, k = 2;
  const std::vector<float> logits = {0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 3.0f, 2.0f, 3.0f};
  std::vector<float> probs(8), lse(2), w(4);
  I64 idx(4);
  const int64_t nan_rows = fastdist::moe_route_cpu(logits.data(), fastdist::StorageType::kFloat32, experts, k,
                                                   probs.data(), lse.data(), idx.data(), w.data(), 0, 2);
  EXPECT_TRUE(nan_rows == 0);
  EXPECT_EQ(idx, (I64{0, 1, 1, 3}));
  EXPECT_TRUE(std::fabs(probs[0] - 0.25f) < 1e-7f) << probs[0];
  const double z = std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_TRUE(std::fabs(lse[1] - std::log(z)) < 1e-5) << lse[1];
  EXPECT_TRUE(std::fabs(w[2] - std::exp(3.0) / z) < 1e-6) << w[2];
  const std::vector<float> bad = {0.0f, NAN, 1.0f, 2.0f};
  EXPECT_TRUE(fastdist::moe_route_cpu(bad.data(), fastdist::StorageType::kFloat32, experts, 1, probs.data(), lse.data(),
                                      idx.data(), w.data(), 0, 1) == 1)
      << "NaN row not reported";
}

TEST(Moe, moe_route_cpu_counts_rows_without_a_softmax) {
  // +inf and an all -inf row have no softmax (inf - inf), like a NaN logit; a -inf among finite logits is fine.
  const float inf = INFINITY;
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -inf, -inf, -inf,  //
                                     1.0f, inf,  0.0f, -inf, 3.0f, 1.0f};
  std::vector<float> probs(12), lse(4), w(4);
  I64 idx(4);
  EXPECT_EQ(fastdist::moe_route_cpu(logits.data(), fastdist::StorageType::kFloat32, 3, 1, probs.data(), lse.data(),
                                    idx.data(), w.data(), 0, 4),
            2);
  EXPECT_EQ(idx[0], 2);
  EXPECT_EQ(idx[3], 1);
  EXPECT_EQ(probs[9], 0.0f) << "a -inf logit has probability 0";
}

TEST(Moe, moe_unpermute_cpu_rounds_a_bfloat16_sum_once) {
  // Three slots per token summed in float32 and rounded to bfloat16 at the end, not after every add.
  const int64_t tokens = 2, k = 3, d = 4;
  const I64 row_of_slot = {0, 1, 2, 3, -1, 4};
  std::vector<uint16_t> y(5 * d), out(tokens * d);
  std::vector<float> y_float(5 * d);
  for (int64_t i = 0; i < 5 * d; ++i) {
    y[i] = fastdist::float_to_bfloat16(1.0f + static_cast<float>(i) / 128.0f);  // exact in bfloat16
    y_float[i] = fastdist::bfloat16_to_float(y[i]);
  }
  fastdist::moe_unpermute_cpu(y.data(), fastdist::StorageType::kBFloat16, d, k, row_of_slot.data(), nullptr, out.data(),
                              0, tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < d; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_slot[t * k + j];
        if (r >= 0) sum += y_float[r * d + c];
      }
      EXPECT_EQ(out[t * d + c], fastdist::float_to_bfloat16(sum)) << "t " << t << " c " << c;
    }
  }
}
