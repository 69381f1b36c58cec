// The AVX-512 path of paged decode attention (the layout and the other path: decode_attention.cpp).
//
// One (sequence, kv head) pair at a time: its G query heads score 16 keys at a time (each key's products
// summed lane-wise, then the 16 keys' sums in one transposing reduction rather than 16 horizontal ones), the
// softmax runs 16 scores to a register with a vector exp, and the weighted sum reads each value row once for up
// to four heads, whose output rows stay in registers over the whole context. A tile of a prompt's consecutive
// rows on one kv head (TileArgs, each row causal) scores its rows x G queries against each key block as read,
// and weighs each 16-row block of values from L1 for all of them. The generic path compiles for the baseline
// ISA (128-bit, scalar exp), which left batch-16 decode spending as long in attention as in the projections.

#include "attention_pair.h"

#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#define AVX512_FN __attribute__((target("avx512f,avx2,fma")))

namespace attention {
namespace {

// e^x for x <= 0 (scores minus their max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial in r, scaled by 2^n (underflowing to 0 as expf does). Within 2 ulp of the correctly rounded
// result, as libm's and Sleef's (torch's softmax) are within 1.
AVX512_FN inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in float32 after scaling
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// scores[0, len) -> softmax(scores) in place.
AVX512_FN void softmax_(float* scores, int64_t len) {
  __m512 vmax = _mm512_set1_ps(-__builtin_inff());
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
  vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, scores + t));
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 total = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t), max_score));
    _mm512_storeu_ps(scores + t, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + t), max_score));
  _mm512_mask_storeu_ps(scores + t, tail, e);
  total = _mm512_mask_add_ps(total, tail, total, e);
  const __m512 inv_total = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (t = 0; t < len; t += 16) {
    const __mmask16 m = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : tail;
    _mm512_mask_storeu_ps(scores + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + t), inv_total));
  }
}

// 16 elements of a cache row as float32 (float16 widened exactly).
AVX512_FN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512_FN inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r lane i = the sum of v[kTransposedOrder[i]]'s lanes: four add rounds, each of two shuffles of eight vector
// pairs, instead of sixteen horizontal reductions. (The shuffles leave the sums in the order given here: an
// involution, so the caller writes token i's products to v[kTransposedOrder[i]].)
constexpr int kTransposedOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

AVX512_FN inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes 0+2 and 1+3: v[i] in the low half, v[i + 8] in the high
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // lanes 0-3 hold v[i], v[i + 8], v[i + 4], v[i + 12], four floats each
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[i], t[i + 4], 0x88), _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // within a lane: u[i]'s sum in floats 0 + 2, u[i + 2]'s in 1 + 3
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[i], u[i + 2]), _mm512_unpackhi_ps(u[i], u[i + 2]));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
}

// Positions [t0, t0 + n) of a cache (`cache`: a.keys or a.values) as float32 rows: the cache's own, or float16
// widened once into `widened` (in L1).
template <int NV, typename T>
AVX512_FN inline void cache_rows(const PairArgs& a, const void* cache, int64_t t0, int n, float (*widened)[16 * NV],
                                 const float* rows[16]) {
  for (int i = 0; i < n; ++i) {
    const T* row = static_cast<const T*>(cache) + a.slot_of(t0 + i) * a.row_stride;
    if constexpr (std::is_same_v<T, float>) {
      rows[i] = row;
    } else {
      for (int c = 0; c < NV; ++c) _mm512_store_ps(widened[i] + 16 * c, load16(row + 16 * c));
      rows[i] = widened[i];
    }
  }
}

// scores[g * len + t] = scale * q_g . k_t for the queries q_g = queries[g], g < num_queries, 16 keys at a time:
// each key's products with a query summed lane-wise, then the 16 keys' lanes summed together. float16 keys are
// widened once into `widened` (in L1), not once per query.
template <int NV, typename T>
AVX512_FN void score_keys(const PairArgs& a, const float* const* queries, int64_t num_queries) {
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16][16 * NV];
  for (int64_t t0 = 0; t0 < a.len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, a.len - t0));
    const float* keys[16];
    cache_rows<NV, T>(a, a.keys, t0, n, widened, keys);
    const __mmask16 mask = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
    for (int64_t g = 0; g < num_queries; ++g) {
      const float* q = queries[g];
      __m512 qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
      __m512 products[16];
      for (int i = 0; i < 16; ++i) {
        __m512 acc = _mm512_setzero_ps();
        if (i < n) {
          for (int c = 0; c < NV; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys[i] + 16 * c), acc);
        }
        products[kTransposedOrder[i]] = acc;
      }
      const __m512 s = _mm512_mul_ps(sum_lanes16(products), _mm512_set1_ps(a.scale));
      _mm512_mask_storeu_ps(a.scores + g * a.len + t0, mask, s);
    }
  }
}

