// Float32 attention of new query rows over their allowed keys (float32, or bfloat16 widened
// exactly), on AVX-512: every (row, head) runs the same instructions in the same order over the
// same sequence of allowed keys, whatever the other rows, heads, batch rows, padding keys or
// threads are, so a row's bits depend only on its query and the keys it sees (see
// models/attention_kernel.py).
//
// A call runs in three phases, each split over threads by units whose arithmetic never depends
// on the split: the scores (key head x 64 keys), the softmax weights (row x head), the weighted
// values (key head x 16 dimensions x rows). Why this way: a decode step over a long context
// reads every key and value once per layer, so the step is bound by memory; the keys are
// transposed 64 at a time into a tile that stays in the core's cache, never into a buffer the
// size of the cache, the values are read once for all the rows that share their keys, and both
// are fetched a tile ahead of their use (prefetches change no arithmetic).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bfloat16.h"

namespace {

constexpr int LANES = 16;
constexpr int MAX_GROUP = 16;  // query heads per key head

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf: x = n ln2 + r, |r| <= ln2/2,
// a degree-7 polynomial for exp(r), then 2^n by vscalefps (0 past the float range). About 1 ulp.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// A [B, H, R, D] tensor's pointer and strides (elements; D's stride is 1), of float32 or of
// bfloat16 (uint16_t, a cache that keeps its keys and values in bfloat16).
template <typename T>
struct View4 {
  const T* p;
  int64_t b, h, r;
  const T* at(int64_t bi, int64_t hi, int64_t ri) const { return p + bi * b + hi * h + ri * r; }
};

// Sixteen consecutive values as float32: bfloat16 ones widened exactly, so a kernel given
// bfloat16 keys computes what it computes on float32 keys of those values.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) { return from_bf16x16(x); }

// Rows r[0..16) become columns: the standard unpack / shuffle network.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xDD);
    }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD);
    r[k + 4] = _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0x88);
    r[k + 12] = _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0xDD);
  }
}

constexpr int TILE = 64;  // keys a scoring unit transposes and scores at once: four blocks of 16

// Keys [j0, j0 + 16 nb) of one key head as tile [D, TILE] (zeros past KV).
template <typename T>
void transpose_tile(const View4<T>& k, int64_t bi, int64_t hk, int64_t KV, int64_t D, int64_t j0, int64_t nb,
                    float* tile) {
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t first = j0 + blk * LANES;
    for (int64_t c = 0; c < D / LANES; ++c) {
      __m512 r[16];
      for (int i = 0; i < LANES; ++i)
        r[i] = first + i < KV ? load16(k.at(bi, hk, first + i) + c * LANES) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < LANES; ++i) _mm512_storeu_ps(tile + (c * LANES + i) * TILE + blk * LANES, r[i]);
    }
  }
}

// Scores of NQ query vectors against NB blocks of 16 keys of kt: each key's dot product is
// q[0] k[0], then an FMA per dimension in order, then times the scale: the same arithmetic in
// every lane, pass, block and query vector, whatever vectors share the pass.
template <int NB, int NQ>
inline void score_blocks(const float* const* qp, const float* kt, int64_t padded, int64_t D, float scale,
                         float* const* s, int64_t at) {
  __m512 a[NQ][NB];
  for (int q = 0; q < NQ; ++q) {
    const __m512 q0 = _mm512_set1_ps(qp[q][0]);
    for (int b = 0; b < NB; ++b) a[q][b] = _mm512_mul_ps(q0, _mm512_loadu_ps(kt + b * LANES));
  }
  for (int64_t d = 1; d < D; ++d) {
    const float* row = kt + d * padded;
    __m512 kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = _mm512_loadu_ps(row + b * LANES);
    for (int q = 0; q < NQ; ++q) {
      const __m512 qd = _mm512_set1_ps(qp[q][d]);
      for (int b = 0; b < NB; ++b) a[q][b] = _mm512_fmadd_ps(qd, kv[b], a[q][b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int q = 0; q < NQ; ++q)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s[q] + at + b * LANES, _mm512_mul_ps(a[q][b], sc));
}

// NQ query vectors' scores over `blocks` blocks of 16 keys: four blocks a pass (NQ x 4 accumulators).
template <int NQ>
void score_vectors(const float* const* qp, const float* kt, int64_t padded, int64_t D, int64_t blocks, float scale,
                   float* const* s) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) score_blocks<4, NQ>(qp, kt + b * LANES, padded, D, scale, s, b * LANES);
  switch (blocks - b) {
    case 3: score_blocks<3, NQ>(qp, kt + b * LANES, padded, D, scale, s, b * LANES); break;
    case 2: score_blocks<2, NQ>(qp, kt + b * LANES, padded, D, scale, s, b * LANES); break;
    case 1: score_blocks<1, NQ>(qp, kt + b * LANES, padded, D, scale, s, b * LANES); break;
    default: break;
  }
}

