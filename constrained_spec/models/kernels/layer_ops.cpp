// The small ops of a decoder layer, each a call where torch takes several (see
// models/layer_kernels.py): RMSNorm of float32 rows with the mean of squares summed in float64 in
// one fixed order, row by row (a row's bits depend only on the row), with the residual add
// before it; the rotary embedding of q and k with the cache write of k and v. Built with
// -ffp-contract=off, so every elementwise step is the one torch's ops take, rounded alone.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "bfloat16.h"

namespace {

// sum(x[i]^2) in float64: two accumulators of 8 lanes over 16 floats a step (a float's square is
// exact in float64, so the FMA rounds only its add), then the tail in order, then one fixed
// reduction of the lanes. Divided by d and rounded to float32, as torch's
// (x.double().square().sum(-1) / d).float() does.
inline float mean_square(const float* x, int64_t d) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + j)), hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + j + 8));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, _mm512_add_pd(a0, a1));
  double sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  for (; j < d; ++j) sum += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  return static_cast<float>(sum / static_cast<double>(d));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
              name, ": contiguous float32 rows");
}

// x [..., d] -> its rows' mean squares [..., 1] (float32).
at::Tensor row_variance(const at::Tensor& x) {
  check_rows(x, "row_variance");
  const int64_t d = x.size(-1), n = x.numel() / d;
  auto sizes = x.sizes().vec();
  sizes.back() = 1;
  auto out = at::empty(sizes, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) op[r] = mean_square(xp + r * d, d);
  return out;
}

// (x + delta, weight * (s * rsqrt(mean_square(s) + eps))) with s = x + delta (delta None: s = x),
// each step as torch computes it: s = x + delta; r = 1 / sqrt(var + (float)eps); weight * (s * r).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  const int64_t d = x.size(-1), n = x.numel() / d;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == d,
              "add_rms_norm: a float32 weight of the rows' width");
  const bool adds = delta.has_value() && delta->defined();
  if (adds) {
    check_rows(*delta, "add_rms_norm");
    TORCH_CHECK(delta->sizes() == x.sizes(), "add_rms_norm: delta of x's shape");
  }
  // A copy even without delta: an op's outputs must not alias its inputs (the schema says so).
  at::Tensor sum = adds ? at::empty_like(x) : x.clone();
  auto out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* dp = adds ? delta->const_data_ptr<float>() : nullptr;
  const float* wp = weight.const_data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < n; ++r) {
    const float* s = xp + r * d;
    if (adds) {
      float* t = sp + r * d;
      int64_t j = 0;
      for (; j + 16 <= d; j += 16)
        _mm512_storeu_ps(t + j, _mm512_add_ps(_mm512_loadu_ps(s + j), _mm512_loadu_ps(dp + r * d + j)));
      for (; j < d; ++j) t[j] = s[j] + dp[r * d + j];
      s = t;
    }
    const float inv = 1.0f / std::sqrt(mean_square(s, d) + e);
    const __m512 vi = _mm512_set1_ps(inv);
    float* o = op + r * d;
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
      _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(wp + j), _mm512_mul_ps(_mm512_loadu_ps(s + j), vi)));
    for (; j < d; ++j) o[j] = wp[j] * (s[j] * inv);
  }
  return {sum, out};
}

// x * cos + roll(x, D / 2) * signed_sin for a row of one head (signed_sin: sin with its first
// half negated, so the products are transformers' rotate_half ones, the same bits).
inline void rotate(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < D; j += 16) {
    const int64_t partner = j < half ? j + half : j - half;
    _mm512_storeu_ps(out + j, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(c + j)),
                                            _mm512_mul_ps(_mm512_loadu_ps(x + partner), _mm512_loadu_ps(s + j))));
  }
}

// Row x of D values stored into `to`: as they are (float32), or rounded to bfloat16 as torch's
// conversion rounds them (a cache that keeps bfloat16, uint16_t here).
inline void store_row(const float* x, int64_t D, float* to) { std::copy(x, x + D, to); }
inline void store_row(const float* x, int64_t D, uint16_t* to) {
  for (int64_t j = 0; j < D; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j), to_bf16x16(_mm512_loadu_ps(x + j)));
}

template <typename T>
void rotate_and_store(const float* xp, const float* cp, const float* sp, int64_t n, int64_t width, int64_t q_heads,
                      int64_t Hk, int64_t D, float* qp, T* kp, int64_t ks, int64_t kt, T* vp, int64_t vs, int64_t vt,
                      int64_t past) {
  alignas(64) float rotated[512];
  for (int64_t t = 0; t < n; ++t) {
    const float* row = xp + t * width;
    for (int64_t h = 0; h < q_heads; ++h) rotate(row + h * D, cp + t * D, sp + t * D, D, qp + (t * q_heads + h) * D);
    for (int64_t h = 0; h < Hk; ++h) {
      rotate(row + (q_heads + h) * D, cp + t * D, sp + t * D, D, rotated);
      store_row(rotated, D, kp + h * ks + (past + t) * kt);
      store_row(row + (q_heads + Hk + h) * D, D, vp + h * vs + (past + t) * vt);
    }
  }
}

// qkv [n, (Hq + 2 Hk) D] float32 (q's heads, k's, v's), cos / signed_sin [n, D]: writes the rotated
// k and the v of row t into keys / values [1, Hk, capacity, D] (both float32 or both bfloat16) at
// position past + t, and returns the rotated q as [1, n, Hq, D] (the caller's transpose is
// [1, Hq, n, D]).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                      at::Tensor& values, int64_t past, int64_t q_heads, int64_t head_dim) {
  check_rows(qkv, "rope_store");
  check_rows(cos, "rope_store");
  check_rows(sin, "rope_store");
  const int64_t n = qkv.size(0), D = head_dim, Hk = keys.size(1);
  TORCH_CHECK(qkv.dim() == 2 && D % 32 == 0 && D <= 512 && qkv.size(1) == (q_heads + 2 * Hk) * D,
              "rope_store: qkv [n, (q_heads + 2 kv_heads) head_dim] with head_dim a multiple of 32, at most 512");
  TORCH_CHECK(cos.numel() == n * D && sin.numel() == n * D, "rope_store: cos and sin [n, head_dim]");
  const bool bf16 = cache_in_bfloat16(keys, values, "rope_store");
  for (const at::Tensor* t : {&keys, &values})
    TORCH_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(1) == Hk
                && t->size(3) == D && t->stride(3) == 1 && past >= 0 && past + n <= t->size(2),
                "rope_store: keys and values [1, kv_heads, capacity >= past + n, head_dim]");
  auto q = at::empty({1, n, q_heads, D}, qkv.options());
  const float* xp = qkv.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t width = qkv.size(1), ks = keys.stride(1), kt = keys.stride(2), vs = values.stride(1), vt = values.stride(2);
  if (bf16)
    rotate_and_store(xp, cp, sp, n, width, q_heads, Hk, D, qp, static_cast<uint16_t*>(keys.data_ptr()), ks, kt,
                     static_cast<uint16_t*>(values.data_ptr()), vs, vt, past);
  else
    rotate_and_store(xp, cp, sp, n, width, q_heads, Hk, D, qp, keys.data_ptr<float>(), ks, kt,
                     values.data_ptr<float>(), vs, vt, past);
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) {
  m.impl("row_variance", &row_variance);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
}
