"""Bad input through the real router: INVALID_ARGUMENT naming the field; a valid request
still succeeds after each one."""

from __future__ import annotations

import grpc
import pytest

from .conftest import MAX_POS, VOCAB

pytestmark = pytest.mark.integration

GOOD = dict(token_ids=[5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)

CASES = {
    "empty prompt": (dict(token_ids=[]), "prompt"),
    "max_tokens 0": (dict(max_tokens=0), "max_tokens"),
    "prompt longer than the context": (dict(token_ids=[5] * (MAX_POS + 1)), "max_model_len"),
    "negative temperature": (dict(temperature=-0.5), "temperature"),
    "top_p 0": (dict(top_p=0.0), "top_p"),
    "top_p 1.5": (dict(top_p=1.5), "top_p"),
    "top_k -1": (dict(top_k=-1), "top_k"),
    "token id >= vocab": (dict(token_ids=[5, VOCAB, 6]), "token_ids.ids"),
    "session id with spaces": (dict(session_id="bad id with spaces"), "session_id"),
    "session id of 200 chars": (dict(session_id="s" * 200), "session_id"),
}


@pytest.fixture(scope="module")
def client(cluster_1p1d):
    from pdserve.client import Client

    with Client(cluster_1p1d.addr, timeout=60.0, max_retries=0) as c:
        yield c


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_invalid_argument(client, case):
    from pdserve.client import InvalidArgument

    override, field = CASES[case]
    with pytest.raises(InvalidArgument) as info:
        client.generate(**{**GOOD, **override})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.message, info.value.message
    res = client.generate(**GOOD)  # the router (and the cluster) is still fine
    assert len(res.token_ids) == 4 and res.finish_reason == "length"


def test_raw_grpc_status_code(cluster_1p1d):
    """The same through a bare gRPC stub (no SDK mapping in between)."""
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=0))
    req.token_ids.ids.extend([5, 6])
    with grpc.insecure_channel(cluster_1p1d.addr) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(req, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in info.value.details()