// Every query vector's scores, six vectors a pass: kt is read once for six of them.
void score_all(const float* const* qp, int nq, const float* kt, int64_t padded, int64_t D, int64_t blocks, float scale,
               float* const* s) {
  for (int q = 0; q < nq; q += 6) {
    switch (std::min(6, nq - q)) {
      case 6: score_vectors<6>(qp + q, kt, padded, D, blocks, scale, s + q); break;
      case 5: score_vectors<5>(qp + q, kt, padded, D, blocks, scale, s + q); break;
      case 4: score_vectors<4>(qp + q, kt, padded, D, blocks, scale, s + q); break;
      case 3: score_vectors<3>(qp + q, kt, padded, D, blocks, scale, s + q); break;
      case 2: score_vectors<2>(qp + q, kt, padded, D, blocks, scale, s + q); break;
      default: score_vectors<1>(qp + q, kt, padded, D, blocks, scale, s + q); break;
    }
  }
}

// Softmax weights of one (row, head) in place over its n compacted scores: the maximum (exact
// whatever the order; the padding past n left out), exp(s - max), and their sum, lane-wise by
// place in the sequence (padding adds exact zeros).
inline __m512 softmax_weights(float* w, int64_t n) {
  const int64_t seq = (n + LANES - 1) / LANES * LANES;
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < seq; j += LANES) {
    const __mmask16 live = n - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, live, m, _mm512_loadu_ps(w + j));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < seq; j += LANES) {
    const __mmask16 live = n - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(w + j), mx)));
    _mm512_storeu_ps(w + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_set1_ps(_mm512_reduce_add_ps(sum));
}


constexpr int MAX_ACC = 24;  // accumulators a weighted-values pass keeps in registers

