// One (sequence, kv head) pair of paged decode attention, as decode_attention.cpp hands it to a SIMD path.
#pragma once

#include <cstdint>

namespace attention {

constexpr int64_t kMaxGroup = 64;          // query heads a kv head, at most, for the AVX-512 path
constexpr int64_t kMaxTileQueries = 1024;  // a tile's rows x group, at most, for the AVX-512 path

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

// Consecutive query rows of one sequence (a prompt's chunk, positions p .. p + rows - 1) on one kv head: row r's
// queries attend the first len - (rows - 1 - r) positions, as causal attention does. Each key and value row is
// read once for all of the tile's rows x group queries, instead of once a row.
struct TileArgs {
  PairArgs pair;          // the first row's queries and out; len: the last row's context length
  int64_t rows;
  int64_t row_query_stride;  // floats from a row's queries to the next row's
  int64_t row_out_stride;    // floats from a row's outputs to the next row's
  float* acc;                // scratch [rows * group, head_dim]; pair.scores: [rows * group, len]
};

// decode_attention_avx512.cpp: false (nothing written) for a head_dim it has no kernel for.
bool attend_pair_avx512(const PairArgs& args);
bool attend_tile_avx512(const TileArgs& args);

}  // namespace attention
