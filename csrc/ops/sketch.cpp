// torch.ops.fastdist count-sketch ops: schemas and CPU kernels. See csrc/kernels/sketch.h for the hash family and
// the layouts.
//
// Determinism: count_sketch runs in parallel over table positions: each thread owns a range of the buckets and adds,
// in increasing index, every value that lands there, so each bucket is the same float32 sum, in the same order,
// whatever the thread count: results are bit-identical from 1 thread to many and from run to run.
// Units of m > 1 values (row granularity) split the rows * cols buckets evenly, a range crossing rows: each thread
// reads every unit and adds the part of its windows that falls in its range, so that the threads share the work
// evenly where splitting whole rows would not (2 threads on 3 rows: one does 2).
// Units of one value (element granularity) split whole rows: with per-value hashing an owner of part of a row must
// hash every value, and steering the other owners' values away costs about as much as adding them. So at most
// `rows` threads work on such a sketch, unevenly when the thread count does not divide the rows.
// Decode, nonzero_bitmap and sketch_hash write disjoint outputs per thread and involve no sums.
#include <ATen/Parallel.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <deque>
#include <mutex>
#include <vector>

#include "ops/parallel.h"
#include "ops/sketch.h"

namespace fastdist::sketch {
namespace {

// count_sketch allocates its table (rows x cols float32, a few MiB) on every call, and malloc hands out a buffer
// that size as freshly mapped pages each time, whose first-touch faults cost a large part of a sparse gradient's
// sketch (bench/README.md). So freed tables go back to this pool, most recent last, and a call
// takes one of its size from there: at most kPooledBytes in all (the oldest leave first). The tensors are
// ordinary CPU tensors but for not being resizable.
class TablePool {
 public:
  static constexpr size_t kPooledBytes = size_t{64} << 20;

  static TablePool& instance() {
    static TablePool* pool = new TablePool();  // never destroyed: a table may be freed during static destruction
    return *pool;
  }

  at::Tensor table(int64_t rows, int64_t cols, const at::TensorOptions& options) {
    const size_t nbytes = static_cast<size_t>(rows * cols) * sizeof(float);
    void* data = nbytes <= kPooledBytes ? take(nbytes) : nullptr;
    if (data == nullptr) data = c10::alloc_cpu(nbytes);
    return at::from_blob(data, {rows, cols}, [nbytes](void* p) { TablePool::instance().give(p, nbytes); },
                         options.dtype(at::kFloat));
  }

 private:
  void* take(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->first != nbytes) continue;
      void* data = it->second;
      free_.erase(std::next(it).base());
      pooled_ -= nbytes;
      return data;
    }
    return nullptr;
  }

  void give(void* data, size_t nbytes) {
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (nbytes > kPooledBytes) {
        evicted.push_back(data);
      } else {
        free_.emplace_back(nbytes, data);
        pooled_ += nbytes;
      }
      while (pooled_ > kPooledBytes) {
        evicted.push_back(free_.front().second);
        pooled_ -= free_.front().first;
        free_.pop_front();
      }
    }
    for (void* p : evicted) c10::free_cpu(p);
  }

  std::mutex mutex_;
  std::deque<std::pair<size_t, void*>> free_;  // (bytes, buffer), most recently freed last
  size_t pooled_ = 0;
};

// Runs sketch(begin, end) in parallel over ranges of the rows x cols table positions (see the top of this file):
// any ranges for units of m > 1 values, no range under a quarter row (every thread hashes every unit); whole rows
// for m == 1. Below a few chunks of work (values to read plus table to clear per row), one thread does everything.
template <typename SketchFn>
void for_table_ranges(int64_t rows, int64_t cols, int64_t m, int64_t value_bytes, SketchFn sketch) {
  const int64_t work_bytes = (value_bytes + cols * static_cast<int64_t>(sizeof(float))) * rows;
  const bool one_thread = work_bytes < 2 * kMinBytesPerThread;
  if (m > 1) {
    at::parallel_for(0, rows * cols, one_thread ? rows * cols : std::max<int64_t>(cols / 4, 1), sketch);
    return;
  }
  at::parallel_for(0, rows, one_thread ? rows : 1,
                   [&](int64_t begin, int64_t end) { sketch(begin * cols, end * cols); });
}

at::Tensor nonzero_bitmap_cpu_op(const at::Tensor& x, c10::string_view granularity) {
  const UnitShape shape = check_nonzero_bitmap(x, std::string(granularity));
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty({packed_bytes(shape.n)}, src.options().dtype(at::kByte));
  const void* in = src.const_data_ptr();
  const int elem_bytes = static_cast<int>(src.element_size());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), grain_for({8, shape.m, elem_bytes}), [&](int64_t begin, int64_t end) {
    fastdist::nonzero_bitmap_cpu(in, elem_bytes, shape.n, shape.m, dst, begin, end);
  });
  return out;
}

