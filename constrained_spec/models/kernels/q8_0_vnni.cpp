// Eight-bit weights times activations split into two int8 parts per block of 32, on AVX-512 VNNI,
// batch-invariant: every row's result is computed by the same instructions in the same order
// whatever the other rows are (see models/q8_output.py).
//
// Weights: w = d q (+ m), q in -128..127, a float32 d per block of 32 (Q8_0, Q5_0, Q5_1, Q5_K
// repacked) or per half-block of 16 (Q6_K), and optionally a float32 m per block of 32.
//
// A row's block x (32 floats) is t = x / dx with dx = max|x| / 127, a = round(t), b = round(254 (t - a)):
// x = dx (a + b / 254) to within dx / 508, about 15 bits. The weights are stored as u = q + 128
// (0..255) for vpdpbusd's unsigned operand: sum(q a) = sum(u a) - 128 sum(a), exact in int32.
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
constexpr int GROUP = 32;         // weights of a block
constexpr int BLOCK_BYTES = 512;  // 16 columns x 32 weights
constexpr int SPLIT = 254;        // b's scale against a's
constexpr int64_t ROW_PASS = 128;  // rows a pass over a thread's columns (see multiply)

struct Rows {
  const int8_t* a;        // [M, K] activations' first int8 part
  const int8_t* b;        // [M, K] the remainder's
  const int32_t* corr;    // [M, G, 3] 128 (254 sum(a) + sum(b)) of each block, then of its two halves
  const float* dx;        // [M, G] dx / 254
  const float* sx;        // [M, G] the sums of the block's float activations (for the mins)
  int64_t K, G;
};

// R rows against one unpacked column block of group g. Each row's integer sums are exact; its
// float updates run in one order, whatever R is. HALVES: a scale per 16 weights (d[0], d[1]),
// else one (d[0]); MINS: add m * sum(x) last.
template <int R, bool HALVES, bool MINS>
inline void rows_block(const __m512i* w, const Rows& x, int64_t r0, int64_t g, const __m512* d, __m512 m,
                       float* acc) {
  constexpr int H = HALVES ? 2 : 1;
  __m512i sa[R][H], sb[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) sa[r][h] = sb[r][h] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const int h = HALVES ? t / 4 : 0;  // loads 0-3 hold weights 0..15, loads 4-7 weights 16..31
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.K + g * GROUP + 4 * t;
      sa[r][h] = _mm512_dpbusd_epi32(sa[r][h], w[t], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.a + at)));
      sb[r][h] = _mm512_dpbusd_epi32(sb[r][h], w[t], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.b + at)));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t rg = (r0 + r) * x.G + g;
    const __m512 dx = _mm512_set1_ps(x.dx[rg]);
    __m512 a = _mm512_loadu_ps(acc + r * COLS);
    for (int h = 0; h < H; ++h) {
      // 254 sum(u a) + sum(u b) - 128 (254 sum(a) + sum(b)) = 254 sum(q a) + sum(q b), in int32.
      const int32_t corr = x.corr[3 * rg + (HALVES ? 1 + h : 0)];
      const __m512i total = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_mullo_epi32(sa[r][h], _mm512_set1_epi32(SPLIT)), sb[r][h]), _mm512_set1_epi32(corr));
      a = _mm512_fmadd_ps(_mm512_mul_ps(d[h], dx), _mm512_cvtepi32_ps(total), a);
    }
    if (MINS) a = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sx[rg]), a);
    _mm512_storeu_ps(acc + r * COLS, a);
  }
}

// Each row's blocks of 32 as a + b / 254 in units of max|x| / 127 (see the top of the file).
void split_rows(const float* xp, int64_t M, int64_t K, int8_t* qa, int8_t* qb, int32_t* corr, float* dxs, float* sxs) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = xp + r * K + g * GROUP;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float dx = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(dx != 0.0f ? 1.0f / dx : 0.0f), split = _mm512_set1_ps(float(SPLIT));
      int32_t half[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 t = _mm512_mul_ps(h ? v1 : v0, inv);
        const __m512 a = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // t - a is exact (Sterbenz); times 254 it rounds to -127..127.
        const __m512i ai = _mm512_cvtps_epi32(a), bi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, a), split));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(ai));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + r * K + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(bi));
        half[h] = 128 * (SPLIT * _mm512_reduce_add_epi32(ai) + _mm512_reduce_add_epi32(bi));
      }
      int32_t* c = corr + 3 * (r * G + g);
      c[0] = half[0] + half[1];  // integers: the same value as summing the block's parts first
      c[1] = half[0];
      c[2] = half[1];
      dxs[r * G + g] = dx / float(SPLIT);
      sxs[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));  // as the four-bit kernel sums
    }
}

