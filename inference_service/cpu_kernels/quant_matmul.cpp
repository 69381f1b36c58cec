// Weight-only quantized matmul on the CPU: GGUF Q4_0, Q4_1 and Q8_0 blocks executed in place.
//
// A weight row of K elements is K / 32 blocks. Each block keeps its quants as GGUF stores them and its
// scale (and Q4_1's min) as the fp16 GGUF stores, split into separate arrays at load (quant.py):
//   qs     [R, K / 32 * QB] uint8   QB = 16 for the 4-bit types (element j in the low nibble of byte j,
//                                   element j + 16 in its high nibble), 32 for Q8_0 (int8)
//   scales [R, K / 32] fp16          d
//   mins   [R, K / 32] fp16          Q4_1's m (empty for the others)
// Dequantized: Q4_0 w = d * (q - 8), Q4_1 w = d * q + m, Q8_0 w = d * q. The kernels dequantize a block
// in registers (one fused multiply-add per element) and multiply it into every activation row while it
// is there, with fp32 activations and fp32 accumulation, so results are the dequantized model's up to
// summation order.
//
// Paths, chosen at run time: AMX-BF16 for calls of at least g_amx_min_rows activation rows (quant_amx.cpp),
// AVX-512 (quant_avx512.cpp), AVX2 + FMA, and a scalar one for other CPUs.

#include "ops.h"
#include "quant_blocks.h"
#include "worker_pool.h"
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

using namespace quant;

namespace {

// Activation rows handled together: each dequantized block is reused this many times from registers.
constexpr int64_t kRowTile = 4;

// ----------------------------------------------------------------------------------- scalar path

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline void dequant_block_scalar(int64_t qtype, const uint8_t* q, float d, float m, float* w) {
  switch (qtype) {
    case kQ4_0:
      for (int j = 0; j < 16; ++j) {
        w[j] = d * (float)((q[j] & 0x0F) - 8);
        w[j + 16] = d * (float)((q[j] >> 4) - 8);
      }
      break;
    case kQ4_1:
      for (int j = 0; j < 16; ++j) {
        w[j] = d * (float)(q[j] & 0x0F) + m;
        w[j + 16] = d * (float)(q[j] >> 4) + m;
      }
      break;
    default:
      for (int j = 0; j < 32; ++j) w[j] = d * (float)(int8_t)q[j];
  }
}

void matmul_rows_scalar(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows, const uint8_t* qs,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                        int64_t out_stride, int64_t first, int64_t last) {
  const int64_t qb = quant_bytes_per_block(qtype);
  float w[kBlock];
  for (int64_t r = first; r < last; ++r) {
    for (int64_t n = 0; n < num_rows; ++n) out[n * out_stride + r] = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequant_block_scalar(qtype, qs + (r * num_blocks + b) * qb, half_to_float(scales[r * num_blocks + b]),
                           mins ? half_to_float(mins[r * num_blocks + b]) : 0.f, w);
      for (int64_t n = 0; n < num_rows; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += w[j] * xb[j];
        out[n * out_stride + r] += s;
      }
    }
  }
}

// ----------------------------------------------------------------------------------- AVX2 path

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

// One block dequantized into four 8-lane vectors (elements 0-7, 8-15, 16-23, 24-31).
AVX2_FN inline void dequant_block_avx2(int64_t qtype, const uint8_t* q, float d, float m, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d);
  if (qtype == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
    }
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask);                     // elements 0-15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // elements 16-31
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  // Q4_0: d * (q - 8) = d * q + (-8 d); Q4_1: d * q + m.
  const __m256 vm = _mm256_set1_ps(qtype == kQ4_1 ? m : -8.f * d);
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd, vm);
  }
}

