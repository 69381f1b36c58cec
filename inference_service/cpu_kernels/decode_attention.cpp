// Paged decode attention for float32 on the CPU: each sequence's one new query attends its whole context.
//
// One call per layer writes the step's keys and values into the cache and attends every (row, kv head) pair:
// the pair's G query heads share each key and value row as it is read. A row is one query token with its own
// block table and context length (a prompt's token t: its first t + 1 positions); with AVX-512, up to kTileRows
// consecutive rows of one sequence attend as a tile that reads each key and value once. The cache holds float32
// or float16 (rounded to nearest even when written, as torch's cast, widened when read). Scores, softmax and
// the weighted sum are float32 (the max subtracted before exp, as softmax does), so results equal the
// torch path's up to summation order (and the AVX-512 path's exp, within 2 ulp of libm's).
//
// Paths: AVX-512 for head_dim 16-256 in steps the kernel has (decode_attention_avx512.cpp), when the
// quantized matmul uses AVX-512 too (`limit_instruction_set` caps both); the generic one otherwise.

#include "ops.h"

#include "attention_pair.h"

#include "worker_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Most rows of one sequence a tile of the AVX-512 path attends together (TileArgs).
constexpr int64_t kTileRows = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Row `slot` of a cache (its kv head's head_dim elements) as float32: the row itself, or widened into `buffer`.
template <typename T>
const float* cache_row(const T* cache, int64_t slot, int64_t row_stride, int64_t head_dim, float* buffer) {
  const T* row = cache + slot * row_stride;
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < head_dim; ++i) buffer[i] = c10::detail::fp16_ieee_to_fp32_value(row[i]);
    return buffer;
  }
}

