// The per-task math of fixed_attn.cpp: one (token, kv head) task attends its G query rows
// over keys lo .. hi of the paged cache (see the order in fixed_attn.cpp's header).
// AVX-512 intrinsics when compiled with AVX-512 flags, else a scalar version of the same
// order. Included once, by fixed_attn.cpp (ninja tracks it as a dependency).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PD_AVX512 1
#include <immintrin.h>
#else
#define PD_AVX512 0
#endif

namespace pdserve_attn {

using bf16 = c10::BFloat16;

struct Shape {
  int64_t hkv, g, d, bs, width;  // kv heads, query heads per kv head, head_dim, block, table
  int64_t row;                   // elements per cache row (Hkv * D)
};

#if PD_AVX512
constexpr int kLanes = 16;

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);  // bf16 -> fp32 is exact: bits << 16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by
// scalef). exp(0) == 1 exactly; x < -103 gives 0.
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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

// Lane i of the result = the sum of the 16 lanes of p[i], by one fixed tree for every i:
// per 128-bit quarter (x0 + x2) + (x1 + x3), then (Q0 + Q1) + (Q2 + Q3).
inline __m512 sum16(const __m512* p) {
  __m512 u[4];
  for (int m = 0; m < 4; ++m) {
    const __m512* x = p + 4 * m;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    u[m] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// q: [G][NV*16] fp32 (scaled, zero-padded); writes s[g * n + (j - lo)] for j = lo .. hi.
// Keys go in groups of 16 (from lo); a group's K rows are converted once into kf [16][NV*16]
// (rows past hi zeroed, their scores never stored); per row and key the product vector is an
// FMA chain over the NV chunks in order, then sum16 (the same tree for every key slot).
template <typename CT, int NV>
void scores_fixed(const float* q, const CT* kbase, const int32_t* table, const Shape& sh,
                  int64_t lo, int64_t hi, float* s, int64_t n, float* kf) {
  const __mmask16 last = tail_mask(sh.d - (NV - 1) * kLanes);
  for (int64_t base = lo; base <= hi; base += kLanes) {
    const int64_t cnt = std::min<int64_t>(kLanes, hi - base + 1);
    for (int64_t i = 0; i < kLanes; ++i) {
      float* kr = kf + i * NV * kLanes;
      if (i < cnt) {
        const int64_t j = base + i;
        const CT* kp = kbase + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
        for (int c = 0; c < NV; ++c)
          _mm512_storeu_ps(kr + c * kLanes, load16(kp + c * kLanes, c == NV - 1 ? last : 0xFFFF));
      } else {
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(kr + c * kLanes, _mm512_setzero_ps());
      }
    }
    for (int64_t g = 0; g < sh.g; ++g) {
      const float* qg = q + g * NV * kLanes;
      __m512 qv[NV], p[kLanes];
      for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qg + c * kLanes);
      for (int i = 0; i < kLanes; ++i) {
        const float* kr = kf + i * NV * kLanes;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + c * kLanes), acc);
        p[i] = acc;
      }
      _mm512_mask_storeu_ps(s + g * n + (base - lo), tail_mask(cnt), sum16(p));
    }
  }
}

// Same for any head_dim (NV chunks at run time; K row converted into `kf` once per key).
template <typename CT>
void scores_any(const float* q, const CT* kbase, const int32_t* table, const Shape& sh,
                int64_t lo, int64_t hi, float* s, int64_t n, float* kf) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes;
  for (int64_t j = lo; j <= hi; ++j) {
    const CT* kp = kbase + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
    for (int64_t c = 0; c < nv; ++c)
      _mm512_storeu_ps(kf + c * kLanes, load16(kp + c * kLanes, tail_mask(sh.d - c * kLanes)));
    for (int64_t g = 0; g < sh.g; ++g) {
      const float* qg = q + g * nv * kLanes;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kf));
      for (int64_t c = 1; c < nv; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * kLanes), _mm512_loadu_ps(kf + c * kLanes), acc);
      s[g * n + (j - lo)] = _mm512_reduce_add_ps(acc);
    }
  }
}

// s[g] (n scores) -> exp(s - max) in place; returns the sum l per row into `l`.
inline void softmax_rows(float* s, int64_t g_rows, int64_t n, float* l) {
  for (int64_t g = 0; g < g_rows; ++g) {
    float* sg = s + g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += kLanes)
      mx = _mm512_mask_max_ps(mx, tail_mask(n - i), mx, _mm512_maskz_loadu_ps(tail_mask(n - i), sg + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 k = tail_mask(n - i);
      __m512 e = _mm512_maskz_mov_ps(k, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), m)));
      _mm512_mask_storeu_ps(sg + i, k, e);
      sum = _mm512_add_ps(sum, e);  // masked lanes add an exact +0 to a sum of >= +0 values
    }
    l[g] = _mm512_reduce_add_ps(sum);
  }
}