AVX2_FN inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[n, r] for weight rows [first, last) and NR activation rows, two weight rows at a time. With few
// activation rows each (row, activation) pair keeps NA accumulators, so a block's four multiply-adds
// are not one dependency chain (batch 1 would otherwise wait on FMA latency, not memory).
template <int NR>
AVX2_FN void matmul_tile_avx2(int64_t qtype, const float* x, int64_t x_stride, const uint8_t* qs,
                              const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                              int64_t out_stride, int64_t first, int64_t last) {
  constexpr int NA = NR <= 2 ? 2 : 1;
  const int64_t qb = quant_bytes_per_block(qtype);
  int64_t r = first;
  for (; r + 1 < last; r += 2) {
    __m256 acc0[NR][NA], acc1[NR][NA];
    for (int n = 0; n < NR; ++n)
      for (int a = 0; a < NA; ++a) acc0[n][a] = acc1[n][a] = _mm256_setzero_ps();
    const uint8_t* q0 = qs + r * num_blocks * qb;
    const uint8_t* q1 = q0 + num_blocks * qb;
    const uint16_t* d0 = scales + r * num_blocks;
    const uint16_t* m0 = mins ? mins + r * num_blocks : nullptr;
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 w0[4], w1[4];
      dequant_block_avx2(qtype, q0 + b * qb, _cvtsh_ss(d0[b]), m0 ? _cvtsh_ss(m0[b]) : 0.f, w0);
      dequant_block_avx2(qtype, q1 + b * qb, _cvtsh_ss(d0[num_blocks + b]), m0 ? _cvtsh_ss(m0[num_blocks + b]) : 0.f, w1);
      for (int n = 0; n < NR; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        for (int i = 0; i < 4; ++i) {
          const __m256 xv = _mm256_loadu_ps(xb + 8 * i);
          acc0[n][i % NA] = _mm256_fmadd_ps(w0[i], xv, acc0[n][i % NA]);
          acc1[n][i % NA] = _mm256_fmadd_ps(w1[i], xv, acc1[n][i % NA]);
        }
      }
    }
    for (int n = 0; n < NR; ++n) {
      for (int a = 1; a < NA; ++a) {
        acc0[n][0] = _mm256_add_ps(acc0[n][0], acc0[n][a]);
        acc1[n][0] = _mm256_add_ps(acc1[n][0], acc1[n][a]);
      }
      out[n * out_stride + r] = hsum_avx2(acc0[n][0]);
      out[n * out_stride + r + 1] = hsum_avx2(acc1[n][0]);
    }
  }
  for (; r < last; ++r) {
    __m256 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 w[4];
      dequant_block_avx2(qtype, qs + (r * num_blocks + b) * qb, _cvtsh_ss(scales[r * num_blocks + b]),
                         mins ? _cvtsh_ss(mins[r * num_blocks + b]) : 0.f, w);
      for (int n = 0; n < NR; ++n) {
        const float* xb = x + n * x_stride + b * kBlock;
        for (int i = 0; i < 4; ++i) acc[n] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) out[n * out_stride + r] = hsum_avx2(acc[n]);
  }
}

AVX2_FN void matmul_rows_avx2(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows,
                              const uint8_t* qs, const uint16_t* scales, const uint16_t* mins, int64_t num_blocks,
                              float* out, int64_t out_stride, int64_t first, int64_t last) {
  for (int64_t n = 0; n < num_rows; n += kRowTile) {
    const float* xn = x + n * x_stride;
    float* on = out + n * out_stride;
    switch (std::min<int64_t>(kRowTile, num_rows - n)) {
      case 1: matmul_tile_avx2<1>(qtype, xn, x_stride, qs, scales, mins, num_blocks, on, out_stride, first, last); break;
      case 2: matmul_tile_avx2<2>(qtype, xn, x_stride, qs, scales, mins, num_blocks, on, out_stride, first, last); break;
      case 3: matmul_tile_avx2<3>(qtype, xn, x_stride, qs, scales, mins, num_blocks, on, out_stride, first, last); break;
      default: matmul_tile_avx2<4>(qtype, xn, x_stride, qs, scales, mins, num_blocks, on, out_stride, first, last);
    }
  }
}

AVX2_FN void dequant_row_avx2(int64_t qtype, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                              int64_t num_blocks, float* w) {
  const int64_t qb = quant_bytes_per_block(qtype);
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256 v[4];
    dequant_block_avx2(qtype, q + b * qb, _cvtsh_ss(d[b]), m ? _cvtsh_ss(m[b]) : 0.f, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + b * kBlock + 8 * i, v[i]);
  }
}

