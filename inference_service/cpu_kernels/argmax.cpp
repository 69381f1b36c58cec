// The greedy sampler's argmax over each row of the logits, [N, V] float32 -> [N] int64.
//
// NOTE: why not torch's: over a long row its argmax is slow, and its max reduction runs as an OpenMP
// parallel region, after which libgomp's threads spin (300,000 rounds unless GOMP_SPINCOUNT says
// otherwise) on the cores the CPU kernels' workers need next: one such region a decode step made the
// embedded model's batch-1 step 1.5x slower. Here a row is one task on the kernels' own pool.
//
// torch.argmax's semantics: the first index of the maximum, and NaN counts as the maximum (the first NaN).

#include "ops.h"

#include "worker_pool.h"

#include <immintrin.h>

#include <cmath>
#include <limits>

namespace {

int64_t argmax_row_generic(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// Two passes over a row that sits in L2: the maximum (and whether any lane is NaN), then its first index.
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* row, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 any_nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    any_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  float best = _mm512_reduce_max_ps(vmax);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(row[j])) any_nan = 1;
    else if (row[j] > best) best = row[j];
  }
  if (any_nan) return argmax_row_generic(row, n);
  const __m512 target = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    if (row[i] == best) return i;
  }
  return 0;  // unreachable: the maximum is in the row
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous float32 [N, V] with V > 0");
  const int64_t num_rows = x.size(0), vocab = x.size(1);
  torch::Tensor out = torch::empty({num_rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx512 = uses_avx512();
  WorkerPool::instance().run(0, num_rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      op[r] = avx512 ? argmax_row_avx512(xp + r * vocab, vocab) : argmax_row_generic(xp + r * vocab, vocab);
    }
  });
  return out;
}
