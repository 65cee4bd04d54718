// Batch-invariant paged attention for CPU (pdserve.model.attention.fixed_kernel).
//
// One call per layer attends every query token of a step (prefill chunks and decodes alike)
// against its sequence's keys, read straight from the paged cache
// [num_blocks, 2, block_size, Hkv, D] through the block table (bf16 or fp32; fp32 math in
// registers, or bf16 dot products for a bf16 q and cache, below). A tile is a run of up to kTileRows / G consecutive tokens of one
// sequence (consecutive positions) x one kv head, i.e. its G = H / Hkv query heads: each K/V
// row is converted once for all the tile's rows (fixed_attn_math.h, attend_tile). With fp32
// math a single token (a decode) goes through attend_task, one (token, kv head) at a time, and
// the two paths give every row the same bits (tests/unit/test_fixed_kernel.py compares them);
// the bf16 dot-product path (below) tiles every token. Tiles are
// split across threads; a tile never is, so no row's reduction is ever split.
//
// The order of every reduction of a row depends only on the row's own position p, the
// window and head_dim, never on the batch, the chunking, the other rows or the thread count.
// fp32 math (fp32 q or cache, or a build without AVX512-BF16):
//   keys: lo = max(0, p - window + 1) (0 without window) .. hi = p; no key outside is read
//         into any sum (a masked key never contributes, not even an exact zero);
//   score_j = (sum over d of q[d] * k_j[d], 16-lane FMA chains over d-chunks in order, then a
//             fixed horizontal reduction), q pre-multiplied by `scale` in fp32;
//   m = max_j score_j (exact, any order); e_j = exp(score_j - m) by one polynomial;
//   l = sum of e_j in 16-lane partial sums over j - lo in order, then a fixed reduction;
//   out[d] = (sum over j = lo .. hi in order of e_j * v_j[d], one FMA per key) / l.
// bf16 q and cache on a CPU with AVX512-BF16 (the served bf16 path; always tiled, a decode is
// a tile of one token): both products by VDPBF16PS (acc += a0 b0 + a1 b1, exact bf16
// products, fp32 accumulation), as the linear kernel:
//   score_j = (VDPBF16PS over the d pairs (2i, 2i + 1) in order, ONE accumulator from +0)
//             * scale, q unscaled;
//   m, e_j and l as above (fp32); e_j then rounded to bf16 (nearest even);
//   out[d] = (VDPBF16PS over the key pairs (2m, 2m + 1) with m = lo / 2 .. hi / 2 in order,
//            one accumulator from +0) / l; the half of a pair outside lo .. hi has e = 0
//            (a zero product leaves the sum's bits unchanged: see tile_softmax_pv_dp).
// Rounding P to bf16 for P.V is what flash attention does on GPUs and what torch's CPU SDPA
// does for bf16; scores keep exact products and an fp32 sum.
// The build has no -ffast-math and no FP contraction outside the explicit FMA intrinsics.
// Without AVX-512 the fp32 algorithm runs in scalar code (other bits, equally invariant).
// The per-task math is in fixed_attn_math.h; this file splits tasks, checks inputs, binds.

// ATen + the pybind bridge only (not torch/extension.h: a much shorter first-use build)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/python.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "fixed_attn_math.h"

