// The math of fixed_attn.cpp: attend_task, one (token, kv head) attends its G query rows over
// keys lo .. hi of the paged cache (see the order in fixed_attn.cpp's header); attend_tile,
// the same for several tokens of one sequence at once, with the same bits per row.
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
#include "../../csrc/avx512_math.h"
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

using pdserve_simd::tail_mask;
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  return pdserve_simd::load_bf16(reinterpret_cast<const uint16_t*>(p), m);
}

// Row i/o, exactly as the scalar casts: q -> (float)q * scale, zero-padded to w; fp32 -> QT
// (bf16 by c10's rounding: nearest even, NaN -> 0x7FC0).
template <typename QT>
inline void load_q(const QT* src, int64_t d, float sc, float* dst) {
  for (int64_t c = 0; c < d; c += kLanes) {
    const __mmask16 m = tail_mask(d - c);
    _mm512_storeu_ps(dst + c, _mm512_maskz_mul_ps(m, load16(src + c, m), _mm512_set1_ps(sc)));
  }
}
inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16(bf16* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, pdserve_simd::bf16_bits_c10(x));
}
template <typename QT>
inline void store_out(const float* src, int64_t d, QT* dst) {
  for (int64_t c = 0; c < d; c += kLanes)
    store16(dst + c, _mm512_loadu_ps(src + c), tail_mask(d - c));
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by
// scalef). exp(0) == 1 exactly; x < -103 gives 0.
inline __m512 exp_nonpos(__m512 x) {
  return pdserve_simd::exp_clamped(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)));
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

#if defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;  // bf16 q and cache: attend_tile_bf16 (below), every token
#else
constexpr bool kDotBf16 = false;
#endif
constexpr int64_t kPairs = 16;  // bf16 pairs per zmm (32 bf16)
constexpr bool kVector = true;

// ---- Tiled path: several query tokens of one sequence x G heads, the same bits per row ----
// A row's score for key j is a perfect binary tree of additions over the 16 lane partials
// P_l = q[l] * k_j[l] (+ FMA over the chunks c = 1 .. NV-1 of q[16c + l] * k_j[16c + l]),
// the leaves taken in a fixed lane order: sum16's tree for NV = 1, 2, 4, 8 and GCC's
// _mm512_reduce_add_ps tree otherwise (the trees scores_fixed / scores_any apply). Here the
// keys are the lanes instead: K is transposed per group of 16 keys (kt[d][key]) and each P_l
// is a vector over 16 keys, so the tree is 15 vertical adds and the transpose is shared by all
// the tile's rows. Every add and FMA is the same operation on the same operands as before.
constexpr int kSum16Leaves[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
constexpr int kReduceLeaves[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// r[i] (key i, 16 dims) -> r[l] (dim l, 16 keys)
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4) {
    const __m512d a = _mm512_castps_pd(t[k]), b = _mm512_castps_pd(t[k + 2]);
    const __m512d c = _mm512_castps_pd(t[k + 1]), d = _mm512_castps_pd(t[k + 3]);
    r[k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // r[4k + e], 128-bit quarter Q: element 4Q + e of keys 4k .. 4k + 3
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[8 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Scores of RR rows for one group of 16 keys: kt [NV*16][16] (transposed K), q[r] the row's
// scaled padded q, s[r] receives the 16 scores. NV = 0: nv chunks at run time.
template <int RR, int NV, bool S16>
inline void score_block(const float* kt, int64_t nv, const float* const* q, float* const* s) {
  const int64_t n = NV > 0 ? NV : nv;
  __m512 part[RR][4];  // pending complete subtrees of 1, 2, 4, 8 leaves
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const int l = S16 ? kSum16Leaves[i] : kReduceLeaves[i];
    __m512 acc[RR];
    {
      const __m512 kv = _mm512_loadu_ps(kt + l * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[r] = _mm512_mul_ps(_mm512_set1_ps(q[r][l]), kv);
    }
    for (int64_t c = 1; c < n; ++c) {
      const __m512 kv = _mm512_loadu_ps(kt + (c * kLanes + l) * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][c * kLanes + l]), kv, acc[r]);
    }
    int k = 0;  // binary counter: leaf i completes the subtrees of its trailing one bits
#pragma GCC unroll 4
    for (; k < 4 && ((i >> k) & 1); ++k)
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[r] = _mm512_add_ps(part[r][k], acc[r]);
    if (i == 15) {
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) _mm512_storeu_ps(s[r], acc[r]);
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) part[r][k] = acc[r];
    }
  }
}

