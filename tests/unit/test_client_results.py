"""Client SDK pieces without a network: request building, result folding,
error mapping, the status table."""

import grpc
import pytest

from pdserve.client import (
    ClusterStatus,
    FailedPrecondition,
    GenerationEvent,
    InstanceInfo,
    Internal,
    InvalidArgument,
    NotFound,
    PdserveClientError,
    PermissionDenied,
    Unavailable,
    Usage,
    build_request,
)
from pdserve.client.errors import from_rpc_error
from pdserve.client.results import collect


def test_build_request_prompt_kinds():
    assert build_request(prompt="hi").WhichOneof("prompt") == "text"
    assert build_request(token_ids=[1]).WhichOneof("prompt") == "token_ids"
    req = build_request(messages=[{"role": "user", "content": "x"}], stop=["\n"])
    assert req.WhichOneof("prompt") == "chat" and list(req.sampling.stop) == ["\n"]
    assert not req.sampling.HasField("temperature")  # unset -> router defaults
    with pytest.raises(ValueError):
        build_request(prompt="a", token_ids=[1])


def test_collect_timings_and_fields():
    evs = [
        GenerationEvent("r", [1, 2], "ab", arrival_s=10.1),
        GenerationEvent("r", [3], "c", arrival_s=10.3),
        GenerationEvent(
            "r",
            [4],
            "",
            arrival_s=10.4,
            finish_reason="stop",
            usage=Usage(prompt_tokens=5, cached_tokens=4),
        ),
    ]
    res = collect(evs, start_s=10.0)
    assert (res.token_ids, res.text, res.finish_reason) == ([1, 2, 3, 4], "abc", "stop")
    assert res.token_times == [10.1, 10.1, 10.3, 10.4]
    assert res.ttft_ms == pytest.approx(100.0) and res.e2e_ms == pytest.approx(400.0)
    assert res.tpot_ms == pytest.approx(100.0)  # (10.4 - 10.1) / 3 gaps
    assert (res.prompt_tokens, res.cached_tokens) == (5, 4)
    assert set(res.to_dict()) >= {"token_ids", "text", "finish_reason", "ttft_ms", "tpot_ms"}


def test_collect_empty_stream():
    res = collect([], start_s=1.0)
    assert res.token_ids == [] and res.finish_reason is None and res.ttft_ms == 0.0


class _Err(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


def test_error_mapping():
    e = from_rpc_error(_Err(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]"))
    assert isinstance(e, InvalidArgument) and e.message.startswith("top_p")
    assert isinstance(from_rpc_error(_Err(grpc.StatusCode.UNAVAILABLE, "x")), Unavailable)
    assert isinstance(from_rpc_error(_Err(grpc.StatusCode.INTERNAL, "x")), Internal)
    gone = from_rpc_error(_Err(grpc.StatusCode.NOT_FOUND, "unknown stream"))
    assert isinstance(gone, NotFound) and gone.code == grpc.StatusCode.NOT_FOUND
    for code, cls in (
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
    ):
        assert isinstance(from_rpc_error(_Err(code, "x")), cls)
    other = from_rpc_error(_Err(grpc.StatusCode.ABORTED, "x"))
    assert type(other) is PdserveClientError and other.code == grpc.StatusCode.ABORTED


def test_status_table_and_hit_rate():
    from pdserve.cli.status import format_table

    st = ClusterStatus(
        instances=[
            InstanceInfo(
                "p-1",
                "127.0.0.1:5",
                "prefill",
                "serving",
                0.4,
                {
                    "num_running": 2,
                    "num_waiting": 1,
                    "free_blocks": 90,
                    "total_blocks": 100,
                    "step_ms_ewma": 12.34,
                },
            )
        ],
        requests_total=10,
        requests_running=1,
        prompt_tokens_total=200,
        cached_tokens_total=50,
        model="tiny",
        kvstore_address="",
    )
    table = format_table(st)
    assert "p-1" in table and "prefill" in table and "90/100" in table
    assert "STEP MS" in table and " 12.3 " in table
    assert "hit rate 25.0%" in table
    assert st.to_dict()["cache_hit_rate"] == 0.25