namespace {

using namespace pdserve_attn;

// Tokens per tile: runs of consecutive tokens of one sequence at consecutive positions are
// cut into tiles of up to kTileRows / G tokens (x G heads = the tile's rows).
constexpr int64_t kTileRows = 64;

// path: 0 auto (tiles of >= 2 tokens tiled, single tokens per task), 1 every token per task,
// 2 every tile tiled (the paths give the same bits; 1 and 2 exist for tests and benchmarks).
template <typename QT, typename CT>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
         const at::Tensor& tok_seq, const at::Tensor& tok_pos, const at::Tensor& ctx,
         int64_t window, double scale, int64_t path, at::Tensor& out) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  Shape sh{cache.size(3), h / cache.size(3), d, cache.size(2), tables.size(1), cache.size(3) * d};
  const int64_t w = (d + kLanes - 1) / kLanes * kLanes;
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* cp = cache.data_ptr<CT>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* seq = tok_seq.data_ptr<int32_t>();
  const int32_t* pos = tok_pos.data_ptr<int32_t>();
  const int32_t* cl = ctx.data_ptr<int32_t>();
  const float sc = (float)scale;
  // bf16 q and cache (and an even head_dim): q.k by bf16 dot products (fixed_attn_math.h)
  constexpr bool kBothBf16 = std::is_same_v<QT, bf16> && std::is_same_v<CT, bf16>;
  [[maybe_unused]] const bool dot = kDotBf16 && kBothBf16 && d % 2 == 0;
  const int64_t tile_tok = (kVector && path != 1) ? std::max<int64_t>(1, kTileRows / sh.g) : 1;
  std::vector<int64_t> starts;  // first token of each tile, then t
  for (int64_t i = 0; i < t; ++i)
    if (i == 0 || seq[i] != seq[i - 1] || pos[i] != pos[i - 1] + 1 || i - starts.back() >= tile_tok)
      starts.push_back(i);
  starts.push_back(t);
  const int64_t ntiles = (int64_t)(starts.size() - 1) * sh.hkv;
  auto bounds = [&](int64_t ti, int64_t& lo, int64_t& hi) {
    const int64_t p = pos[ti];
    hi = std::min<int64_t>(p, (int64_t)cl[seq[ti]] - 1);
    lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  };
  // grain: ~16 tokens' tasks (tasks of a few hundred keys are ~10 us; decode batches stay on
  // one thread)
  const int64_t grain = std::max<int64_t>(1, 16 * ntiles / std::max<int64_t>(1, t * sh.hkv));
  at::parallel_for(0, ntiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(sh.g * w), of(sh.g * w), l(sh.g), kf(kLanes * w), s;
#if PD_AVX512
    TileScratch ws;
    std::vector<float> tq, to;
#if defined(__AVX512BF16__)
    const int64_t nc = (d / 2 + kPairs - 1) / kPairs;  // q pairs per row: nc chunks of 16
    std::vector<uint32_t> tqp;
#endif
    std::vector<int64_t> tlo, thi;
#endif
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = starts[tile / sh.hkv], t1 = starts[tile / sh.hkv + 1];
      const int64_t hk = tile % sh.hkv, b = seq[t0];
#if PD_AVX512
      if (dot || path == 2 || (path == 0 && t1 - t0 >= 2)) {  // (bf16 q.k: always tiled)
        const int64_t nt = t1 - t0, rows = nt * sh.g;
        to.resize(rows * w), tlo.resize(nt), thi.resize(nt);
        for (int64_t i = 0; i < nt; ++i) bounds(t0 + i, tlo[i], thi[i]);
        bool done = false;
#if defined(__AVX512BF16__)
        if constexpr (kBothBf16) if (dot) {
          tqp.resize(rows * nc * kPairs);
          for (int64_t i = 0; i < nt; ++i) {
            const QT* qt = qp + ((t0 + i) * h + hk * sh.g) * d;
            for (int64_t g = 0; g < sh.g; ++g)
              load_q_pairs(qt + g * d, d, nc, tqp.data() + (i * sh.g + g) * nc * kPairs);
          }
          attend_tile_dp(tqp.data(), cp + hk * d, tb + b * sh.width, sh, nt, tlo.data(),
                         thi.data(), sc, ws, to.data());
          done = true;
        }
#endif
        if (!done) {
          tq.resize(rows * w);
          for (int64_t i = 0; i < nt; ++i) {
            const QT* qt = qp + ((t0 + i) * h + hk * sh.g) * d;
            for (int64_t g = 0; g < sh.g; ++g)
              load_q(qt + g * d, d, sc, tq.data() + (i * sh.g + g) * w);
          }
          attend_tile<CT>(tq.data(), cp + hk * d, tb + b * sh.width, sh, nt, tlo.data(),
                          thi.data(), ws, to.data());
        }
        for (int64_t i = 0; i < nt; ++i) {
          QT* ot = op + ((t0 + i) * h + hk * sh.g) * d;
          for (int64_t g = 0; g < sh.g; ++g) store_out(to.data() + (i * sh.g + g) * w, d, ot + g * d);
        }
        continue;
      }
#endif
      for (int64_t ti = t0; ti < t1; ++ti) {
        int64_t lo, hi;
        bounds(ti, lo, hi);
        const QT* qt = qp + (ti * h + hk * sh.g) * d;
        QT* ot = op + (ti * h + hk * sh.g) * d;
        const int64_t n = hi - lo + 1;
        if ((int64_t)s.size() < sh.g * n) s.resize(sh.g * n);
        for (int64_t g = 0; g < sh.g; ++g) load_q(qt + g * d, d, sc, qf.data() + g * w);
        attend_task<CT>(qf.data(), cp + hk * d, tb + b * sh.width, sh, lo, hi, s.data(), l.data(),
                        kf.data(), of.data());
        for (int64_t g = 0; g < sh.g; ++g) store_out(of.data() + g * w, d, ot + g * d);
      }
    }
  });
}