// The P.V step of the tiled paths, per output element one accumulator over the keys in order:
// PvFma (fp32: acc += e_j * v_j, one FMA per key; V rows fp32) and PvDot (bf16: acc +=
// VDPBF16PS(e pair, v pair), one per key pair; V pairs as dwords, lane d = (v_2m[d], v_2m+1[d]),
// e pairs as one dword). `E` is a row's weight of one key (pair), `V` a V buffer element.
struct PvFma {
  using E = float;
  using V = float;
  using Vec = __m512;
  static Vec load(const V* p) { return _mm512_loadu_ps(p); }
  static Vec weight(E e) { return _mm512_set1_ps(e); }
  static __m512 step(__m512 acc, Vec w, Vec v) { return _mm512_fmadd_ps(w, v, acc); }
};
#if defined(__AVX512BF16__)
struct PvDot {
  using E = uint32_t;
  using V = uint32_t;
  using Vec = __m512bh;
  static Vec load(const V* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec weight(E e) { return (__m512bh)_mm512_set1_epi32((int)e); }
  static __m512 step(__m512 acc, Vec w, Vec v) { return _mm512_dpbf16_ps(acc, w, v); }
};
#endif

// o[r] (CB chunks of 16 dims) += the steps of keys (pairs) j = j0 .. j1 in order, for RB rows;
// a row skips the keys outside its own range [lo[r], hi[r]]. vf: the V buffer from key `kc`
// (row stride w).
template <class Op, int RB, int CB>
inline void pv_tile_block(const typename Op::V* vf, int64_t w, int64_t kc, int64_t j0,
                          int64_t j1, const int64_t* lo, const int64_t* hi,
                          const typename Op::E* const* e, float* const* o) {
  __m512 acc[RB][CB];
  int64_t cl = j0, ch = j1;  // keys every row of the block uses
  for (int r = 0; r < RB; ++r) {
    cl = std::max(cl, lo[r]);
    ch = std::min(ch, hi[r]);
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_loadu_ps(o[r] + c * kLanes);
  }
  auto some = [&](int64_t a, int64_t b) {  // keys some rows skip
    for (int64_t j = a; j <= b; ++j) {
      const typename Op::V* vp = vf + (j - kc) * w;
      for (int r = 0; r < RB; ++r) {
        if (j < lo[r] || j > hi[r]) continue;
        const typename Op::Vec wt = Op::weight(e[r][j]);
        for (int c = 0; c < CB; ++c) acc[r][c] = Op::step(acc[r][c], wt, Op::load(vp + c * kLanes));
      }
    }
  };
  if (cl > ch) {
    some(j0, j1);
  } else {
    some(j0, cl - 1);
    for (int64_t j = cl; j <= ch; ++j) {
      const typename Op::V* vp = vf + (j - kc) * w;
      typename Op::Vec vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = Op::load(vp + c * kLanes);
      for (int r = 0; r < RB; ++r) {
        const typename Op::Vec wt = Op::weight(e[r][j]);
        for (int c = 0; c < CB; ++c) acc[r][c] = Op::step(acc[r][c], wt, vv[c]);
      }
    }
    some(ch + 1, j1);
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(o[r] + c * kLanes, acc[r][c]);
}

template <class Op, int RB>
inline void pv_tile_rows(const typename Op::V* vf, int64_t w, int64_t nv, int64_t kc, int64_t j0,
                         int64_t j1, const int64_t* lo, const int64_t* hi,
                         const typename Op::E* const* e, float* const* o) {
  constexpr int CB = 4;
  float* oc[RB];
  for (int64_t c = 0; c < nv; c += CB) {
    for (int r = 0; r < RB; ++r) oc[r] = o[r] + c * kLanes;
    const typename Op::V* v = vf + c * kLanes;
    switch (std::min<int64_t>(CB, nv - c)) {
      case 4: pv_tile_block<Op, RB, 4>(v, w, kc, j0, j1, lo, hi, e, oc); break;
      case 3: pv_tile_block<Op, RB, 3>(v, w, kc, j0, j1, lo, hi, e, oc); break;
      case 2: pv_tile_block<Op, RB, 2>(v, w, kc, j0, j1, lo, hi, e, oc); break;
      default: pv_tile_block<Op, RB, 1>(v, w, kc, j0, j1, lo, hi, e, oc); break;
    }
  }
}

// Every row of a tile against the V buffer's keys (pairs) kc .. ke: rows in blocks of RB over
// the keys their block uses (the union of the rows' ranges, within kc .. ke).
template <class Op, int RB>
inline void pv_tile_all(const typename Op::V* vf, int64_t w, int64_t nv, int64_t kc, int64_t ke,
                        int64_t rows, const int64_t* lo, const int64_t* hi,
                        const typename Op::E* const* e, float* const* o) {
  static_assert(RB <= 6, "row blocks of up to 6");
  for (int64_t r = 0; r < rows; r += RB) {
    const int64_t nb = std::min<int64_t>(RB, rows - r);
    int64_t j0 = ke + 1, j1 = kc - 1;
    for (int64_t i = r; i < r + nb; ++i) j0 = std::min(j0, lo[i]), j1 = std::max(j1, hi[i]);
    j0 = std::max(j0, kc), j1 = std::min(j1, ke);
    if (j0 > j1) continue;
    const int64_t *l = lo + r, *h = hi + r;
    switch (nb) {
      case 6: pv_tile_rows<Op, 6>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
      case 5: pv_tile_rows<Op, 5>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
      case 4: pv_tile_rows<Op, 4>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
      case 3: pv_tile_rows<Op, 3>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
      case 2: pv_tile_rows<Op, 2>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
      default: pv_tile_rows<Op, 1>(vf, w, nv, kc, j0, j1, l, h, e + r, o + r); break;
    }
  }
}

struct TileScratch {
  std::vector<float> kt, vf, s, l, o;
  std::vector<uint32_t> ktp, vpair;     // the bf16 path: transposed k pairs, v pairs
  std::vector<uint16_t> eb;             // its e rows in bf16
  std::vector<const uint32_t*> qpp, epp;  // its q rows, e pair rows
  std::vector<int64_t> plo, phi;        // each row's first and last pair
  std::vector<int64_t> rlo, rhi, krow;
  std::vector<const float*> qp, ep;
  std::vector<float*> sp, op;
};

constexpr int64_t kPvKeys = 256;  // V rows converted to fp32 at a time

// A tile: rows r = i * G + g (token i of `ntok`, head g), token i attends keys lo[i] .. hi[i].
// tile_setup fills the per-row key ranges and the K row offsets of keys klo .. khi; the scores
// go to ws.s (row r at s + r * spad, key j at column j - klo); tile_softmax_pv then turns them
// into out [rows][w] (w = 16-lane-padded head_dim), bit for bit attend_task's rows.
template <typename CT>
void tile_setup(const int32_t* table, const Shape& sh, int64_t ntok, const int64_t* lo,
                const int64_t* hi, TileScratch& ws, int64_t& klo, int64_t& khi, int64_t& spad) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes, w = nv * kLanes, rows = ntok * sh.g;
  klo = lo[0], khi = hi[0];
  for (int64_t i = 1; i < ntok; ++i) klo = std::min(klo, lo[i]), khi = std::max(khi, hi[i]);
  spad = (khi - klo + kLanes) / kLanes * kLanes;
  ws.kt.resize(w * kLanes);
  ws.vf.resize(kPvKeys * w);
  if ((int64_t)ws.s.size() < rows * spad) ws.s.resize(rows * spad);
  ws.l.resize(rows), ws.rlo.resize(rows), ws.rhi.resize(rows);
  ws.qp.resize(rows), ws.qpp.resize(rows), ws.ep.resize(rows), ws.sp.resize(rows);
  ws.op.resize(rows);
  for (int64_t r = 0; r < rows; ++r) ws.rlo[r] = lo[r / sh.g], ws.rhi[r] = hi[r / sh.g];
  ws.krow.resize(khi - klo + 1);  // K row offset of key klo + i (its V row: + bs * row)
  for (int64_t j = klo, b = klo / sh.bs, o = klo % sh.bs; j <= khi; ++j) {
    ws.krow[j - klo] = ((int64_t)table[b] * 2 * sh.bs + o) * sh.row;
    if (++o == sh.bs) o = 0, ++b;
  }
}

// The rows (pointers into ws.qp / ws.sp from `q` with row stride `qstride`) that use keys
// base .. base + cnt - 1; returns their count.
template <typename QE>
int64_t rows_using(const QE* q, int64_t qstride, int64_t rows, int64_t base, int64_t cnt,
                   int64_t klo, int64_t spad, TileScratch& ws, std::vector<const QE*>& qp) {
  int64_t m = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (ws.rhi[r] < base || ws.rlo[r] > base + cnt - 1) continue;
    qp[m] = q + r * qstride;
    ws.sp[m++] = ws.s.data() + r * spad + (base - klo);
  }
  return m;
}