enum class Isa { kScalar, kAvx2, kAvx512, kAmx };

Isa detect_isa() {
  static const Isa isa = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return amx_available() ? Isa::kAmx : Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return isa;
}

// The path a call takes: the best this CPU has, or a lower one forced (tests run every path they can).
Isa g_forced_isa = Isa::kAmx;
Isa active_isa() { return std::min(detect_isa(), g_forced_isa); }

// Calls with fewer activation rows take the AVX-512 path where AMX is active (it wins from about here).
int64_t g_amx_min_rows = 10;
// The AMX path's activation rows a pass (64 rows of K = 1536 pack to 576 KiB).
constexpr int64_t kAmxMaxTokens = 64;

}  // namespace

// ----------------------------------------------------------------------------------- entry points

static void check_weight(const torch::Tensor& qs, const torch::Tensor& scales, const torch::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "unknown quant type ", qtype);
  TORCH_CHECK(qs.dtype() == torch::kUInt8 && qs.dim() == 2 && qs.is_contiguous(), "qs must be contiguous uint8 [R, B * QB]");
  TORCH_CHECK(scales.dtype() == torch::kFloat16 && scales.dim() == 2 && scales.is_contiguous(),
              "scales must be contiguous float16 [R, B]");
  TORCH_CHECK(qs.size(0) == scales.size(0) && qs.size(1) == scales.size(1) * quant_bytes_per_block(qtype),
              "qs ", qs.sizes(), " does not match scales ", scales.sizes());
  if (qtype == kQ4_1) {
    TORCH_CHECK(mins.dtype() == torch::kFloat16 && mins.sizes() == scales.sizes() && mins.is_contiguous(),
                "Q4_1 needs mins shaped like scales");
  }
}

// out[n, r] = sum_k x[n, k] * W[r, k]; `out` may be a column slice of a wider tensor (row stride free).
void quant_matmul(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                  const torch::Tensor& mins, int64_t qtype, torch::Tensor& out) {
  check_weight(qs, scales, mins, qtype);
  const int64_t num_weight_rows = qs.size(0), num_blocks = scales.size(1);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [N, K], rows contiguous");
  TORCH_CHECK(x.size(1) == num_blocks * kBlock, "x has ", x.size(1), " columns, the weight ", num_blocks * kBlock);
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == num_weight_rows,
              "out must be float32 [N, R] with contiguous rows");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = qtype == kQ4_1 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t num_rows = x.size(0), x_stride = x.stride(0), out_stride = out.stride(0);
  const Isa isa = active_isa();
  const int64_t qb = quant_bytes_per_block(qtype);
  if (isa == Isa::kAmx && num_rows >= g_amx_min_rows) {
    thread_local PackedActivations packed_here;
    // NOTE: a pointer, as a lambda does not capture a thread_local: the workers would read their own.
    const PackedActivations* packed = &packed_here;
    // Grain: ~64 KiB of quants a task, whole 16-row tiles.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 16 * num_blocks * qb)) * 16;
    // Tokens in chunks whose packed activations stay in L2 while every weight row passes over them.
    for (int64_t n0 = 0; n0 < num_rows; n0 += kAmxMaxTokens) {
      const int64_t num_tokens = std::min(kAmxMaxTokens, num_rows - n0);
      reserve_activations_amx(num_tokens, num_blocks, packed_here);
      // (token tile, block) pairs: a decode batch is one token tile, and its blocks still split over the threads.
      WorkerPool::instance().run(0, (num_tokens + 15) / 16 * num_blocks, 4, [&](int64_t first, int64_t last) {
        pack_activations_amx(xp + n0 * x_stride, x_stride, first, last, *packed);
      });
      WorkerPool::instance().run(0, num_weight_rows, grain, [&](int64_t first, int64_t last) {
        matmul_rows_amx(qtype, *packed, qp, dp, mp, num_blocks, op + n0 * out_stride, out_stride, first, last);
      });
    }
    return;
  }
  // Grain: enough weight rows that a task streams ~64 KiB of quants, and an even count (rows go in pairs).
  const int64_t grain = std::max<int64_t>(2, (65536 / std::max<int64_t>(1, num_blocks * qb)) & ~1);
  WorkerPool::instance().run(0, num_weight_rows, grain, [&](int64_t first, int64_t last) {
    switch (isa) {
      case Isa::kAmx:
      case Isa::kAvx512:
        matmul_rows_avx512(qtype, xp, x_stride, num_rows, qp, dp, mp, num_blocks, op, out_stride, first, last);
        break;
      case Isa::kAvx2:
        matmul_rows_avx2(qtype, xp, x_stride, num_rows, qp, dp, mp, num_blocks, op, out_stride, first, last);
        break;
      default:
        matmul_rows_scalar(qtype, xp, x_stride, num_rows, qp, dp, mp, num_blocks, op, out_stride, first, last);
    }
  });
}

