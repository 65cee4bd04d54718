"""The sliding window group (kv/window_group.py): Gemma 4's sliding layers keep their own block
pool, and blocks that leave the window are freed while a request runs.

Manager level (no torch): hits need main blocks [0, k) and window blocks [k - W, k); trimming
frees and keeps blocks cached; integrity is exact. Engine level (tiny Gemma 4, window 24,
block size 4): the window pool's free count rises during a long decode; after a burst (many
requests, some aborted) both pools are full again; greedy tokens equal the one-pool engine and
transformers fp32; preemption and prefix hits under the window; a disaggregated request lands
its window in the window pool."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from pdserve.engine.sequence import Sequence
from pdserve.kv.cache_manager import KVCacheManager
from pdserve.kv.window_group import NULL_BLOCK, WindowGroup, window_pool_sizes
from tests.conftest import assert_greedy_matches, hf_greedy

BS = 4
W = 8  # manager tests: a window of 2 blocks


def _seq(rid: str, n: int, seed: int = 0) -> Sequence:
    from pdserve.engine.params import SamplingParams

    rng = random.Random(seed)
    return Sequence(rid, [rng.randrange(2, 500) for _ in range(n)], SamplingParams())


def _manager(n=32, n_w=16, caching=True) -> KVCacheManager:
    return KVCacheManager(n, BS, caching, "t", window=W, window_blocks=n_w)


# ---- manager (no torch) ------------------------------------------------------------------
def test_hit_needs_the_window_blocks_before_its_end():
    g = WindowGroup(8, BS, W, True)
    hashes = [bytes([i]) * 16 for i in range(6)]
    blocks = g.pool.allocate(6)
    for b, h in zip(blocks, hashes, strict=True):
        g.pool.cache_block(b, h)
    g.pool.free(blocks)
    full = list(range(100, 106))
    assert g.hit(hashes, full) == (6, blocks[4:6])  # first_needed(24) = (24 - 8) // 4 = 4
    # evict window block 4: a hit at 6 lacks it; at 5 it needs [3, 5) (4 missing); at 4 it
    # needs [2, 4): present
    g.pool._drop_hash(blocks[4])
    assert g.hit(hashes, full) == (4, blocks[2:4])
    assert g.hit(hashes, full[:1]) == (1, blocks[0:1])  # first_needed(4) = 0
    assert g.hit(hashes, []) == (0, [])


def test_trim_frees_window_blocks_and_keeps_them_cached():
    kv = _manager()
    seq = _seq("a", 30)
    assert kv.allocate_first_chunk(seq, 64, record=True) == 30
    assert kv.num_free_window_blocks == 16 - 8 and kv.num_free_blocks == 32 - 8
    seq.num_computed_tokens = 30
    kv.register_computed(seq)
    assert kv.trim_window(seq) == (30 - W) // BS  # 5 blocks before the window
    assert seq.window_table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in seq.window_table[5:]
    assert kv.num_free_window_blocks == 16 - 3
    kv.check_integrity([seq])
    leaked = kv._w.pool.allocate(1)  # a reference nobody owns: integrity must say so
    with pytest.raises(AssertionError, match="window block"):
        kv.check_integrity([seq])
    kv._w.pool.free(leaked)
    kv.free(seq)
    kv.check_integrity([])
    assert kv.num_free_window_blocks == 16 and kv.num_free_blocks == 32
    # same prompt again: every block cached (the freed window blocks kept their hashes)
    again = _seq("b", 30)
    assert kv.allocate_first_chunk(again, 64, record=True) == 30 - 7 * BS
    assert again.window_table[:5] == [NULL_BLOCK] * 5  # the hit needs [5, 7) only
    kv.check_integrity([again])
    kv.free(again)


def test_window_pool_bounds_admission_and_reservations():
    kv = _manager(n=32, n_w=4)
    a = _seq("a", 12)
    assert kv.allocate_first_chunk(a, 64, record=False) == 12  # 3 of 4 window blocks
    assert kv.allocate_first_chunk(_seq("b", 8), 64, record=False) == 0  # 2 more: no room
    assert kv.has_room(1) and not kv.has_room(2)
    from pdserve.errors import OverloadedError

    with pytest.raises(OverloadedError, match="window pool"):
        kv.reserve("r", 20)  # 5 blocks
    # a reservation for 40 tokens whose first 36 arrive trimmed: 10 main blocks, window
    # entries from first_needed(36) = 7 on only: 3 window blocks
    kv.free(a)
    kv.reserve("r", 40, num_kv_tokens=36)
    assert kv.reserved_blocks("r", window=True)[:7] == [NULL_BLOCK] * 7
    assert kv.num_free_window_blocks == 1
    kv.check_integrity([])
    assert kv.release("r") == 10
    assert kv.num_free_window_blocks == 4 and kv.num_free_blocks == 32
    kv.check_integrity([])


def test_pool_sizes():
    sizes = dict(step_tokens=64, max_num_seqs=8, window_blocks=None, default_blocks=100)
    # explicit main blocks: the window pool as large (never binds first)
    assert window_pool_sizes((10, 30), 4, 24, kv_cache_bytes=None, num_blocks=50, **sizes) == (
        50,
        50,
    )
    # a byte budget: 8 windows of ceil(24/4) + 2 blocks + one step's 16 + 1 blocks first
    n, n_w = window_pool_sizes((10, 30), 4, 24, kv_cache_bytes=40_000, num_blocks=None, **sizes)
    assert n_w == 8 * 8 + 17 and n == (40_000 - (n_w + 1) * 30) // 10
    # a small budget: equal pools (the window pool never larger than the main one)
    n, n_w = window_pool_sizes((10, 30), 4, 24, kv_cache_bytes=2_000, num_blocks=None, **sizes)
    assert n == n_w == (2_000 - 30) // 40
    # with max_model_len (64 tokens: 16 main + 8 window blocks per sequence), a roomy budget
    # keeps as many windows as full chains: 7,999 window blocks (~1,000 sequences) instead
    # of 8 windows + a step (81)
    n, n_w = window_pool_sizes(
        (10, 30), 4, 24, kv_cache_bytes=400_000, num_blocks=None, max_model_len=64, **sizes
    )
    assert (n, n_w) == ((399_970 - 7_999 * 30) // 10, 7_999) and n // 16 == n_w // 8 + 1
    # a long max_model_len balances at fewer window blocks than 8 windows: the windows win
    n, n_w = window_pool_sizes(
        (10, 30), 4, 24, kv_cache_bytes=400_000, num_blocks=None, max_model_len=1 << 20, **sizes
    )
    assert n_w == 81
    # a tight budget (8 windows do not fit) stays an equal split whatever max_model_len
    for max_len in (24, 64, 1 << 20):
        n, n_w = window_pool_sizes(
            (10, 30), 4, 24, kv_cache_bytes=2_000, num_blocks=None, max_model_len=max_len, **sizes
        )
        assert n == n_w == (2_000 - 30) // 40


# ---- engine (tiny Gemma 4) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def g4_dir(tmp_path_factory) -> Path:
    from pdserve.model.tiny import TinySpec, make_tiny

    return Path(
        make_tiny(tmp_path_factory.mktemp("g4w") / "g4", TinySpec(family="gemma4", vocab=512))
    )


@pytest.fixture(scope="module")
def g4(g4_dir):
    from pdserve.model.loader import load_model

    return load_model(g4_dir, dtype="float32")


@pytest.fixture
def engine(g4, make_engine):
    """Engines over the tiny Gemma 4 (fp32, block size 4); each is checked at teardown by
    `make_engine`: nothing running, integrity exact, both pools full."""

    def factory(**kw):
        kw.setdefault("num_blocks", 200)
        kw.setdefault("block_size", BS)
        kw.setdefault("max_num_batched_tokens", 64)
        kw.setdefault("max_num_seqs", 64)  # EngineConfig's default (sizes the window pool)
        return make_engine(loaded=g4, dtype="float32", **kw)

    return factory


def _prompts(n, lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(7, 512) for _ in range(lens[i % len(lens)])] for i in range(n)]


def _steps_checked(e) -> list:
    """Step `e` until idle, checking block integrity after every step; the outputs."""
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
        e.check_integrity()
    return outs


def _greedy(n):
    from pdserve.engine.params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_layout_two_pools(engine):
    e = engine(window_blocks=40)
    assert e.window == 24 and e.kv.num_window_blocks == 40
    caches = e.runner.kv_caches
    # stored layers: sliding, sliding, full (K = V), sliding
    assert [c.shape[0] for c in caches] == [41, 41, 200, 41]
    assert all(float(c[0].abs().sum()) == 0 for i, c in enumerate(caches) if i != 2)
    one = engine(window_pool=False)
    assert one.window is None and one.kv.num_window_blocks == 0
    assert [c.shape[0] for c in one.runner.kv_caches] == [200] * 4


def test_long_decode_frees_window_blocks(engine):
    e = engine(window_blocks=40)
    e.add_request("a", _prompts(1, [10])[0], _greedy(80))
    free_seen, live_max = [], 0
    while e.has_unfinished_requests():
        e.step()
        e.check_integrity()
        free_seen.append(e.kv.num_free_window_blocks)
        for s in e.scheduler.running:
            live = [b for b in s.window_table if b != NULL_BLOCK]
            live_max = max(live_max, len(live))
    # the window (24 tokens = 6 blocks) + the partial block + the one being filled
    assert live_max <= 24 // BS + 2
    rises = sum(1 for a, b in itertools.pairwise(free_seen) if b > a)
    assert rises >= (90 - 24) // BS - 2  # a block leaves the window every 4 tokens
    assert min(free_seen) >= 40 - (24 // BS + 2)
    # the null block was read (freed entries) but never written: still zero
    for i, c in enumerate(e.runner.kv_caches):
        if i != 2:
            assert float(c[NULL_BLOCK].abs().sum()) == 0


def test_tokens_equal_one_pool_engine_and_transformers(engine, g4_dir):
    prompts = _prompts(6, [1, 15, 23, 40, 57, 70], seed=3)
    ours = engine(window_blocks=60, max_num_seqs=6).generate(prompts, _greedy(30))
    one = engine(window_pool=False).generate(prompts, _greedy(30))
    assert ours == one
    for p, toks in list(zip(prompts, ours, strict=True))[::2]:
        ref, logits = hf_greedy(g4_dir, p, 30)
        assert_greedy_matches(toks, ref, logits)


def test_burst_returns_both_pools_to_full_with_preemption(engine):
    # 12 requests, a window pool of 3 windows: admission waits, growth preempts
    e = engine(window_blocks=30, num_blocks=80, max_num_seqs=12)
    prompts = _prompts(12, [5, 30, 47, 12], seed=7)
    toks: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, _greedy(40))
        toks[f"r{i}"] = []
    steps = 0
    while e.has_unfinished_requests():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
        e.check_integrity()
        steps += 1
        if steps == 15:
            assert e.abort_request("r3") and e.abort_request("r8")
    assert e.scheduler.num_preemptions > 0
    assert e.kv.num_free_window_blocks == 30 and e.kv.num_free_blocks == 80
    # the survivors' tokens equal an unconstrained one-pool engine's
    keep = [i for i in range(12) if i not in (3, 8)]
    ref = engine(window_pool=False).generate([prompts[i] for i in keep], _greedy(40))
    assert [toks[f"r{i}"] for i in keep] == ref


def test_prefix_hit_under_the_window(engine):
    e = engine(window_blocks=60)
    base = _prompts(1, [50], seed=11)[0]
    first = e.generate([base], _greedy(4))[0]
    follow = base + first + _prompts(1, [9], seed=12)[0]
    e.add_request("b", follow, _greedy(12))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
        e.check_integrity()
    cached = outs[0].num_cached_tokens
    assert cached >= 48  # base's 12 full blocks at least (its head's window blocks were freed)
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == engine(window_pool=False).generate([follow], _greedy(12))[0]


def test_prefix_hit_shortens_when_window_blocks_are_evicted(engine):
    e = engine(window_blocks=60)
    base = _prompts(1, [64], seed=13)[0]
    e.generate([base], _greedy(1))
    hashes = e.compute_block_hashes(base)
    assert len(e.cached_prefix(hashes)) == 16
    # evict the window pool's copies of blocks 12 and 13 (the window of a 16-block hit)
    w = e.kv._w
    for i in (12, 13):
        w.pool._drop_hash(w.pool.lookup(hashes[i]))
    # a hit at k needs window [k - 6, k): k = 16..14 include 12 or 13 -> 12 ... needs [6, 12)
    assert len(e.cached_prefix(hashes)) == 12
    e.add_request("c", [*base, 9, 10, 11], _greedy(5))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert outs[0].num_cached_tokens == 48
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == engine(window_pool=False).generate([[*base, 9, 10, 11]], _greedy(5))[0]


def test_disaggregated_request_lands_its_window(engine):
    prefill, decode = engine(), engine(window_blocks=40)
    p = _prompts(1, [61], seed=5)[0]
    layers = {}
    prefill.add_request("r", p, _greedy(20), prefill_only=True, kv_sink=layers.__setitem__)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    n = -(-len(p) // BS)
    first_needed = (len(p) - 24) // BS
    assert layers[0].shape[0] == n - first_needed and layers[2].shape[0] == n
    decode.reserve("r", len(p) + 20, len(p))
    assert decode.kv.num_free_window_blocks == 40 - (-(-(len(p) + 20) // BS) - first_needed)
    for layer, kv in layers.items():
        decode.write_kv("r", layer, kv, len(p))
    assert decode.add_prefilled_request("r", p, outs[0].new_token_ids[0], _greedy(20)) is None
    toks = list(outs[0].new_token_ids)
    while decode.has_unfinished_requests():
        for o in decode.step():
            toks += o.new_token_ids
        decode.check_integrity()
    assert toks == engine(window_pool=False).generate([p], _greedy(20))[0]
    # the received blocks are cached: the same prompt hits (main [0, k), window [k - W, k))
    assert len(decode.cached_prefix(decode.compute_block_hashes(p))) == len(p) // BS


def test_kvstore_read_and_import_fill_both_pools(engine):
    """A publish reads blocks cached in both pools (all layers); an import writes every
    block's full layers into the main pool and the chain's last window into the window pool,
    which is what a hit at the chain's end needs."""
    src, dst = engine(window_blocks=60), engine(window_blocks=60)
    base = _prompts(1, [64], seed=17)[0]
    src.generate([base], _greedy(1))
    hashes = src.compute_block_hashes(base)
    data = src.read_cached(hashes, 0)
    assert tuple(data.shape) == src.spec.blocks_shape(16)
    assert dst.import_cached_blocks(hashes, data) == 16
    assert dst.kv._w.pool.num_cached_blocks == 24 // BS + 2  # the tail only
    assert len(dst.cached_prefix(hashes)) == 16
    dst.add_request("d", [*base, 3, 4], _greedy(6))
    outs = _steps_checked(dst)
    assert outs[0].num_cached_tokens == 64
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == engine(window_pool=False).generate([[*base, 3, 4]], _greedy(6))[0]
    # one pool <-> window pool: the same bytes per block (a kvstore block is every layer)
    one = engine(window_pool=False)
    assert one.spec.blocks_shape(16) == src.spec.blocks_shape(16)
    assert (one.import_cached_blocks(hashes, data), len(one.cached_prefix(hashes))) == (16, 16)