template <typename CT>
void tile_softmax_pv(const CT* cache, const Shape& sh, int64_t rows, int64_t klo, int64_t khi,
                     int64_t spad, TileScratch& ws, float* out) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes, w = nv * kLanes;
  float* s = ws.s.data();
  for (int64_t r = 0; r < rows; ++r) {  // each row over its own keys, as attend_task
    softmax_rows(s + r * spad + (ws.rlo[r] - klo), 1, ws.rhi[r] - ws.rlo[r] + 1, &ws.l[r]);
    ws.ep[r] = s + r * spad - klo;  // ep[r][j]: e of key j
    ws.op[r] = out + r * w;
  }
  std::fill(out, out + rows * w, 0.0f);
  const CT* vbase = cache + sh.bs * sh.row;
  for (int64_t kc = klo; kc <= khi; kc += kPvKeys) {
    const int64_t ke = std::min(khi, kc + kPvKeys - 1);
    for (int64_t j = kc; j <= ke; ++j) {
      const CT* vp = vbase + ws.krow[j - klo];
      for (int64_t c = 0; c < nv; ++c)
        _mm512_storeu_ps(ws.vf.data() + (j - kc) * w + c * kLanes,
                         load16(vp + c * kLanes, tail_mask(sh.d - c * kLanes)));
    }
    pv_tile_all<PvFma, 4>(ws.vf.data(), w, nv, kc, ke, rows, ws.rlo.data(), ws.rhi.data(),
                          ws.ep.data(), ws.op.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 den = _mm512_set1_ps(ws.l[r]);
    for (int64_t c = 0; c < nv; ++c) {
      float* o = out + r * w + c * kLanes;
      _mm512_storeu_ps(o, _mm512_div_ps(_mm512_loadu_ps(o), den));
    }
  }
}

