// A batch-invariant bf16 linear on Intel AMX: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why: on a CPU with AMX, oneDNN picks its bf16 GEMM kernel by the row count (AVX-512 for a
// few rows, AMX tiles above, another path for the M tail), so a row's bits depend on how many
// other rows share the call. Here every row, alone or among thousands, runs the same
// instruction sequence: for each output element, one fp32 accumulator in an AMX tile, fed
// K-tile by K-tile in order (k = 0, 32, 64, ...), each TDPBF16PS adding its 16 bf16 pairs in
// the hardware's fixed order. A tile row's result depends only on that row's inputs, so the
// M blocking (16 or 32 rows), the position of a row in the batch and the thread split (over
// N only) do not change any bit.
//
// Weight layout (pack): W [N, K] bf16 -> P [Nb, Kb, 16, 32] bf16, Nb = ceil(N/16),
// Kb = ceil(K/32), P[nb, kb, r, 2c + j] = W[16 nb + c, 32 kb + 2 r + j] (AMX's VNNI pairs;
// zero where n >= N or k >= K). One (nb, kb) tile is 1 KiB; an N block of 16 is contiguous
// over kb, so a one-row product streams the weight front to back.
//
// Blocking (cache only: it never changes an element's K order). Threads split N in pairs of N
// blocks (32 columns); a pair's 32 x 32 output block is 2 x 2 C tiles fed by two A row tiles
// and two B tiles per kb, its fp32 partial sums waiting in a buffer between K slices of
// kKSlice tiles. Up to 32 rows (decode): A packed per call, a chunk of pairs (~512 KiB of
// weight) per K slice, then each row's epilogue. From 33 rows (prefill), each 32 x 32 block's
// epilogue runs as soon as its last slice is done (partial sums still in L1), and: up to 128
// rows with at most 1 MiB of packed A, per pair and K slice the weight slice (16 KiB, L1) runs
// against every 32-row block (the weight is read once, the blocks' partial sums fit in L1;
// more blocks were slower with the weight in DRAM); else a chunk of ~1 MiB of weight stays in
// L2 while each 32-row block's A slice (16 KiB, L1) runs against the chunk's pairs, A packed
// per call or, with at most 2 chunks, per block just before its use (no call-sized copy).
//
// Build flags: AMX-TILE, AMX-BF16 and AVX-512 (F, BW, VL, BF16): see amx_linear.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int kTileRows = 16;   // rows of every tile used here
constexpr int kTileBytes = 64;  // bytes per tile row (32 bf16 or 16 fp32)
constexpr int kKTile = 32;      // K per tile (bf16 elements)
constexpr int kNTile = 16;      // N per tile (fp32 outputs)
constexpr int64_t kKSlice = 8;  // K tiles per slice (cache blocking only; 4 and 16: slower)
constexpr int64_t kLargeM = 33;  // rows from which the prefill blocking runs
constexpr int64_t kSmallChunkBytes = 512 << 10;   // weight per N chunk, up to 32 rows
constexpr int64_t kLargeChunkBytes = 1024 << 10;  // weight per N chunk, from 33 rows
constexpr int64_t kASmallBlocks = 4;              // up to 4 32-row blocks (128 rows) and
constexpr int64_t kASmallBytes = 1024 << 10;      // 1 MiB of packed A: weight-stationary
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: C (2 x 2 tiles of 16 x 16 fp32), tmm4..5: A (16 rows x 32 bf16), tmm6..7: B.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = kTileBytes;
  }
  _tile_loadconfig(&cfg);
}

