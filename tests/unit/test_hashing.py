import hashlib
import struct

import pytest

from pdserve.kv.hashing import block_hashes, hash_block, root_hash
from pdserve.kv.spec import KVSpec

NS = "ns-test"


def test_hash_block_matches_explicit_byte_encoding():
    parent = root_hash(NS)
    toks = [1, 2, 70000, 2**31 - 1]
    expected = hashlib.blake2b(
        parent + struct.pack("<4i", *toks) + NS.encode(), digest_size=16
    ).digest()
    assert hash_block(parent, toks, NS) == expected
    assert len(expected) == 16


def test_block_hashes_chain_full_blocks_only():
    toks = list(range(37))
    hs = block_hashes(toks, 16, NS)
    assert len(hs) == 2
    assert hs[0] == hash_block(root_hash(NS), toks[:16], NS)
    assert hs[1] == hash_block(hs[0], toks[16:32], NS)
    # chained: same second block after a different first block -> different hash
    other = block_hashes([99, *toks[1:]], 16, NS)
    assert other[1] != hs[1]
    # resumable from a parent
    assert block_hashes(toks[16:], 16, NS, parent=hs[0]) == hs[1:]


def test_namespace_and_spec_fingerprint_separate_models():
    toks = list(range(16))
    assert block_hashes(toks, 16, "a") != block_hashes(toks, 16, "b")
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    fp = spec.kv_fingerprint("model-x")
    assert fp == KVSpec(2, 2, 32, 16, "float32").kv_fingerprint("model-x")
    assert fp != spec.kv_fingerprint("model-y")
    assert fp != KVSpec(2, 2, 32, 8, "float32").kv_fingerprint("model-x")
    assert fp != KVSpec(2, 2, 32, 16, "bfloat16").kv_fingerprint("model-x")


def test_spec_sizes():
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    assert spec.itemsize == 2
    assert spec.bytes_per_block_layer == 2 * 4 * 2 * 8 * 2
    assert spec.bytes_per_block == 3 * spec.bytes_per_block_layer
    assert spec.num_blocks_for(9) == 3
    with pytest.raises(ValueError):
        KVSpec(1, 1, 1, 1, "int4")
    q = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="int8")
    assert q.quantized and q.itemsize == 1  # int8 elements + float32 scales per (K/V, head)
    assert q.bytes_per_block_layer == 2 * 4 * 2 * 8 + 2 * 2 * 4


def test_token_out_of_int32_rejected():
    with pytest.raises(ValueError):
        hash_block(root_hash(NS), [2**31], NS)
