// Fused bf16 pointwise ops of a llama layer on CPU (pdserve.model.bf16_pointwise).
//
// Each op replaces a chain of torch ops that made a bf16 prefill step spend 10-20 % of its
// time outside the GEMMs (a pass over memory per op, a temporary per op, a slow strided
// path for SiLU over a `chunk` view). Each keeps the ROUNDINGS of the chain it replaces:
// every intermediate the torch chain rounds to bf16 is rounded here too, to nearest even
// (rne_bits: c10::BFloat16's rule, except a denormal reads as zero with AVX512-BF16):
//   rms_norm:      y = rne(x * r), out = rne(w * y), r = 1 / sqrt(mean(x^2) + eps)
//   add_rms_norm:  x <- rne(x + d) (in place), then rms_norm of the new x
//   silu_mul:      out = rne(rne(g / (1 + exp(-g))) * u), [g | u] = the two halves of a row
//   rope:          out = rne(rne(x * cos) + rne(roll(x, D/2) * sin_signed))
// RoPE's products of two bf16 values are exact in fp32, so it is bit-identical to the torch
// chain. rms_norm's sum of squares (16 lanes over the row in order, then a fixed horizontal
// reduction) and silu's exp (a fixed polynomial) may differ from torch's in the last fp32 ulp,
// which rounding to bf16 almost always hides.
//
// Batch invariance: every op works row by row; a row's arithmetic depends only on its length
// (H, I, D), never on the row count, its position in the batch or the thread count (threads
// split rows, never a row). No -ffast-math, no FP contraction outside the explicit FMAs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include "avx512_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kVec = 16;  // fp32 lanes per zmm

using pdserve_simd::load_bf16;
using pdserve_simd::tail_mask;

// fp32 -> bf16 bits, round to nearest even. With AVX512-BF16: VCVTNEPS2BF16 (one instruction;
// it reads a denormal input as zero). Without: c10's rule in integer code. The two builds
// differ only for denormals and NaN payloads.
inline __m256i rne_bits(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  return pdserve_simd::bf16_bits_c10(x);
#endif
}

// rne to bf16 and back to fp32: the value a torch op would have stored.
inline __m512 rne(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rne_bits(x)), 16));
}

inline void store_bf16(uint16_t* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, rne_bits(x));
}

inline const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* bits_mut(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Rows per parallel task: ~32 Ki elements (64 KiB of bf16), so a small batch stays on one thread.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (32 << 10) / row_elems); }

// The second half of a row's norm: out = rne(w * rne(x * r)), r = 1 / sqrt(mean + eps), mean
// from `acc`, the 16 lane sums of x^2 over the row in order (see norm_row).
void scale_row(const uint16_t* x, const uint16_t* w, float eps, int64_t h, __m512 acc,
               uint16_t* out) {
  const float mean = _mm512_reduce_add_ps(acc) / (float)h;
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < h; i += kVec) {
    const __mmask16 m = tail_mask(h - i);
    const __m512 y = rne(_mm512_mul_ps(load_bf16(x + i, m), r));
    store_bf16(out + i, m, _mm512_mul_ps(load_bf16(w + i, m), y));
  }
}

// One row: y = rne(x * r), out = rne(w * y).
void norm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t h, uint16_t* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += kVec) {
    const __m512 v = load_bf16(x + i, tail_mask(h - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  scale_row(x, w, eps, h, acc, out);
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, op,
              ": bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.is_cpu(), op, ": x must be [T, H], rows contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), op,
              ": weight must be [H]");
}

}  // namespace

// x [T, H] bf16 (rows contiguous), w [H] bf16 -> [T, H] bf16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  const int64_t t = x.size(0), h = x.size(1), ld = x.stride(0);
  auto out = at::empty({t, h}, x.options());
  const uint16_t *xp = bits(x), *wp = bits(w);
  uint16_t* op = bits_mut(out);
  at::parallel_for(0, t, grain(h), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm_row(xp + i * ld, wp, (float)eps, h, op + i * h);
  });
  return out;
}

// x <- rne(x + d) in place (the residual stream), then returns rms_norm(x, w).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(d.scalar_type() == at::kBFloat16 && d.dim() == 2 && d.stride(1) == 1 &&
                  d.size(0) == x.size(0) && d.size(1) == x.size(1),
              "add_rms_norm: d must be bf16 [T, H] like x");
  const int64_t t = x.size(0), h = x.size(1), lx = x.stride(0), ld = d.stride(0);
  auto out = at::empty({t, h}, x.options());
  uint16_t* xp = bits_mut(x);
  const uint16_t *dp = bits(d), *wp = bits(w);
  uint16_t* op = bits_mut(out);
  at::parallel_for(0, t, grain(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      // one pass: the new x rounded and stored, and its squares summed as norm_row sums
      // them (the same values in the same order), then the scaling pass
      uint16_t* xr = xp + r * lx;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < h; i += kVec) {
        const __mmask16 m = tail_mask(h - i);
        const __m512 v = rne(_mm512_add_ps(load_bf16(xr + i, m), load_bf16(dp + r * ld + i, m)));
        store_bf16(xr + i, m, v);  // exact: v is already bf16
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      scale_row(xr, wp, (float)eps, h, acc, op + r * h);
    }
  });
  return out;
}

