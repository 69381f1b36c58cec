// A Llama-family decoder layer's decode step in one call, over weights kept in GGUF blocks.
//
// NOTE: why a whole layer in C++: at batch 1 the embedded model's layer reads ~2 MB of quantized weights
// (~100 us at this machine's bandwidth), while the dozen torch calls around its four matmuls (norms,
// views, rotary, attention, activation, residual adds) cost about as much again in Python dispatch and
// allocation. The layer object is built once at load and holds its tensors, so a decode step crosses into
// C++ once per layer. The arithmetic is the eager layer's, op for op (the same kernels in the same order,
// the activation through ATen as there), so its results are the eager path's exactly.

#include "decoder_layer.h"

namespace {

void linear_forward(const std::vector<LinearPart>& parts, const std::optional<torch::Tensor>& bias,
                    const torch::Tensor& x, torch::Tensor& out) {
  for (const LinearPart& part : parts) {
    torch::Tensor slice = out.narrow(1, part.first_row, part.num_rows);  // [N, rows] of the fused output
    quant_matmul(x, part.qs, part.scales, part.mins, part.qtype, slice);
  }
  if (bias.has_value()) out.add_(*bias);
}

std::vector<LinearPart> to_parts(const std::vector<LinearPartArgs>& args) {
  std::vector<LinearPart> parts;
  for (const auto& [qs, scales, mins, qtype, first_row] : args) {
    parts.push_back({qs, scales, mins, qtype, first_row, qs.size(0)});
  }
  return parts;
}

}  // namespace

CpuDecoderLayer::CpuDecoderLayer(const std::vector<LinearPartArgs>& qkv, std::optional<torch::Tensor> qkv_bias,
                                 const std::vector<LinearPartArgs>& o, std::optional<torch::Tensor> o_bias,
                                 const std::vector<LinearPartArgs>& gate_up, const std::vector<LinearPartArgs>& down,
                                 torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t intermediate_size, double scale, bool is_gelu)
    : qkv_(to_parts(qkv)), o_(to_parts(o)), gate_up_(to_parts(gate_up)), down_(to_parts(down)),
      qkv_bias_(std::move(qkv_bias)), o_bias_(std::move(o_bias)), input_norm_(std::move(input_norm)),
      post_attention_norm_(std::move(post_attention_norm)), eps_(eps), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), intermediate_size_(intermediate_size), scale_(scale),
      is_gelu_(is_gelu) {}

// hidden [N, H] (the residual stream, updated in place); cos, sin_signed [N, 1, D]; one query a row.
void CpuDecoderLayer::forward(torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                              torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, const torch::Tensor& slot_mapping) const {
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const auto options = hidden.options();

  torch::Tensor x = add_rms_norm(hidden, std::nullopt, input_norm_, eps_);  // [N, H]
  torch::Tensor qkv = torch::empty({num_tokens, q_size + 2 * kv_size}, options);
  linear_forward(qkv_, qkv_bias_, x, qkv);
  // q and k sit side by side: rotate both heads' worth in one pass, in place.
  torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({num_tokens, num_heads_ + num_kv_heads_, head_dim_});
  rotary_(qk, cos, sin_signed);
  torch::Tensor attn = paged_decode_attention(
      qk.narrow(1, 0, num_heads_), qk.narrow(1, num_heads_, num_kv_heads_),
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads_, head_dim_}), k_cache, v_cache,
      block_tables, seq_lens, slot_mapping, scale_);  // [N, Hq, D]
  torch::Tensor attn_out = torch::empty({num_tokens, hidden_size}, options);
  linear_forward(o_, o_bias_, attn.view({num_tokens, q_size}), attn_out);

  x = add_rms_norm(hidden, attn_out, post_attention_norm_, eps_);  // hidden += attn_out first
  torch::Tensor gate_up = torch::empty({num_tokens, 2 * intermediate_size_}, options);
  linear_forward(gate_up_, std::nullopt, x, gate_up);
  torch::Tensor gate = gate_up.narrow(1, 0, intermediate_size_);
  torch::Tensor act = is_gelu_ ? at::gelu(gate, "tanh") : at::silu(gate);  // [N, I], torch's own arithmetic
  act.mul_(gate_up.narrow(1, intermediate_size_, intermediate_size_));
  torch::Tensor mlp_out = torch::empty({num_tokens, hidden_size}, options);
  linear_forward(down_, std::nullopt, act, mlp_out);
  hidden.add_(mlp_out);
}