torch::Tensor quant_matmul_new(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                               const torch::Tensor& mins, int64_t qtype) {
  torch::Tensor out = torch::empty({x.size(0), qs.size(0)}, x.options());
  quant_matmul(x, qs, scales, mins, qtype, out);
  return out;
}

// Rows `rows` of the weight dequantized to float32 [len(rows), K] (all rows when `rows` is empty).
torch::Tensor dequantize_rows(const torch::Tensor& qs, const torch::Tensor& scales, const torch::Tensor& mins,
                              int64_t qtype, const torch::Tensor& rows) {
  check_weight(qs, scales, mins, qtype);
  const int64_t num_blocks = scales.size(1), qb = quant_bytes_per_block(qtype);
  const bool all_rows = rows.numel() == 0;
  torch::Tensor index = all_rows ? rows : rows.to(torch::kInt64).contiguous();
  const int64_t num_out = all_rows ? qs.size(0) : index.numel();
  const int64_t* ip = all_rows ? nullptr : index.data_ptr<int64_t>();
  if (ip) {
    for (int64_t i = 0; i < num_out; ++i) {
      TORCH_CHECK(ip[i] >= 0 && ip[i] < qs.size(0), "row ", ip[i], " out of range [0, ", qs.size(0), ")");
    }
  }
  torch::Tensor out = torch::empty({num_out, num_blocks * kBlock}, torch::kFloat32);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = qtype == kQ4_1 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  float* op = out.data_ptr<float>();
  const Isa isa = active_isa();
  WorkerPool::instance().run(0, num_out, 16, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t r = ip ? ip[i] : i;
      const uint8_t* q = qp + r * num_blocks * qb;
      const uint16_t* d = dp + r * num_blocks;
      const uint16_t* m = mp ? mp + r * num_blocks : nullptr;
      float* w = op + i * num_blocks * kBlock;
      if (isa >= Isa::kAvx512) {
        dequant_row_avx512(qtype, q, d, m, num_blocks, w);
      } else if (isa == Isa::kAvx2) {
        dequant_row_avx2(qtype, q, d, m, num_blocks, w);
      } else {
        for (int64_t b = 0; b < num_blocks; ++b) dequant_block_scalar(qtype, q + b * qb, half_to_float(d[b]), m ? half_to_float(m[b]) : 0.f, w + b * kBlock);
      }
    }
  });
  return out;
}

static const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

std::string instruction_set() { return isa_name(active_isa()); }

bool uses_avx512() { return active_isa() >= Isa::kAvx512; }

// Caps the path used from now on at `name` ("amx", "avx512", "avx2" or "scalar"); returns the path in effect.
std::string limit_instruction_set(const std::string& name) {
  for (Isa isa : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (name == isa_name(isa)) {
      g_forced_isa = isa;
      return instruction_set();
    }
  }
  TORCH_CHECK(false, "unknown instruction set ", name);
}

// Sets the fewest activation rows a call needs to take the AMX path; returns the previous value.
int64_t set_amx_min_rows(int64_t num_rows) {
  TORCH_CHECK(num_rows >= 1, "the AMX path needs at least one row, got ", num_rows);
  return std::exchange(g_amx_min_rows, num_rows);
}
