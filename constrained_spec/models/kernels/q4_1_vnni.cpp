// Four-bit weights (w = d q + m, q in 0..15, float32 d and m per block of 32: Q4_0, Q4_1, Q4_K
// repacked) times activations quantized to int8 per block of 32 (llama.cpp's q4_1 x q8_1
// arithmetic), or split into two int8 parts (about 15 bits: x = dx (a + b / 254), as in
// q8_0_vnni.cpp), on AVX-512 VNNI, batch-invariant: every row's result is computed by the same
// instructions in the same order whatever the other rows are (see models/q4_vnni.py).
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
constexpr int GROUP = 32;         // weights of a Q4_1 block
constexpr int BLOCK_BYTES = 512;  // nibbles of 32 columns (two blocks of 16) x 32 weights

constexpr int SPLIT = 254;        // the second part's scale against the first's
constexpr int64_t ROW_PASS = 128;  // rows a pass over a thread's columns (see multiply)

struct Rows {
  const int8_t* q;   // [M, K] activations as int8
  const int8_t* qb;  // [M, K] the remainders as int8 (split rows only)
  const float* dx;   // [M, G] their scales (split: dx / 254)
  const float* sx;   // [M, G] the sums of the float activations
  int64_t K, G;
};

// R rows against two unpacked column blocks (32 columns) of group g. Each row's integer dot
// products are exact; its float updates run in one order, whatever R is.
template <int R, bool SPLIT_ROWS>
inline void rows_block(const __m512i* b, const Rows& x, int64_t r0, int64_t g, const __m512* d, const __m512* m,
                       float* acc) {
  __m512i s[R][2], t[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = t[r][0] = t[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.K + g * GROUP + 4 * i;
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.q + at));
      s[r][0] = _mm512_dpbusd_epi32(s[r][0], b[i], a);
      s[r][1] = _mm512_dpbusd_epi32(s[r][1], b[8 + i], a);
      if (SPLIT_ROWS) {
        const __m512i e = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.qb + at));
        t[r][0] = _mm512_dpbusd_epi32(t[r][0], b[i], e);
        t[r][1] = _mm512_dpbusd_epi32(t[r][1], b[8 + i], e);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t rg = (r0 + r) * x.G + g;
    const __m512 dx = _mm512_set1_ps(x.dx[rg]), sx = _mm512_set1_ps(x.sx[rg]);
    for (int c = 0; c < 2; ++c) {
      // Split: 254 sum(q a) + sum(q b), below 2^24, so exact in float32 too.
      const __m512i dot = SPLIT_ROWS ? _mm512_add_epi32(_mm512_mullo_epi32(s[r][c], _mm512_set1_epi32(SPLIT)), t[r][c])
                                     : s[r][c];
      __m512 a = _mm512_loadu_ps(acc + (2 * r + c) * COLS);
      a = _mm512_fmadd_ps(_mm512_mul_ps(d[c], dx), _mm512_cvtepi32_ps(dot), a);
      a = _mm512_fmadd_ps(m[c], sx, a);
      _mm512_storeu_ps(acc + (2 * r + c) * COLS, a);
    }
  }
}

// Each row's blocks of 32 as int8 with one scale (max |x| / 127) and the block's float sum;
// with `qb`, the remainders too (b = round(254 (x / dx - a)), the scale then dx / 254).
void quantize_rows(const float* xp, int64_t M, int64_t K, int8_t* q, int8_t* qb, float* dx, float* sx) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = xp + r * K + g * GROUP;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f;
      const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      for (int h = 0; h < 2; ++h) {
        const __m512 t = _mm512_mul_ps(h ? v1 : v0, id);
        const __m512 a = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * K + g * GROUP + 16 * h),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a)));
        if (qb) {  // t - a is exact (Sterbenz); times 254 it rounds to -127..127
          const __m512i e = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, a), _mm512_set1_ps(float(SPLIT))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + r * K + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(e));
        }
      }
      dx[r * G + g] = qb ? d / float(SPLIT) : d;
      sx[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
}