// The generic path: any head_dim, the compiler's vectors for the baseline ISA, libm's exp.
template <typename T>
void attend_pair(const attention::PairArgs& a) {
  const int64_t len = a.len, head_dim = a.head_dim;
  float* scores = a.scores;
  std::vector<float> row(head_dim);
  for (int64_t t = 0; t < len; ++t) {
    const float* key = cache_row(static_cast<const T*>(a.keys), a.slot_of(t), a.row_stride, head_dim, row.data());
    for (int64_t g = 0; g < a.group; ++g) scores[g * len + t] = dot(a.queries + g * a.query_stride, key, head_dim) * a.scale;
  }
  for (int64_t g = 0; g < a.group; ++g) {
    float* sc = scores + g * len;
    const float max_score = *std::max_element(sc, sc + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (sc[t] = std::exp(sc[t] - max_score));
    const float inv_total = 1.f / total;
    for (int64_t t = 0; t < len; ++t) sc[t] *= inv_total;
  }
  std::fill_n(a.out, a.group * head_dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* value = cache_row(static_cast<const T*>(a.values), a.slot_of(t), a.row_stride, head_dim, row.data());
    for (int64_t g = 0; g < a.group; ++g) axpy(scores[g * len + t], value, a.out + g * head_dim, head_dim);
  }
}

// n floats into a cache row: as they are, or rounded to float16 (nearest even, as torch's cast).
void store_row(const float* src, int64_t n, bool is_half, char* dst) {
  if (!is_half) {
    std::copy_n(src, n, reinterpret_cast<float*>(dst));
    return;
  }
  uint16_t* half = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) half[i] = c10::detail::fp16_ieee_from_fp32_value(src[i]);
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     torch::Tensor& k_cache, torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     const torch::Tensor& slot_mapping, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1, "q must be float32 [S, Hq, D]");
  const bool is_half = k_cache.dtype() == torch::kFloat16;
  TORCH_CHECK((is_half || k_cache.dtype() == torch::kFloat32) && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && v_cache.dtype() == k_cache.dtype(),
              "caches must be contiguous float32 or float16 [num_blocks, block_size, Hkv, D], both alike");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(k.dim() == 3 && k.size(0) == num_seqs && k.size(1) == num_kv_heads && k.size(2) == head_dim &&
                  k.stride(2) == 1 && v.sizes() == k.sizes() && v.stride(2) == 1,
              "k and v must be [S, Hkv, D] with D contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == num_seqs, "block_tables must be int32 [S, max_blocks], rows contiguous");
  TORCH_CHECK(seq_lens.dtype() == torch::kInt32 && seq_lens.numel() == num_seqs && seq_lens.is_contiguous(),
              "seq_lens must be int32 [S]");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == num_seqs && slot_mapping.is_contiguous(),
              "slot_mapping must be int64 [S]");
  const int64_t num_slots = k_cache.size(0) * block_size, row = num_kv_heads * head_dim;
  const int64_t element = k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {  // write this step's keys and values first: the query sees its own
    if (slots[s] < 0) continue;
    TORCH_CHECK(slots[s] < num_slots, "slot ", slots[s], " out of range");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t at = (slots[s] * row + h * head_dim) * element;
      store_row(k.data_ptr<float>() + s * k.stride(0) + h * k.stride(1), head_dim, is_half, kc + at);
      store_row(v.data_ptr<float>() + s * v.stride(0) + h * v.stride(1), head_dim, is_half, vc + at);
    }
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), table_stride = block_tables.stride(0);
  const int64_t group = num_heads / num_kv_heads;
  for (int64_t s = 0; s < num_seqs; ++s) {  // checked here: the pool's tasks must not throw
    TORCH_CHECK(lens[s] > 0 && (lens[s] + block_size - 1) / block_size <= max_blocks, "bad seq_len ", lens[s]);
  }
  torch::Tensor out = torch::empty({num_seqs, num_heads, head_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool avx512 = uses_avx512();
  // Tiles of up to kTileRows consecutive rows of one sequence (a prompt's chunk: the same block table, contexts
  // one position apart): the AVX-512 path reads each key and value once for the whole tile, not once a row.
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first row, rows)
  auto same_table = [&](int64_t a, int64_t b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    return std::equal(tables + a * table_stride, tables + a * table_stride + used, tables + b * table_stride);
  };
  for (int64_t s = 0; s < num_seqs;) {
    int64_t n = 1;
    while (avx512 && s + n < num_seqs && n < kTileRows && lens[s + n] == lens[s + n - 1] + 1 && same_table(s, s + n)) {
      ++n;
    }
    tiles.emplace_back(s, n);
    s += n;
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  WorkerPool::instance().run(0, num_tiles * num_kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores, acc;
    for (int64_t item = first; item < last; ++item) {
      // Tiles in the order first, last, second, second to last...: a prompt's later tiles read longer contexts,
      // and the pool hands each thread a contiguous range of items.
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const auto [s0, rows] = tiles[t % 2 == 0 ? t / 2 : num_tiles - 1 - t / 2];
      auto pair_args = [&](int64_t s, int64_t len) {
        return attention::PairArgs{qp + s * q.stride(0) + h * group * q.stride(1), q.stride(1), group,
                                   kc + h * head_dim * element, vc + h * head_dim * element, is_half, row,
                                   tables + s * table_stride, block_size, len, head_dim, (float)scale,
                                   nullptr, op + (s * num_heads + h * group) * head_dim};
      };
      if (rows > 1) {
        const int64_t len = lens[s0 + rows - 1];
        scores.resize(rows * group * len);
        acc.resize(rows * group * head_dim);
        attention::TileArgs tile{pair_args(s0, len), rows, q.stride(0), num_heads * head_dim, acc.data()};
        tile.pair.scores = scores.data();
        if (attention::attend_tile_avx512(tile)) continue;
      }
      for (int64_t s = s0; s < s0 + rows; ++s) {
        scores.resize(group * lens[s]);
        attention::PairArgs args = pair_args(s, lens[s]);
        args.scores = scores.data();
        if (avx512 && attention::attend_pair_avx512(args)) continue;
        if (is_half) {
          attend_pair<uint16_t>(args);
        } else {
          attend_pair<float>(args);
        }
      }
    }
  });
  return out;
}
