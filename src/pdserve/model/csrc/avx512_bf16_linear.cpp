// A batch-invariant bf16 linear on AVX512-BF16 (no AMX): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why: oneDNN's packed bf16 linear is not reliably row-invariant on such a CPU (on an AMD EPYC,
// Zen 4: a 2048-input layer gives row 0 other bits alone than among >= 2 rows), and its
// few-row products stream the weight at well under the read bandwidth, where a batch-1 decode
// step spends most of its time. Here a row's bits are fixed by construction, and the one-row
// path streams the weight once, front to back.
//
// Invariant: every output element has ONE fp32 accumulator (a lane of a zmm register), zeroed,
// then fed pair by pair over k = (0, 1), (2, 3), ... in order by VDPBF16PS (acc += x[2i] w[2i] +
// x[2i+1] w[2i+1], the instruction's fixed internal order), an odd K's last element as a pair
// with a zero; then bias added in fp32 and ONE rounding to bf16 (VCVTNEPS2BF16, round to
// nearest even). The register blocking (1-6 rows x 4 column vectors) and the thread split
// (over column panels only) decide which instructions run side by side, never an element's
// sequence, so a row's bits depend neither on the row count, its position nor the threads.
//
// Weight layout (pack): W [N, K] bf16 -> P [Np, Kp, 64, 2] bf16, Np = ceil(N/64), Kp =
// ceil(K/2), P[p, i, c, j] = W[64 p + c, 2 i + j] (zero where n >= N or k >= K). For a k pair
// i, a panel's 64 columns are 256 contiguous bytes: four zmm loads give 4 x 16 columns x 2 k,
// multiplied by x's pair broadcast as one 32-bit value. A panel is contiguous over i, and the
// panels follow each other, so one row's product streams the weight front to back.
//
// Blocking (speed only). Threads split the panels. Per panel, the rows run in blocks of
// kRows (6: 24 accumulators + 4 weight vectors + 1 broadcast of the 32 zmm registers) over the
// whole K; the panel (K x 128 bytes: 64 KiB at K = 512, 256 KiB at 2048) stays in L2 from the
// first row block to the last, the rows' x in L1/L2. Above 2 MiB of x, rows run in chunks of
// ~256 KiB of x (252 rows at K = 512), each chunk against all of a thread's panels, so that x
// stays in L2 (at 4,096 rows: within a few % of unchunked, noisy; chunking from 252 rows made
// bench50m's 8 x 128 prefill 1-6 % slower). A block of 1-2 rows (decode) is bound
// by memory and streams the weight at what the hardware prefetcher gives (software prefetch of
// 1-4 lines, 0.5-8 KiB ahead, was 15-35 % slower; two panels streamed side by side: no gain).
// What helped it: packed weights in transparent huge pages (packed_storage; +15-25 % GB/s at
// one row on 4-16 MiB weights), and a model's weights packed back to back in model order into
// one storage (alloc + pack into a slice: avx512_bf16_linear.pack_all), so a decode step is
// one run of memory, small weights included.
//
// Loads. From kPrefetchRows (64) rows a call is compute-bound (each weight byte feeds >= 64
// products), and the first row block of each panel would wait on DRAM for the panel: the
// panel's row blocks instead prefetch (PREFETCHT0) the next panel, one line per k pair, spread
// over them (past a weight's last panel: what follows it in pack_all's arena, the next weight).
// Paired in-engine runs on bench50m: a 1 x 128 prefill step 1.021x +- 0.005; 8 x 128
// 1.006x +- 0.010, 64 x 128 1.007x +- 0.028, a 64-row decode 1.043x +- 0.041. Below 64 rows
// (decode) it is off: at 8 rows it measured 0.85x +- 0.09, competing with the weight stream.
//
// Stores. A block's epilogue writes 2-3 lines per row of y, which was just allocated and is
// rarely in L1: each store that misses waits for its line. A block of >= 3 rows therefore
// prefetches those lines when it starts, ~R x K/2 x 4 products before the stores. On bench50m
// (one thread, paired runs): 128 x 512 -> 4096 hot 1.09x faster (a 1 MiB y; the write-only
// diagnostic, no stores at all, 1.11x); in the engine a 1 x 128 prefill step 1.05x, 8 x 128
// 1.085x. PREFETCHW (-mprfchw) instead of PREFETCHT0: no better.
//
// Fused silu_mul (linear_silu_mul). A gate_up weight [2I, K] reordered so that panel p holds
// gate rows 32p..32p+31 then the same up rows (avx512_bf16_linear.gate_up_order) gives, in
// one epilogue, the gate and up values of 32 columns: they are rounded to bf16 as the plain
// linear would store them, then silu_mul's arithmetic runs on them (silu_ps, avx512_math.h),
// so y [M, I] = silu_mul(linear(x)) bit for bit, without the [M, 2I] intermediate. bench50m
// bf16 prefill 1.016x (1 x 128) and 1.019x (8 x 128), paired in-engine runs.
//
// Build flags: AVX-512 (F, BW, VL, BF16): see avx512_bf16_linear.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <sys/mman.h>

