// Causal attention of a prompt chunk's rows in bfloat16 on AVX512_BF16 (vdpbf16ps), accumulated
// in float32, row by row: each (row, head) runs the same instructions in the same order over its
// keys, tiles of 64 keys cut at fixed positions from key 0, whatever rows, heads or threads are
// beside it, so a row's bits depend only on its query, its keys and its position (see
// models/prompt_attention_kernel.py).
//
// Per key head: the keys and values are rounded to bfloat16 once a call into the instruction's
// pair layouts (keys paired along the head dimension, values along the keys); per block of up to
// four query vectors of that key head: for each tile up to the last one a vector sees, the scores
// (one vdpbf16ps per pair of dimensions), an online softmax in float32 (exp by a Cephes
// polynomial), the weights rounded to bfloat16 and the values accumulated (one vdpbf16ps per pair
// of keys). Why: torch's CPU flash attention runs bfloat16 no faster than float32 on a CPU
// without AMX, where this instruction doubles the multiply-adds per cycle.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int TILE = 64;   // keys a tile: four vectors of 16 scores
constexpr int BLOCK = 4;   // query vectors a pass over the keys

// exp(x) for x <= 0, as in row_attention.cpp (Cephes' expf, about 1 ulp; exp(0) is exactly 1).
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

// float32 -> bfloat16, round to nearest even (what vcvtneps2bf16 and torch's conversion do).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// A float32 tensor's rows [n, D] at a stride, rounded to bfloat16 into `out`.
void round_row(const float* x, int64_t D, uint16_t* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = to_bf16(x[d]);
}

struct Packed {
  // Keys: [tile][D/2][TILE][2]; values: [tile][TILE/2][D][2]; zeros past the last key.
  std::vector<uint16_t> keys, values;
};

// One key head's keys and values (float32 [KV, D] at row stride `rs`) in the pair layouts.
void pack_head(const float* k, const float* v, int64_t rs, int64_t KV, int64_t D, Packed& out) {
  const int64_t tiles = (KV + TILE - 1) / TILE;
  out.keys.assign(tiles * D * TILE, 0);
  out.values.assign(tiles * TILE * D, 0);
  std::vector<uint16_t> row(D);
  for (int64_t j = 0; j < KV; ++j) {
    const int64_t t = j / TILE, in = j % TILE;
    round_row(k + j * rs, D, row.data());
    uint16_t* kt = out.keys.data() + t * D * TILE;
    for (int64_t d = 0; d < D; ++d) kt[(d / 2) * TILE * 2 + in * 2 + (d % 2)] = row[d];
    round_row(v + j * rs, D, row.data());
    uint16_t* vt = out.values.data() + t * TILE * D;
    for (int64_t d = 0; d < D; ++d) vt[(in / 2) * D * 2 + d * 2 + (in % 2)] = row[d];
  }
}

template <int D>
struct Vector {  // one query vector's state
  const uint16_t* q;  // bfloat16 [D]
  int64_t last;       // the last key it sees
  float max, sum;
  float out[D];
};

// One tile's work for NV vectors (all of whose `last` is at least the tile's first key).
template <int D, int NV>
inline void tile_step(Vector<D>* vec, const uint16_t* kt, const uint16_t* vt, int64_t j0, float scale) {
  constexpr int NC = D / LANES;
  // Scores: four vectors of 16 keys for each query vector, one vdpbf16ps a pair of dimensions.
  __m512 s[NV][4];
  for (int q = 0; q < NV; ++q)
    for (int b = 0; b < 4; ++b) s[q][b] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const uint16_t* kp = kt + p * TILE * 2;
    __m512bh kk[4];
    for (int b = 0; b < 4; ++b) kk[b] = (__m512bh)_mm512_loadu_si512(kp + b * LANES * 2);
    for (int q = 0; q < NV; ++q) {
      int32_t pair;
      std::memcpy(&pair, vec[q].q + 2 * p, 4);
      const __m512bh qq = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < 4; ++b) s[q][b] = _mm512_dpbf16_ps(s[q][b], qq, kk[b]);
    }
  }
  alignas(64) uint16_t weights[NV][TILE];
  float alpha[NV];
  const __m512 sc = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
  for (int q = 0; q < NV; ++q) {
    // Keys past the vector's last are masked: their weight is exactly 0.
    const int64_t seen = std::min<int64_t>(TILE, vec[q].last - j0 + 1);
    __mmask16 keep[4];
    __m512 m = minus_inf;
    for (int b = 0; b < 4; ++b) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(LANES, seen - b * LANES));
      keep[b] = n >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
      s[q][b] = _mm512_mask_mul_ps(minus_inf, keep[b], s[q][b], sc);
      m = _mm512_max_ps(m, s[q][b]);
    }
    const float tile_max = _mm512_reduce_max_ps(m);
    const float new_max = std::max(vec[q].max, tile_max);
    alpha[q] = vec[q].max == -INFINITY ? 0.0f : _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(vec[q].max - new_max)));
    const __m512 nm = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    for (int b = 0; b < 4; ++b) {
      const __m512 w = _mm512_maskz_mov_ps(keep[b], exp_nonpositive(_mm512_sub_ps(s[q][b], nm)));
      total = _mm512_add_ps(total, w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights[q] + b * LANES), (__m256i)_mm512_cvtneps_pbh(w));
    }
    vec[q].sum = vec[q].sum * alpha[q] + _mm512_reduce_add_ps(total);
    vec[q].max = new_max;
  }
  // Values: the output rescaled, then one vdpbf16ps a pair of keys, 64 dimensions at a time (the
  // accumulators stay in registers; each weight pair is broadcast once for them all).
  constexpr int NCB = NC < 4 ? NC : 4;
  for (int c0 = 0; c0 < NC; c0 += NCB) {
    __m512 o[NV][NCB];
    for (int q = 0; q < NV; ++q) {
      const __m512 a = _mm512_set1_ps(alpha[q]);
      for (int c = 0; c < NCB; ++c) o[q][c] = _mm512_mul_ps(_mm512_loadu_ps(vec[q].out + (c0 + c) * LANES), a);
    }
    for (int p = 0; p < TILE / 2; ++p) {
      const uint16_t* vp = vt + p * D * 2 + c0 * LANES * 2;
      __m512bh w[NV];
      for (int q = 0; q < NV; ++q) {
        int32_t pair;
        std::memcpy(&pair, weights[q] + 2 * p, 4);
        w[q] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int c = 0; c < NCB; ++c) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + c * LANES * 2);
        for (int q = 0; q < NV; ++q) o[q][c] = _mm512_dpbf16_ps(o[q][c], w[q], vv);
      }
    }
    for (int q = 0; q < NV; ++q)
      for (int c = 0; c < NCB; ++c) _mm512_storeu_ps(vec[q].out + (c0 + c) * LANES, o[q][c]);
  }
}

