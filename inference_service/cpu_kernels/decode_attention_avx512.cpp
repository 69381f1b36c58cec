// The AVX-512 path of paged decode attention (the layout and the other path: decode_attention.cpp).
//
// One (sequence, kv head) pair at a time: its G query heads score each key row as it is read, the
// softmax runs 16 scores to a register with a vector exp, and the weighted sum keeps each head's output
// row in registers over the whole context. The generic path compiles for the baseline ISA (128-bit,
// scalar exp), which left batch-16 decode spending as long in attention as in the projections.

#include "attention_pair.h"

#include <immintrin.h>

#include <algorithm>

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

// NV = head_dim / 16 vectors a row.
template <int NV>
AVX512_FN void attend(const PairArgs& a) {
  for (int64_t t = 0; t < a.len; ++t) {
    const float* key = a.keys + a.slot_of(t) * a.row_stride;
    __m512 k[NV];
    for (int c = 0; c < NV; ++c) k[c] = _mm512_loadu_ps(key + 16 * c);
    for (int64_t g = 0; g < a.group; ++g) {
      const float* q = a.queries + g * a.query_stride;
      __m512 acc0 = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
      __m512 acc1 = _mm512_setzero_ps();  // two chains: half the FMA latency per score
      for (int c = 1; c < NV; ++c) {
        if (c % 2) acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], acc1);
        else acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], acc0);
      }
      a.scores[g * a.len + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) * a.scale;
    }
  }
  for (int64_t g = 0; g < a.group; ++g) softmax_(a.scores + g * a.len, a.len);
  for (int64_t g = 0; g < a.group; ++g) {
    const float* p = a.scores + g * a.len;
    __m512 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < a.len; ++t) {
      const float* value = a.values + a.slot_of(t) * a.row_stride;
      const __m512 weight = _mm512_set1_ps(p[t]);
      for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(a.out + g * a.head_dim + 16 * c, acc[c]);
  }
}

}  // namespace

bool attend_pair_avx512(const PairArgs& args) {
  switch (args.head_dim) {
    case 16: attend<1>(args); return true;
    case 32: attend<2>(args); return true;
    case 64: attend<4>(args); return true;
    case 96: attend<6>(args); return true;
    case 128: attend<8>(args); return true;
    case 256: attend<16>(args); return true;
    default: return false;
  }
}

}  // namespace attention