template <bool HALVES, bool MINS>
void multiply(const Rows& rows, int64_t M, int64_t NB, int64_t G, const uint8_t* wp, const float* sp,
              const float* mp, float* yp) {
  const int64_t N = NB * COLS;
  // Threads split the columns, never a row's sum: the split changes no bit. Rows go ROW_PASS at a
  // time through all of a thread's columns, so their activations stay in the core's cache (a
  // long prompt's do not fit); a row's arithmetic is the same in any pass.
  at::parallel_for(0, NB, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(M, ROW_PASS) * COLS);
    for (int64_t r0 = 0; r0 < M; r0 += ROW_PASS) {
      const int64_t rn = std::min(ROW_PASS, M - r0);
      for (int64_t nb = begin; nb < end; ++nb) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t g = 0; g < G; ++g) {
          __m512i w[8];
          const uint8_t* wb = wp + (nb * G + g) * BLOCK_BYTES;
          for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(wb + 64 * t);
          __m512 d[2];
          if (HALVES) {
            d[0] = _mm512_loadu_ps(sp + ((nb * G + g) * 2) * COLS);
            d[1] = _mm512_loadu_ps(sp + ((nb * G + g) * 2 + 1) * COLS);
          } else {
            d[0] = d[1] = _mm512_loadu_ps(sp + (nb * G + g) * COLS);
          }
          const __m512 m = MINS ? _mm512_loadu_ps(mp + (nb * G + g) * COLS) : _mm512_setzero_ps();
          int64_t r = r0;
          for (; r + 4 <= r0 + rn; r += 4) rows_block<4, HALVES, MINS>(w, rows, r, g, d, m, acc.data() + (r - r0) * COLS);
          float* a = acc.data() + (r - r0) * COLS;
          switch (r0 + rn - r) {
            case 3: rows_block<3, HALVES, MINS>(w, rows, r, g, d, m, a); break;
            case 2: rows_block<2, HALVES, MINS>(w, rows, r, g, d, m, a); break;
            case 1: rows_block<1, HALVES, MINS>(w, rows, r, g, d, m, a); break;
            default: break;
          }
        }
        for (int64_t r = 0; r < rn; ++r)
          _mm512_storeu_ps(yp + (r0 + r) * N + nb * COLS, _mm512_loadu_ps(acc.data() + r * COLS));
      }
    }
  });
}

// x [M, K] times the packed weights: scales [N/16, K/32, 16] (a scale per block of 32) or
// [N/16, K/32, 2, 16] (per half-block of 16), mins [N/16, K/32, 16] or empty.
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_mm: x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == BLOCK_BYTES,
              "q8_mm: packed must be contiguous uint8 [N/16, K/32, 512]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), N = NB * COLS;
  TORCH_CHECK(G * GROUP == K, "q8_mm: packed [", NB, ", ", G, "] does not fit x's ", K, " columns");
  const bool halves = scales.dim() == 4;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && (scales.dim() == 3 || halves) &&
                  scales.numel() == NB * G * COLS * (halves ? 2 : 1),
              "q8_mm: scales must be contiguous float32 [N/16, K/32, 16] or [N/16, K/32, 2, 16]");
  const bool with_mins = mins.numel() > 0;
  TORCH_CHECK(!with_mins || (mins.scalar_type() == at::kFloat && mins.is_contiguous() && mins.numel() == NB * G * COLS),
              "q8_mm: mins must be empty or contiguous float32 [N/16, K/32, 16]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> qa(M * K), qb(M * K);
  std::vector<int32_t> corr(M * G * 3);
  std::vector<float> dxs(M * G), sxs(M * G);
  split_rows(x.const_data_ptr<float>(), M, K, qa.data(), qb.data(), corr.data(), dxs.data(), sxs.data());
  const Rows rows{qa.data(), qb.data(), corr.data(), dxs.data(), sxs.data(), K, G};
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* mp = with_mins ? mins.const_data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (halves && with_mins) multiply<true, true>(rows, M, NB, G, wp, sp, mp, yp);
  else if (halves) multiply<true, false>(rows, M, NB, G, wp, sp, mp, yp);
  else if (with_mins) multiply<false, true>(rows, M, NB, G, wp, sp, mp, yp);
  else multiply<false, false>(rows, M, NB, G, wp, sp, mp, yp);
  return y;
}

// The embedded model's Q8_0 output projection: one scale per block, no mins.
at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return q8_mm(x, packed, scales, at::empty({0}, x.options()));
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) {
  m.impl("q8_0_mm", &q8_0_mm);
  m.impl("q8_mm", &q8_mm);
}