// CC 16-wide slices of the weighted values of NW (row, head) pairs over the key sequence
// keys[0..n) (indices into the cache, in order): each pair's slice is one chain of FMAs over the
// sequence, weights past a pair's own sequence being exact zeros (acc + 0 v = acc: a shorter,
// nested row gets the bits it gets alone), whatever pairs and slices share the pass.
template <int NW, int CC, typename T>
inline void weigh_slices(const T* v0, int64_t key_stride, const int32_t* keys, int64_t n, const float* const* w,
                         __m512* acc) {
  __m512 a[NW][CC];
  for (int i = 0; i < NW; ++i)
    for (int c = 0; c < CC; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* vp = v0 + keys[j] * key_stride;
    if (j + TILE < n)  // a tile ahead, as the scores fetch keys (see there)
      for (int c = 0; c < CC; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(v0 + keys[j + TILE] * key_stride + c * LANES), _MM_HINT_T1);
    __m512 vv[CC];
    for (int c = 0; c < CC; ++c) vv[c] = load16(vp + c * LANES);
    for (int i = 0; i < NW; ++i) {
      const __m512 wj = _mm512_set1_ps(w[i][j]);
      for (int c = 0; c < CC; ++c) a[i][c] = _mm512_fmadd_ps(wj, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int c = 0; c < CC; ++c) acc[i * CC + c] = a[i][c];
}

template <int CC, typename T>
void weigh_slices_of(int nw, const T* v0, int64_t key_stride, const int32_t* keys, int64_t n, const float* const* w,
                     __m512* acc) {
  switch (nw) {
#define CASE(K) case K: if constexpr (K * CC <= MAX_ACC) { weigh_slices<K, CC, T>(v0, key_stride, keys, n, w, acc); return; } break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
    CASE(13) CASE(14) CASE(15) CASE(16) CASE(17) CASE(18) CASE(19) CASE(20) CASE(21) CASE(22) CASE(23) CASE(24)
#undef CASE
    default: break;
  }
  TORCH_CHECK(false, "attend_rows: ", nw, " weight rows of ", CC, " slices a pass");
}

template <typename T>
void weigh_slices_any(int nw, int cc, const T* v0, int64_t key_stride, const int32_t* keys, int64_t n,
                      const float* const* w, __m512* acc) {
  if (cc == 4) weigh_slices_of<4, T>(nw, v0, key_stride, keys, n, w, acc);
  else if (cc == 2) weigh_slices_of<2, T>(nw, v0, key_stride, keys, n, w, acc);
  else weigh_slices_of<1, T>(nw, v0, key_stride, keys, n, w, acc);
}

// Rows a call takes at once (the scores of a tile of rows are held for all its keys).
constexpr int64_t ROW_TILE = 16;

template <typename T>
View4<T> view(const at::Tensor& t) {
  return View4<T>{static_cast<const T*>(t.const_data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// Units of a phase split over threads, at least `min_work` multiply-adds a thread: a forward of
// a few rows over a few hundred keys stays on one thread (a wake-up costs more than it saves).
int64_t grain(int64_t units, int64_t work_per_unit, int64_t min_work = 50000) {
  return std::max<int64_t>(1, std::min<int64_t>(units, min_work / std::max<int64_t>(1, work_per_unit)));
}

// The call's work over keys and values of type T (float, or uint16_t holding bfloat16), the
// arguments checked by attend_rows; writes out [B, R, H, D].
template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                double scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3);
  const int64_t Hk = key.size(1), KV = key.size(2);
  const bool masked = mask.defined();
  const int64_t group = H / Hk, DC = D / LANES;
  const View4<float> q = view<float>(query);
  const View4<T> k = view<T>(key), v = view<T>(value);
  const bool* mp = masked ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t mask_b = masked && mask.size(0) == B ? R * KV : 0;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  std::vector<int32_t> keys(std::min(R, ROW_TILE) * KV);
  std::vector<float> scores, weights;
  std::vector<__m512> totals;
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE) {
      const int64_t rt = std::min(ROW_TILE, R - r0);
      // Each row's allowed keys in order, and whether every row's are the start of the longest's
      // (causal rows): then the values are read once for all of them.
      int64_t n[ROW_TILE], longest = 0;
      for (int64_t i = 0; i < rt; ++i) {
        int32_t* ks = keys.data() + i * KV;
        n[i] = 0;
        if (mp) {
          const bool* row = mp + bi * mask_b + (r0 + i) * KV;
          for (int64_t j = 0; j < KV; ++j)
            if (row[j]) ks[n[i]++] = static_cast<int32_t>(j);
        } else {
          for (int64_t j = 0; j < KV; ++j) ks[n[i]++] = static_cast<int32_t>(j);
        }
        if (n[i] > n[longest]) longest = i;
      }
      bool nested = true;
      for (int64_t i = 0; i < rt && nested; ++i)
        nested = std::equal(keys.data() + i * KV, keys.data() + i * KV + n[i], keys.data() + longest * KV);
      int64_t seen = 0;
      for (int64_t i = 0; i < rt; ++i) seen = std::max<int64_t>(seen, n[i] ? keys[i * KV + n[i] - 1] + 1 : 0);
      const int64_t padded = (seen + LANES - 1) / LANES * LANES, tiles = (padded + TILE - 1) / TILE;
      const int64_t width = (n[longest] + LANES - 1) / LANES * LANES;  // a weight row: the longest sequence, padded
      const int64_t nq = rt * group;  // query vectors a key head scores: row-major, then head
      scores.resize(Hk * nq * padded);
      weights.assign(rt * H * std::max<int64_t>(width, 1), 0.0f);
      totals.resize(rt * H);

      // Scores: a unit is a key head's tile of 64 keys, for every query vector of the key head.
      at::parallel_for(0, Hk * tiles, grain(Hk * tiles, nq * TILE * D), [&](int64_t begin, int64_t end) {
        std::vector<float> tile(D * TILE);
        std::vector<const float*> qp(nq);
        std::vector<float*> sp(nq);
        for (int64_t u = begin; u < end; ++u) {
          const int64_t hk = u / tiles, j0 = (u % tiles) * TILE, nb = std::min<int64_t>(TILE, padded - j0) / LANES;
          // The next tile's keys asked of memory while this one is scored: a decode step over a
          // long context finds none of them in the cache, and the transposition's own loads
          // left the core waiting on each (docs/extraction.md, long documents).
          for (int64_t j = j0 + TILE; j < std::min<int64_t>(j0 + 2 * TILE, KV); ++j)
            for (int64_t c = 0; c < D; c += LANES)
              _mm_prefetch(reinterpret_cast<const char*>(k.at(bi, hk, j) + c), _MM_HINT_T1);
          transpose_tile(k, bi, hk, KV, D, j0, nb, tile.data());
          for (int64_t i = 0; i < rt; ++i)
            for (int64_t g = 0; g < group; ++g) {
              qp[i * group + g] = q.at(bi, hk * group + g, r0 + i);
              sp[i * group + g] = scores.data() + (hk * nq + i * group + g) * padded + j0;
            }
          for (int64_t first = 0; first < nq; first += 6) {
            const int count = static_cast<int>(std::min<int64_t>(6, nq - first));
            score_all(qp.data() + first, count, tile.data(), TILE, D, nb, sc, sp.data() + first);
          }
        }
      });

      // Softmax weights: a unit is a (row, head), its scores gathered in its sequence's order.
      at::parallel_for(0, rt * H, grain(rt * H, n[longest] * 4), [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          const int64_t i = u / H, h = u % H, hk = h / group, g = h % group;
          const float* raw = scores.data() + (hk * nq + i * group + g) * padded;
          float* w = weights.data() + u * width;
          const int32_t* ks = keys.data() + i * KV;
          for (int64_t j = 0; j < n[i]; ++j) w[j] = raw[ks[j]];
          totals[u] = softmax_weights(w, n[i]);
        }
      });

      // Weighted values: a unit is a key head's `cc` slices of 16 dimensions for a pass of (row,
      // head) pairs (rows side by side when nested, else one row a pass), at most MAX_ACC
      // accumulators. Slices as wide as leave each thread two units (a decode step's few heads).
      int64_t cc = std::min<int64_t>(4, DC);
      while (cc > 1 && Hk * (DC / cc) < 2 * at::get_num_threads()) cc /= 2;
      const int64_t rows_a_pass = nested ? std::max<int64_t>(1, MAX_ACC / (cc * group)) : 1;
      while (cc > 1 && group * cc > MAX_ACC) cc /= 2;  // 16 heads a key head: one slice a pass
      struct Pass { int64_t row0, rows; };
      std::vector<Pass> passes;
      for (int64_t i = 0; i < rt; i += rows_a_pass) passes.push_back({i, std::min(rows_a_pass, rt - i)});
      const int64_t np = static_cast<int64_t>(passes.size()), slices = DC / cc, units = Hk * slices * np;
      at::parallel_for(0, units, grain(units, n[longest] * rows_a_pass * group * cc * LANES),
                       [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          const int64_t hk = u / (slices * np), c0 = (u / np) % slices * cc;
          const Pass p = passes[u % np];
          // The pass's sequence: its longest row's (every row of a nested pass is a start of it).
          int64_t lead = p.row0;
          for (int64_t i = p.row0; i < p.row0 + p.rows; ++i)
            if (n[i] > n[lead]) lead = i;
          const float* w[MAX_ACC];
          __m512 acc[MAX_ACC];
          int nw = 0;
          for (int64_t i = p.row0; i < p.row0 + p.rows; ++i)
            for (int64_t g = 0; g < group; ++g) w[nw++] = weights.data() + (i * H + hk * group + g) * width;
          weigh_slices_any(nw, static_cast<int>(cc), v.at(bi, hk, 0) + c0 * LANES, v.r, keys.data() + lead * KV,
                           n[lead], w, acc);
          nw = 0;
          for (int64_t i = p.row0; i < p.row0 + p.rows; ++i)
            for (int64_t g = 0; g < group; ++g, ++nw) {
              const __m512 total = totals[i * H + hk * group + g];
              float* o = op + ((bi * R + r0 + i) * H + hk * group + g) * D + c0 * LANES;
              for (int64_t c = 0; c < cc; ++c)
                _mm512_storeu_ps(o + c * LANES, n[i] > 0 ? _mm512_div_ps(acc[nw * cc + c], total) : _mm512_setzero_ps());
            }
        }
      });
    }
}

