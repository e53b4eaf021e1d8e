// Bfloat16 conversions the kernels share: a cache that keeps its keys and values in bfloat16
// is written by layer_ops.cpp and read by row_attention.cpp and prompt_attention.cpp, and all
// of them must agree with torch's own conversion bit for bit (tested).
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <cstdint>

// Whether a cache's keys and values are bfloat16 (else float32), refused by `op`'s name unless
// both are one or both the other: the check of every kernel that reads or writes a cache.
inline bool cache_in_bfloat16(const at::Tensor& keys, const at::Tensor& values, const char* op) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type()
              && (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              op, ": keys and values both float32 or both bfloat16");
  return keys.scalar_type() == at::kBFloat16;
}

// Sixteen float32 values rounded to bfloat16, to nearest even, as torch's conversion rounds each
// (add 0x7fff plus the kept part's lowest bit, keep the high half; a NaN stays a NaN):
// vcvtneps2bf16 would flush denormals, which torch's conversion keeps.
inline __m256i to_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// Sixteen bfloat16 values (uint16_t) widened to float32, exactly (their bits moved up).
inline __m512 from_bf16x16(const uint16_t* x) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
