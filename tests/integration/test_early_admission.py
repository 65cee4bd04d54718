"""Admission at the worker API, with real processes: one Decode stream reserves (its first
message is the ticket), the decode starts the request the moment its KV and token 0 land from
the prefill, and the same stream carries the tokens after token 0. A stream whose KV never
comes ends at its lease (counted as expired); one that leaves before its KV frees its blocks."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import counter, pool_idle, wait_until

pytestmark = pytest.mark.integration

PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16


def _stub(cluster, name: str) -> worker_pb2_grpc.WorkerStub:
    channel = cluster.internal_channel(name, as_name="router")  # acts as the router
    return worker_pb2_grpc.WorkerStub(channel)


def _open(cluster, request_id: str, lease_s: float, max_tokens: int):
    """A Decode stream and its ticket (the first message, which carries no tokens)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream = _stub(cluster, "decode0").Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling, lease_s=lease_s
        ),
        timeout=60,
    )
    head = next(stream)
    assert head.HasField("ticket") and not head.token_ids
    return stream, head.ticket, sampling


def test_decode_stream_admits_on_arrival_and_carries_the_rest(cluster_1p1d, reference_engine):
    from pdserve.engine.params import SamplingParams

    cluster = cluster_1p1d
    admitted = counter(cluster, "decode0", "decode_admitted")
    stream, ticket, sampling = _open(cluster, "early-1", 20.0, 8)
    first = _stub(cluster, "prefill0").Prefill(
        worker_pb2.PrefillRequest(
            request_id="early-1", token_ids=PROMPT, sampling=sampling, ticket=ticket
        ),
        timeout=30,
    )
    tokens = [first.first_token_id] + [t for c in stream for t in c.token_ids]
    expected = reference_engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )[0]
    assert tokens == expected
    assert counter(cluster, "decode0", "decode_admitted") > admitted
    wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle")


def test_a_stream_whose_kv_never_comes_ends_at_its_lease(cluster_1p1d):
    cluster = cluster_1p1d
    expired = counter(cluster, "decode0", "decode_leases_expired")
    stream, _, _ = _open(cluster, "early-orphan", 2.0, 200)  # no prefill ever pushes
    with pytest.raises(grpc.RpcError) as ei:
        list(stream)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(
        lambda: counter(cluster, "decode0", "decode_leases_expired") > expired,
        15,
        "lease expiry of the reservation",
    )
    wait_until(lambda: pool_idle(cluster, "decode0"), 15, "decode pool idle")


def test_a_stream_left_before_its_kv_frees_its_blocks(cluster_1p1d):
    cluster = cluster_1p1d
    stream, _, _ = _open(cluster, "early-left", 30.0, 200)
    assert not pool_idle(cluster, "decode0")  # the reservation holds blocks
    stream.cancel()
    wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle")
