// RMSNorm (with the residual add before it) and rotate-half RoPE for float32 activations on the CPU.
//
// At batch 1 a decoder layer's matmuls take tens of microseconds, so the handful of torch ops each norm
// and rotation is made of (a dispatch and an allocation apiece) cost as much as the arithmetic. Each is
// one call here, computed as HF computes it in float32: x * rsqrt(mean(x^2) + eps) * w (the mean of
// squares accumulated in double), and x * cos + roll(x, D / 2) * sin_signed.

#include "ops.h"

#include "worker_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor add_rms_norm(torch::Tensor& hidden, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 2 && hidden.is_contiguous(),
              "hidden must be contiguous float32 [T, H]");
  const int64_t num_tokens = hidden.size(0), dim = hidden.size(1);
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.numel() == dim && weight.is_contiguous(),
              "weight must be float32 [H]");
  const float* dp = nullptr;
  if (delta.has_value()) {
    TORCH_CHECK(delta->dtype() == torch::kFloat32 && delta->sizes() == hidden.sizes() && delta->stride(1) == 1,
                "delta must be float32 shaped like hidden, rows contiguous");
    dp = delta->data_ptr<float>();
  }
  const int64_t delta_stride = delta.has_value() ? delta->stride(0) : 0;
  torch::Tensor out = torch::empty_like(hidden);
  float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  WorkerPool::instance().run(0, num_tokens, 64, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      float* h = hp + t * dim;
      if (dp) {
        const float* d = dp + t * delta_stride;
        for (int64_t i = 0; i < dim; ++i) h[i] += d[i];
      }
      double sum_sq = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum_sq += (double)h[i] * h[i];
      const float inv_rms = 1.0f / std::sqrt((float)(sum_sq / dim) + (float)eps);
      float* o = op + t * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = wp[i] * (h[i] * inv_rms);
    }
  });
  return out;
}

void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1, "x must be float32 [T, H, D], D contiguous");
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0, "head dim must be even");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && sin_signed.dtype() == torch::kFloat32 && cos.is_contiguous() &&
                  sin_signed.is_contiguous() && cos.numel() == num_tokens * head_dim &&
                  sin_signed.numel() == num_tokens * head_dim,
              "cos and sin must be contiguous float32 [T, 1, D]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  WorkerPool::instance().run(0, num_tokens, 64, [&](int64_t first, int64_t last) {
    std::vector<float> low(half);
    for (int64_t t = first; t < last; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* v = xp + t * token_stride + h * head_stride;
        // roll(v, D / 2) is v's halves swapped: two straight loops the compiler vectorizes (no index modulo)
        std::copy_n(v, half, low.data());
        for (int64_t i = 0; i < half; ++i) v[i] = v[i] * c[i] + v[i + half] * s[i];
        for (int64_t i = 0; i < half; ++i) v[half + i] = v[half + i] * c[half + i] + low[i] * s[half + i];
      }
    }
  });
}