// The OS must grant this process the AMX tile state once (Linux >= 5.16).
bool request_amx() {
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// C tiles of one 32-row x 32-col output block, K tiles [kb_begin, kb_end): zeroed first
// (first) or loaded from c, then stored back to c (fp32: a store and reload change no bit, so
// the K blocking does not change an element's sum). a0 / a1: the block's two A row tiles over
// kb (tile-packed, 1 KiB per kb); b0 / b1: its two N blocks of the packed weight.
// two_rows / two_cols: whether the second A tile / B tile exists (tails use one).
template <bool two_rows, bool two_cols>
void block(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0, const uint16_t* b1,
           int64_t kb_begin, int64_t kb_end, bool first, float* c, int64_t c_stride_bytes) {
  constexpr int64_t kTile = kTileRows * kKTile;  // bf16 elements per tile
  const int64_t down = kTileRows * (c_stride_bytes / 4);
  if (first) {
    _tile_zero(0);
    if (two_cols) _tile_zero(1);
    if (two_rows) _tile_zero(2);
    if (two_rows && two_cols) _tile_zero(3);
  } else {
    _tile_loadd(0, c, c_stride_bytes);
    if (two_cols) _tile_loadd(1, c + kNTile, c_stride_bytes);
    if (two_rows) _tile_loadd(2, c + down, c_stride_bytes);
    if (two_rows && two_cols) _tile_loadd(3, c + down + kNTile, c_stride_bytes);
  }
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    _tile_loadd(4, a0 + kb * kTile, kTileBytes);
    if (two_rows) _tile_loadd(5, a1 + kb * kTile, kTileBytes);
    _tile_loadd(6, b0 + kb * kTile, kTileBytes);
    if (two_cols) _tile_loadd(7, b1 + kb * kTile, kTileBytes);
    _tile_dpbf16ps(0, 4, 6);
    if (two_cols) _tile_dpbf16ps(1, 4, 7);
    if (two_rows) _tile_dpbf16ps(2, 5, 6);
    if (two_rows && two_cols) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride_bytes);
  if (two_cols) _tile_stored(1, c + kNTile, c_stride_bytes);
  if (two_rows) _tile_stored(2, c + down, c_stride_bytes);
  if (two_rows && two_cols) _tile_stored(3, c + down + kNTile, c_stride_bytes);
}

// One output row: y[j] = bf16(c[j] (+ bias[j])), j < cols, 16 at a time (VCVTNEPS2BF16:
// round to nearest even; the same instruction for every element, tails masked).
inline void store_row(const float* c, const float* bias, uint16_t* y, int64_t cols) {
  for (int64_t j = 0; j < cols; j += kNTile) {
    const __mmask16 mask = cols - j >= kNTile ? 0xffff : (__mmask16)((1u << (cols - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, c + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(y + j, mask, h);
  }
}

// The epilogue of one C block (rows x cols, up to 32 x 32; row stride 32 floats, 64-byte
// aligned): per element the same instructions as store_row.
inline void store_block(const float* c, const float* bias, uint16_t* y, int64_t y_stride,
                        int64_t rows, int64_t cols) {
  const __mmask16 m0 = cols >= kNTile ? 0xffff : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 2 * kNTile ? 0xffff
                       : cols > kNTile    ? (__mmask16)((1u << (cols - kNTile)) - 1)
                                          : 0;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + kNTile);
  }
  for (int64_t r = 0; r < rows; ++r, c += 2 * kNTile, y += y_stride) {
    __m512 v0 = _mm512_load_ps(c), v1 = _mm512_load_ps(c + kNTile);
    if (bias != nullptr) {
      v0 = _mm512_add_ps(v0, b0);
      v1 = _mm512_add_ps(v1, b1);
    }
    _mm256_mask_storeu_epi16(y, m0, (__m256i)_mm512_cvtneps_pbh(v0));
    if (m1) _mm256_mask_storeu_epi16(y + kNTile, m1, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}

// x rows [m0, m0 + rows) into the tile layout of block(): a0 (rows 0-15) and a1 (16-31), Kb
// tiles each, zeros past k and past rows (rows <= 16: a0 only).
inline void pack_a_block(const uint16_t* x, int64_t k, int64_t kb, int64_t rows, uint16_t* a0,
                         uint16_t* a1) {
  constexpr int64_t kTile = kTileRows * kKTile;
  const int64_t tail = k - (kb - 1) * kKTile;  // K in the last tile, 1..32
  const __mmask32 tail_mask = tail == kKTile ? 0xffffffffu : (1u << tail) - 1;
  for (int64_t r = 0; r < (rows > kTileRows ? 2 : 1) * kTileRows; ++r) {
    uint16_t* dst = (r < kTileRows ? a0 : a1) + (r % kTileRows) * kKTile;
    if (r < rows) {
      const uint16_t* src = x + r * k;
      for (int64_t t = 0; t + 1 < kb; ++t)
        _mm512_store_si512(dst + t * kTile, _mm512_loadu_si512(src + t * kKTile));
      _mm512_store_si512(dst + (kb - 1) * kTile,
                         _mm512_maskz_loadu_epi16(tail_mask, src + (kb - 1) * kKTile));
    } else {
      for (int64_t t = 0; t < kb; ++t) _mm512_store_si512(dst + t * kTile, _mm512_setzero_si512());
    }
  }
}

inline void block_any(bool two_rows, bool two_cols, const uint16_t* a0, const uint16_t* a1,
                      const uint16_t* b0, const uint16_t* b1, int64_t k0, int64_t k1, bool first,
                      float* c, int64_t cs) {
  if (two_rows && two_cols) block<true, true>(a0, a1, b0, b1, k0, k1, first, c, cs);
  else if (two_rows) block<true, false>(a0, a1, b0, b1, k0, k1, first, c, cs);
  else if (two_cols) block<false, true>(a0, a1, b0, b1, k0, k1, first, c, cs);
  else block<false, false>(a0, a1, b0, b1, k0, k1, first, c, cs);
}

// 64-byte aligned storage of n elements, per call (the vector's own data may be unaligned).
template <typename T>
T* aligned(std::vector<T>& v, int64_t n) {
  v.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

}  // namespace

bool init() { return request_amx(); }

// W [N, K] bf16 -> [Nb, Kb, 16, 32] bf16 (layout above).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack: W must be [N, K] bf16");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t nb = (n + kNTile - 1) / kNTile, kb = (k + kKTile - 1) / kKTile;
  auto out = torch::zeros({nb, kb, kTileRows, kKTile}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t c = 0; c < kNTile && b * kNTile + c < n; ++c) {
        const uint16_t* row = src + (b * kNTile + c) * k;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t t = kk / kKTile, r = (kk % kKTile) / 2, j = kk % 2;
          dst[((b * kb + t) * kTileRows + r) * kKTile + 2 * c + j] = row[kk];
        }
      }
  });
  return out;
}

