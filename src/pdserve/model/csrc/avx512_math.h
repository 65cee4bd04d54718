// AVX-512 helpers shared by this package's CPU kernels (model/csrc/bf16_pointwise.cpp,
// model/csrc/avx512_bf16_linear.cpp and model/attention/csrc/fixed_attn_math.h). Compile with -mavx512f -mavx512bw -mavx512vl.
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

// fp32 -> bf16 bits, round to nearest even. With AVX512-BF16: VCVTNEPS2BF16 (one instruction;
// it reads a denormal input as zero). Without: c10's rule in integer code. The two builds
// differ only for denormals and NaN payloads.
inline __m256i rne_bits(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  return bf16_bits_c10(x);
#endif
}

// rne to bf16 and back to fp32: the value a torch op would have stored.
inline __m512 rne(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rne_bits(x)), 16));
}

// RoPE of one head of d (even) bf16 values, HF's rotate_half convention, torch's roundings:
// o[i] = rne(rne(x[i] * cos[i]) + rne(x[(i + d/2) mod d] * sin_signed[i])). cs: the row's cos
// as ceil(d/16) fp32 vectors, then as many sin_signed vectors (lanes past d zero: rope_tables);
// twice: scratch of 2d values, used when d/2 is not a multiple of 16 (a 16-lane chunk of the
// rolled head would wrap). One definition for rope_qk (bf16_pointwise.cpp) and the attention
// kernel that applies RoPE itself (fixed_attn.cpp), so both give the same bits. o may not
// alias x.
inline void rope_tables(const uint16_t* cos, const uint16_t* sin, int64_t d, __m512* cs) {
  const int64_t nv = (d + 15) / 16;
  for (int64_t i = 0, c = 0; i < d; i += 16, ++c) {
    cs[c] = load_bf16(cos + i, tail_mask(d - i));
    cs[nv + c] = load_bf16(sin + i, tail_mask(d - i));
  }
}
inline void rope_head(const uint16_t* x, const __m512* cs, int64_t d, uint16_t* twice,
                      uint16_t* o) {
  const int64_t half = d / 2, nv = (d + 15) / 16;
  const bool direct = half % 16 == 0;
  if (!direct) {
    for (int64_t i = 0; i < d; ++i) twice[i] = twice[d + i] = x[i];
  }
  for (int64_t i = 0, c = 0; i < d; i += 16, ++c) {
    const __mmask16 m = tail_mask(d - i);
    const uint16_t* rolled = direct ? x + (i + half) % d : twice + half + i;
    const __m512 a = rne(_mm512_mul_ps(load_bf16(x + i, m), cs[c]));
    const __m512 b = rne(_mm512_mul_ps(load_bf16(rolled, m), cs[nv + c]));
    _mm256_mask_storeu_epi16(o + i, m, rne_bits(_mm512_add_ps(a, b)));
  }
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
