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

// Scores of one query row against NB blocks of 16 keys of kt: each key's dot product is
// q[0] k[0], then an FMA per dimension in order, then times the scale: the same arithmetic in
// every lane, pass and row.
template <int NB>
inline void score_blocks(const float* qp, const float* kt, int64_t padded, int64_t D, float scale, float* s) {
  __m512 a[NB];
  const __m512 q0 = _mm512_set1_ps(qp[0]);
  for (int b = 0; b < NB; ++b) a[b] = _mm512_mul_ps(q0, _mm512_loadu_ps(kt + b * LANES));
  for (int64_t d = 1; d < D; ++d) {
    const __m512 qd = _mm512_set1_ps(qp[d]);
    const float* row = kt + d * padded;
    for (int b = 0; b < NB; ++b) a[b] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row + b * LANES), a[b]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + b * LANES, _mm512_mul_ps(a[b], sc));
}

void score_row(const float* qp, const float* kt, int64_t padded, int64_t D, int64_t blocks, float scale, float* s) {
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) score_blocks<8>(qp, kt + b * LANES, padded, D, scale, s + b * LANES);
  const float* k = kt + b * LANES;
  float* o = s + b * LANES;
  switch (blocks - b) {
    case 7: score_blocks<7>(qp, k, padded, D, scale, o); break;
    case 6: score_blocks<6>(qp, k, padded, D, scale, o); break;
    case 5: score_blocks<5>(qp, k, padded, D, scale, o); break;
    case 4: score_blocks<4>(qp, k, padded, D, scale, o); break;
    case 3: score_blocks<3>(qp, k, padded, D, scale, o); break;
    case 2: score_blocks<2>(qp, k, padded, D, scale, o); break;
    case 1: score_blocks<1>(qp, k, padded, D, scale, o); break;
    default: break;
  }
}

// GB heads' weighted sums of the values over the sequence `keys[0..n)`, divided by `total`.
template <int DC, int GB>
inline void weigh_values(const View4& v, int64_t bi, int64_t hk, const int32_t* keys, int64_t n, const float* weights,
                         int64_t seq, const __m512* total, float* out) {
  __m512 acc[GB][DC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vp = v.at(bi, hk, keys[j]);
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = _mm512_loadu_ps(vp + c * LANES);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * seq + j]);
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < DC; ++c)
      _mm512_storeu_ps(out + g * DC * LANES + c * LANES, n > 0 ? _mm512_div_ps(acc[g][c], total[g]) : _mm512_setzero_ps());
}

// One batch row, key head and query row: the `group` query heads that share the key head, over
// the allowed keys `keys[0..n)` (indices into the cache, in order; each below `seen`). The
// softmax sums and the weighted values run by place in that sequence, so padding keys and
// the batch change nothing. DC: the head dimension in 16s.
template <int DC>
void attend_unit(const View4& q, const float* kt, int64_t padded, const View4& v, int64_t bi, int64_t hk, int64_t ri,
                 int group, const int32_t* keys, int64_t n, int64_t seen, float scale, float* out,
                 std::vector<float>& raw, std::vector<float>& weights) {
  const int64_t D = DC * LANES, blocks = (seen + LANES - 1) / LANES, seq = (n + LANES - 1) / LANES * LANES;
  raw.resize(blocks * LANES);
  weights.assign(group * seq, 0.0f);
  __m512 total[MAX_GROUP];
  for (int g = 0; g < group; ++g) {
    score_row(q.at(bi, hk * group + g, ri), kt, padded, D, blocks, scale, raw.data());
    float* w = weights.data() + g * seq;
    for (int64_t j = 0; j < n; ++j) w[j] = raw[keys[j]];
    // The maximum is exact whatever the order; the padding past n is left out of it.
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < seq; j += LANES) {
      const __mmask16 live = n - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      m = _mm512_mask_max_ps(m, live, m, _mm512_loadu_ps(w + j));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    // Weights exp(s - max), summed lane-wise by place in the sequence (padding adds exact zeros).
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < seq; j += LANES) {
      const __mmask16 live = n - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(w + j), mx)));
      _mm512_storeu_ps(w + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  }
  // Weighted values, key by key in sequence order, then divided by the weights' sum; heads in
  // fours, each (head, dimension) one chain of FMAs whatever the heads beside it.
  for (int g = 0; g < group;) {
    const int gb = std::min(4, group - g);
    switch (gb) {
      case 4: weigh_values<DC, 4>(v, bi, hk, keys, n, weights.data() + g * seq, seq, total + g, out + (hk * group + g) * D); break;
      case 3: weigh_values<DC, 3>(v, bi, hk, keys, n, weights.data() + g * seq, seq, total + g, out + (hk * group + g) * D); break;
      case 2: weigh_values<DC, 2>(v, bi, hk, keys, n, weights.data() + g * seq, seq, total + g, out + (hk * group + g) * D); break;
      default: weigh_values<DC, 1>(v, bi, hk, keys, n, weights.data() + g * seq, seq, total + g, out + (hk * group + g) * D); break;
    }
    g += gb;
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
  TORCH_CHECK(D == 64 || D == 128, "attend_rows: head dimension 64 or 128, not ", D);
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
    // Threads split whole (key head, query row) units, never a sum; a forward of a few rows
    // over a few hundred keys stays on one thread.
    const int64_t grain = std::max<int64_t>(1, 100000 / std::max<int64_t>(1, group * KV * D));
    at::parallel_for(0, Hk * R, grain, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> keys(KV);
      std::vector<float> raw, weights;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t hk = u / R, ri = u % R;
        int64_t n = 0;
        if (mp) {
          const bool* row = mp + bi * mask_b + ri * KV;
          for (int64_t j = 0; j < KV; ++j)
            if (row[j]) keys[n++] = static_cast<int32_t>(j);
        } else {
          for (int64_t j = 0; j < KV; ++j) keys[n++] = static_cast<int32_t>(j);
        }
        const int64_t seen = n > 0 ? keys[n - 1] + 1 : 0;
        float* o = op + (bi * R + ri) * H * D;
        const float* kh = kt.data() + hk * D * padded;
        if (D == 64)
          attend_unit<4>(q, kh, padded, v, bi, hk, ri, group, keys.data(), n, seen, sc, o, raw, weights);
        else
          attend_unit<8>(q, kh, padded, v, bi, hk, ri, group, keys.data(), n, seen, sc, o, raw, weights);
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("attend_rows", &attend_rows); }