def test_kvstore_parts_import_fills_the_window_from_window_from(engine):
    """A layered kvstore hit (kv/store_parts.py): main parts of every block and window parts
    of the last window_blocks blocks, joined and imported with `window_from`: the window pool
    gets those blocks only, the hit at the chain's end decodes exactly, a prompt diverging
    before the fetched window gets no hit from them, and a one-pool engine refuses them."""
    from pdserve.errors import InvalidRequestError
    from pdserve.kv import store_parts

    src, dst = engine(window_blocks=60), engine(window_blocks=60)
    base = _prompts(1, [64], seed=19)[0]
    src.generate([base], _greedy(1))
    hashes = src.compute_block_hashes(base)
    data = src.read_cached(hashes, 0)
    t = store_parts.window_blocks(src.spec)
    assert t == 24 // BS + 1
    main, window = store_parts.split(src.spec, data, 16)
    joined = dst.empty_kv(dst.spec.blocks_shape(16))
    store_parts.join(dst.spec, main, window[16 - t :], joined)
    assert dst.import_cached_blocks(hashes, joined, 16 - t) == 16
    assert dst.kv._w.pool.num_cached_blocks == t
    assert len(dst.cached_prefix(hashes)) == 16
    # diverging inside block 8: main hit 8, but no window block before 16 - t is cached
    assert len(dst.cached_prefix(dst.compute_block_hashes([*base[:33], 5, 6, 7]))) == 0
    dst.add_request("d", [*base, 3, 4], _greedy(6))
    outs = _steps_checked(dst)
    assert outs[0].num_cached_tokens == 64
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == engine(window_pool=False).generate([[*base, 3, 4]], _greedy(6))[0]
    one = engine(window_pool=False)
    with pytest.raises(InvalidRequestError, match="window"):
        one.import_cached_blocks(hashes, joined, 16 - t)
    assert one.kv.num_cached_blocks == 0