// qf [rows][w] scaled padded q (fp32); writes out [rows][w] (the rows' results, bit for bit
// those of attend_task).
template <typename CT, int NV, bool S16>
void attend_tile_nv(const float* qf, const CT* cache, const int32_t* table, const Shape& sh,
                    int64_t ntok, const int64_t* lo, const int64_t* hi, TileScratch& ws,
                    float* out) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes, w = nv * kLanes, rows = ntok * sh.g;
  int64_t klo, khi, spad;
  tile_setup<CT>(table, sh, ntok, lo, hi, ws, klo, khi, spad);
  float* kt = ws.kt.data();
  // scores, one group of 16 keys (from klo) at a time, for the rows that use the group
  for (int64_t base = klo; base <= khi; base += kLanes) {
    const int64_t cnt = std::min<int64_t>(kLanes, khi - base + 1);
    const CT* kp[kLanes];
    for (int64_t i = 0; i < cnt; ++i) kp[i] = cache + ws.krow[base + i - klo];
    for (int64_t c = 0; c < nv; ++c) {
      const __mmask16 m = tail_mask(sh.d - c * kLanes);
      __m512 x[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        x[i] = i < cnt ? load16(kp[i] + c * kLanes, m) : _mm512_setzero_ps();
      transpose16(x);
      for (int i = 0; i < kLanes; ++i) _mm512_storeu_ps(kt + (c * kLanes + i) * kLanes, x[i]);
    }
    const int64_t m = rows_using(qf, w, rows, base, cnt, klo, spad, ws, ws.qp);
    const float* const* qp = ws.qp.data();
    float* const* sp = ws.sp.data();
    int64_t k = 0;
    for (; k + 4 <= m; k += 4) score_block<4, NV, S16>(kt, nv, qp + k, sp + k);
    switch (m - k) {
      case 3: score_block<3, NV, S16>(kt, nv, qp + k, sp + k); break;
      case 2: score_block<2, NV, S16>(kt, nv, qp + k, sp + k); break;
      case 1: score_block<1, NV, S16>(kt, nv, qp + k, sp + k); break;
      default: break;
    }
  }
  tile_softmax_pv<CT>(cache, sh, rows, klo, khi, spad, ws, out);
}