// Every block the kernel will read exists: per sequence, the blocks of keys min(lo) .. max(p)
// over its tokens (blocks outside a window are never read, so a table may leave them unset).
void check_tables(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& tok_seq,
                  const at::Tensor& tok_pos, const at::Tensor& ctx, int64_t window) {
  const int64_t nb = cache.size(0), bs = cache.size(2), width = tables.size(1);
  const int64_t b = tables.size(0);
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* cl = ctx.data_ptr<int32_t>();
  const int32_t* seq = tok_seq.data_ptr<int32_t>();
  const int32_t* pos = tok_pos.data_ptr<int32_t>();
  std::vector<int64_t> first(b, INT64_MAX), last(b, -1);
  for (int64_t i = 0; i < tok_seq.size(0); ++i) {
    TORCH_CHECK(seq[i] >= 0 && seq[i] < b, "token ", i, ": sequence index out of range");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cl[seq[i]], "token ", i, ": position ", pos[i],
                " not inside its context of ", cl[seq[i]]);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0;
    first[seq[i]] = std::min(first[seq[i]], lo / bs);
    last[seq[i]] = std::max(last[seq[i]], (int64_t)pos[i] / bs);
  }
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(last[i] < width, "sequence ", i, ": position beyond its block table (", width,
                " blocks)");
    for (int64_t k = first[i]; k <= last[i]; ++k)
      TORCH_CHECK(tb[i * width + k] >= 0 && tb[i * width + k] < nb, "block id ",
                  tb[i * width + k], " out of range");
  }
}

}  // namespace

// q [T, H, D] (bf16 | fp32), cache [num_blocks, 2, block_size, Hkv, D] (bf16 | fp32),
// block_tables [B, W] int32, tok_seq [T] int32 (row of block_tables), tok_pos [T] int32,
// ctx_lens [B] int32 (keys 0 .. ctx - 1 are in the cache), window <= 0: none.
// Returns [T, H, D] in q's dtype: query at position p sees keys max(0, p - window + 1) .. p.
// The step's new K and V rows into the cache (what two index_copy_ calls on the flat view
// [num_blocks * 2 * bs, Hkv, D] did, in one call): token t's K row is k_rows[t], its V row
// k_rows[t] + bs. k, v: [T, Hkv, D] in the cache's dtype (v may be a strided view of the qkv
// output; a row whose Hkv x D is not one run is copied first). Exact copies: no bit moves.
void write_kv(const at::Tensor& cache, at::Tensor k, at::Tensor v, const at::Tensor& k_rows) {
  const int64_t t = k.size(0), bs = cache.size(2), hkv = cache.size(3), d = cache.size(4);
  const int64_t rows = cache.size(0) * 2 * bs, row = hkv * d;
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == hkv && k.size(2) == d &&
                  v.sizes() == k.sizes(),
              "k and v must be [T, Hkv, D] like the cache's rows");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k and v must have the cache's dtype");
  for (auto* x : {&k, &v})  // a row's Hkv x D must be one run of memory
    if (x->stride(2) != 1 || x->stride(1) != d) *x = x->contiguous();
  TORCH_CHECK(k_rows.scalar_type() == at::kLong && k_rows.dim() == 1 && k_rows.size(0) == t &&
                  k_rows.is_contiguous(),
              "k_rows must be int64 [T]");
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  const int64_t esz = cache.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t i = 0; i < t; ++i)  // all checked before any is written
    TORCH_CHECK(kr[i] >= 0 && kr[i] % (2 * bs) < bs && kr[i] + bs < rows, "token ", i,
                ": K row ", kr[i], " is not a K row of the cache");
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(base + kr[i] * row * esz, kp + i * k.stride(0) * esz, row * esz);
    std::memcpy(base + (kr[i] + bs) * row * esz, vp + i * v.stride(0) * esz, row * esz);
  }
}

