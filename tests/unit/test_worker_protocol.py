"""The worker API's request path: two calls (Decode, which reserves, and Prefill), and the
fields removed from it stay reserved so that no later field reuses their numbers."""

from __future__ import annotations

from google.protobuf import descriptor_pb2

from pdserve.v1 import worker_pb2


def _message(name: str) -> descriptor_pb2.DescriptorProto:
    proto = descriptor_pb2.DescriptorProto()
    worker_pb2.DESCRIPTOR.message_types_by_name[name].CopyToProto(proto)
    return proto


def test_reserve_is_the_decode_streams_first_message():
    svc = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert "Reserve" not in svc.methods_by_name
    decode = svc.methods_by_name["Decode"]
    assert decode.server_streaming and not decode.client_streaming
    assert decode.output_type.name == "TokenChunk"
    assert "ticket" in worker_pb2.TokenChunk.DESCRIPTOR.fields_by_name
    assert "ReserveRequest" not in worker_pb2.DESCRIPTOR.message_types_by_name


def test_removed_fields_are_reserved():
    decode = _message("DecodeRequest")
    assert {r.start for r in decode.reserved_range} == {2, 4}
    assert set(decode.reserved_name) == {"ticket_id", "first_token_id"}
    ticket = _message("Ticket")
    assert [r.start for r in ticket.reserved_range] == [8]
    assert list(ticket.reserved_name) == ["early_admission"]
    # what the decode needs, once: the prompt, the sampling, its headroom and lease
    assert set(worker_pb2.DecodeRequest.DESCRIPTOR.fields_by_name) == {
        "request_id", "prompt_token_ids", "sampling", "write_back", "num_predicted_tokens",
        "lease_s",
    }  # fmt: skip
