// One (sequence, kv head) pair of paged decode attention, as decode_attention.cpp hands it to a SIMD path.
#pragma once

#include <cstdint>

namespace attention {

struct PairArgs {
  const float* queries;   // the pair's first query head; head g at queries + g * query_stride
  int64_t query_stride;
  int64_t group;          // query heads sharing this kv head
  const void* keys;       // the cache's slot 0, this kv head: slot s at keys + s * row_stride elements
  const void* values;
  bool is_half;           // the cache holds IEEE float16 (as uint16_t), else float32
  int64_t row_stride;     // elements per cache slot (all kv heads)
  const int32_t* block_table;
  int64_t block_size;
  int64_t len;            // context length, this step's token included
  int64_t head_dim;
  float scale;
  float* scores;          // scratch [group, len]
  float* out;             // [group, head_dim], contiguous

  int64_t slot_of(int64_t t) const { return (int64_t)block_table[t / block_size] * block_size + t % block_size; }
};

// decode_attention_avx512.cpp: false (nothing written) for a head_dim it has no kernel for.
bool attend_pair_avx512(const PairArgs& args);

}  // namespace attention
