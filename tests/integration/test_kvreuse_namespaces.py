"""Two different models never share a kvstore block: two tiny checkpoints of the same shapes but
different weights (seeds) have different KV namespaces, so one store shared by two clusters keeps
their blocks apart — the same token ids from model B find none of model A's blocks."""

from __future__ import annotations

import pytest

from tests.integration.kvreuse_helpers import (
    Conversation,
    StoreProbe,
    block_hashes_of,
    make_engine,
    make_model,
    reference,
    start_cluster,
    wait_written_back,
    written_back_blocks,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")


def test_two_models_one_store_share_nothing(tmp_path_factory, tmp_path):
    from pdserve.client import Client

    root = tmp_path_factory.mktemp("kvreuse-ns")
    dir_a, dir_b = make_model(root, seed=1), make_model(root, seed=2)
    engine_a, engine_b = make_engine(dir_a), make_engine(dir_b)
    assert engine_a.spec == engine_b.spec, "same shapes: same KV layout and block bytes"
    ns_a, ns_b = engine_a.kv_fingerprint, engine_b.kv_fingerprint
    assert ns_a != ns_b

    conv_a, conv_b = Conversation(seed=5), Conversation(seed=5)  # the same questions
    cluster_a = start_cluster(dir_a, prefill=1, decode=1, kvstore=True, log_dir=str(tmp_path / "a"))
    try:
        store_addr = f"127.0.0.1:{cluster_a.kvstore_port}"
        probe = StoreProbe(cluster_a.kvstore_port)
        with Client(cluster_a.addr, max_retries=0) as client:
            conv_a.send(client)
            wait_written_back(probe, ns_a, conv_a.last)
        blocks_a = probe.stats().num_blocks
        assert blocks_a >= written_back_blocks(len(conv_a.last)) > 0

        # Model B's view of the same token ids: other hashes, and none under B's namespace.
        hashes_a = block_hashes_of(ns_a, conv_a.last)
        hashes_b = block_hashes_of(ns_b, conv_a.last)
        assert not set(hashes_a) & set(hashes_b)
        assert probe.lookup(ns_a, hashes_a) >= written_back_blocks(len(conv_a.last))
        assert probe.lookup(ns_b, hashes_b) == 0
        assert probe.lookup(ns_b, hashes_a) == 0, "the namespace is part of the key"

        # Cluster B (model B) on the same store process.
        cluster_b = start_cluster(
            dir_b, prefill=1, decode=1, kvstore=False, log_dir=str(tmp_path / "b"),
            router_args=["--kvstore-addr", store_addr],
        )  # fmt: skip
        try:
            with Client(cluster_b.addr, max_retries=0) as client:
                first = conv_b.send(client)
                assert first.prompt == conv_a.turns[0].prompt
                assert first.kvstore_tokens == 0 and first.cached_tokens == 0
                wait_written_back(probe, ns_b, conv_b.last)  # B does use the shared store
                stats = probe.stats()
        finally:
            cluster_b.stop()
    finally:
        cluster_a.stop()

    # Both models' blocks are stored side by side (no block counted for both).
    assert stats.num_blocks >= blocks_a + written_back_blocks(len(conv_b.last))
    assert conv_a.turns[0].answer == reference(engine_a, conv_a.turns[0].prompt, 16)
    assert conv_b.turns[0].answer == reference(engine_b, conv_b.turns[0].prompt, 16)
    assert conv_a.turns[0].answer != conv_b.turns[0].answer, "the two models should differ"
