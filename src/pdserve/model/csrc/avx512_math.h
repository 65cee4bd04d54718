// AVX-512 helpers shared by this package's CPU kernels (model/csrc/bf16_pointwise.cpp and
// model/attention/csrc/fixed_attn_math.h). Compile with -mavx512f -mavx512bw -mavx512vl.
// Every function is a fixed sequence of instructions: the same input gives the same bits in
// every kernel that calls it.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pdserve_simd {

// Lanes [0, n) of 16 (all 16 from n >= 16).
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// 16 bf16 (masked lanes read as 0) -> 16 fp32, exact: the bf16 bits are the fp32's upper half.
inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits by c10::BFloat16's rule: round to nearest even, denormals kept, NaN ->
// 0x7FC0 (integer code; VCVTNEPS2BF16 instead reads a denormal input as zero).
inline __m256i bf16_bits_c10(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// exp(x) for x already clamped by the caller to where 2^n stays finite (Cephes expf): range
// reduction x = n ln2 + r with ln2 in two parts, a degree-5 polynomial in r, then 2^n by
// scalef. exp(0) == 1 exactly.
inline __m512 exp_clamped(__m512 x) {
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
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + exp(-g)) in fp32, exp's argument clamped to [-87.3, 88.7] (2^n finite).
// One definition for silu_mul (bf16_pointwise.cpp) and the gate_up linear that fuses it
// (avx512_bf16_linear.cpp), so that both give the same bits.
inline __m512 silu_ps(__m512 g) {
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __m512 e =
      exp_clamped(_mm512_max_ps(_mm512_min_ps(neg, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f)));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

}  // namespace pdserve_simd
