// The AVX-512 path of the quantized matmul (the layout and the other paths: quant_matmul.cpp).
//
// A 4-bit block needs no int -> float conversion here: with the block's 16 possible weights in a
// table (d * j + m, one multiply-add for all 16), `vpermps` turns each lane's low nibble into its
// weight. Byte j of a GGUF block widened to lane j holds element j in its low nibble and element
// j + 16 in its high one, so one shift gives the second half.

#include "quant_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace quant {
namespace {

constexpr int64_t kRowTileAvx512 = 8;
// Row pairs ahead whose quants, scales and mins a pair prefetches (`prefetch_lines`). NOTE: the hardware
// prefetchers alone kept too few lines in flight: all of the embedded model's projections at one row,
// cycling through 30 layers' weights (cold in cache, as in a decode step), took 6.6-7.2 ms a pass without
// this, 4.9-5.8 with it (1 to 4 pairs ahead alike; 2026-11-27, 2-core Xeon). The same for the AMX path's
// next 16-row group measured no change at 16 rows (bound by its tile products, not by memory).
constexpr int64_t kPrefetchPairs = 2;

AVX512_FN inline void dequant_block_avx512(int64_t qtype, const uint8_t* q, float d, float m, __m512 w[2]) {
  if (qtype == kQ8_0) {
    const __m512 vd = _mm512_set1_ps(d);
    for (int i = 0; i < 2; ++i) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vd);
    }
    return;
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Q4_0: d * (j - 8) = d * j + (-8 d); Q4_1: d * j + m.
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(qtype == kQ4_1 ? m : -8.f * d));
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  w[0] = _mm512_permutexvar_ps(lanes, table);                         // elements 0-15 (low nibbles)
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);  // elements 16-31 (high nibbles)
}

// n fp16 values as float32 into out, 16 a conversion instruction: a block's scale then costs one
// broadcast load instead of a scalar conversion and a broadcast (a fifth of a 4-bit block's work).
AVX512_FN inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, tail, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, h + i)));
  }
}

// Lane i of the result = the sum of v[i]'s 16 lanes: unpacks, in-lane shuffles, then 128-bit-lane shuffles, an add
// at each of four levels (45 instructions where 16 `_mm512_reduce_add_ps` take ~130: at K = 576, the embedded
// model's hidden size, those were a fifth of an 8-row tile's instructions).
AVX512_FN inline __m512 lane_sums16(const __m512 v[16]) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int NR>
AVX512_FN void matmul_tile_avx512(int64_t qtype, const float* x, int64_t x_stride, const uint8_t* qs,
                                  const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                                  int64_t out_stride, int64_t first, int64_t last) {
  static_assert(NR <= kRowTileAvx512 && kRowTileAvx512 == 8, "lane_sums16 takes 2 x 8 accumulators");
  const int64_t qb = quant_bytes_per_block(qtype);
  // The row pair's scales and mins as float32: [d of r, d of r + 1, m of r, m of r + 1], num_blocks each.
  thread_local std::vector<float> scale_buffer;
  scale_buffer.resize(4 * num_blocks);
  float* d0 = scale_buffer.data();
  float* m0 = d0 + 2 * num_blocks;
  if (!mins) std::fill_n(m0, 2 * num_blocks, 0.f);
  int64_t r = first;
  for (; r + 1 < last; r += 2) {
    // With few activation rows, two accumulators per (weight row, activation row), so the halves of a
    // block are separate chains; with many, one each (they are chains enough, and must fit 32 registers).
    constexpr int NA = NR <= 2 ? 2 : 1;
    __m512 acc0[NR][NA], acc1[NR][NA];
    for (int n = 0; n < NR; ++n)
      for (int a = 0; a < NA; ++a) acc0[n][a] = acc1[n][a] = _mm512_setzero_ps();
    const uint8_t* q0 = qs + r * num_blocks * qb;
    const uint8_t* q1 = q0 + num_blocks * qb;
    if (r + 2 * kPrefetchPairs + 1 < last) {  // the pair kPrefetchPairs ahead, into L1
      const int64_t ahead = r + 2 * kPrefetchPairs;
      prefetch_lines(qs + ahead * num_blocks * qb, 2 * num_blocks * qb);
      prefetch_lines(scales + ahead * num_blocks, 4 * num_blocks);
      if (mins) prefetch_lines(mins + ahead * num_blocks, 4 * num_blocks);
    }
    halves_to_floats(scales + r * num_blocks, 2 * num_blocks, d0);  // rows r and r + 1 are adjacent
    if (mins) halves_to_floats(mins + r * num_blocks, 2 * num_blocks, m0);
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m512 w0[2], w1[2];
      dequant_block_avx512(qtype, q0 + b * qb, d0[b], m0[b], w0);
      dequant_block_avx512(qtype, q1 + b * qb, d0[num_blocks + b], m0[num_blocks + b], w1);
      for (int n = 0; n < NR; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        for (int i = 0; i < 2; ++i) {
          const __m512 xv = _mm512_loadu_ps(xb + 16 * i);
          acc0[n][i % NA] = _mm512_fmadd_ps(w0[i], xv, acc0[n][i % NA]);
          acc1[n][i % NA] = _mm512_fmadd_ps(w1[i], xv, acc1[n][i % NA]);
        }
      }
    }
    if constexpr (NR >= 3) {  // one accumulator each: the 2 NR sums in one tree
      __m512 v[16];
      for (int n = 0; n < 8; ++n) {
        v[2 * n] = n < NR ? acc0[n][0] : _mm512_setzero_ps();
        v[2 * n + 1] = n < NR ? acc1[n][0] : _mm512_setzero_ps();
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, lane_sums16(v));
      for (int n = 0; n < NR; ++n) {
        out[n * out_stride + r] = sums[2 * n];
        out[n * out_stride + r + 1] = sums[2 * n + 1];
      }
    } else {
      for (int n = 0; n < NR; ++n) {
        out[n * out_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[n][0], acc0[n][NA - 1]));
        out[n * out_stride + r + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc1[n][0], acc1[n][NA - 1]));
      }
    }
  }
  for (; r < last; ++r) {
    __m512 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m512 w[2];
      dequant_block_avx512(qtype, qs + (r * num_blocks + b) * qb, _cvtsh_ss(scales[r * num_blocks + b]),
                           mins ? _cvtsh_ss(mins[r * num_blocks + b]) : 0.f, w);
      for (int n = 0; n < NR; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        for (int i = 0; i < 2; ++i) acc[n] = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(xb + 16 * i), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) out[n * out_stride + r] = _mm512_reduce_add_ps(acc[n]);
  }
}

