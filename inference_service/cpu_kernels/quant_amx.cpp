// The AMX-BF16 path of the quantized matmul (the layout and the other paths: quant_matmul.cpp).
//
// out^T = W x^T with the weights as the tiles' A operand (no weight transposes: an A tile row is K
// contiguous, as GGUF stores a row): an A tile is 16 weight rows x one 32-element block of integer
// codes (Q4_0 q - 8, Q4_1 q, Q8_0 q), which bf16 represents exactly. The activations are the B operand,
// packed once a call in the VNNI layout (a B tile row is one K pair for 16 tokens). Each fp32 activation
// is split into bf16 parts x = hi + mid + lo, exact for fp32, so every code x part product is exact and
// TDPBF16PS sums them in fp32: C[r][n] = sum over the block of q * x. The block's scale then applies in
// fp32 registers, acc[r] += d[r][b] * C[r] (and Q4_1's acc[r] += m[r][b] * sum of the block's x): the
// dequantized fp32 model up to summation order.
//
//   A tile (weights)        B tile (one part)                 C tile
//   16 rows x 32 codes      16 K pairs x 16 tokens x 2         16 rows x 16 tokens, fp32
//   [r][k] bf16             [k / 2][n][k % 2] bf16

#include "quant_blocks.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace quant {
namespace {

constexpr int kTile = 16;                          // weight rows of an A tile, tokens of a B tile
constexpr int kParts = 3;                          // bf16 parts of an fp32 activation
constexpr int64_t kTileBytes = 1024;               // every tile here is 16 rows x 64 bytes
// Tile registers (the intrinsics paste their number into the instruction, so macros): C, A, the B parts.
#define TMM_C0 0
#define TMM_C1 1
#define TMM_A0 2
#define TMM_A1 3
#define TMM_B0 4
#define TMM_B1 5
#define TMM_B2 6

// NOTE: GCC's tileloadd and ldtilecfg do not tell the compiler which memory they read: without this
// barrier it may sink or drop the stores that fill a tile's buffer or the configuration.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// The 64-byte block _tile_loadconfig reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

AMX_FN void configure_tiles() {
  TileConfig config;
  for (int t = 0; t <= TMM_B2; ++t) {
    config.rows[t] = kTile;
    config.colsb[t] = 64;
  }
  compiler_barrier();
  _tile_loadconfig(&config);
}

// Rows r[0..15] of 32-bit elements transposed in place (r[i] lane j <- r[j] lane i).
AMX_FN inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
      t[8 * h + i + 4] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

AMX_FN inline __m512 bf16_to_float(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Activations [num_tokens, K] -> B tiles [token tile][block][part] and block sums [token tile][block][16]
// for the (token tile, block) pairs [first, last) in that order, tokens past num_tokens zero. A part's 32
// bf16 of one token are 16 K pairs: one column of the B tile.
AMX_FN void pack_activations(const float* x, int64_t x_stride, int64_t num_tokens, int64_t num_blocks,
                             int64_t first, int64_t last, uint8_t* tiles, float* sums) {
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t t0 = pair / num_blocks * kTile, b = pair % num_blocks;
    __m512i parts[kParts][kTile];
    alignas(64) float block_sums[kTile];
    for (int n = 0; n < kTile; ++n) {
      __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
      if (t0 + n < num_tokens) {
        const float* xb = x + (t0 + n) * x_stride + b * kBlock;
        x0 = _mm512_loadu_ps(xb);
        x1 = _mm512_loadu_ps(xb + 16);
      }
      block_sums[n] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      for (int p = 0; p < kParts; ++p) {
        // The 32 bf16 in K order: as 16 dwords, dword i is the pair (2i, 2i + 1), one B tile row.
        const __m512i part = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0));
        parts[p][n] = part;
        x0 = _mm512_sub_ps(x0, bf16_to_float(_mm512_castsi512_si256(part)));  // exact: what is left over
        x1 = _mm512_sub_ps(x1, bf16_to_float(_mm512_extracti64x4_epi64(part, 1)));
      }
    }
    for (int p = 0; p < kParts; ++p) {
      transpose16(parts[p]);
      uint8_t* tile = tiles + ((t0 / kTile * num_blocks + b) * kParts + p) * kTileBytes;
      for (int i = 0; i < kTile; ++i) _mm512_store_si512(tile + 64 * i, parts[p][i]);
    }
    std::memcpy(sums + (t0 / kTile * num_blocks + b) * kTile, block_sums, sizeof(block_sums));
  }
}

