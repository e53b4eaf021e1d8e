// Float32 attention of new query rows over their allowed keys, on AVX-512, computed row by row:
// every (row, head) runs the same instructions in the same order over the same sequence of
// allowed keys, whatever the other rows, heads, batch rows or padding keys are, so a row's bits
// depend only on its query and the keys it sees (see models/attention_kernel.py).
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

struct View4 {  // a float32 [B, H, R, D] tensor's pointer and strides (elements; D's stride is 1)
  const float* p;
  int64_t b, h, r;
  const float* at(int64_t bi, int64_t hi, int64_t ri) const { return p + bi * b + hi * h + ri * r; }
};

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

// One key head's keys [KV, D] as kt [D, padded] (zeros past KV), blocks [b0, b1) of 16 keys.
void transpose_keys(const View4& k, int64_t bi, int64_t hk, int64_t KV, int64_t D, int64_t padded, int64_t b0,
                    int64_t b1, float* kt) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t j0 = blk * LANES;
    for (int64_t c = 0; c < D / LANES; ++c) {
      __m512 r[16];
      for (int i = 0; i < LANES; ++i)
        r[i] = j0 + i < KV ? _mm512_loadu_ps(k.at(bi, hk, j0 + i) + c * LANES) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < LANES; ++i) _mm512_storeu_ps(kt + (c * LANES + i) * padded + j0, r[i]);
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

// The weighted values of NR rows (their sequences nested: the shorter a prefix of the longer,
// n[0] <= n[NR - 1]) for GB heads, divided by `total`: each (row, head, dimension) one chain of
// FMAs over its own sequence in order, whatever rows and heads share the pass.
template <int DC, int NR, int GB>
inline void weigh_values(const View4& v, int64_t bi, int64_t hk, const int32_t* keys, const int64_t* n,
                         const float* const* w, const __m512* total, float* const* out) {
  __m512 acc[NR][GB][DC];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c) acc[r][g][c] = _mm512_setzero_ps();
  // Keys every row sees, then (two rows) the longer row's own: compile-time row loops, so the
  // accumulators stay in registers.
  auto step = [&](int64_t j, auto rows_from) {
    constexpr int FIRST = decltype(rows_from)::value;
    const float* vp = v.at(bi, hk, keys[j]);
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = _mm512_loadu_ps(vp + c * LANES);
    for (int r = FIRST; r < NR; ++r)
      for (int g = 0; g < GB; ++g) {
        const __m512 wj = _mm512_set1_ps(w[r * GB + g][j]);
        for (int c = 0; c < DC; ++c) acc[r][g][c] = _mm512_fmadd_ps(wj, vv[c], acc[r][g][c]);
      }
  };
  int64_t j = 0;
  for (; j < n[0]; ++j) step(j, std::integral_constant<int, 0>{});
  if constexpr (NR == 2)
    for (; j < n[1]; ++j) step(j, std::integral_constant<int, 1>{});
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c)
        _mm512_storeu_ps(out[r] + g * DC * LANES + c * LANES,
                         n[r] > 0 ? _mm512_div_ps(acc[r][g][c], total[r * GB + g]) : _mm512_setzero_ps());
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

struct Scratch {
  std::vector<float> raw, weights;
  std::vector<const float*> qp;
  std::vector<float*> sp, wp;
};

// NR query rows (nested sequences, see weigh_values) of one batch row and key head: the `group`
// query heads that share the key head, over the allowed keys `keys[0..n[r])` (indices into the
// cache, in order). DC: the head dimension in 16s.
template <int DC, int NR>
void attend_rows_of(const View4& q, const float* kt, int64_t padded, const View4& v, int64_t bi, int64_t hk,
                    const int64_t* rows, int group, const int32_t* keys, const int64_t* n, float scale,
                    float* const* out, Scratch& s) {
  const int64_t D = DC * LANES, seen = n[NR - 1] > 0 ? keys[n[NR - 1] - 1] + 1 : 0;
  const int64_t blocks = (seen + LANES - 1) / LANES, seq = (n[NR - 1] + LANES - 1) / LANES * LANES;
  const int nq = NR * group;
  s.raw.resize(nq * blocks * LANES);
  s.weights.assign(nq * seq, 0.0f);
  s.qp.resize(nq);
  s.sp.resize(nq);
  s.wp.resize(nq);
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < group; ++g) {
      s.qp[r * group + g] = q.at(bi, hk * group + g, rows[r]);
      s.sp[r * group + g] = s.raw.data() + (r * group + g) * blocks * LANES;
      s.wp[r * group + g] = s.weights.data() + (r * group + g) * seq;
    }
  score_all(s.qp.data(), nq, kt, padded, D, blocks, scale, s.sp.data());
  std::vector<__m512> total(nq);
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < group; ++g) {
      const float* raw = s.sp[r * group + g];
      float* w = s.wp[r * group + g];
      for (int64_t j = 0; j < n[r]; ++j) w[j] = raw[keys[j]];
      total[r * group + g] = softmax_weights(w, n[r]);
    }
  // Heads in chunks whose accumulators fit the registers (NR x GB x DC <= 24 where it can).
  constexpr int GB = std::max(1, 24 / (NR * DC));
  for (int g = 0; g < group; g += GB) {
    const int gb = std::min(GB, group - g);
    const float* w[NR * GB];
    __m512 t[NR * GB];
    float* o[NR];
    for (int r = 0; r < NR; ++r) {
      for (int i = 0; i < gb; ++i) {
        w[r * gb + i] = s.wp[r * group + g + i];
        t[r * gb + i] = total[r * group + g + i];
      }
      o[r] = out[r] + (hk * group + g) * D;
    }
    switch (gb) {
#define CASE(K) case K: if constexpr (K <= GB) weigh_values<DC, NR, K>(v, bi, hk, keys, n, w, t, o); break;
      CASE(6) CASE(5) CASE(4) CASE(3) CASE(2)
#undef CASE
      default: weigh_values<DC, NR, 1>(v, bi, hk, keys, n, w, t, o); break;
    }
  }
}

