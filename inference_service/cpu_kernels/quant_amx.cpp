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
#define TMM_C 0
#define TMM_A 1
#define TMM_B0 2
#define TMM_B1 3
#define TMM_B2 4

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

// Weight rows [r0, r0 + num_rows) as A tiles [block][16 rows][32 codes] bf16; rows past num_rows zero.
AMX_FN void widen_weights(int64_t qtype, const uint8_t* qs, int64_t num_blocks, int64_t num_rows, uint16_t* tiles) {
  const int64_t qb = quant_bytes_per_block(qtype);
  // bf16 of code j & 15 at index j: vpermw reads an index's low 5 bits, and a low-nibble lane still
  // carries its byte's high nibble above bit 4, so entries 16-31 repeat 0-15.
  alignas(64) uint16_t table[32];
  for (int j = 0; j < 32; ++j) {
    const float code = static_cast<float>(qtype == kQ4_0 ? (j & 15) - 8 : (j & 15));
    uint32_t bits;
    std::memcpy(&bits, &code, sizeof(bits));
    table[j] = static_cast<uint16_t>(bits >> 16);  // small integers: exact
  }
  const __m512i codes = _mm512_load_si512(table);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint16_t* tile = tiles + b * kTile * kBlock;
    for (int64_t r = 0; r < kTile; ++r) {
      __m512i row = _mm512_setzero_si512();
      if (r < num_rows) {
        const uint8_t* q = qs + (r * num_blocks + b) * qb;
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
}

// n fp16 values as float32 into out.
AMX_FN inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, h + i)));
  }
}

struct Scratch {
  std::vector<uint16_t> a;  // A tiles of one row group, plus 64 bytes of slack to align them
  std::vector<float> d, m;  // the group's scales and mins [16][num_blocks]; rows past the weight's unset
};

// out[n, r] for one group of up to 16 weight rows (num_rows) and every token, from its widened A tiles.
// Rows past num_rows compute garbage (their scales are unset) that the masked stores leave out.
AMX_FN void matmul_group(const uint8_t* b_tiles, const float* sums, int64_t num_tokens,
                         int64_t num_blocks, const uint16_t* a_tiles, const float* d, const float* m,
                         int64_t num_rows, float* out, int64_t out_stride) {
  alignas(64) float c[kTile * kTile];
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kTile) {
    __m512 acc[kTile];
    for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* bt = b_tiles + t0 / kTile * num_blocks * kParts * kTileBytes;
    const float* st = sums + t0 / kTile * num_blocks * kTile;
    for (int64_t b = 0; b < num_blocks; ++b) {
      _tile_zero(TMM_C);
      _tile_loadd(TMM_A, a_tiles + b * kTile * kBlock, 64);
      _tile_loadd(TMM_B0, bt + (b * kParts) * kTileBytes, 64);
      _tile_loadd(TMM_B1, bt + (b * kParts + 1) * kTileBytes, 64);
      _tile_loadd(TMM_B2, bt + (b * kParts + 2) * kTileBytes, 64);
      _tile_dpbf16ps(TMM_C, TMM_A, TMM_B0);
      _tile_dpbf16ps(TMM_C, TMM_A, TMM_B1);
      _tile_dpbf16ps(TMM_C, TMM_A, TMM_B2);
      _tile_stored(TMM_C, c, 64);
      for (int r = 0; r < kTile; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + kTile * r), _mm512_set1_ps(d[r * num_blocks + b]), acc[r]);
      }
      if (m) {
        const __m512 s = _mm512_load_ps(st + b * kTile);
        for (int r = 0; r < kTile; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(m[r * num_blocks + b]), s, acc[r]);
      }
    }
    // acc[r] lane n is out[t0 + n, r]: transposed, each token's outputs are one (masked) store.
    __m512i rows[kTile];
    for (int r = 0; r < kTile; ++r) rows[r] = _mm512_castps_si512(acc[r]);
    transpose16(rows);
    const __mmask16 mask = static_cast<__mmask16>(num_rows >= kTile ? 0xFFFF : (1u << num_rows) - 1);
    for (int64_t n = 0; n < std::min<int64_t>(kTile, num_tokens - t0); ++n) {
      _mm512_mask_storeu_ps(out + (t0 + n) * out_stride, mask, _mm512_castsi512_ps(rows[n]));
    }
  }
}

AMX_FN void matmul_rows(int64_t qtype, const PackedActivations& packed, const uint8_t* qs, const uint16_t* scales,
                        const uint16_t* mins, int64_t num_blocks, float* out, int64_t out_stride, int64_t first,
                        int64_t last) {
  thread_local Scratch scratch;
  scratch.a.resize(num_blocks * kTile * kBlock + 32);
  scratch.d.resize(kTile * num_blocks);
  scratch.m.resize(kTile * num_blocks);
  uint16_t* a_tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.a.data()) + 63) & ~uintptr_t{63});
  const int64_t qb = quant_bytes_per_block(qtype);
  configure_tiles();  // per task: the pool's threads each need their own configuration
  for (int64_t r0 = first; r0 < last; r0 += kTile) {
    const int64_t num_rows = std::min<int64_t>(kTile, last - r0);
    widen_weights(qtype, qs + r0 * num_blocks * qb, num_blocks, num_rows, a_tiles);
    compiler_barrier();
    halves_to_floats(scales + r0 * num_blocks, num_rows * num_blocks, scratch.d.data());
    if (mins) halves_to_floats(mins + r0 * num_blocks, num_rows * num_blocks, scratch.m.data());
    matmul_group(packed.tile_data, packed.sum_data, packed.num_tokens, num_blocks, a_tiles,
                 scratch.d.data(), mins ? scratch.m.data() : nullptr, num_rows, out + r0, out_stride);
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
