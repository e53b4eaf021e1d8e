// Causal attention of a prompt chunk's rows in bfloat16 on AVX512_BF16 (vdpbf16ps), accumulated
// in float32, row by row: each (row, head) runs the same instructions in the same order over its
// keys, tiles of 64 keys cut at fixed positions from key 0, whatever rows, heads or threads are
// beside it, so a row's bits depend only on its query, its keys and its position (see
// models/prompt_attention_kernel.py).
//
// Per key head: the keys and values are rounded to bfloat16 once a call into the instruction's
// pair layouts (keys paired along the head dimension, values along the keys); per block of twelve
// query vectors of that key head (four rows of three heads sharing a key head, say), for each
// tile up to the last one a vector sees: the scores of all twelve (one vdpbf16ps per pair of
// dimensions, each key pair loaded once for the block), an online softmax per vector in float32
// (in base 2, by Cephes' exp2f polynomial; the sum kept lane by lane), its weights rounded to
// bfloat16, and the values accumulated (one vdpbf16ps per pair of keys, each value pair loaded
// once for the block). A vector's arithmetic is the same in any block: the block only shares
// loads. Why: torch's CPU flash attention runs bfloat16 no faster than float32 on a CPU without
// AMX, where this instruction doubles the multiply-adds per cycle; twelve vectors a block keep
// the loads below the multiply-adds (docs/extraction.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bfloat16.h"

namespace {

constexpr int LANES = 16;
constexpr int TILE = 64;   // keys a tile: four vectors of 16 scores
constexpr int BLOCK = 12;  // query vectors a pass over the keys (12 x 2 accumulators + 3 of 32 registers)

// 2^x for x <= 0 (scores less their maximum, in base 2: the scale folds in log2(e)), Cephes'
// exp2f: x = n + f, |f| <= 1/2, a degree-6 polynomial for 2^f, then 2^n by vscalefps (0 past
// the float range). About 1 ulp, four operations fewer than exp's (no multiply by log2(e), no
// two-part reduction by ln 2).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row of D (a multiple of 16) float32 values rounded to bfloat16 into `out`; a bfloat16 row
// (a cache that keeps bfloat16, uint16_t here) is copied: the rounding it already had.
inline void round_row(const float* x, int64_t D, uint16_t* out) {
  for (int64_t d = 0; d < D; d += LANES)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), to_bf16x16(_mm512_loadu_ps(x + d)));
}
inline void round_row(const uint16_t* x, int64_t D, uint16_t* out) { std::memcpy(out, x, D * sizeof(uint16_t)); }

struct Packed {
  // Keys: [tile][D/2][TILE][2]; values: [tile][TILE/2][D][2]; zeros past the last key. Left
  // uninitialised until pack_tile writes every element.
  std::unique_ptr<uint16_t[]> keys, values;
};