// The table widen_block turns 4-bit codes into bf16 with: bf16 of code j & 15 at index j (vpermw reads an
// index's low 5 bits, and a low-nibble lane still carries its byte's high nibble above bit 4, so entries
// 16-31 repeat 0-15).
AMX_FN __m512i code_table(int64_t qtype) {
  alignas(64) uint16_t table[32];
  for (int j = 0; j < 32; ++j) {
    const float code = static_cast<float>(qtype == kQ4_0 ? (j & 15) - 8 : (j & 15));
    uint32_t bits;
    std::memcpy(&bits, &code, sizeof(bits));
    table[j] = static_cast<uint16_t>(bits >> 16);  // small integers: exact
  }
  return _mm512_load_si512(table);
}

// One block of 16 weight rows (q at its first row's block, rows row_bytes apart) as an A tile [16 rows][32
// codes] bf16; rows past num_rows zero.
AMX_FN inline void widen_block(int64_t qtype, const uint8_t* q, int64_t row_bytes, int64_t num_rows, __m512i codes,
                               uint16_t* tile) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t r = 0; r < kTile; ++r, q += row_bytes) {
    __m512i row = _mm512_setzero_si512();
    if (r < num_rows) {
      if (qtype == kQ8_0) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
        row = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      } else {
        // Bytes 0-15 in words 0-15 and again in 16-31; the second copy shifted to its high nibbles.
        const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        row = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), shifts), codes);
      }
    }
    _mm512_store_si512(tile + r * kBlock, row);
  }
}

// n fp16 values as float32 into out.
AMX_FN inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, h + i)));
  }
}

// C = A x (B0 + B1 + B2), stored to c, through the numbered tiles C_TILE and A_TILE (a macro: the intrinsics
// paste a tile's number into the instruction).
#define BLOCK_PRODUCTS(C_TILE, A_TILE, a, bt, c)     \
  do {                                               \
    _tile_loadd(A_TILE, a, 64);                      \
    _tile_loadd(TMM_B0, bt, 64);                     \
    _tile_loadd(TMM_B1, (bt) + kTileBytes, 64);      \
    _tile_loadd(TMM_B2, (bt) + 2 * kTileBytes, 64);  \
    _tile_zero(C_TILE);                              \
    _tile_dpbf16ps(C_TILE, A_TILE, TMM_B0);          \
    _tile_dpbf16ps(C_TILE, A_TILE, TMM_B1);          \
    _tile_dpbf16ps(C_TILE, A_TILE, TMM_B2);          \
    _tile_stored(C_TILE, c, 64);                     \
  } while (0)

// acc[r] += a block's products c[r] x its scales d[r * stride] (and Q4_1's mins m[r * stride] x the block's
// activation sums s).
AMX_FN inline void scale_block(const float* c, const float* d, const float* m, const float* s, int64_t stride,
                               __m512 acc[kTile]) {
  for (int r = 0; r < kTile; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + kTile * r), _mm512_set1_ps(d[r * stride]), acc[r]);
  }
  if (m) {
    const __m512 sums = _mm512_load_ps(s);
    for (int r = 0; r < kTile; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(m[r * stride]), sums, acc[r]);
  }
}

// Weight rows a panel: their accumulators (1 KiB a 16-row group and token tile) stay in cache across its chunks.
constexpr int64_t kPanelRows = 256;
// K blocks a chunk at most: the chunk's B tiles (3 KiB a block and token tile) stay in L1 while every group of
// the panel passes over them.
constexpr int64_t kMaxChunkBlocks = 6;
// Items ahead whose quants an item prefetches. NOTE: with the weights cold in cache (as in a model step), a
// 16-token call over a 3072 x 576 Q4_1 weight took ~105 ns a 16 x 32 block without, ~86 with (~55 warm).
constexpr int64_t kPrefetchItems = 4;

struct Scratch {
  std::vector<uint16_t> a;  // A tiles of two (chunk, group) items [parity][block of the chunk], aligned within
  std::vector<float> acc;   // accumulators [token tile][group][16 rows][16 tokens], aligned within
  std::vector<float> d, m;  // the panel's scales and mins [row][num_blocks]
};