#include "avx512_math.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace {

constexpr int kVec = 16;                   // fp32 lanes per zmm (columns per vector)
constexpr int kCols = 4 * kVec;            // columns per panel
constexpr int64_t kPairBytes = kCols * 4;  // one k pair of a panel: 256 bytes
constexpr size_t kHuge = 2 << 20;          // a transparent huge page
constexpr int kRows = 6;                   // rows per register block
constexpr int64_t kChunkBytes = 256 << 10;  // x per row chunk (many rows: L2 blocking)
constexpr int64_t kUnchunkedBytes = 2 << 20;  // up to this much x: one chunk
constexpr int64_t kPrefetchRows = 64;  // from this many rows a call prefetches its next panels

// x's pair (x[2i], x[2i+1]) as one 32-bit value broadcast to all lanes.
inline __m512bh pair_at(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One row's odd last element: the pair (x[K-1], 0).
inline __m512bh last_at(const uint16_t* x) { return (__m512bh)_mm512_set1_epi32(*x); }

// x -> bf16 (round to nearest even) -> fp32: the value a bf16 tensor would have stored.
inline __m512 rne(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// The fused silu_mul epilogue of a gate_up panel: gate = rne(acc[r][0..1] + bias), up =
// rne(acc[r][2..3] + bias), exactly the gate_up linear's bf16 outputs; then silu_mul's own
// arithmetic (bf16_pointwise.cpp): out = rne(rne(silu(gate)) * up), silu from avx512_math.h.
// So a row's bits equal silu_mul(linear(x)) of the unfused path. y: cols <= 32 columns.
template <int R>
inline void silu_mul_epilogue(const __m512 (&acc)[R][4], const float* bias, uint16_t* y,
                              int64_t ldy, int64_t cols) {
  for (int v = 0; v < 2; ++v) {
    const int64_t c0 = v * kVec;
    if (c0 >= cols) break;
    const __mmask16 mask = pdserve_simd::tail_mask(cols - c0);
    const __m512 bg = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c0);
    const __m512 bu =
        bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + 2 * kVec + c0);
    for (int r = 0; r < R; ++r) {
      const __m512 g = rne(bias == nullptr ? acc[r][v] : _mm512_add_ps(acc[r][v], bg));
      const __m512 u = rne(bias == nullptr ? acc[r][v + 2] : _mm512_add_ps(acc[r][v + 2], bu));
      const __m512 out = _mm512_mul_ps(rne(pdserve_simd::silu_ps(g)), u);
      _mm256_mask_storeu_epi16(y + r * ldy + c0, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

// Rows [0, R) of x (row stride ldx) times one panel w (Kp pairs of 256 bytes) into
// y[r, 0:cols] (row stride ldy): the whole K in registers, then the epilogue. bias: this
// panel's first column in an fp32 array, or null. kSiluMul: the panel is a gate_up panel
// (columns 0-31 gate, 32-63 the matching up: gate_up_order) and y gets cols <= 32 columns of
// silu(gate) * up (see silu_mul_epilogue).
// pf: lines [0, pf_lines) of the next panel to prefetch, one per k pair (header: "Loads").
template <int R, bool kSiluMul>
void block(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, const float* bias,
           uint16_t* y, int64_t ldy, int64_t cols, const char* pf, int64_t pf_lines) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  // the lines the epilogue stores (a row's 64 bf16 columns), fetched while the products run
  // (header: "Stores"); rows of 1-2 (decode, memory-bound) are left as they were
  if constexpr (R >= 3)
    for (int r = 0; r < R; ++r) {
      const char* yr = reinterpret_cast<const char*>(y + r * ldy);
      _mm_prefetch(yr, _MM_HINT_T0);
      _mm_prefetch(yr + 64, _MM_HINT_T0);
      _mm_prefetch(yr + 127, _MM_HINT_T0);  // a third line when the row is not 64-B aligned
    }
  const int64_t pairs = k / 2;
  const char* wb = reinterpret_cast<const char*>(w);
  for (int64_t i = 0; i < pairs; ++i) {
    const char* wi = wb + i * kPairBytes;
    if constexpr (R >= 3)  // (1-2 rows: decode, never given lines; its loop unchanged)
      if (i < pf_lines) _mm_prefetch(pf + i * 64, _MM_HINT_T0);
    const __m512bh b0 = (__m512bh)_mm512_load_si512(wi);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(wi + 64);
    const __m512bh b2 = (__m512bh)_mm512_load_si512(wi + 128);
    const __m512bh b3 = (__m512bh)_mm512_load_si512(wi + 192);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_at(x + r * ldx + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  if (k & 1) {  // the last pair: (x[K-1], 0) against (w[K-1], 0)
    const char* wi = wb + pairs * kPairBytes;
    __m512bh b[4];
    for (int v = 0; v < 4; ++v) b[v] = (__m512bh)_mm512_load_si512(wi + 64 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = last_at(x + r * ldx + k - 1);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  if constexpr (kSiluMul) {
    silu_mul_epilogue<R>(acc, bias, y, ldy, cols);
    return;
  }
  // epilogue: (acc + bias) in fp32, one rounding to bf16, masked past cols
  for (int v = 0; v < 4; ++v) {
    const int64_t c0 = v * kVec;
    if (c0 >= cols) break;
    const __mmask16 mask = pdserve_simd::tail_mask(cols - c0);
    const __m512 bv = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c0);
    for (int r = 0; r < R; ++r) {
      const __m512 s = bias == nullptr ? acc[r][v] : _mm512_add_ps(acc[r][v], bv);
      _mm256_mask_storeu_epi16(y + r * ldy + c0, mask, (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

// Zeroed bf16 storage of n elements for a packed weight: from 2 MiB up in 2 MiB-aligned
// memory that the kernel is asked to back with transparent huge pages (madvise; a hint, also
// with THP in "madvise" mode). A one-row product streams the weight once: with 4 KiB pages
// the hardware prefetcher stops at every page boundary and the TLB misses every 64 k pairs.
torch::Tensor packed_storage(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * 2;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16);
  if (bytes < kHuge) return torch::zeros({n}, opts);
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHuge, size) == 0, "pack: out of memory");
  madvise(p, size, MADV_HUGEPAGE);  // best effort: the layout is the same without it
  std::memset(p, 0, size);
  return torch::from_blob(p, {n}, [](void* q) { std::free(q); }, opts);
}

using BlockFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*,
                         uint16_t*, int64_t, int64_t, const char*, int64_t);
template <bool kSiluMul>
constexpr BlockFn kBlocks[kRows + 1] = {nullptr,
                                        block<1, kSiluMul>,
                                        block<2, kSiluMul>,
                                        block<3, kSiluMul>,
                                        block<4, kSiluMul>,
                                        block<5, kSiluMul>,
                                        block<6, kSiluMul>};

}  // namespace

// Zeroed storage for packed weights of n bf16 elements in all (1-D; see packed_storage).
torch::Tensor alloc(int64_t n) { return packed_storage(n); }

// W [N, K] bf16 -> [Np, Kp, 64, 2] bf16 (layout above), into `into` when given: a zeroed,
// contiguous, 64-byte aligned 1-D bf16 slice of Np * Kp * 128 elements (of alloc()'s storage:
// several weights packed back to back, so that a decode step streams them as one run).
torch::Tensor pack(torch::Tensor w, const std::optional<torch::Tensor>& into) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack: W must be [N, K] bf16");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t np = (n + kCols - 1) / kCols, kp = (k + 1) / 2;
  torch::Tensor out;
  if (into.has_value() && into->defined()) {
    out = *into;
    TORCH_CHECK(out.dim() == 1 && out.numel() == np * kp * kCols * 2 &&
                    out.scalar_type() == torch::kBFloat16 && out.is_contiguous() &&
                    reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0,
                "pack: `into` must be a contiguous, 64-byte aligned bf16 [Np * Kp * 128]");
  } else {
    out = packed_storage(np * kp * kCols * 2);
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, np, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t c = 0; c < kCols && p * kCols + c < n; ++c) {
        const uint16_t* row = src + (p * kCols + c) * k;
        for (int64_t kk = 0; kk < k; ++kk)
          dst[((p * kp + kk / 2) * kCols + c) * 2 + kk % 2] = row[kk];
      }
  });
  return out.view({np, kp, kCols, 2});
}

namespace {

// The product of linear / linear_silu_mul. Plain: panel p gives y's columns [64 p, 64 p + 64).
// kSiluMul: panel p (32 gate + 32 up columns, gate_up_order's order) gives y's columns
// [32 p, 32 p + 32) of silu(gate) * up; n = I, y [M, I], bias in the packed order [64 Np].
template <bool kSiluMul>
torch::Tensor run(const char* op, torch::Tensor x, torch::Tensor packed,
                  const std::optional<torch::Tensor>& bias, int64_t n) {
  constexpr int64_t kOut = kSiluMul ? kCols / 2 : kCols;  // y columns per panel
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, op, ": x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              op, ": packed must come from pack()");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              op, ": packed must be 64-byte aligned");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t np = packed.size(0), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2 && np == (n + kOut - 1) / kOut,
              op, ": x's K or n does not match the packed weight");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  torch::Tensor bias_f;  // fp32 (Avx512Bf16Linear keeps it so: no conversion per call)
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == (kSiluMul ? np * kCols : n), op,
                kSiluMul ? ": bias must have 64 * Np elements (gate_up_order's order)"
                         : ": bias must have n elements");
    bias_f = bias->to(torch::kFloat32).contiguous();
  }
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Threads split the panels only: a row's bits never depend on the thread count.
  // rows per chunk: a chunk's x (~kChunkBytes) stays in L2 while it runs against every panel
  const int64_t chunk = 2 * m * k <= kUnchunkedBytes
                            ? m
                            : std::max<int64_t>(kRows, kChunkBytes / (2 * k) / kRows * kRows);
  at::parallel_for(0, np, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t m1 = 0; m1 < m; m1 += chunk) {
      const int64_t m_end = std::min(m, m1 + chunk);
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t col0 = p * kOut;
        const int64_t cols = std::min<int64_t>(kOut, n - col0);
        const uint16_t* w = wp + p * kp * kCols * 2;
        const float* b = bias_p == nullptr ? nullptr : bias_p + p * kCols;
        // compute-bound (>= kPrefetchRows rows): the next panel (past a weight's last: the
        // next weight of pack_all's arena) into L1 / L2, spread over this panel's row blocks
        const char* next = reinterpret_cast<const char*>(w + kp * kCols * 2);
        const int64_t nblocks = (m_end - m1 + kRows - 1) / kRows;
        const int64_t panel_lines = kp * kPairBytes / 64;
        const int64_t per =
            m_end - m1 >= kPrefetchRows ? (panel_lines + nblocks - 1) / nblocks : 0;
        for (int64_t m0 = m1, bi = 0; m0 < m_end; m0 += kRows, ++bi) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m_end - m0));
          const int64_t l0 = bi * per;
          const int64_t lines = std::max<int64_t>(0, std::min(per, panel_lines - l0));
          kBlocks<kSiluMul>[rows](xs + m0 * k, k, k, w, b, yp + m0 * n + col0, n, cols,
                                  next + l0 * 64, lines);
        }
      }
    }
  });
  return y;
}

}  // namespace

// x [M, K] bf16, packed from pack(W), bias [N] (any float dtype) or empty -> y [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias,
                     int64_t n) {
  return run<false>("linear", x, packed, bias, n);
}

// x [M, K] bf16, packed from pack(gate_up_order(W_gate_up [2I, K])), bias [64 Np] or
// empty -> silu(gate) * up [M, I] bf16, bit-equal to silu_mul(linear(x, W_gate_up)).
torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed,
                              const std::optional<torch::Tensor>& bias, int64_t i) {
  return run<true>("linear_silu_mul", x, packed, bias, i);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("alloc", &alloc, "zeroed storage for packed weights (huge pages from 2 MiB)");
  m.def("pack", &pack, "W [N, K] bf16 -> panels of 64 columns x k pairs [Np, Kp, 64, 2]",
        py::arg("w"), py::arg("into") = py::none());
  m.def("linear", &linear, "y = x @ W^T (+ bias), batch-invariant, bf16 out");
  m.def("linear_silu_mul", &linear_silu_mul,
        "silu(gate) * up of x @ W_gate_up^T (+ bias), W in gate_up_order's order, bf16 out");
}