// query [B, H, R, D] float32, key / value [B, Hk, KV, D] both float32 or both bfloat16 (D's
// stride 1), allowed: None (every key) or bool [Bm, R, KV] with Bm 1 or B. Returns float32
// [B, R, H, D] (the caller's transpose of it is the [B, H, R, D] result, laid out as the output
// projection reads it).
at::Tensor attend_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const c10::optional<at::Tensor>& allowed, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "attend_rows: query, key and value must be 4-d");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "attend_rows: float32 queries");
  const bool bf16 = cache_in_bfloat16(key, value, "attend_rows");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(3) == 1, "attend_rows: tensors with a unit last stride");
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3);
  const int64_t Hk = key.size(1), KV = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.sizes() == key.sizes() && key.size(3) == D, "attend_rows: key and value must be [B, Hk, KV, D]");
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "attend_rows: head dimension 64, 128 or 256, not ", D);
  TORCH_CHECK(Hk > 0 && H % Hk == 0 && H / Hk <= MAX_GROUP, "attend_rows: ", H, " query heads over ", Hk, " key heads");
  at::Tensor mask;
  if (allowed.has_value() && allowed->defined()) {
    mask = allowed->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == B)
                && mask.size(1) == R && mask.size(2) == KV, "attend_rows: allowed must be bool [1 or B, R, KV]");
  }
  auto out = at::empty({B, R, H, D}, query.options());
  if (bf16) attend_all<uint16_t>(query, key, value, mask, scale, out);
  else attend_all<float>(query, key, value, mask, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("attend_rows", &attend_rows); }