at::Tensor count_sketch_cpu_op(const at::Tensor& x, int64_t rows, int64_t cols, int64_t seed,
                               const std::optional<at::Tensor>& support, c10::string_view granularity) {
  const UnitShape shape = check_count_sketch(x, rows, cols, seed, support, std::string(granularity));
  const at::Tensor src = x.contiguous();
  const at::Tensor sup = support.has_value() ? support->contiguous() : at::Tensor();
  at::Tensor table = TablePool::instance().table(rows, cols, src.options());
  const SketchHash hash = hash_for(seed, rows, cols);
  const void* in = src.const_data_ptr();
  const uint8_t* sup_bytes = sup.defined() ? support_bytes(sup) : nullptr;
  float* dst = table.data_ptr<float>();
  const StorageType type = storage_type_of(src, "x");
  for_table_ranges(rows, cols, shape.m, shape.n * shape.m * src.element_size(), [&](int64_t begin, int64_t end) {
    fastdist::count_sketch_cpu(in, type, shape.n, shape.m, sup_bytes, hash, dst, begin, end);
  });
  return table;
}

at::Tensor count_sketch_decode_cpu_op(const at::Tensor& table, const at::Tensor& support, int64_t n, int64_t m,
                                      int64_t seed) {
  const UnitShape shape = check_count_sketch_decode(table, support, n, m, seed);
  const at::Tensor tab = table.contiguous();
  const at::Tensor sup = support.contiguous();
  at::Tensor out = at::empty({shape.n, shape.m}, tab.options());
  const SketchHash hash = hash_for(seed, tab.size(0), tab.size(1));
  const float* table_values = tab.const_data_ptr<float>();
  const uint8_t* sup_bytes = support_bytes(sup);
  float* dst = out.data_ptr<float>();
  // Work items are units; each writes its m outputs (reading rows table values each where supported).
  const int64_t grain = grain_for({shape.m, sizeof(float)});
  at::parallel_for(0, shape.n, grain, [&](int64_t begin, int64_t end) {
    fastdist::count_sketch_decode_cpu(table_values, sup_bytes, shape.n, shape.m, hash, dst, begin, end);
  });
  return out;
}

at::Tensor count_sketch_units_cpu_op(const at::Tensor& values, const at::Tensor& units, int64_t rows, int64_t cols,
                                     int64_t seed) {
  const UnitShape shape = check_count_sketch_units(values, units, rows, cols, seed);
  const at::Tensor src = values.contiguous();
  const at::Tensor idx = units.contiguous();
  at::Tensor table = TablePool::instance().table(rows, cols, src.options());
  const SketchHash hash = hash_for(seed, rows, cols);
  const void* in = src.const_data_ptr();
  const StorageType type = storage_type_of(src, "values");
  const int64_t* unit_ids = idx.const_data_ptr<int64_t>();
  float* dst = table.data_ptr<float>();
  for_table_ranges(rows, cols, shape.m, shape.n * shape.m * src.element_size(), [&](int64_t begin, int64_t end) {
    fastdist::count_sketch_units_cpu(in, type, unit_ids, shape.n, shape.m, hash, dst, begin, end);
  });
  return table;
}

