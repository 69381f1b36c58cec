// The CPU decode layer (decoder_layer.cpp), bound to Python as a class in bindings.cpp.
#pragma once

#include "ops.h"

#include <optional>
#include <tuple>
#include <vector>

// One block of a projection's output rows in GGUF blocks (quant_matmul.cpp's layout), starting at
// `first_row`; a fused projection (qkv, gate_up) whose parts differ in type is several.
struct LinearPart {
  torch::Tensor qs, scales, mins;
  int64_t qtype, first_row, num_rows;
};
using LinearPartArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t>;

// A pre-norm Llama-family layer (RMSNorm, RoPE on all of each head, gated MLP) for query rows, float32:
// row i attends block_tables[i] up to seq_lens[i] (a decode token, or one token of a short prompt).
class CpuDecoderLayer {
 public:
  CpuDecoderLayer(const std::vector<LinearPartArgs>& qkv, std::optional<torch::Tensor> qkv_bias,
                  const std::vector<LinearPartArgs>& o, std::optional<torch::Tensor> o_bias,
                  const std::vector<LinearPartArgs>& gate_up, const std::vector<LinearPartArgs>& down,
                  torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale, bool is_gelu);

  void forward(torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin_signed,
               torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& block_tables,
               const torch::Tensor& seq_lens, const torch::Tensor& slot_mapping) const;

 private:
  std::vector<LinearPart> qkv_, o_, gate_up_, down_;
  std::optional<torch::Tensor> qkv_bias_, o_bias_;
  torch::Tensor input_norm_, post_attention_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_size_;
  double scale_;
  bool is_gelu_;
};