// One tile of one key head's keys and values ([KV, D] at row stride `rs`, float32 or bfloat16)
// in the pair layouts: a key's dimension pairs go to D/2 places a tile apart; two keys' values
// interleave.
template <typename T>
void pack_tile(const T* k, const T* v, int64_t rs, int64_t KV, int64_t D, int64_t t, Packed& out) {
  uint32_t* kt = reinterpret_cast<uint32_t*>(out.keys.get() + t * D * TILE);
  uint32_t* vt = reinterpret_cast<uint32_t*>(out.values.get() + t * TILE * D);
  alignas(64) uint16_t row[256], next[256];
  const int64_t end = std::min<int64_t>(TILE, KV - t * TILE);
  // Rows past the last key are zeros (every pair of the tile is written).
  const auto round_or_zero = [&](const T* x, int64_t in, uint16_t* to) {
    if (in < end) round_row(x + (t * TILE + in) * rs, D, to);
    else std::memset(to, 0, D * sizeof(uint16_t));
  };
  for (int64_t in = 0; in < TILE; in += 2) {
    round_or_zero(k, in, row);
    round_or_zero(k, in + 1, next);
    for (int64_t p = 0; p < D / 2; ++p) {
      std::memcpy(kt + p * TILE + in, row + 2 * p, 4);
      std::memcpy(kt + p * TILE + in + 1, next + 2 * p, 4);
    }
    round_or_zero(v, in, row);
    round_or_zero(v, in + 1, next);
    for (int64_t d = 0; d < D; d += LANES) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(row + d)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(next + d)));
      _mm512_storeu_si512(vt + (in / 2) * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

template <int D>
struct Block {
  alignas(64) uint16_t q[BLOCK][D];  // bfloat16 queries
  alignas(64) float out[BLOCK][D];
  alignas(64) float scores[BLOCK][TILE];
  alignas(64) uint16_t weights[BLOCK][TILE];
  int64_t from[BLOCK], last[BLOCK];  // the first and the last key each sees
  alignas(64) float sum[BLOCK][LANES];  // the weights' sums, lane by lane
  float max[BLOCK], alpha[BLOCK];
};

// acc[q] += vector q's bfloat16 pairs 0 .. N - 1 (row q of `a`, rows `a_row` apart) times the two
// 16-lane operands at `b`, `b_step` apart a pair: one vdpbf16ps a pair, vector and operand, each
// operand loaded once for the block. The inner loop of both the scores and the values.
template <int N>
inline void pair_products(__m512 (&acc)[BLOCK][2], const uint16_t* a, int64_t a_row, const uint16_t* b,
                          int64_t b_step) {
  for (int p = 0; p < N; ++p) {
    const uint16_t* bp = b + p * b_step;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + LANES * 2);
    for (int q = 0; q < BLOCK; ++q) {
      int32_t pair;
      std::memcpy(&pair, a + q * a_row + 2 * p, 4);
      const __m512bh aa = (__m512bh)_mm512_set1_epi32(pair);
      acc[q][0] = _mm512_dpbf16_ps(acc[q][0], aa, b0);
      acc[q][1] = _mm512_dpbf16_ps(acc[q][1], aa, b1);
    }
  }
}

// Scores of a tile's 64 keys for every vector, 32 keys at a time (pairs along the head dimension).
template <int D>
inline void tile_scores(Block<D>& blk, const uint16_t* kt) {
  for (int half = 0; half < 2; ++half) {
    __m512 s[BLOCK][2];
    for (int q = 0; q < BLOCK; ++q) s[q][0] = s[q][1] = _mm512_setzero_ps();
    pair_products<D / 2>(s, blk.q[0], D, kt + half * 2 * LANES * 2, TILE * 2);
    for (int q = 0; q < BLOCK; ++q) {
      _mm512_store_ps(blk.scores[q] + half * 2 * LANES, s[q][0]);
      _mm512_store_ps(blk.scores[q] + half * 2 * LANES + LANES, s[q][1]);
    }
  }
}