// x [M, K] bf16, packed from pack(W), bias [N] (any float dtype) or empty -> y [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias,
                     int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kKTile,
              "linear: packed must come from pack()");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t nb = packed.size(0), kb = packed.size(1);
  TORCH_CHECK(kb == (k + kKTile - 1) / kKTile && nb == (n + kNTile - 1) / kNTile,
              "linear: x's K or n does not match the packed weight");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear: bias must have n elements");
    auto bf = bias->to(torch::kFloat32).contiguous();
    bias_f.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + n);
  }
  const float* bias_p = bias_f.empty() ? nullptr : bias_f.data();
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  constexpr int64_t kTile = kTileRows * kKTile;
  constexpr int64_t kBlock = 2 * kTileRows * 2 * kNTile;  // fp32 elements per C block
  constexpr int64_t cs = 2 * kNTile * 4;                   // C block row stride (bytes)
  const int64_t pairs = (nb + 1) / 2;  // N blocks of 32 columns (the last may hold 16)
  auto xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const int64_t mblocks = (m + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t mt = m <= kTileRows ? 1 : 2 * mblocks;
  const int64_t chunk = std::max<int64_t>(1, kLargeChunkBytes / (2 * kb * kTile * 2));
  const bool a_small = mblocks <= kASmallBlocks && mt * kb * kTile * 2 <= kASmallBytes;
  // From 33 rows, not weight-stationary and at most 2 weight chunks: each thread packs a 32-row
  // block's A just before its use (2 x Kb KiB) instead of a call-sized copy (measured faster).
  const bool lazy = m >= kLargeM && !a_small && pairs <= 2 * chunk;
  // A in tiles, zero-padded: [Mt, Kb, 16, 32], Mt row tiles (even, or 1 when m <= 16), so that
  // every A tile load reads 1 KiB in a row; a 32-row block's two row tiles are adjacent.
  torch::Tensor a;
  uint16_t* ap = nullptr;
  if (!lazy) {
    a = torch::empty({mt, kb, kTileRows, kKTile}, x.options());
    ap = reinterpret_cast<uint16_t*>(a.data_ptr());
    at::parallel_for(0, mblocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t m0 = b * 2 * kTileRows;
        uint16_t* a0 = ap + 2 * b * kb * kTile;
        const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
        pack_a_block(xs + m0 * k, k, kb, rows, a0, a0 + kb * kTile);
      }
    });
  }
  if (m >= kLargeM) {
    // The 32 x 32 block at rows m0, pair p over K tiles [k0, k1) (partial sums in c); after the
    // last slice, its epilogue.
    auto run = [&](const uint16_t* a0, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* c) {
      const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
      const uint16_t* w0 = bp + 2 * p * kb * kTile;
      block_any(rows > kTileRows, 2 * p + 1 < nb, a0, a0 + kb * kTile, w0, w0 + kb * kTile, k0, k1,
                k0 == 0, c, cs);
      if (k1 == kb) {
        const int64_t col0 = 2 * p * kNTile;
        store_block(c, bias_p == nullptr ? nullptr : bias_p + col0, yp + m0 * n + col0, n, rows,
                    std::min<int64_t>(2 * kNTile, n - col0));
      }
    };
    // Threads split N only: a row's bits never depend on the thread count.
    at::parallel_for(0, pairs, 1, [&](int64_t lo, int64_t hi) {
      configure_tiles();
      std::vector<float> cvec;
      if (a_small) {  // a pair's weight slice (16 KiB, L1) against every 32-row block
        float* cb = aligned(cvec, mblocks * kBlock);
        for (int64_t p = lo; p < hi; ++p) {
          for (int64_t k0 = 0; k0 < kb; k0 += kKSlice) {
            const int64_t k1 = std::min(kb, k0 + kKSlice);
            for (int64_t b = 0; b < mblocks; ++b)
              run(ap + 2 * b * kb * kTile, b * 2 * kTileRows, p, k0, k1, cb + b * kBlock);
          }
        }
        _tile_release();
        return;
      }
      // else a chunk of ~1 MiB of weight stays in L2 while every block runs against it
      float* cb = aligned(cvec, std::min(chunk, hi - lo) * kBlock);
      std::vector<uint16_t> avec;
      uint16_t* abuf = lazy ? aligned(avec, 2 * kb * kTile) : nullptr;
      for (int64_t pc = lo; pc < hi; pc += chunk) {
        const int64_t pc_end = std::min(hi, pc + chunk);
        for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
          if (lazy)
            pack_a_block(xs + m0 * k, k, kb, std::min<int64_t>(2 * kTileRows, m - m0), abuf,
                         abuf + kb * kTile);
          const uint16_t* a0 = lazy ? abuf : ap + (m0 / kTileRows) * kb * kTile;
          for (int64_t k0 = 0; k0 < kb; k0 += kKSlice) {
            const int64_t k1 = std::min(kb, k0 + kKSlice);
            for (int64_t p = pc; p < pc_end; ++p) run(a0, m0, p, k0, k1, cb + (p - pc) * kBlock);
          }
        }
      }
      _tile_release();
    });
    return y;
  }
  // Up to 32 rows (see the header): per K slice, the chunk's pairs; then each row's epilogue.
  const int64_t pairs_chunk = std::max<int64_t>(1, kSmallChunkBytes / (2 * kb * kTile * 2));
  // Threads split N only: a row's bits never depend on the thread count.
  at::parallel_for(0, pairs, 1, [&](int64_t lo, int64_t hi) {
    configure_tiles();
    std::vector<float> cvec;
    float* cb = aligned(cvec, std::min(pairs_chunk, hi - lo) * kBlock);
    for (int64_t pc = lo; pc < hi; pc += pairs_chunk) {
      const int64_t pc_end = std::min(hi, pc + pairs_chunk);
      for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
        const bool two_rows = m0 + kTileRows < m;
        const uint16_t* a0 = ap + (m0 / kTileRows) * kb * kTile;
        const uint16_t* a1 = a0 + kb * kTile;
        for (int64_t k0 = 0; k0 < kb; k0 += kKSlice) {
          const int64_t k1 = std::min(kb, k0 + kKSlice);
          for (int64_t p = pc; p < pc_end; ++p) {
            const uint16_t* w0 = bp + 2 * p * kb * kTile;
            block_any(two_rows, 2 * p + 1 < nb, a0, a1, w0, w0 + kb * kTile, k0, k1, k0 == 0,
                      cb + (p - pc) * kBlock, cs);
          }
        }
        const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t p = pc; p < pc_end; ++p) {
            const int64_t col0 = 2 * p * kNTile;
            const float* bias_j = bias_p == nullptr ? nullptr : bias_p + col0;
            store_row(cb + (p - pc) * kBlock + r * 2 * kNTile, bias_j, yp + (m0 + r) * n + col0,
                      std::min<int64_t>(2 * kNTile, n - col0));
          }
      }
    }
    _tile_release();
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init, "ask the OS for the AMX tile state; false when refused");
  m.def("pack", &pack, "W [N, K] bf16 -> AMX VNNI tiles [Nb, Kb, 16, 32]");
  m.def("linear", &linear, "y = x @ W^T (+ bias), batch-invariant, bf16 out");
}