View4 view(const at::Tensor& t) { return View4{t.const_data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

// query [B, H, R, D], key / value [B, Hk, KV, D] float32 (D's stride 1), allowed: None (every
// key) or bool [Bm, R, KV] with Bm 1 or B. Returns float32 [B, R, H, D] (the caller's transpose
// of it is the [B, H, R, D] result, laid out as the output projection reads it).
at::Tensor attend_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const c10::optional<at::Tensor>& allowed, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "attend_rows: query, key and value must be 4-d");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(3) == 1, "attend_rows: float32 tensors with a unit last stride");
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3);
  const int64_t Hk = key.size(1), KV = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.sizes() == key.sizes() && key.size(3) == D, "attend_rows: key and value must be [B, Hk, KV, D]");
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "attend_rows: head dimension 64, 128 or 256, not ", D);
  TORCH_CHECK(Hk > 0 && H % Hk == 0 && H / Hk <= MAX_GROUP, "attend_rows: ", H, " query heads over ", Hk, " key heads");
  const bool masked = allowed.has_value() && allowed->defined();
  at::Tensor mask;
  if (masked) {
    mask = allowed->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == B)
                && mask.size(1) == R && mask.size(2) == KV, "attend_rows: allowed must be bool [1 or B, R, KV]");
  }
  auto out = at::empty({B, R, H, D}, query.options());
  const int group = static_cast<int>(H / Hk);
  const View4 q = view(query), k = view(key), v = view(value);
  const bool* mp = masked ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t mask_b = masked && mask.size(0) == B ? R * KV : 0;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t padded = (KV + LANES - 1) / LANES * LANES, key_blocks = padded / LANES;
  // The keys of one batch row transposed once ([Hk, D, padded]), shared by all its rows and heads.
  std::vector<float> kt(Hk * D * padded);
  for (int64_t bi = 0; bi < B; ++bi) {
    at::parallel_for(0, Hk * key_blocks, std::max<int64_t>(1, 64 / std::max<int64_t>(1, D / LANES)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end;) {
        const int64_t hk = u / key_blocks, b0 = u % key_blocks, b1 = std::min(key_blocks, b0 + (end - u));
        transpose_keys(k, bi, hk, KV, D, padded, b0, b1, kt.data() + hk * D * padded);
        u += b1 - b0;
      }
    });
    // Threads split whole (key head, pair of query rows) units, never a sum; a forward of a few
    // rows over a few hundred keys stays on one thread.
    const int64_t pairs = (R + 1) / 2;
    const int64_t grain = std::max<int64_t>(1, 100000 / std::max<int64_t>(1, 2 * group * KV * D));
    at::parallel_for(0, Hk * pairs, grain, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> keys(2 * KV);
      Scratch scratch;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t hk = u / pairs, r0 = 2 * (u % pairs), nr = std::min<int64_t>(2, R - r0);
        int64_t n[2] = {0, 0};
        for (int64_t i = 0; i < nr; ++i) {
          int32_t* ks = keys.data() + i * KV;
          if (mp) {
            const bool* row = mp + bi * mask_b + (r0 + i) * KV;
            for (int64_t j = 0; j < KV; ++j)
              if (row[j]) ks[n[i]++] = static_cast<int32_t>(j);
          } else {
            for (int64_t j = 0; j < KV; ++j) ks[n[i]++] = static_cast<int32_t>(j);
          }
        }
        // Two rows share a pass when one's keys are the start of the other's (causal rows);
        // otherwise each takes its own. Either way each row's arithmetic is the same.
        const int longer = nr == 2 && n[1] < n[0] ? 0 : nr - 1, shorter = 1 - longer;
        const bool nested = nr == 2 && std::equal(keys.data() + shorter * KV, keys.data() + shorter * KV + n[shorter],
                                                  keys.data() + longer * KV);
        const float* kh = kt.data() + hk * D * padded;
        auto run = [&](const int64_t* rows, const int32_t* ks, const int64_t* counts, int count) {
          float* o[2] = {op + (bi * R + rows[0]) * H * D, count == 2 ? op + (bi * R + rows[1]) * H * D : nullptr};
          // Gemma's 256-wide heads: twice the accumulators of the 128-wide ones, so a pair of rows
          // spills registers; the arithmetic of each row is the same either way.
          if (count == 2) {
            if (D == 64) attend_rows_of<4, 2>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
            else if (D == 128) attend_rows_of<8, 2>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
            else attend_rows_of<16, 2>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
          } else {
            if (D == 64) attend_rows_of<4, 1>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
            else if (D == 128) attend_rows_of<8, 1>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
            else attend_rows_of<16, 1>(q, kh, padded, v, bi, hk, rows, group, ks, counts, sc, o, scratch);
          }
        };
        if (nested) {
          const int64_t rows[2] = {r0 + shorter, r0 + longer}, counts[2] = {n[shorter], n[longer]};
          run(rows, keys.data() + longer * KV, counts, 2);
        } else {
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t rows[1] = {r0 + i}, counts[1] = {n[i]};
            run(rows, keys.data() + i * KV, counts, 1);
          }
        }
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("attend_rows", &attend_rows); }