AVX512_FN void matmul_rows(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows, const uint8_t* qs,
                           const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                           int64_t out_stride, int64_t first, int64_t last) {
  // 32 registers hold the accumulators of 8 activation rows x 2 weight rows: each dequantized block
  // is reused 8 times.
  for (int64_t n = 0; n < num_rows; n += kRowTileAvx512) {
    const float* xn = x + n * x_stride;
    float* on = out + n * out_stride;
#define TILE(NR) matmul_tile_avx512<NR>(qtype, xn, x_stride, qs, scales, mins, num_blocks, on, out_stride, first, last)
    switch (std::min<int64_t>(kRowTileAvx512, num_rows - n)) {
      case 1: TILE(1); break;
      case 2: TILE(2); break;
      case 3: TILE(3); break;
      case 4: TILE(4); break;
      case 5: TILE(5); break;
      case 6: TILE(6); break;
      case 7: TILE(7); break;
      default: TILE(8);
    }
#undef TILE
  }
}

AVX512_FN void dequant_row(int64_t qtype, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                           int64_t num_blocks, float* w) {
  const int64_t qb = quant_bytes_per_block(qtype);
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 v[2];
    dequant_block_avx512(qtype, q + b * qb, _cvtsh_ss(d[b]), m ? _cvtsh_ss(m[b]) : 0.f, v);
    _mm512_storeu_ps(w + b * kBlock, v[0]);
    _mm512_storeu_ps(w + b * kBlock + 16, v[1]);
  }
}

}  // namespace

// NOTE: the exported functions carry no target attribute (GCC would read a differing one as a second
// version of the declared function); callers check the CPU before calling them.
void matmul_rows_avx512(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows, const uint8_t* qs,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                        int64_t out_stride, int64_t first, int64_t last) {
  matmul_rows(qtype, x, x_stride, num_rows, qs, scales, mins, num_blocks, out, out_stride, first, last);
}

void dequant_row_avx512(int64_t qtype, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t num_blocks,
                        float* w) {
  dequant_row(qtype, q, d, m, num_blocks, w);
}

}  // namespace quant