// One vector's online softmax step over a tile's scores: its weights rounded to bfloat16, the
// factor that rescales its output. Keys outside the vector's own are masked: their weight is 0.
// Two horizontal reductions a tile cost as much as the exps: the tile's maximum is reduced only
// where a score passes the running one (else the maximum stays and the factor is exactly 1, as
// exp(0) is), and the weights' sum is kept lane by lane and reduced once, at the end.
template <int D>
inline void tile_softmax(Block<D>& blk, int q, int64_t j0, float scale) {
  const __m512 sc = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
  const __m512 running = _mm512_set1_ps(blk.max[q]);
  // The tile's keys this vector sees: lanes lo .. hi - 1.
  const int64_t lo = std::max<int64_t>(0, blk.from[q] - j0), hi = std::min<int64_t>(TILE, blk.last[q] - j0 + 1);
  __mmask16 keep[4], above = 0;
  __m512 s[4];
  for (int b = 0; b < 4; ++b) {
    const int64_t l = std::clamp<int64_t>(lo - b * LANES, 0, LANES), h = std::clamp<int64_t>(hi - b * LANES, 0, LANES);
    keep[b] = __mmask16(((1u << h) - 1u) & ~((1u << l) - 1u));
    s[b] = _mm512_mask_mul_ps(minus_inf, keep[b], _mm512_load_ps(blk.scores[q] + b * LANES), sc);
    above |= _mm512_cmp_ps_mask(s[b], running, _CMP_GT_OQ);
  }
  float new_max = blk.max[q];
  blk.alpha[q] = 1.0f;
  if (above) {
    const __m512 m = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
    new_max = _mm512_reduce_max_ps(m);  // above the running maximum, so the new one
    blk.alpha[q] =
        blk.max[q] == -INFINITY ? 0.0f : _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps(blk.max[q] - new_max)));
  }
  const __m512 nm = _mm512_set1_ps(new_max);
  __m512 total = _mm512_mul_ps(_mm512_load_ps(blk.sum[q]), _mm512_set1_ps(blk.alpha[q]));
  for (int b = 0; b < 4; ++b) {
    const __m512 w = _mm512_maskz_mov_ps(keep[b], exp2_nonpositive(_mm512_sub_ps(s[b], nm)));
    total = _mm512_add_ps(total, w);
    _mm256_store_si256(reinterpret_cast<__m256i*>(blk.weights[q] + b * LANES), (__m256i)_mm512_cvtneps_pbh(w));
  }
  _mm512_store_ps(blk.sum[q], total);
  blk.max[q] = new_max;
}

// The outputs rescaled, then one vdpbf16ps a pair of keys a vector, 32 dimensions at a time
// (each value pair loaded once for the block). Only vectors that see the tile are written back.
template <int D>
inline void tile_values(Block<D>& blk, const uint16_t* vt, const bool* sees) {
  for (int c0 = 0; c0 < D / LANES; c0 += 2) {
    __m512 o[BLOCK][2];
    for (int q = 0; q < BLOCK; ++q) {
      const __m512 a = _mm512_set1_ps(blk.alpha[q]);
      o[q][0] = _mm512_mul_ps(_mm512_load_ps(blk.out[q] + c0 * LANES), a);
      o[q][1] = _mm512_mul_ps(_mm512_load_ps(blk.out[q] + c0 * LANES + LANES), a);
    }
    pair_products<TILE / 2>(o, blk.weights[0], TILE, vt + c0 * LANES * 2, D * 2);  // pairs along the keys
    for (int q = 0; q < BLOCK; ++q) {
      if (!sees[q]) continue;
      _mm512_store_ps(blk.out[q] + c0 * LANES, o[q][0]);
      _mm512_store_ps(blk.out[q] + c0 * LANES + LANES, o[q][1]);
    }
  }
}

template <int D>
void run_block(Block<D>& blk, const Packed& kv, float scale) {
  int64_t from = blk.from[0], last = 0;
  for (int q = 0; q < BLOCK; ++q) from = std::min(from, blk.from[q]), last = std::max(last, blk.last[q]);
  for (int64_t t = from / TILE; t * TILE <= last; ++t) {
    const int64_t j0 = t * TILE;
    // A vector that sees no key of this tile keeps its state: its bits must not depend on it.
    bool sees[BLOCK];
    for (int q = 0; q < BLOCK; ++q) sees[q] = blk.last[q] >= j0 && blk.from[q] < j0 + TILE;
    tile_scores<D>(blk, kv.keys.get() + t * D * TILE);
    for (int q = 0; q < BLOCK; ++q)
      if (sees[q]) tile_softmax<D>(blk, q, j0, scale);  // the others' products are computed, never stored
    tile_values<D>(blk, kv.values.get() + t * TILE * D, sees);
  }
}