#if defined(__AVX512BF16__)
// Scores of RR rows against NG groups of 16 keys, bf16 dot products: ktp [np][4][16] the keys'
// k pairs transposed (pair p of key 16 g + i at (p * 4 + g) * 16 + i), q[r] the row's pairs;
// s[r] receives the 16 * NG scores. A score is ONE accumulator: VDPBF16PS over the pairs
// p = 0 .. np - 1 in order from +0, then one multiply by `scale` (register blocking as the
// linear kernel's: RR rows x NG key vectors, each q pair broadcast once for NG products).
template <int RR, int NG>
inline void score_rows_dp(const uint32_t* ktp, int64_t np, const uint32_t* const* q,
                          __m512 scale, float* const* s) {
  __m512 acc[RR][NG];
  for (int r = 0; r < RR; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh kv[NG];
    for (int g = 0; g < NG; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(ktp + (p * 4 + g) * kLanes);
    for (int r = 0; r < RR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r][p]);
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qb, kv[g]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s[r] + g * kLanes, _mm512_mul_ps(acc[r][g], scale));
}

template <int NG>
inline void score_block_dp(const uint32_t* ktp, int64_t np, int64_t m, const uint32_t* const* q,
                           __m512 scale, float* const* s) {
  int64_t k = 0;
  for (; k + 6 <= m; k += 6) score_rows_dp<6, NG>(ktp, np, q + k, scale, s + k);
  switch (m - k) {
    case 5: return score_rows_dp<5, NG>(ktp, np, q + k, scale, s + k);
    case 4: return score_rows_dp<4, NG>(ktp, np, q + k, scale, s + k);
    case 3: return score_rows_dp<3, NG>(ktp, np, q + k, scale, s + k);
    case 2: return score_rows_dp<2, NG>(ktp, np, q + k, scale, s + k);
    case 1: return score_rows_dp<1, NG>(ktp, np, q + k, scale, s + k);
    default: return;
  }
}