// gu [T, 2I] bf16 (gate | up per row) -> [T, I] bf16: rne(rne(silu(gate)) * up).
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.dim() == 2 && gu.stride(1) == 1 &&
                  gu.size(1) % 2 == 0 && gu.is_cpu(),
              "silu_mul: gate_up must be bf16 [T, 2I], rows contiguous");
  const int64_t t = gu.size(0), n = gu.size(1) / 2, ld = gu.stride(0);
  auto out = at::empty({t, n}, gu.options());
  const uint16_t* gp = bits(gu);
  uint16_t* op = bits_mut(out);
  // rne(silu(g)) of 16 lanes (masked lanes: g = 0)
  auto silu = [](__m512 gv) { return rne(pdserve_simd::silu_ps(gv)); };
  at::parallel_for(0, t, grain(2 * n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* g = gp + r * ld;
      uint16_t* o = op + r * n;
      int64_t i = 0;
      // 4 vectors per step: independent exp chains side by side (the same lanes' math)
      for (; i + 4 * kVec <= n; i += 4 * kVec) {
        __m512 s[4];
        for (int u = 0; u < 4; ++u) s[u] = silu(load_bf16(g + i + u * kVec, 0xFFFF));
        for (int u = 0; u < 4; ++u)
          store_bf16(o + i + u * kVec, 0xFFFF,
                     _mm512_mul_ps(s[u], load_bf16(g + n + i + u * kVec, 0xFFFF)));
      }
      for (; i < n; i += kVec) {
        const __mmask16 m = tail_mask(n - i);
        store_bf16(o + i, m, _mm512_mul_ps(silu(load_bf16(g + i, m)), load_bf16(g + n + i, m)));
      }
    }
  });
  return out;
}

// qkv [T, (H + 2 Hkv) D] bf16 (rows contiguous), cos / sin_signed [T, D] bf16 ->
// (q [T, H, D], k [T, Hkv, D]) contiguous, RoPE applied to both (v is left where it is).
std::vector<at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t h, int64_t hkv, int64_t d) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16,
              "rope_qk: bf16 tensors only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (h + 2 * hkv) * d,
              "rope_qk: qkv must be [T, (H + 2 Hkv) D], rows contiguous");
  TORCH_CHECK(d % 2 == 0, "rope_qk: odd head_dim");
  const int64_t t = qkv.size(0), ld = qkv.stride(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && cos.stride(1) == 1 &&
                  sin.dim() == 2 && sin.size(0) == t && sin.size(1) == d && sin.stride(1) == 1,
              "rope_qk: cos and sin must be [T, D]");
  auto q = at::empty({t, h, d}, qkv.options());
  auto k = at::empty({t, hkv, d}, qkv.options());
  const uint16_t *xp = bits(qkv), *cp = bits(cos), *sp = bits(sin);
  uint16_t *qp = bits_mut(q), *kp = bits_mut(k);
  const int64_t lc = cos.stride(0), ls = sin.stride(0), half = d / 2;
  at::parallel_for(0, t, grain((h + hkv) * d), [&](int64_t b, int64_t e) {
    // roll(x, D/2)[i] = x[(i + D/2) mod D]: read in place when no 16-lane chunk wraps,
    // else from a copy of the head twice over
    const bool direct = half % kVec == 0;
    std::vector<uint16_t> twice(2 * d);
    const int64_t nv = (d + kVec - 1) / kVec;
    std::vector<__m512> cs(2 * nv);  // the row's cos and sin in fp32, shared by its heads
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0, c = 0; i < d; i += kVec, ++c) {
        const __mmask16 m = tail_mask(d - i);
        cs[c] = load_bf16(cp + r * lc + i, m);
        cs[nv + c] = load_bf16(sp + r * ls + i, m);
      }
      for (int64_t j = 0; j < h + hkv; ++j) {
        const uint16_t* x = xp + r * ld + j * d;
        uint16_t* o = j < h ? qp + (r * h + j) * d : kp + (r * hkv + j - h) * d;
        if (!direct) {
          std::copy(x, x + d, twice.begin());
          std::copy(x, x + d, twice.begin() + d);
        }
        for (int64_t i = 0, c = 0; i < d; i += kVec, ++c) {
          const __mmask16 m = tail_mask(d - i);
          const uint16_t* rolled = direct ? x + (i + half) % d : twice.data() + half + i;
          const __m512 with_cos = rne(_mm512_mul_ps(load_bf16(x + i, m), cs[c]));
          const __m512 with_sin = rne(_mm512_mul_ps(load_bf16(rolled, m), cs[nv + c]));
          store_bf16(o + i, m, _mm512_add_ps(with_cos, with_sin));
        }
      }
    }
  });
  return {q, k};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm, torch's roundings (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "x += d in place, then bf16 RMSNorm (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2I] bf16 gate_up (CPU)");
  m.def("rope_qk", &rope_qk, "RoPE of q and k out of a fused qkv row, bf16 (CPU)");
}