at::Tensor count_sketch_decode_units_cpu_op(const at::Tensor& table, const at::Tensor& units, int64_t m,
                                            int64_t seed) {
  const int64_t k = check_count_sketch_decode_units(table, units, m, seed);
  const at::Tensor tab = table.contiguous();
  const at::Tensor idx = units.contiguous();
  at::Tensor out = at::empty({k, m}, tab.options());
  const SketchHash hash = hash_for(seed, tab.size(0), tab.size(1));
  const float* table_values = tab.const_data_ptr<float>();
  const int64_t* unit_ids = idx.const_data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, k, grain_for({m, sizeof(float)}), [&](int64_t begin, int64_t end) {
    fastdist::count_sketch_decode_units_cpu(table_values, unit_ids, m, hash, dst, begin, end);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> sketch_hash_cpu_op(const at::Tensor& idx, int64_t rows, int64_t cols,
                                                      int64_t seed, int64_t m) {
  check_sketch_hash(idx, rows, cols, seed, m);
  const at::Tensor src = idx.contiguous();
  const int64_t len = src.numel();
  at::Tensor bucket = at::empty({rows, len}, src.options());
  at::Tensor sign = at::empty({rows, len}, src.options().dtype(at::kChar));
  const SketchHash hash = hash_for(seed, rows, cols);
  const int64_t* in = src.const_data_ptr<int64_t>();
  int64_t* bucket_out = bucket.data_ptr<int64_t>();
  int8_t* sign_out = sign.data_ptr<int8_t>();
  at::parallel_for(0, len, grain_for({rows, 64}), [&](int64_t begin, int64_t end) {  // ~64 bytes' worth per hash
    fastdist::sketch_hash_cpu(in, len, m, hash, bucket_out, sign_out, begin, end);
  });
  return {bucket, sign};
}

// Two passes over fixed chunks of the packed bytes: count each chunk's units per support and in the union, then, from
// the prefix sums, write each chunk's units and sums. Every sum's adds and their order depend only on the data, so the
// result is the same for any number of threads.
std::tuple<at::Tensor, at::Tensor> union_sum_rows_cpu_op(const at::Tensor& bitmaps, const at::Tensor& rows, int64_t n,
                                                         int64_t divisor) {
  const UnionRowsShape shape = check_union_sum_rows(bitmaps, rows, n, divisor);
  const std::pair<at::Tensor, int64_t> bits_and_stride = with_contiguous_blocks(bitmaps);
  const std::pair<at::Tensor, int64_t> rows_and_stride = with_contiguous_blocks(rows);
  const at::Tensor& bits = bits_and_stride.first;
  const at::Tensor& src = rows_and_stride.first;
  const int64_t bitmap_stride = bits_and_stride.second, rank_stride = rows_and_stride.second;
  const int64_t p = shape.p, m = shape.m, bytes = packed_bytes(n);
  constexpr int64_t kChunkBytes = 1024;
  const int64_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  std::vector<int64_t> first((chunks + 1) * (p + 1), 0);  // chunk c's counts, then (below) what precedes it
  const uint8_t* bit_bytes = support_bytes(bits);
  // A chunk reads its bytes of every support, then (second pass) writes about 8 units per byte.
  at::parallel_for(0, chunks, grain_for({kChunkBytes, std::max<int64_t>(p, 1)}), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      fastdist::union_rows_count_cpu(bit_bytes, p, bitmap_stride, n, first.data() + (c + 1) * (p + 1),
                                     c * kChunkBytes, std::min(bytes, (c + 1) * kChunkBytes));
    }
  });
  for (int64_t c = 1; c <= chunks; ++c) {  // running totals: row c is what chunks before c hold
    for (int64_t r = 0; r <= p; ++r) first[c * (p + 1) + r] += first[(c - 1) * (p + 1) + r];
  }
  check_union_rows_fit(first.data() + chunks * (p + 1), p, shape.k);
  const int64_t total = first[chunks * (p + 1) + p];
  at::Tensor units = at::empty({total}, bits.options().dtype(at::kLong));
  at::Tensor sums = at::empty({total, m}, src.options());
  const void* in = src.const_data_ptr();
  const StorageType type = storage_type_of(src, "rows");
  int64_t* unit_out = units.data_ptr<int64_t>();
  void* sum_out = sums.data_ptr();
  const int64_t grain = grain_for({kChunkBytes, 8, std::max<int64_t>(m, 1), src.element_size()});
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      fastdist::union_sum_rows_cpu(bit_bytes, p, bitmap_stride, n, in, type, rank_stride, m, divisor,
                                   first.data() + c * (p + 1), unit_out, sum_out, c * kChunkBytes,
                                   std::min(bytes, (c + 1) * kChunkBytes));
    }
  });
  return {units, sums};
}

}  // namespace
}  // namespace fastdist::sketch

TORCH_LIBRARY_FRAGMENT(fastdist, m) {
  m.def("nonzero_bitmap(Tensor x, str granularity) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("count_sketch(Tensor x, int rows, int cols, int seed, Tensor? support, str granularity) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("count_sketch_decode(Tensor table, Tensor support, int n, int m, int seed) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("count_sketch_units(Tensor values, Tensor units, int rows, int cols, int seed) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("count_sketch_decode_units(Tensor table, Tensor units, int m, int seed) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("sketch_hash(Tensor idx, int rows, int cols, int seed, int m=1) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("union_sum_rows(Tensor bitmaps, Tensor rows, int n, int divisor=1) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(fastdist, CPU, m) {
  m.impl("nonzero_bitmap", &fastdist::sketch::nonzero_bitmap_cpu_op);
  m.impl("count_sketch", &fastdist::sketch::count_sketch_cpu_op);
  m.impl("count_sketch_decode", &fastdist::sketch::count_sketch_decode_cpu_op);
  m.impl("count_sketch_units", &fastdist::sketch::count_sketch_units_cpu_op);
  m.impl("count_sketch_decode_units", &fastdist::sketch::count_sketch_decode_units_cpu_op);
  m.impl("sketch_hash", &fastdist::sketch::sketch_hash_cpu_op);
  m.impl("union_sum_rows", &fastdist::sketch::union_sum_rows_cpu_op);
}