// The same products for a tile of few rows (a decode: one token's G heads), without the pair
// buffer: v pairs are built in registers from the cache rows as they stream in (the buffer
// would only be read once). Chunks c0 .. c0 + CB - 1 of the output; the same VDPBF16PS
// sequence per output element as pv_tile_block<PvDot>, so the same bits.
template <int RB, int CB>
inline void pv_pairs_direct(const bf16* vbase, const int64_t* krow, int64_t klo, int64_t khi,
                            int64_t d, int64_t c0, int64_t m0, int64_t m1, const int64_t* plo,
                            const int64_t* phi, const uint32_t* const* e, float* const* o) {
  __m512 acc[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_loadu_ps(o[r] + (c0 + c) * kLanes);
  __mmask16 mk[CB];
  for (int c = 0; c < CB; ++c) mk[c] = tail_mask(d - (c0 + c) * kLanes);
  for (int64_t m = m0; m <= m1; ++m) {
    const int64_t a = 2 * m, b = a + 1;
    const uint16_t* va = a >= klo ? reinterpret_cast<const uint16_t*>(vbase + krow[a - klo]) : nullptr;
    const uint16_t* vb = b <= khi ? reinterpret_cast<const uint16_t*>(vbase + krow[b - klo]) : nullptr;
    __m512bh vv[CB];
    for (int c = 0; c < CB; ++c) {
      const int64_t off = (c0 + c) * kLanes;
      const __m512i x = va ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk[c], va + off)) : _mm512_setzero_si512();
      const __m512i y = vb ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk[c], vb + off)), 16) : _mm512_setzero_si512();
      vv[c] = (__m512bh)_mm512_or_si512(x, y);
    }
    for (int r = 0; r < RB; ++r) {
      if (m < plo[r] || m > phi[r]) continue;
      const __m512bh wt = (__m512bh)_mm512_set1_epi32((int)e[r][m]);
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wt, vv[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(o[r] + (c0 + c) * kLanes, acc[r][c]);
}

template <int RB>
inline void pv_direct_rows(const bf16* vbase, const int64_t* krow, int64_t klo, int64_t khi,
                           int64_t d, int64_t nv, int64_t m0, int64_t m1, const int64_t* plo,
                           const int64_t* phi, const uint32_t* const* e, float* const* o) {
  for (int64_t c = 0; c < nv; c += 4) {
    switch (std::min<int64_t>(4, nv - c)) {
      case 4: pv_pairs_direct<RB, 4>(vbase, krow, klo, khi, d, c, m0, m1, plo, phi, e, o); break;
      case 3: pv_pairs_direct<RB, 3>(vbase, krow, klo, khi, d, c, m0, m1, plo, phi, e, o); break;
      case 2: pv_pairs_direct<RB, 2>(vbase, krow, klo, khi, d, c, m0, m1, plo, phi, e, o); break;
      default: pv_pairs_direct<RB, 1>(vbase, krow, klo, khi, d, c, m0, m1, plo, phi, e, o); break;
    }
  }
}

constexpr int64_t kDirectRows = 8;  // tiles of up to this many rows: pv_pairs_direct

constexpr int64_t kPvPairs = kPvKeys / 2;  // V pairs built at a time

// The bf16 path's softmax and P.V. e = exp(s - max) in fp32 and l = its fp32 sum, as
// softmax_rows; then e is rounded to bf16 (VCVTNEPS2BF16) and paired by absolute key index,
// pair m = keys (2m, 2m + 1); out[d] = (VDPBF16PS chain over the row's pairs m = lo/2 .. hi/2 in
// order, from +0) / l. The half of a pair outside the row's keys has e = +0: its product is a
// zero, which leaves the sum's bits as they are (the sum starts at +0 and is never -0), so the
// row's bits do not depend on which other keys the tile holds (a key's V is finite: the cache
// only holds computed K/V; keys outside the tile's range are zero).
inline void tile_softmax_pv_dp(const bf16* cache, const Shape& sh, int64_t rows, int64_t klo,
                               int64_t khi, int64_t spad, TileScratch& ws, float* out) {
  const int64_t nv = (sh.d + kLanes - 1) / kLanes, w = nv * kLanes;
  const int64_t pa = klo / 2, pb = khi / 2, npairs = pb - pa + 1;  // the tile's pairs
  float* s = ws.s.data();
  ws.eb.assign(rows * npairs * 2, 0);
  ws.plo.resize(rows), ws.phi.resize(rows), ws.epp.resize(rows), ws.vpair.resize(kPvPairs * w);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = ws.rlo[r], n = ws.rhi[r] - lo + 1;
    float* e = s + r * spad + (lo - klo);
    softmax_rows(e, 1, n, &ws.l[r]);
    uint16_t* eb = ws.eb.data() + r * npairs * 2 + (lo - 2 * pa);
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      _mm256_mask_storeu_epi16(eb + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, e + i)));
    }
    ws.plo[r] = lo / 2, ws.phi[r] = ws.rhi[r] / 2;
    ws.epp[r] = reinterpret_cast<const uint32_t*>(ws.eb.data() + r * npairs * 2) - pa;
    ws.op[r] = out + r * w;
  }
  std::fill(out, out + rows * w, 0.0f);
  const bf16* vbase = cache + sh.bs * sh.row;
  if (rows <= kDirectRows) {
    for (int64_t r = 0; r < rows; r += 4) {
      const int64_t nb = std::min<int64_t>(4, rows - r);
      int64_t m0 = pb, m1 = pa;
      for (int64_t i = r; i < r + nb; ++i) m0 = std::min(m0, ws.plo[i]), m1 = std::max(m1, ws.phi[i]);
      const int64_t* pl = ws.plo.data() + r;
      const int64_t* ph = ws.phi.data() + r;
      const uint32_t* const* ep = ws.epp.data() + r;
      float* const* op = ws.op.data() + r;
      const int64_t* kr = ws.krow.data();
      switch (nb) {
        case 4: pv_direct_rows<4>(vbase, kr, klo, khi, sh.d, nv, m0, m1, pl, ph, ep, op); break;
        case 3: pv_direct_rows<3>(vbase, kr, klo, khi, sh.d, nv, m0, m1, pl, ph, ep, op); break;
        case 2: pv_direct_rows<2>(vbase, kr, klo, khi, sh.d, nv, m0, m1, pl, ph, ep, op); break;
        default: pv_direct_rows<1>(vbase, kr, klo, khi, sh.d, nv, m0, m1, pl, ph, ep, op); break;
      }
    }
  }
  for (int64_t mc = pa; rows > kDirectRows && mc <= pb; mc += kPvPairs) {
    const int64_t me = std::min(pb, mc + kPvPairs - 1);
    for (int64_t m = mc; m <= me; ++m) {  // lane d: (v_2m[d], v_2m+1[d]), a key outside klo..khi as 0
      const int64_t a = 2 * m, b = a + 1;
      const uint16_t* va = a >= klo ? reinterpret_cast<const uint16_t*>(vbase + ws.krow[a - klo]) : nullptr;
      const uint16_t* vb = b <= khi ? reinterpret_cast<const uint16_t*>(vbase + ws.krow[b - klo]) : nullptr;
      uint32_t* dst = ws.vpair.data() + (m - mc) * w;
      for (int64_t c = 0; c < nv; ++c) {
        const __mmask16 k = tail_mask(sh.d - c * kLanes);
        const __m512i lo16 = va ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, va + c * kLanes)) : _mm512_setzero_si512();
        const __m512i hi16 = vb ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, vb + c * kLanes)), 16) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + c * kLanes, _mm512_or_si512(lo16, hi16));
      }
    }
    pv_tile_all<PvDot, 6>(ws.vpair.data(), w, nv, mc, me, rows, ws.plo.data(), ws.phi.data(),
                          ws.epp.data(), ws.op.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 den = _mm512_set1_ps(ws.l[r]);
    for (int64_t c = 0; c < nv; ++c) {
      float* o = out + r * w + c * kLanes;
      _mm512_storeu_ps(o, _mm512_div_ps(_mm512_loadu_ps(o), den));
    }
  }
}

