// Q8_0 weights times activations split into two int8 parts per block of 32, on AVX-512 VNNI,
// batch-invariant: every row's result is computed by the same instructions in the same order
// whatever the other rows are (see models/q8_output.py).
//
// A row's block x (32 floats) is t = x / dx with dx = max|x| / 127, a = round(t), b = round(254 (t - a)):
// x = dx (a + b / 254) to within dx / 508, about 15 bits. The weights are stored as u = q + 128
// (0..254) for vpdpbusd's unsigned operand: sum(q a) = sum(u a) - 128 sum(a), exact in int32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int COLS = 16;          // output columns of a block: one zmm of float32
constexpr int GROUP = 32;         // weights of a Q8_0 block
constexpr int BLOCK_BYTES = 512;  // 16 columns x 32 weights
constexpr int SPLIT = 254;        // b's scale against a's

struct Rows {
  const int8_t* a;        // [M, K] activations' first int8 part
  const int8_t* b;        // [M, K] the remainder's
  const int32_t* corr;    // [M, G] 128 (254 sum(a) + sum(b)) of each block
  const float* dx;        // [M, G] dx / 254
  int64_t K, G;
};

// R rows against one unpacked column block of group g. Each row's integer sums are exact; its
// float update runs in one order, whatever R is.
template <int R>
inline void rows_block(const __m512i* w, const Rows& x, int64_t r0, int64_t g, __m512 d, float* acc) {
  __m512i sa[R], sb[R];
  for (int r = 0; r < R; ++r) sa[r] = sb[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.K + g * GROUP + 4 * t;
      sa[r] = _mm512_dpbusd_epi32(sa[r], w[t], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.a + at)));
      sb[r] = _mm512_dpbusd_epi32(sb[r], w[t], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.b + at)));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t rg = (r0 + r) * x.G + g;
    // 254 sum(u a) + sum(u b) - 128 (254 sum(a) + sum(b)) = 254 sum(q a) + sum(q b), in int32.
    const __m512i total = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(sa[r], _mm512_set1_epi32(SPLIT)), sb[r]),
                                           _mm512_set1_epi32(x.corr[rg]));
    __m512 a = _mm512_loadu_ps(acc + r * COLS);
    a = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.dx[rg])), _mm512_cvtepi32_ps(total), a);
    _mm512_storeu_ps(acc + r * COLS, a);
  }
}

// Each row's blocks of 32 as a + b / 254 in units of max|x| / 127 (see the top of the file).
void split_rows(const float* xp, int64_t M, int64_t K, int8_t* qa, int8_t* qb, int32_t* corr, float* dxs) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = xp + r * K + g * GROUP;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float dx = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(dx != 0.0f ? 1.0f / dx : 0.0f), split = _mm512_set1_ps(float(SPLIT));
      int32_t sums[2] = {0, 0};
      for (int h = 0; h < 2; ++h) {
        const __m512 t = _mm512_mul_ps(h ? v1 : v0, inv);
        const __m512 a = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // t - a is exact (Sterbenz); times 254 it rounds to -127..127.
        const __m512i ai = _mm512_cvtps_epi32(a), bi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, a), split));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(ai));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + r * K + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(bi));
        sums[0] += _mm512_reduce_add_epi32(ai);
        sums[1] += _mm512_reduce_add_epi32(bi);
      }
      corr[r * G + g] = 128 * (SPLIT * sums[0] + sums[1]);
      dxs[r * G + g] = dx / float(SPLIT);
    }
}

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_0_mm: x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == BLOCK_BYTES,
              "q8_0_mm: packed must be contiguous uint8 [N/16, K/32, 512]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), N = NB * COLS;
  TORCH_CHECK(G * GROUP == K, "q8_0_mm: packed [", NB, ", ", G, "] does not fit x's ", K, " columns");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == NB * G * COLS,
              "q8_0_mm: scales must be contiguous float16 [N/16, K/32, 16]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> qa(M * K), qb(M * K);
  std::vector<int32_t> corr(M * G);
  std::vector<float> dxs(M * G);
  split_rows(x.const_data_ptr<float>(), M, K, qa.data(), qb.data(), corr.data(), dxs.data());
  const Rows rows{qa.data(), qb.data(), corr.data(), dxs.data(), K, G};
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.const_data_ptr());
  float* yp = y.data_ptr<float>();
  // Threads split the columns, never a row's sum: the split changes no bit.
  at::parallel_for(0, NB, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * COLS);
    for (int64_t nb = begin; nb < end; ++nb) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g) {
        __m512i w[8];
        const uint8_t* wb = wp + (nb * G + g) * BLOCK_BYTES;
        for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(wb + 64 * t);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + (nb * G + g) * COLS)));
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) rows_block<4>(w, rows, r, g, d, acc.data() + r * COLS);
        float* a = acc.data() + r * COLS;
        switch (M - r) {
          case 3: rows_block<3>(w, rows, r, g, d, a); break;
          case 2: rows_block<2>(w, rows, r, g, d, a); break;
          case 1: rows_block<1>(w, rows, r, g, d, a); break;
          default: break;
        }
      }
      for (int64_t r = 0; r < M; ++r) _mm512_storeu_ps(yp + r * N + nb * COLS, _mm512_loadu_ps(acc.data() + r * COLS));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("q8_0_mm", &q8_0_mm); }