at::Tensor attend_paged(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                        at::Tensor tok_seq, at::Tensor tok_pos, at::Tensor ctx_lens,
                        int64_t window, double scale, int64_t path,
                        const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                        const std::optional<at::Tensor>& k_rows) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.size(1) == 2, "bad shapes");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "q and cache must be contiguous");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0, "head shapes");
  for (const auto* x : {&block_tables, &tok_seq, &tok_pos, &ctx_lens})
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous(), "int32 index tensors");
  TORCH_CHECK(tok_seq.size(0) == q.size(0) && tok_pos.size(0) == q.size(0), "one seq/pos per token");
  TORCH_CHECK(ctx_lens.size(0) == block_tables.size(0), "one context length per table row");
  TORCH_CHECK(path >= 0 && path <= 2, "path: 0, 1 or 2");
  check_tables(cache, block_tables, tok_seq, tok_pos, ctx_lens, window);
  TORCH_CHECK(k.has_value() == v.has_value() && k.has_value() == k_rows.has_value(),
              "k, v and k_rows come together");
  if (k.has_value()) {
    TORCH_CHECK(k->size(0) == q.size(0), "one k / v row per token of q");
    write_kv(cache, *k, *v, *k_rows);  // before the products: a token sees its own key
  }
  auto out = at::empty_like(q);
  const auto qt = q.scalar_type(), ct = cache.scalar_type();
  if (qt == at::kBFloat16 && ct == at::kBFloat16)
    run<bf16, bf16>(q, cache, block_tables, tok_seq, tok_pos, ctx_lens, window, scale, path, out);
  else if (qt == at::kFloat && ct == at::kFloat)
    run<float, float>(q, cache, block_tables, tok_seq, tok_pos, ctx_lens, window, scale, path, out);
  else if (qt == at::kFloat && ct == at::kBFloat16)
    run<float, bf16>(q, cache, block_tables, tok_seq, tok_pos, ctx_lens, window, scale, path, out);
  else if (qt == at::kBFloat16 && ct == at::kFloat)
    run<bf16, float>(q, cache, block_tables, tok_seq, tok_pos, ctx_lens, window, scale, path, out);
  else
    TORCH_CHECK(false, "dtypes: bf16 or fp32 only");
  return out;
}

bool vectorized() { return kVector; }
bool dot_bf16() { return kDotBf16; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_paged", &attend_paged, "batch-invariant paged attention (CPU)",
        pybind11::arg("q"), pybind11::arg("cache"), pybind11::arg("block_tables"),
        pybind11::arg("tok_seq"), pybind11::arg("tok_pos"), pybind11::arg("ctx_lens"),
        pybind11::arg("window"), pybind11::arg("scale"), pybind11::arg("path") = 0,
        pybind11::arg("k") = pybind11::none(), pybind11::arg("v") = pybind11::none(),
        pybind11::arg("k_rows") = pybind11::none());
  m.def("vectorized", &vectorized, "true when built with AVX-512");
  m.def("dot_bf16", &dot_bf16, "true when bf16 q and cache use bf16 dot products (AVX512-BF16)");
}