// q row (d bf16, d even) -> nc * 16 pairs, zero-padded.
inline void load_q_pairs(const bf16* src, int64_t d, int64_t nc, uint32_t* dst) {
  for (int64_t c = 0; c < nc; ++c)
    _mm512_storeu_si512(dst + c * kPairs, _mm512_maskz_loadu_epi32(tail_mask(d / 2 - c * kPairs),
                                                                   src + 2 * c * kPairs));
}

// The tiled path for bf16 q and cache: qp [rows][nc*16] q pairs (load_q_pairs).
// The tiled path for bf16 q and cache: q [rows][nc * 16] the rows' q pairs (load_q_pairs).
// Scores in blocks of up to 64 keys (4 groups of 16, from klo) for the rows that use the block.
inline void attend_tile_dp(const uint32_t* q, const bf16* cache, const int32_t* table,
                           const Shape& sh, int64_t ntok, const int64_t* lo, const int64_t* hi,
                           float sc, TileScratch& ws, float* out) {
  const int64_t np = sh.d / 2, nc = (np + kPairs - 1) / kPairs, rows = ntok * sh.g;
  int64_t klo, khi, spad;
  tile_setup<bf16>(table, sh, ntok, lo, hi, ws, klo, khi, spad);
  ws.ktp.resize(nc * kPairs * 4 * kLanes);
  uint32_t* kt = ws.ktp.data();
  const __m512 scale = _mm512_set1_ps(sc);
  for (int64_t base = klo; base <= khi; base += 4 * kLanes) {
    const int64_t ng = std::min<int64_t>(4, (khi - base) / kLanes + 1);
    for (int64_t g = 0; g < ng; ++g) {  // 16 keys x 16 pairs -> 16 pairs x 16 keys (bits)
      const int64_t kb = base + g * kLanes, cnt = std::min<int64_t>(kLanes, khi - kb + 1);
      const bf16* kp[kLanes];
      for (int64_t i = 0; i < cnt; ++i) kp[i] = cache + ws.krow[kb + i - klo];
      for (int64_t c = 0; c < nc; ++c) {
        const __mmask16 m = tail_mask(np - c * kPairs);
        __m512 x[kLanes];
        for (int64_t i = 0; i < kLanes; ++i)
          x[i] = i < cnt ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, kp[i] + 2 * c * kPairs))
                         : _mm512_setzero_ps();
        transpose16(x);
        for (int i = 0; i < kLanes; ++i)
          _mm512_storeu_si512(kt + ((c * kPairs + i) * 4 + g) * kLanes, _mm512_castps_si512(x[i]));
      }
    }
    const int64_t cnt = std::min<int64_t>(ng * kLanes, khi - base + 1);
    const int64_t m = rows_using(q, nc * kPairs, rows, base, cnt, klo, spad, ws, ws.qpp);
    const uint32_t* const* qp = ws.qpp.data();
    float* const* sp = ws.sp.data();
    switch (ng) {
      case 4: score_block_dp<4>(kt, np, m, qp, scale, sp); break;
      case 3: score_block_dp<3>(kt, np, m, qp, scale, sp); break;
      case 2: score_block_dp<2>(kt, np, m, qp, scale, sp); break;
      default: score_block_dp<1>(kt, np, m, qp, scale, sp); break;
    }
  }
  tile_softmax_pv_dp(cache, sh, rows, klo, khi, spad, ws, out);
}