// out[g] = sum over t of p_g[t] v_t for GN heads from `first`, each value row read once for all of them.
template <int NV, int GN, typename T>
AVX512_FN void weigh_values(const PairArgs& a, int64_t first) {
  __m512 acc[GN][NV];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  const float* p = a.scores + first * a.len;
  for (int64_t t = 0; t < a.len; ++t) {
    const T* value = static_cast<const T*>(a.values) + a.slot_of(t) * a.row_stride;
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load16(value + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 weight = _mm512_set1_ps(p[g * a.len + t]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(weight, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(a.out + (first + g) * a.head_dim + 16 * c, acc[g][c]);
  }
}

// NV = head_dim / 16 vectors a row. The values' pass takes as many heads at once as keep their accumulators
// in registers (at most 16 of the 32), in chunks of up to kHeads.
template <int NV, typename T>
AVX512_FN void attend(const PairArgs& a) {
  const float* queries[kMaxGroup];
  for (int64_t g = 0; g < a.group; ++g) queries[g] = a.queries + g * a.query_stride;
  score_keys<NV, T>(a, queries, a.group);
  for (int64_t g = 0; g < a.group; ++g) softmax_(a.scores + g * a.len, a.len);
  constexpr int kHeads = NV >= 16 ? 1 : std::min(4, 16 / NV);
  for (int64_t g = 0; g < a.group; g += kHeads) {
    switch (std::min<int64_t>(kHeads, a.group - g)) {
      case 4: if constexpr (kHeads >= 4) weigh_values<NV, 4, T>(a, g); break;
      case 3: if constexpr (kHeads >= 3) weigh_values<NV, 3, T>(a, g); break;
      case 2: if constexpr (kHeads >= 2) weigh_values<NV, 2, T>(a, g); break;
      default: weigh_values<NV, 1, T>(a, g);
    }
  }
}

// out[q] += sum over t in [t0, t0 + 16) of p_q[t] v_t for the GN queries from `first` (acc rows, in memory
// between blocks), the block's 16 value rows read from L1 for every query.
template <int NV, int GN>
AVX512_FN void weigh_value_block(const float* const values[16], int n, const float* p, int64_t len, int64_t first,
                                 float* acc, int64_t head_dim) {
  __m512 sums[GN][NV];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NV; ++c) sums[g][c] = _mm512_loadu_ps(acc + (first + g) * head_dim + 16 * c);
  }
  for (int i = 0; i < n; ++i) {
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(values[i] + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 weight = _mm512_set1_ps(p[(first + g) * len + i]);
      for (int c = 0; c < NV; ++c) sums[g][c] = _mm512_fmadd_ps(weight, v[c], sums[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (first + g) * head_dim + 16 * c, sums[g][c]);
  }
}

// A tile of consecutive rows of one sequence (TileArgs): the scores of every query over the last row's context,
// each row's softmax over its own (the later positions' weights zero), then the values 16 rows at a time.
template <int NV, typename T>
AVX512_FN void attend_tile(const TileArgs& tile) {
  const PairArgs& a = tile.pair;
  const int64_t num_queries = tile.rows * a.group, len = a.len, head_dim = a.head_dim;
  const float* queries[kMaxTileQueries];
  for (int64_t r = 0; r < tile.rows; ++r) {
    for (int64_t g = 0; g < a.group; ++g) {
      queries[r * a.group + g] = a.queries + r * tile.row_query_stride + g * a.query_stride;
    }
  }
  score_keys<NV, T>(a, queries, num_queries);
  for (int64_t q = 0; q < num_queries; ++q) {
    const int64_t row_len = len - (tile.rows - 1 - q / a.group);
    softmax_(a.scores + q * len, row_len);
    std::fill(a.scores + q * len + row_len, a.scores + (q + 1) * len, 0.f);
  }
  std::fill_n(tile.acc, num_queries * head_dim, 0.f);
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16][16 * NV];
  constexpr int kHeads = NV >= 16 ? 1 : std::min(4, 16 / NV);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    const float* values[16];
    cache_rows<NV, T>(a, a.values, t0, n, widened, values);
    const float* p = a.scores + t0;
    for (int64_t q = 0; q < num_queries; q += kHeads) {
      switch (std::min<int64_t>(kHeads, num_queries - q)) {
        case 4: if constexpr (kHeads >= 4) weigh_value_block<NV, 4>(values, n, p, len, q, tile.acc, head_dim); break;
        case 3: if constexpr (kHeads >= 3) weigh_value_block<NV, 3>(values, n, p, len, q, tile.acc, head_dim); break;
        case 2: if constexpr (kHeads >= 2) weigh_value_block<NV, 2>(values, n, p, len, q, tile.acc, head_dim); break;
        default: weigh_value_block<NV, 1>(values, n, p, len, q, tile.acc, head_dim);
      }
    }
  }
  for (int64_t r = 0; r < tile.rows; ++r) {
    std::copy_n(tile.acc + r * a.group * head_dim, a.group * head_dim, a.out + r * tile.row_out_stride);
  }
}

template <typename T>
bool attend_tile_typed(const TileArgs& args) {
  switch (args.pair.head_dim) {
    case 16: attend_tile<1, T>(args); return true;
    case 32: attend_tile<2, T>(args); return true;
    case 64: attend_tile<4, T>(args); return true;
    case 96: attend_tile<6, T>(args); return true;
    case 128: attend_tile<8, T>(args); return true;
    case 256: attend_tile<16, T>(args); return true;
    default: return false;
  }
}

template <typename T>
bool attend_typed(const PairArgs& args) {
  switch (args.head_dim) {
    case 16: attend<1, T>(args); return true;
    case 32: attend<2, T>(args); return true;
    case 64: attend<4, T>(args); return true;
    case 96: attend<6, T>(args); return true;
    case 128: attend<8, T>(args); return true;
    case 256: attend<16, T>(args); return true;
    default: return false;
  }
}

}  // namespace

bool attend_pair_avx512(const PairArgs& args) {
  return args.group <= kMaxGroup && (args.is_half ? attend_typed<uint16_t>(args) : attend_typed<float>(args));
}

bool attend_tile_avx512(const TileArgs& args) {
  return args.rows * args.pair.group <= kMaxTileQueries &&
         (args.pair.is_half ? attend_tile_typed<uint16_t>(args) : attend_tile_typed<float>(args));
}

}  // namespace attention