template <int D>
void run_block(Vector<D>* vec, int nv, const Packed& kv, float scale) {
  const int64_t last = vec[nv - 1].last > vec[0].last ? vec[nv - 1].last : vec[0].last;
  for (int64_t t = 0; t * TILE <= last; ++t) {
    const int64_t j0 = t * TILE;
    // Only the vectors that see a key of this tile: the others' bits must not depend on it.
    Vector<D>* seeing[BLOCK];
    int n = 0;
    for (int q = 0; q < nv; ++q)
      if (vec[q].last >= j0) seeing[n++] = &vec[q];
    const uint16_t* kt = kv.keys.data() + t * D * TILE;
    const uint16_t* vt = kv.values.data() + t * TILE * D;
    // Copies in and out keep one code path for every count.
    Vector<D> local[BLOCK];
    for (int q = 0; q < n; ++q) local[q] = *seeing[q];
    switch (n) {
      case 4: tile_step<D, 4>(local, kt, vt, j0, scale); break;
      case 3: tile_step<D, 3>(local, kt, vt, j0, scale); break;
      case 2: tile_step<D, 2>(local, kt, vt, j0, scale); break;
      case 1: tile_step<D, 1>(local, kt, vt, j0, scale); break;
      default: break;
    }
    for (int q = 0; q < n; ++q) *seeing[q] = local[q];
  }
}

template <int D>
void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first, double scale,
            at::Tensor& out) {
  const int64_t H = query.size(0), R = query.size(1), KVH = key.size(0), KV = key.size(1), G = H / KVH;
  const float* qp = query.const_data_ptr<float>();
  const float* kp = key.const_data_ptr<float>();
  const float* vp = value.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<Packed> packed(KVH);
  at::parallel_for(0, KVH, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h)
      pack_head(kp + h * key.stride(0), vp + h * value.stride(0), key.stride(1), KV, D, packed[h]);
  });
  // Query vectors of one key head in (row, head) order; blocks of BLOCK consecutive ones.
  const int64_t per_head = R * G, blocks = (per_head + BLOCK - 1) / BLOCK;
  at::parallel_for(0, KVH * blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> q16(BLOCK * D);
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t hk = unit / blocks, v0 = (unit % blocks) * BLOCK;
      const int nv = int(std::min<int64_t>(BLOCK, per_head - v0));
      Vector<D> vec[BLOCK];
      for (int q = 0; q < nv; ++q) {
        const int64_t row = (v0 + q) / G, head = hk * G + (v0 + q) % G;
        round_row(qp + head * query.stride(0) + row * query.stride(1), D, q16.data() + q * D);
        vec[q].q = q16.data() + q * D;
        vec[q].last = std::min<int64_t>(first + row, KV - 1);
        vec[q].max = -INFINITY;
        vec[q].sum = 0.0f;
        std::fill(vec[q].out, vec[q].out + D, 0.0f);
      }
      run_block<D>(vec, nv, packed[hk], float(scale));
      for (int q = 0; q < nv; ++q) {
        const int64_t row = (v0 + q) / G, head = hk * G + (v0 + q) % G;
        float* o = op + (row * H + head) * D;
        const float inv = 1.0f / vec[q].sum;
        for (int64_t d = 0; d < D; ++d) o[d] = vec[q].out[d] * inv;
      }
    }
  });
}

// query [H, R, D], key / value [KVH, KV, D] (float32, unit stride along D); row i sees keys
// 0 .. first + i. Returns float32 [R, H, D].
at::Tensor prompt_attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first,
                         double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "prompt_attend: [H, R, D] and [KVH, KV, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "prompt_attend: float32 tensors");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && key.strides() == value.strides(),
              "prompt_attend: unit stride along D, keys and values alike");
  const int64_t H = query.size(0), R = query.size(1), D = query.size(2), KVH = key.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && key.size(2) == D && value.sizes() == key.sizes(), "prompt_attend: shapes");
  TORCH_CHECK(first >= 0 && first + R <= key.size(1), "prompt_attend: rows past the keys");
  auto out = at::empty({R, H, D}, query.options());
  if (R == 0) return out;
  switch (D) {
    case 64: attend<64>(query, key, value, first, scale, out); break;
    case 128: attend<128>(query, key, value, first, scale, out); break;
    case 256: attend<256>(query, key, value, first, scale, out); break;
    default: TORCH_CHECK(false, "prompt_attend: head dimension 64, 128 or 256");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("prompt_attend", &prompt_attend); }