template <int D, typename T>
void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first, double scale,
            int64_t window, at::Tensor& out) {
  const int64_t H = query.size(0), R = query.size(1), KVH = key.size(0), KV = key.size(1), G = H / KVH;
  const float* qp = query.const_data_ptr<float>();
  const T* kp = static_cast<const T*>(key.const_data_ptr());
  const T* vp = static_cast<const T*>(value.const_data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t tiles = (KV + TILE - 1) / TILE;
  // The first key row i sees: 0, or the window's first; tiles before row 0's are never read.
  const auto first_seen = [&](int64_t row) { return window > 0 ? std::max<int64_t>(0, first + row - window + 1) : 0; };
  const int64_t skipped = first_seen(0) / TILE, needed = tiles - skipped;
  std::vector<Packed> packed(KVH);
  for (auto& p : packed) {
    p.keys.reset(new uint16_t[tiles * D * TILE]);
    p.values.reset(new uint16_t[tiles * TILE * D]);
  }
  at::parallel_for(0, KVH * needed, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u)
      pack_tile(kp + (u / needed) * key.stride(0), vp + (u / needed) * value.stride(0), key.stride(1), KV, D,
                skipped + u % needed, packed[u / needed]);
  });
  // Query vectors of one key head in (row, head) order; blocks of BLOCK consecutive ones.
  const int64_t per_head = R * G, blocks = (per_head + BLOCK - 1) / BLOCK;
  at::parallel_for(0, KVH * blocks, 1, [&](int64_t b, int64_t e) {
    auto blk = std::make_unique<Block<D>>();
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t hk = unit / blocks, v0 = (unit % blocks) * BLOCK;
      const int nv = int(std::min<int64_t>(BLOCK, per_head - v0));
      for (int q = 0; q < BLOCK; ++q) {
        const int64_t i = v0 + (q < nv ? q : 0), row = i / G, head = hk * G + i % G;
        round_row(qp + head * query.stride(0) + row * query.stride(1), D, blk->q[q]);
        blk->from[q] = first_seen(row);
        blk->last[q] = std::min<int64_t>(first + row, KV - 1);
        blk->max[q] = -INFINITY;
        std::fill(blk->sum[q], blk->sum[q] + LANES, 0.0f);
        std::fill(blk->out[q], blk->out[q] + D, 0.0f);
      }
      run_block<D>(*blk, packed[hk], float(scale * 1.4426950408889634));  // scores in base 2
      for (int q = 0; q < nv; ++q) {
        const int64_t row = (v0 + q) / G, head = hk * G + (v0 + q) % G;
        float* o = op + (row * H + head) * D;
        const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(blk->sum[q]));
        for (int64_t d = 0; d < D; ++d) o[d] = blk->out[q][d] * inv;
      }
    }
  });
}

// query [H, R, D] float32, key / value [KVH, KV, D] both float32 or both bfloat16 (unit stride
// along D); row i sees keys 0 .. first + i, or with window > 0 the last `window` of them.
// Returns float32 [R, H, D].
at::Tensor prompt_attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first,
                         double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "prompt_attend: [H, R, D] and [KVH, KV, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "prompt_attend: float32 queries");
  const bool bf16 = cache_in_bfloat16(key, value, "prompt_attend");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && key.strides() == value.strides(),
              "prompt_attend: unit stride along D, keys and values alike");
  const int64_t H = query.size(0), R = query.size(1), D = query.size(2), KVH = key.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && key.size(2) == D && value.sizes() == key.sizes(), "prompt_attend: shapes");
  TORCH_CHECK(first >= 0 && first + R <= key.size(1), "prompt_attend: rows past the keys");
  TORCH_CHECK(window >= 0, "prompt_attend: window >= 0");
  auto out = at::empty({R, H, D}, query.options());
  if (R == 0) return out;
  switch (D) {
    case 64: (bf16 ? attend<64, uint16_t> : attend<64, float>)(query, key, value, first, scale, window, out); break;
    case 128: (bf16 ? attend<128, uint16_t> : attend<128, float>)(query, key, value, first, scale, window, out); break;
    case 256: (bf16 ? attend<256, uint16_t> : attend<256, float>)(query, key, value, first, scale, window, out); break;
    default: TORCH_CHECK(false, "prompt_attend: head dimension 64, 128 or 256");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("prompt_attend", &prompt_attend); }