#endif

template <typename CT>
void attend_tile(const float* qf, const CT* cache, const int32_t* table, const Shape& sh,
                 int64_t ntok, const int64_t* lo, const int64_t* hi, TileScratch& ws, float* out) {
  switch ((sh.d + kLanes - 1) / kLanes) {  // the same split as attend_task
    case 1: return attend_tile_nv<CT, 1, true>(qf, cache, table, sh, ntok, lo, hi, ws, out);
    case 2: return attend_tile_nv<CT, 2, true>(qf, cache, table, sh, ntok, lo, hi, ws, out);
    case 4: return attend_tile_nv<CT, 4, true>(qf, cache, table, sh, ntok, lo, hi, ws, out);
    case 8: return attend_tile_nv<CT, 8, true>(qf, cache, table, sh, ntok, lo, hi, ws, out);
    default: return attend_tile_nv<CT, 0, false>(qf, cache, table, sh, ntok, lo, hi, ws, out);
  }
}

#else  // scalar fallback: the same order, one lane

constexpr int kLanes = 16;  // only pads the q/out rows
constexpr bool kVector = false;
constexpr bool kDotBf16 = false;

template <typename QT>
inline void load_q(const QT* src, int64_t d, float sc, float* dst) {
  const int64_t w = (d + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = 0; i < w; ++i) dst[i] = i < d ? (float)src[i] * sc : 0.0f;
}
template <typename QT>
inline void store_out(const float* src, int64_t d, QT* dst) {
  for (int64_t i = 0; i < d; ++i) dst[i] = (QT)src[i];
}

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
