"""The fused batch-invariant attention kernel (pdserve.model.attention.fixed_kernel).

Math: prefill chunks and decodes of a mixed batch, read through shuffled block tables, match
SDPA in fp32 (and the torch `fixed` path) within tolerance, for bf16 and fp32 caches, GQA
ratios 1/2/4, head_dim 16/64/80/128 (80: the any-width path), with and without a window.
Invariance, bitwise: a sequence's rows alone vs inside batches of other sequences (other block
placements, longer neighbours), its prompt whole vs chunked vs as decode rows, 1 vs 2 threads.
The tiled path (runs of tokens) and the per-token path give every row the same bits.
On a CPU with AVX512-BF16 the served build takes bf16 q and cache through bf16 dot products;
the math, invariance and path tests also run on the AVX-512 build with fp32 math (what a CPU
without BF16 serves). The scalar build (no AVX-512) passes this file too:
`pdserve kernels build --all && PDSERVE_ATTN_KERNEL=scalar pytest ...`. A build that is not
there skips with the reason (`pdserve kernels build` makes them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend, fixed_kernel
from pdserve.model.kernel_settings import KernelSettings
from tests.unit.kernel_skip import require

DTYPES = (torch.bfloat16, torch.float32)
BS = 16  # block size


def _served() -> str:
    """The build this process serves (PDSERVE_ATTN_KERNEL picks another: module doc)."""
    return fixed_kernel.variant_for(KernelSettings.from_env().attn_kernel)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require(fixed_kernel.KERNEL, _served())


@pytest.fixture(params=["served", "avx512"])
def variant(request, monkeypatch):
    """The served build; and, where that build uses bf16 dot products, the AVX-512 build with
    fp32 math (swapped in for the test)."""
    if request.param == "served":
        return _served()
    if _served() != "avx512bf16":
        pytest.skip("the served build already has fp32 math")
    ext = require(fixed_kernel.KERNEL, "avx512")
    monkeypatch.setattr(fixed_kernel, "load", lambda variant=None: ext)
    return "avx512"


def test_served_build_reports_its_math():
    ext = fixed_kernel.load()
    variant = _served()
    assert ext.dot_bf16() == (variant == "avx512bf16")
    assert ext.vectorized() == (variant != "scalar")


def _seq(s, h, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))


class Paged:
    """A paged cache holding whole sequences at shuffled blocks; `call` runs the kernel for
    a list of (sequence index, first query position, last query position + 1)."""

    def __init__(self, seqs, hkv, d, dtype, seed=0, spare=3):
        need = sum(-(-k.shape[0] // BS) for _, k, _ in seqs) + spare
        g = torch.Generator().manual_seed(seed)
        self.cache = torch.randn(need, 2, BS, hkv, d, generator=g).to(dtype)  # junk elsewhere
        perm = torch.randperm(need, generator=g).tolist()
        self.tables = []
        for _, k, v in seqs:
            nb = -(-k.shape[0] // BS)
            table, perm = perm[:nb], perm[nb:]
            for pos in range(k.shape[0]):
                self.cache[table[pos // BS], 0, pos % BS] = k[pos]
                self.cache[table[pos // BS], 1, pos % BS] = v[pos]
            self.tables.append(table)
        self.seqs = seqs

    def call(self, parts, window, scale=0.25, path=0):
        """parts: (seq, a, e): queries a .. e-1 of seq, its context = e keys. path: 0 auto,
        1 every token alone (per-task), 2 every run of tokens tiled."""
        qs, tseq, tpos, ctx = [], [], [], []
        width = max(len(t) for t in self.tables)
        tables = []
        for r, (i, a, e) in enumerate(parts):
            qs.append(self.seqs[i][0][a:e])
            tseq += [r] * (e - a)
            tpos += list(range(a, e))
            ctx.append(e)
            tables.append(self.tables[i] + [0] * (width - len(self.tables[i])))
        i32 = torch.int32
        out = fixed_kernel.attend_paged(
            torch.cat(qs),
            self.cache,
            torch.tensor(tables, dtype=i32),
            torch.tensor(tseq, dtype=i32),
            torch.tensor(tpos, dtype=i32),
            torch.tensor(ctx, dtype=i32),
            window,
            scale,
            path,
        )
        return list(out.split([e - a for _, a, e in parts]))


def _sdpa(q, k, v, window, scale=0.25):
    n = q.shape[0]
    qpos, kpos = torch.arange(n)[:, None], torch.arange(n)[None]
    vis = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=vis,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 64), (8, 2, 16), (2, 2, 80), (8, 1, 128)])
def test_kernel_matches_sdpa(dtype, window, heads, variant):
    h, hkv, d = heads
    seqs = [_seq(s, h, hkv, d, dtype, seed) for seed, s in enumerate((150, 37, 1, 70))]
    paged = Paged(seqs, hkv, d, dtype)
    # a mixed step: seq 0 whole, seq 1 a second chunk, seq 2 one token, seq 3 a decode
    outs = paged.call([(0, 0, 150), (1, 20, 37), (2, 0, 1), (3, 69, 70)], window)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for (i, a, e), o in zip([(0, 0, 150), (1, 20, 37), (2, 0, 1), (3, 69, 70)], outs, strict=True):
        q, k, v = seqs[i]
        ref = _sdpa(q[:e], k[:e], v[:e], window)[a:e]
        assert o.dtype == dtype
        torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_rows_are_invariant(dtype, window, variant):
    h, hkv, d = 4, 2, 64
    seqs = [_seq(s, h, hkv, d, dtype, seed) for seed, s in enumerate((150, 300, 7, 129))]
    n = 150
    alone = Paged(seqs[:1], hkv, d, dtype, seed=5)
    full = alone.call([(0, 0, n)], window)[0]
    for cut in (1, 7, 63, 64, 65, 149):  # chunked prefill: the rest of the prompt after cut
        assert torch.equal(alone.call([(0, cut, n)], window)[0], full[cut:]), f"chunk at {cut}"
    positions = (0, 5, 15, 16, 63, 64, 100, n - 1)
    for p in positions:  # decode rows alone
        assert torch.equal(alone.call([(0, p, p + 1)], window)[0], full[p : p + 1])
    # inside batches: other sequences (longer, shorter), other block placements, any order
    crowd = Paged([seqs[1], seqs[2], seqs[0], seqs[3]], hkv, d, dtype, seed=9)
    for parts, mine in (
        ([(0, 299, 300), (2, 0, n), (1, 6, 7)], 1),
        ([(2, 64, n), (3, 0, 129), (0, 0, 300)], 0),
        ([(1, 0, 7)] + [(2, p, p + 1) for p in positions] + [(0, 250, 300)], None),
    ):
        outs = crowd.call(parts, window)
        if mine is None:  # the decode rows of seq 0 among others
            got = torch.cat(outs[1 : 1 + len(positions)])
            assert torch.equal(got, full[list(positions)])
        else:
            _, a, e = parts[mine]
            assert torch.equal(outs[mine], full[a:e]), f"batch {parts}"
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(alone.call([(0, 0, n)], window)[0], full), f"{t} threads"
            out = crowd.call([(0, 0, 300), (2, 0, n)], window)[1]
            assert torch.equal(out, full), f"{t} threads in a batch"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "dtypes",
    [(t, t) for t in DTYPES] + [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize(
    "heads",  # GQA groups 1, 2, 4, 8; head_dim 16, 64, 80 and 72 (any-width), 128, 256
    [(2, 2, 64), (4, 2, 80), (8, 2, 64), (8, 1, 128), (4, 1, 16), (2, 1, 72), (4, 2, 256)],
)
def test_tiled_rows_are_the_per_token_rows(dtypes, heads, variant):
    """The tiled path (runs of tokens x G heads sharing each K/V row) gives every row the bits
    of the per-token path: a prompt's rows at every position equal those rows as decodes; a
    prefill, chunks (one at 600 keys: V in several pieces) and decodes, with and without a
    window, 1 and 2 threads."""
    qdt, cdt = dtypes
    h, hkv, d = heads
    seqs = [_seq(s, h, hkv, d, qdt, seed) for seed, s in enumerate((150, 37, 70, 600))]
    paged = Paged(seqs, hkv, d, cdt, seed=4)
    parts = [(0, 0, 150), (1, 20, 37), (2, 69, 70), (2, 40, 41), (3, 530, 600)]
    threads = torch.get_num_threads()
    try:
        for window in (None, 24, 1):
            alone = torch.cat(paged.call(parts, window, path=1))
            decodes = paged.call([(0, p, p + 1) for p in range(150)], window)  # auto path
            assert torch.equal(torch.cat(decodes), alone[:150]), f"decodes, window {window}"
            for t in (1, 2):
                torch.set_num_threads(t)
                for path in (0, 2):
                    got = torch.cat(paged.call(parts, window, path=path))
                    assert torch.equal(got, alone), f"window {window}, path {path}, {t} threads"
    finally:
        torch.set_num_threads(threads)


def _meta(parts):
    """AttentionMetadata of sequences (query_len, seq_len) with consecutive block tables."""
    tables, nxt = [], 1
    for _, s in parts:
        nb = -(-s // BS)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    return AttentionMetadata.build([q for q, _ in parts], [s for _, s in parts], tables, BS), nxt


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_kernel_path_matches_the_torch_fixed_path(dtype):
    """The backend with the kernel and with the torch fixed path (the fallback), one mixed
    step after a first prefill: the same math, within float tolerance."""
    h, hkv, d = 4, 2, 32
    first = [(40, 40), (9, 9)]
    second = [(1, 41), (30, 39), (5, 5)]  # a decode, a second chunk, a new prompt
    g = torch.Generator().manual_seed(3)
    outs = {}
    for use in (True, False):
        be = TorchAttentionBackend(h, hkv, d)
        be.use_kernel = use
        meta1, nb = _meta(first)
        cache = torch.zeros(nb + 3, 2, BS, hkv, d, dtype=dtype)
        t0, t1 = meta1.block_tables_cpu
        tables2 = [t0, [*t1, nb, nb + 1], [nb + 2]]
        meta2 = AttentionMetadata.build([q for q, _ in second], [s for _, s in second], tables2, BS)
        g.manual_seed(3)
        res = []
        for meta in (meta1, meta2):
            t = meta.num_tokens
            q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
            plan = be.prepare(meta)
            assert isinstance(plan, fixed_kernel.KernelPlan) is use
            res.append(be.forward(plan, q, k, v, cache, None))
        outs[use] = torch.cat(res)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_writes_the_steps_kv_as_index_copy_does(dtype):
    """attend_paged(k=, v=, k_rows=) writes the new K / V rows itself (one call instead of two
    index_copy_): the same cache bits and the same output as index_copy_ then attend_paged,
    with v a strided view of a qkv output as the model passes it."""
    h, hkv, d = 4, 2, 32
    meta, nb = _meta([(7, 40), (1, 9), (12, 12)])
    plan = fixed_kernel.plan(meta)
    g = torch.Generator().manual_seed(5)
    t = meta.num_tokens
    cache0 = torch.randn(nb, 2, BS, hkv, d, generator=g).to(dtype)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d).contiguous()
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)  # strided rows
    a = (plan.tables, plan.tok_seq, plan.tok_pos, plan.ctx_lens, None, 0.25)
    ref_cache = cache0.clone()
    flat = ref_cache.view(-1, hkv, d)
    flat.index_copy_(0, plan.k_rows, k)
    flat.index_copy_(0, plan.v_rows, v)
    ref = fixed_kernel.attend_paged(q, ref_cache, *a)
    cache = cache0.clone()
    out = fixed_kernel.attend_paged(q, cache, *a, k=k, v=v, k_rows=plan.k_rows)
    assert torch.equal(cache, ref_cache) and torch.equal(out, ref)
    bad = plan.k_rows.clone()
    bad[3] += BS  # a V row
    before = cache0.clone()
    with pytest.raises(RuntimeError, match=r"token 3: K row \d+ is not a K row"):
        fixed_kernel.attend_paged(q, cache0, *a, k=k, v=v, k_rows=bad)
    with pytest.raises(RuntimeError, match="come together"):
        fixed_kernel.attend_paged(q, cache0, *a, k=k, v=v)
    assert torch.equal(cache0, before)  # refused before any row was written


def test_blocks_outside_the_window_are_never_read():
    """A sliding layer's table may leave the blocks before the window unset (-1): the kernel
    reads (and checks) only the blocks of keys max(0, p - window + 1) .. p."""
    h, hkv, d, w = 4, 2, 32, 24
    seqs = [_seq(150, h, hkv, d, torch.float32, 0)]
    paged = Paged(seqs, hkv, d, torch.float32)
    full = paged.call([(0, 140, 150)], w)[0]
    table = list(paged.tables[0])
    first = (140 - w + 1) // BS
    paged.tables[0] = [-1] * first + table[first:]
    assert torch.equal(paged.call([(0, 140, 150)], w)[0], full)
    with pytest.raises(RuntimeError, match="out of range"):
        paged.call([(0, 140, 150)], None)  # without the window the unset blocks are needed


def test_bad_tables_are_refused():
    h, hkv, d = 2, 1, 16
    seqs = [_seq(20, h, hkv, d, torch.float32, 0)]
    paged = Paged(seqs, hkv, d, torch.float32)
    i32 = torch.int32
    q = seqs[0][0][:2]
    with pytest.raises(RuntimeError, match="out of range"):
        fixed_kernel.attend_paged(
            q,
            paged.cache,
            torch.tensor([[0, 999]], dtype=i32),
            torch.tensor([0, 0], dtype=i32),
            torch.tensor([18, 19], dtype=i32),
            torch.tensor([20], dtype=i32),
            None,
            0.25,
        )
    with pytest.raises(RuntimeError, match="not inside its context"):
        fixed_kernel.attend_paged(
            q,
            paged.cache,
            torch.tensor([paged.tables[0]], dtype=i32),
            torch.tensor([0, 0], dtype=i32),
            torch.tensor([19, 20], dtype=i32),
            torch.tensor([20], dtype=i32),
            None,
            0.25,
        )


def test_kernel_off_switch_falls_back():
    """attn_kernel=off (PDSERVE_ATTN_KERNEL=0): the selection takes the torch fixed path and
    the backend keeps it."""
    from pdserve.model.kernels import select_kernels

    sel = select_kernels(KernelSettings(attn_kernel="off"), torch.bfloat16, "cpu", True)
    assert (sel.attention, sel.attention_why) == ("fixed", "PDSERVE_ATTN_KERNEL=off")
    be = TorchAttentionBackend(4, 2, 16)
    be.use_kernels(sel)
    meta, _ = _meta([(3, 3)])
    assert not isinstance(be.prepare(meta), fixed_kernel.KernelPlan)
    assert be.use_kernel is False


@pytest.mark.parametrize("use_kernel", [True, False])
def test_engine_paths_are_each_invariant(tmp_path, use_kernel):
    """The engine runs the kernel by default; with the kernel (and with the torch fallback
    chosen by the switch) a request's tokens alone equal its tokens inside a chunked batch
    (bf16)."""
    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny
    from tests.unit.test_conformance import SUBSET, engine, params_of, prompts, run, solo

    lm = load_model(make_tiny(tmp_path / "m", TinySpec(family="qwen2", vocab=512)), "bfloat16")
    ks = KernelSettings(attn_kernel="auto" if use_kernel else "off")
    ps = prompts()
    alone = {i: solo(engine(lm, "bfloat16", kernels=ks), [ps[i]], params_of(i))[0] for i in SUBSET}
    assert lm.model.attn_backend.use_kernel is use_kernel
    batched = engine(lm, "bfloat16", max_num_batched_tokens=64, kernels=ks)
    assert batched.kernels.attention == ("kernel" if use_kernel else "fixed")
    assert run(batched, SUBSET) == alone


def test_plan_addresses_every_token_of_a_mixed_batch():
    """The step plan's per-token arrays, against a token-by-token reference: decodes, a whole
    prompt and a chunk after cached context, at shuffled blocks (block size 4)."""
    bs = 4
    query_lens, seq_lens = [1, 7, 3, 1], [9, 7, 12, 1]
    tables = [[5, 2, 9], [11, 0], [3, 8, 1], [6]]
    p = fixed_kernel.plan(AttentionMetadata.build(query_lens, seq_lens, tables, bs))
    seq, pos, k_rows = [], [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for j in range(s - q, s):
            seq.append(i)
            pos.append(j)
            k_rows.append(tables[i][j // bs] * 2 * bs + j % bs)  # [blocks, 2, bs] flattened
    assert p.tok_seq.tolist() == seq and p.tok_pos.tolist() == pos
    assert p.k_rows.tolist() == k_rows and p.v_rows.tolist() == [r + bs for r in k_rows]
    assert p.ctx_lens.tolist() == seq_lens
    assert p.tok_seq.dtype == p.tok_pos.dtype == p.ctx_lens.dtype == torch.int32
    assert p.tables.dtype == torch.int32 and p.tables.shape == (4, 3)