template <bool SPLIT_ROWS>
void multiply(const Rows& rows, int64_t M, int64_t NP, int64_t G, int64_t N, const uint8_t* wp, const float* sp,
              float* yp);

at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, bool split) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q4_1_mm: x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == BLOCK_BYTES,
              "q4_1_mm: packed must be contiguous uint8 [N/32, K/32, 512]");
  const int64_t M = x.size(0), K = x.size(1), NP = packed.size(0), G = packed.size(1), N = NP * 2 * COLS;
  TORCH_CHECK(G * GROUP == K, "q4_1_mm: packed [", NP, ", ", G, "] does not fit x's ", K, " columns");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == NP * G * 4 * COLS,
              "q4_1_mm: scales must be contiguous float32 [N/32, K/32, 2, 2, 16]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K), xb(split ? M * K : 0);
  std::vector<float> dx(M * G), sx(M * G);
  quantize_rows(x.const_data_ptr<float>(), M, K, xq.data(), split ? xb.data() : nullptr, dx.data(), sx.data());
  const Rows rows{xq.data(), xb.data(), dx.data(), sx.data(), K, G};
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (split)
    multiply<true>(rows, M, NP, G, N, wp, sp, yp);
  else
    multiply<false>(rows, M, NP, G, N, wp, sp, yp);
  return y;
}

template <bool SPLIT_ROWS>
void multiply(const Rows& rows, int64_t M, int64_t NP, int64_t G, int64_t N, const uint8_t* wp, const float* sp,
              float* yp) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  // Threads split the columns, never a row's sum: the split changes no bit. Rows go ROW_PASS at a
  // time through all of a thread's columns, so their activations stay in the core's cache (a
  // long prompt's do not fit); a row's arithmetic is the same in any pass.
  at::parallel_for(0, NP, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(M, ROW_PASS) * 2 * COLS);
    for (int64_t r0 = 0; r0 < M; r0 += ROW_PASS) {
      const int64_t rn = std::min(ROW_PASS, M - r0);
      for (int64_t pair = begin; pair < end; ++pair) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t g = 0; g < G; ++g) {
          __m512i b[16];
          __m512 d[2], m[2];
          // One stream of bytes a thread: the pair's blocks of each group side by side.
          const uint8_t* w = wp + (pair * G + g) * BLOCK_BYTES;
          const float* sc = sp + (pair * G + g) * 4 * COLS;
          for (int c = 0; c < 2; ++c) {
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
              const __m512i raw = _mm512_loadu_si512(w + 256 * c + 64 * t);
              b[8 * c + t] = _mm512_and_si512(raw, low);
              b[8 * c + t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            // d and m as stored in float32 (a file's float16 widened exactly, Q4_K's d * sc as computed).
            d[c] = _mm512_loadu_ps(sc + 2 * c * COLS);
            m[c] = _mm512_loadu_ps(sc + (2 * c + 1) * COLS);
          }
          int64_t r = r0;
          for (; r + 4 <= r0 + rn; r += 4) rows_block<4, SPLIT_ROWS>(b, rows, r, g, d, m, acc.data() + (r - r0) * 2 * COLS);
          float* a = acc.data() + (r - r0) * 2 * COLS;
          switch (r0 + rn - r) {
            case 3: rows_block<3, SPLIT_ROWS>(b, rows, r, g, d, m, a); break;
            case 2: rows_block<2, SPLIT_ROWS>(b, rows, r, g, d, m, a); break;
            case 1: rows_block<1, SPLIT_ROWS>(b, rows, r, g, d, m, a); break;
            default: break;
          }
        }
        for (int64_t r = 0; r < rn; ++r)
          for (int c = 0; c < 2; ++c)
            _mm512_storeu_ps(yp + (r0 + r) * N + (2 * pair + c) * COLS, _mm512_loadu_ps(acc.data() + (2 * r + c) * COLS));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(constrained_spec, CPU, m) { m.impl("q4_1_mm", &q4_1_mm); }