template <typename T>
T* aligned_64(std::vector<T>& v) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// out[n, r] for weight rows [first, last) and every token. The panel's (chunk, group) items run in order,
// each over its chunk's blocks and every token tile, accumulating in fp32 registers. Rows past the weight's
// in a partial group compute garbage (zero codes, stale scales) that the masked stores leave out.
// NOTE: the order and the pipelining come from measurements (2026-11-27, Xeon with AMX, 16 tokens, per 16 x 32
// block of weights): the tile products and the AVX-512 work (widening, scaling) add up rather than overlap.
// B tiles read from L2 cost ~15 ns a block (a third of the total: hence chunks whose B tiles stay in L1); a
// tile load of A tiles AVX-512 stores just wrote waits ~30 ns (hence the next item's A tiles are widened
// during this one); the scales apply two blocks after their products, when the tile store has landed.
AMX_FN void matmul_rows(int64_t qtype, const PackedActivations& packed, const uint8_t* qs, const uint16_t* scales,
                        const uint16_t* mins, int64_t num_blocks, float* out, int64_t out_stride, int64_t first,
                        int64_t last) {
  const int64_t qb = quant_bytes_per_block(qtype), row_bytes = num_blocks * qb;
  const int64_t num_tokens = packed.num_tokens, num_token_tiles = (num_tokens + kTile - 1) / kTile;
  const int64_t num_chunks = (num_blocks + kMaxChunkBlocks - 1) / kMaxChunkBlocks;
  const int64_t chunk_blocks = (num_blocks + num_chunks - 1) / num_chunks;
  constexpr int64_t kGroupsAPanel = kPanelRows / kTile, kTileElems = kTile * kBlock;
  thread_local Scratch scratch;
  scratch.a.resize(2 * chunk_blocks * kTileElems + 32);
  scratch.acc.resize(num_token_tiles * kGroupsAPanel * kTile * kTile + 16);
  scratch.d.resize(kPanelRows * num_blocks);
  scratch.m.resize(kPanelRows * num_blocks);
  uint16_t* a_tiles = aligned_64(scratch.a);
  float* acc_panel = aligned_64(scratch.acc);
  const __m512i codes = code_table(qtype);
  alignas(64) float c[4][kTile * kTile];  // the last four blocks' products
  configure_tiles();  // per task: the pool's threads each need their own configuration
  for (int64_t p0 = first; p0 < last; p0 += kPanelRows) {
    const int64_t panel_rows = std::min(kPanelRows, last - p0), num_groups = (panel_rows + kTile - 1) / kTile;
    const uint8_t* panel_qs = qs + p0 * row_bytes;
    halves_to_floats(scales + p0 * num_blocks, panel_rows * num_blocks, scratch.d.data());
    if (mins) halves_to_floats(mins + p0 * num_blocks, panel_rows * num_blocks, scratch.m.data());
    std::memset(acc_panel, 0, num_token_tiles * num_groups * kTile * kTile * sizeof(float));
    auto item_blocks = [&](int64_t chunk) { return std::min(chunk_blocks, num_blocks - chunk * chunk_blocks); };
    auto item_rows = [&](int64_t group) { return std::min<int64_t>(kTile, panel_rows - group * kTile); };
    for (int64_t j = 0; j < item_blocks(0); ++j) {
      widen_block(qtype, panel_qs + j * qb, row_bytes, item_rows(0), codes, a_tiles + j * kTileElems);
    }
    int64_t parity = 0;
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const int64_t b0 = chunk * chunk_blocks, num_chunk_blocks = item_blocks(chunk);
      for (int64_t g = 0; g < num_groups; ++g, parity ^= 1) {
        // The next item, whose A tiles this one widens: the next group, or the next chunk's first.
        const bool last_group = g + 1 == num_groups;
        const int64_t next_chunk = last_group ? chunk + 1 : chunk, next_group = last_group ? 0 : g + 1;
        const int64_t num_next_blocks = next_chunk < num_chunks ? item_blocks(next_chunk) : 0;
        const uint8_t* next_qs = panel_qs + next_group * kTile * row_bytes + next_chunk * chunk_blocks * qb;
        const int64_t ahead = chunk * num_groups + g + kPrefetchItems;  // into L2 while this item computes
        if (ahead < num_chunks * num_groups) {
          const int64_t ahead_chunk = ahead / num_groups, ahead_group = ahead % num_groups;
          const uint8_t* ahead_qs = panel_qs + ahead_group * kTile * row_bytes + ahead_chunk * chunk_blocks * qb;
          for (int64_t r = 0; r < item_rows(ahead_group); ++r) {
            prefetch_lines<_MM_HINT_T1>(ahead_qs + r * row_bytes, item_blocks(ahead_chunk) * qb);
          }
        }
        const uint16_t* a = a_tiles + parity * chunk_blocks * kTileElems;
        uint16_t* a_next = a_tiles + (parity ^ 1) * chunk_blocks * kTileElems;
        const float* d = scratch.d.data() + g * kTile * num_blocks + b0;
        const float* m = mins ? scratch.m.data() + g * kTile * num_blocks + b0 : nullptr;
        for (int64_t t = 0; t < num_token_tiles; ++t) {
          const uint8_t* bt = packed.tile_data + (t * num_blocks + b0) * kParts * kTileBytes;
          const float* st = packed.sum_data + (t * num_blocks + b0) * kTile;
          float* acc_saved = acc_panel + (t * num_groups + g) * kTile * kTile;
          __m512 acc[kTile];
          for (int r = 0; r < kTile; ++r) acc[r] = _mm512_load_ps(acc_saved + kTile * r);
          for (int64_t j = 0; j < num_chunk_blocks; ++j) {
            compiler_barrier();
            if (j & 1) {
              BLOCK_PRODUCTS(TMM_C1, TMM_A1, a + j * kTileElems, bt + j * kParts * kTileBytes, c[j & 3]);
            } else {
              BLOCK_PRODUCTS(TMM_C0, TMM_A0, a + j * kTileElems, bt + j * kParts * kTileBytes, c[j & 3]);
            }
            if (t == 0 && j < num_next_blocks) {
              widen_block(qtype, next_qs + j * qb, row_bytes, item_rows(next_group), codes, a_next + j * kTileElems);
            }
            compiler_barrier();
            if (j >= 2) {
              scale_block(c[(j - 2) & 3], d + j - 2, m ? m + j - 2 : nullptr, st + (j - 2) * kTile, num_blocks, acc);
            }
          }
          for (int64_t j = std::max<int64_t>(0, num_chunk_blocks - 2); j < num_chunk_blocks; ++j) {
            scale_block(c[j & 3], d + j, m ? m + j : nullptr, st + j * kTile, num_blocks, acc);
          }
          for (int r = 0; r < kTile; ++r) _mm512_store_ps(acc_saved + kTile * r, acc[r]);
        }
      }
    }
    // acc[t][g] row r lane n is out[16 t + n, p0 + 16 g + r]: transposed, each token's outputs are one (masked)
    // store a group.
    for (int64_t t = 0; t < num_token_tiles; ++t) {
      for (int64_t g = 0; g < num_groups; ++g) {
        __m512i rows[kTile];
        const float* acc_saved = acc_panel + (t * num_groups + g) * kTile * kTile;
        for (int r = 0; r < kTile; ++r) rows[r] = _mm512_load_si512(acc_saved + kTile * r);
        transpose16(rows);
        const int64_t group_rows = item_rows(g);
        const __mmask16 mask = static_cast<__mmask16>(group_rows >= kTile ? 0xFFFF : (1u << group_rows) - 1);
        for (int64_t n = 0; n < std::min<int64_t>(kTile, num_tokens - t * kTile); ++n) {
          float* out_row = out + (t * kTile + n) * out_stride + p0 + g * kTile;
          _mm512_mask_storeu_ps(out_row, mask, _mm512_castsi512_ps(rows[n]));
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_available() {
  static const bool available = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) {
      return false;
    }
    // Linux hands out the tiles' state only to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

// NOTE: the exported functions carry no target attribute (see quant_avx512.cpp); callers check
// amx_available() first.
void reserve_activations_amx(int64_t num_tokens, int64_t num_blocks, PackedActivations& packed) {
  const int64_t num_tiles = (num_tokens + kTile - 1) / kTile;
  packed.tiles.resize(num_tiles * num_blocks * kParts * kTileBytes + 64);
  packed.sums.resize(num_tiles * num_blocks * kTile + 16);
  packed.num_tokens = num_tokens;
  packed.num_blocks = num_blocks;
  packed.tile_data = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(packed.tiles.data()) + 63) & ~uintptr_t{63});
  packed.sum_data = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(packed.sums.data()) + 63) & ~uintptr_t{63});
}

void pack_activations_amx(const float* x, int64_t x_stride, int64_t first, int64_t last,
                          const PackedActivations& packed) {
  pack_activations(x, x_stride, packed.num_tokens, packed.num_blocks, first, last, packed.tile_data,
                   packed.sum_data);
}

void matmul_rows_amx(int64_t qtype, const PackedActivations& packed, const uint8_t* qs, const uint16_t* scales,
                     const uint16_t* mins, int64_t num_blocks, float* out, int64_t out_stride, int64_t first,
                     int64_t last) {
  matmul_rows(qtype, packed, qs, scales, mins, num_blocks, out, out_stride, first, last);
}

}  // namespace quant
