"""The served dtype in the router's bookkeeping and in `pdserve status`: a registration
carries the resolved dtype (checked: never `auto`, never junk), the registry keeps it, and
the table shows it next to the checkpoint's when they differ. The same for the kernels an
instance runs (`RegisterRequest.kernels`, the `kernels:` line of the table)."""

from __future__ import annotations

import pytest

from pdserve.client.results import ClusterStatus, InstanceInfo
from pdserve.errors import InvalidRequestError
from pdserve.router.cluster.registry import ROLE_COLOCATED, Registry
from pdserve.router.cluster.registry_checks import check_register
from pdserve.v1 import common_pb2, router_pb2


def _register(dtype: str) -> router_pb2.RegisterRequest:
    return router_pb2.RegisterRequest(
        instance_id="w0", address="127.0.0.1:7000", role=common_pb2.ROLE_COLOCATED,
        model_fingerprint="abc", block_size=16, dtype=dtype,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["", "float32", "bfloat16"])
def test_register_accepts_a_resolved_dtype(dtype):
    check_register(_register(dtype))


@pytest.mark.parametrize("dtype", ["auto", "fp32", "x" * 1000])
def test_register_refuses_anything_else_naming_the_field(dtype):
    with pytest.raises(InvalidRequestError) as err:
        check_register(_register(dtype))
    assert err.value.field == "dtype"


def test_registry_keeps_the_dtype():
    reg = Registry()
    inst = reg.register("w0", "127.0.0.1:7000", ROLE_COLOCATED, "abc", 16, dtype="bfloat16")
    assert inst.dtype == "bfloat16" and reg.instances()[0].dtype == "bfloat16"


def _status(dtype: str, ckpt: str) -> ClusterStatus:
    inst = InstanceInfo(
        "w0", "127.0.0.1:7000", "colocated", "serving", 0.1,
        {"num_running": 0, "num_waiting": 0, "free_blocks": 8, "total_blocks": 8},
        dtype=dtype,
    )  # fmt: skip
    return ClusterStatus([inst], 0, 0, 0, 0, "m", "", dtype=dtype, checkpoint_dtype=ckpt)


def test_table_shows_the_served_dtype_and_the_checkpoints():
    from pdserve.cli.status import format_table

    table = format_table(_status("bfloat16", "float32"))
    assert "dtype: bfloat16 (checkpoint: float32)" in table
    assert "DTYPE" in table.splitlines()[0] and "bfloat16" in table.splitlines()[1]
    assert "dtype: float32\n" in format_table(_status("float32", "float32")) + "\n"
    assert _status("bfloat16", "float32").to_dict()["checkpoint_dtype"] == "float32"


def test_register_carries_the_kernels_and_refuses_junk():
    req = _register("bfloat16")
    req.kernels = "loop=direct attn=kernel/avx512bf16 linear=amx pointwise=fused"
    check_register(req)
    for bad in ("x" * 300, "loop=\ndirect"):
        req.kernels = bad
        with pytest.raises(InvalidRequestError) as err:
            check_register(req)
        assert err.value.field == "kernels"
    reg = Registry()
    inst = reg.register("w0", "127.0.0.1:7000", ROLE_COLOCATED, "abc", 16, kernels="loop=module")
    assert reg.instances()[0].kernels == inst.kernels == "loop=module"


def test_table_shows_the_kernels_one_line_per_kind():
    from dataclasses import replace

    from pdserve.cli.status import format_table

    st = _status("bfloat16", "bfloat16")
    a, b = "loop=direct attn=kernel/avx512bf16 linear=amx pointwise=fused", "loop=module"
    one = replace(st, instances=[replace(st.instances[0], kernels=a)])
    assert f"kernels: {a}" in format_table(one).splitlines()
    two = replace(
        one, instances=[*one.instances, replace(one.instances[0], instance_id="w1", kernels=b)]
    )
    lines = format_table(two).splitlines()
    assert "kernels (they differ):" in lines and f"  {a}: w0" in lines and f"  {b}: w1" in lines
    assert "kernels: - (no worker registered)" in format_table(replace(st, instances=[]))