// out rows g0 .. g0 + RB - 1: acc[r] = sum_j e[r][j] * v_j (keys in order), then / l.
template <typename CT, int NV, int RB>
void pv_block(const float* e, const float* l, int64_t g0, const CT* vbase, const int32_t* table,
              const Shape& sh, int64_t lo, int64_t hi, int64_t n, float* out) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  const __mmask16 last = tail_mask(sh.d - (NV - 1) * kLanes);
  for (int64_t j = lo; j <= hi; ++j) {
    const CT* vp = vbase + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(vp + c * kLanes, c == NV - 1 ? last : 0xFFFF);
    for (int r = 0; r < RB; ++r) {
      const __m512 w = _mm512_set1_ps(e[(g0 + r) * n + (j - lo)]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const __m512 den = _mm512_set1_ps(l[g0 + r]);
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(out + (g0 + r) * NV * kLanes + c * kLanes, _mm512_div_ps(acc[r][c], den));
  }
}

template <typename CT, int NV>
void pv_fixed(const float* e, const float* l, const CT* vbase, const int32_t* table,
              const Shape& sh, int64_t lo, int64_t hi, int64_t n, float* out) {
  constexpr int RB = NV >= 8 ? 1 : (NV >= 4 ? 4 : 8);  // RB * NV accumulators <= 16 (+ NV)
  int64_t g = 0;
  for (; g + RB <= sh.g; g += RB) pv_block<CT, NV, RB>(e, l, g, vbase, table, sh, lo, hi, n, out);
  for (; g < sh.g; ++g) pv_block<CT, NV, 1>(e, l, g, vbase, table, sh, lo, hi, n, out);
}

template <typename CT>
void pv_any(const float* e, const float* l, const CT* vbase, const int32_t* table,
            const Shape& sh, int64_t lo, int64_t hi, int64_t n, float* out) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes, w = nv * kLanes;
  for (int64_t i = 0; i < sh.g * w; ++i) out[i] = 0.0f;
  for (int64_t j = lo; j <= hi; ++j) {
    const CT* vp = vbase + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
    for (int64_t c = 0; c < nv; ++c) {
      const __m512 vv = load16(vp + c * kLanes, tail_mask(sh.d - c * kLanes));
      for (int64_t g = 0; g < sh.g; ++g) {
        float* o = out + g * w + c * kLanes;
        const __m512 wt = _mm512_set1_ps(e[g * n + (j - lo)]);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(wt, vv, _mm512_loadu_ps(o)));
      }
    }
  }
  for (int64_t g = 0; g < sh.g; ++g) {
    const __m512 den = _mm512_set1_ps(l[g]);
    for (int64_t c = 0; c < nv; ++c) {
      float* o = out + g * w + c * kLanes;
      _mm512_storeu_ps(o, _mm512_div_ps(_mm512_loadu_ps(o), den));
    }
  }
}

template <typename CT>
void attend_task(const float* q, const CT* cache, const int32_t* table, const Shape& sh,
                 int64_t lo, int64_t hi, float* s, float* l, float* kf, float* out) {
  const int64_t n = hi - lo + 1, nv = (sh.d + kLanes - 1) / kLanes;
  const CT* vbase = cache + sh.bs * sh.row;  // V rows follow the K rows of each block
  switch (nv) {
#define PD_CASE(NV)                                                  \
  case NV:                                                           \
    scores_fixed<CT, NV>(q, cache, table, sh, lo, hi, s, n, kf);         \
    softmax_rows(s, sh.g, n, l);                                     \
    pv_fixed<CT, NV>(s, l, vbase, table, sh, lo, hi, n, out);        \
    return;
    PD_CASE(1)
    PD_CASE(2)
    PD_CASE(4)
    PD_CASE(8)
#undef PD_CASE
    default:
      scores_any<CT>(q, cache, table, sh, lo, hi, s, n, kf);
      softmax_rows(s, sh.g, n, l);
      pv_any<CT>(s, l, vbase, table, sh, lo, hi, n, out);
  }
}
constexpr bool kVector = true;

#else  // scalar fallback: the same order, one lane

constexpr int kLanes = 16;  // only pads the q/out rows
constexpr bool kVector = false;

inline float exp_nonpos(float x) {
  x = std::max(x, -103.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, (int)n);
}

template <typename CT>
void attend_task(const float* q, const CT* cache, const int32_t* table, const Shape& sh,
                 int64_t lo, int64_t hi, float* s, float* l, float* /*kf*/, float* out) {
  const int64_t n = hi - lo + 1, w = (sh.d + kLanes - 1) / kLanes * kLanes;
  const CT* vbase = cache + sh.bs * sh.row;
  for (int64_t j = lo; j <= hi; ++j) {
    const CT* kp = cache + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
    for (int64_t g = 0; g < sh.g; ++g) {
      float acc = q[g * w] * (float)kp[0];
      for (int64_t d = 1; d < sh.d; ++d) acc = std::fma(q[g * w + d], (float)kp[d], acc);
      s[g * n + (j - lo)] = acc;
    }
  }
  for (int64_t g = 0; g < sh.g; ++g) {
    float* sg = s + g * n;
    float m = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = exp_nonpos(sg[i] - m);
      sum += sg[i];
    }
    l[g] = sum;
    for (int64_t d = 0; d < w; ++d) out[g * w + d] = 0.0f;
  }
  for (int64_t j = lo; j <= hi; ++j) {
    const CT* vp = vbase + ((int64_t)table[j / sh.bs] * 2 * sh.bs + j % sh.bs) * sh.row;
    for (int64_t g = 0; g < sh.g; ++g)
      for (int64_t d = 0; d < sh.d; ++d)
        out[g * w + d] = std::fma(s[g * n + (j - lo)], (float)vp[d], out[g * w + d]);
  }
  for (int64_t g = 0; g < sh.g; ++g)
    for (int64_t d = 0; d < sh.d; ++d) out[g * w + d] = out[g * w + d] / l[g];
}
#endif

}  // namespace pdserve_attn
