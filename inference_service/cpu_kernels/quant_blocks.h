// The GGUF block layout the quantized matmul reads (described in quant_matmul.cpp), shared by its paths.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace quant {

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kBlock = 32;

inline int64_t quant_bytes_per_block(int64_t qtype) { return qtype == kQ8_0 ? 32 : 16; }

// Asks for the cache lines of [start, start + num_bytes) in L1 (or the level kHint names; quant_avx512.cpp's
// kPrefetchPairs says why).
template <_mm_hint kHint = _MM_HINT_T0>
inline void prefetch_lines(const void* start, int64_t num_bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(p + offset, kHint);
}

// quant_avx512.cpp: out[n, r] for weight rows [first, last) and every activation row; one row expanded.
void matmul_rows_avx512(int64_t qtype, const float* x, int64_t x_stride, int64_t num_rows, const uint8_t* qs,
                        const uint16_t* scales, const uint16_t* mins, int64_t num_blocks, float* out,
                        int64_t out_stride, int64_t first, int64_t last);
void dequant_row_avx512(int64_t qtype, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t num_blocks,
                        float* w);

// quant_amx.cpp: the AMX-BF16 path. The activations are packed once a call (16-token tiles x blocks, on any
// threads), then any thread computes out[n, r] for weight rows [first, last) from them.
struct PackedActivations {
  std::vector<uint8_t> tiles;  // storage of the B tiles, aligned within
  std::vector<float> sums;     // storage of each block's activation sum (Q4_1's mins), aligned within
  uint8_t* tile_data = nullptr;
  float* sum_data = nullptr;
  int64_t num_tokens = 0, num_blocks = 0;
};
bool amx_available();  // the CPU has AMX-BF16 and the kernel lets this process use the tiles
void reserve_activations_amx(int64_t num_tokens, int64_t num_blocks, PackedActivations& packed);
void pack_activations_amx(const float* x, int64_t x_stride, int64_t first, int64_t last,
                          const PackedActivations& packed);
void matmul_rows_amx(int64_t qtype, const PackedActivations& packed, const uint8_t* qs, const uint16_t* scales,
                     const uint16_t* mins, int64_t num_blocks, float* out, int64_t out_stride, int64_t first,
                     int64_t last);

}  // namespace quant
