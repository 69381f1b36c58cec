// The GGUF block layout the quantized matmul reads (described in quant_matmul.cpp), shared by its paths.
#pragma once

#include <cstdint>

namespace quant {

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kBlock = 32;

inline int64_t quant_bytes_per_block(int64_t qtype) { return qtype == kQ8_0 ? 32 : 16; }

// quant_avx512.cpp: out[n, r] for weight rows [first, last) and every activation row; one row expanded.
void matmul_rows_avx512(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows, const uint8_t* qs,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                        int64_t out_stride, int64_t first, int64_t last);
void dequant_row_avx512(int64_t qtype, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t num_blocks,
                        float* w);

}  // namespace quant
