"""Early admission at the worker API: the decode starts a request the moment its KV and token 0
land, before any Decode call; a Decode call then collects the stream. A request nobody
collects counts as an expired lease (and is aborted if still running); its blocks come back."""

from __future__ import annotations

import pytest

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import counter, pool_idle, wait_until

pytestmark = pytest.mark.integration

PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16


def _stub(cluster, name: str) -> worker_pb2_grpc.WorkerStub:
    channel = cluster.internal_channel(name, as_name="router")  # acts as the router
    return worker_pb2_grpc.WorkerStub(channel)


def _reserve_and_prefill(cluster, request_id: str, lease_s: float, max_tokens: int):
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ticket = (
        _stub(cluster, "decode0")
        .Reserve(
            worker_pb2.ReserveRequest(
                request_id=request_id,
                num_prompt_tokens=len(PROMPT),
                lease_s=lease_s,
                prompt_token_ids=PROMPT,
                sampling=sampling,
            ),
            timeout=10,
        )
        .ticket
    )
    assert ticket.early_admission
    first = _stub(cluster, "prefill0").Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id, token_ids=PROMPT, sampling=sampling, ticket=ticket
        ),
        timeout=30,
    )
    return ticket, sampling, first.first_token_id


def test_decode_collects_a_request_admitted_before_it(cluster_1p1d, reference_engine):
    from pdserve.engine.params import SamplingParams

    cluster = cluster_1p1d
    admitted = counter(cluster, "decode0", "decode_admitted")
    ticket, sampling, first = _reserve_and_prefill(cluster, "early-1", 20.0, 8)
    # admitted by the decode on KV arrival, before any Decode call
    wait_until(lambda: counter(cluster, "decode0", "decode_admitted") > admitted, 10, "admission")
    chunks = _stub(cluster, "decode0").Decode(
        worker_pb2.DecodeRequest(
            request_id="early-1",
            ticket_id=ticket.ticket_id,
            prompt_token_ids=PROMPT,
            first_token_id=first,
            sampling=sampling,
        ),
        timeout=30,
    )
    tokens = [first] + [t for c in chunks for t in c.token_ids]
    expected = reference_engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )[0]
    assert tokens == expected
    wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle")


def test_uncollected_request_expires_and_frees_its_blocks(cluster_1p1d):
    cluster = cluster_1p1d
    expired = counter(cluster, "decode0", "decode_leases_expired")
    _reserve_and_prefill(cluster, "early-orphan", 2.0, 200)  # nobody calls Decode
    wait_until(
        lambda: counter(cluster, "decode0", "decode_leases_expired") > expired,
        15,
        "lease expiry of the uncollected request",
    )
    wait_until(lambda: pool_idle(cluster, "decode0"), 15, "decode pool idle")
