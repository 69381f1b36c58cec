// The CPU kernels' entry points, bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

// quant_matmul.cpp: GGUF Q4_0 / Q4_1 / Q8_0 weights executed in their blocks.
void quant_matmul(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                  const torch::Tensor& mins, int64_t qtype, torch::Tensor& out);
torch::Tensor quant_matmul_new(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                               const torch::Tensor& mins, int64_t qtype);
torch::Tensor dequantize_rows(const torch::Tensor& qs, const torch::Tensor& scales, const torch::Tensor& mins,
                              int64_t qtype, const torch::Tensor& rows);
std::string instruction_set();
std::string limit_instruction_set(const std::string& name);
int64_t set_amx_min_rows(int64_t num_rows);
bool uses_avx512();  // the path in effect is AVX-512 (the attention's SIMD path follows it too)

// norm_rope.cpp: the decoder's small per-layer ops, one call each instead of several torch ops.
torch::Tensor add_rms_norm(torch::Tensor& hidden, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed);

// decode_attention.cpp: one query per sequence against its paged context; writes this step's k/v first.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     torch::Tensor& k_cache, torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     const torch::Tensor& slot_mapping, double scale);

// argmax.cpp: the greedy sampler's argmax of each row, torch.argmax's semantics (first maximum, NaN first).
torch::Tensor argmax_rows(const torch::Tensor& x);
