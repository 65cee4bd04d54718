"""Hardware per pool: the `--emulate` / `--hardware` grammar, the flags each emulated worker
gets from `pdserve up`, and the simulated twin of a cluster whose pools (or one pool's
workers) model different accelerators."""

from __future__ import annotations

import pytest

from pdserve.cli.up import _emulate_error
from pdserve.costmodel.pools import ANY, PoolHardware
from pdserve.costmodel.roofline import pool_costs, roofline_costs
from pdserve.launcher import Cluster, ClusterConfig
from pdserve.sim.run import spec_from_up_flags


def test_one_name_is_every_pool_and_two_are_prefill_then_decode():
    assert PoolHardware.parse("h100").pools == {ANY: ("h100",)}
    two = PoolHardware.parse("h100, L40S")
    assert two.for_worker("prefill", 3) == "h100" and two.for_worker("decode", 0) == "l40s"
    assert two.for_worker("colocated", 0) == "h100"  # as pool_costs always had it


def test_roles_and_lists_dealt_in_order_cycling():
    hw = PoolHardware.parse("prefill=h100x2,decode=h100+h200")
    assert hw.pool("prefill", 2) == ["h100x2", "h100x2"]
    assert hw.pool("decode", 5) == ["h100", "h200", "h100", "h200", "h100"]
    assert hw.uniform is None and PoolHardware.parse("decode=l40s").uniform == "l40s"
    with pytest.raises(ValueError, match="no hardware for the prefill pool"):
        PoolHardware.parse("decode=l40s").for_worker("prefill", 0)


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("", "bad hardware"),
        ("h100,,l40s", "bad hardware"),
        ("h100,l40s,a100", "at most"),
        ("b200", "unknown hardware"),
        ("prefill=h100,decode=tpu", "unknown hardware"),
        ("prefil=h100", "not ROLE=HW"),
        ("decode=h100,decode=l40s", "given twice"),
        ("prefill=h100,l40s", "not ROLE=HW"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(spec, msg):
    with pytest.raises(ValueError, match=msg):
        PoolHardware.parse(spec)


def test_up_checks_the_spec_against_its_mode():
    assert _emulate_error("prefill=h100,decode=l40s", "disagg") == ""
    assert _emulate_error("h100", "colocated") == ""
    assert "no hardware for the colocated pool" in _emulate_error("prefill=h100,decode=l40s",
                                                                  "colocated")  # fmt: skip
    assert "unknown hardware" in _emulate_error("decode=x9", "disagg")


def _hw(argv: list[str]) -> str:
    return argv[argv.index("--emulate") + 1]


def test_each_emulated_worker_gets_its_pools_hardware(tmp_path):
    c = Cluster(ClusterConfig(log_dir=str(tmp_path), prefill=2, decode=3, time_scale=4.0,
                              emulate="prefill=h100,decode=h100+l40s"))  # fmt: skip
    c.model_dir, c.router_internal_port = str(tmp_path), 1
    got = {name: _hw(c._worker_argv(role, name)) for name, role in c._worker_plan()}
    assert got == {"prefill0": "h100", "prefill1": "h100", "decode0": "h100",
                   "decode1": "l40s", "decode2": "h100"}  # fmt: skip
    argv = c._worker_argv("decode", "decode1")
    assert argv[argv.index("--time-scale") + 1] == "4.0"
    one = Cluster(ClusterConfig(log_dir=str(tmp_path), mode="colocated", colocated=2,
                                emulate="a100"))  # fmt: skip
    one.model_dir, one.router_internal_port = str(tmp_path), 1
    assert _hw(one._worker_argv("colocated", "colocated1")) == "a100"


def test_pool_costs_per_role_and_per_worker():
    pc = pool_costs("llama3-8b", "prefill=h100,decode=h100+l40s")
    h100, l40s = roofline_costs("llama3-8b", "h100"), roofline_costs("llama3-8b", "l40s")
    assert pc["prefill"].name == h100.name and pc["colocated"].name == h100.name
    assert [c.name for c in pc["decode"]] == [h100.name, l40s.name]


def test_simulated_twin_deals_the_same_hardware_with_its_kv_blocks():
    pc = pool_costs("llama3-8b", "prefill=h100,decode=h100+l40s")
    spec = spec_from_up_flags(["--mode", "disagg", "--prefill", "1", "--decode", "3"], pc, 8192)
    decode = [p for p in spec.pools if p.role == "decode"]
    assert [p.costs.name.split("@")[1] for p in decode] == ["h100/bfloat16", "l40s/bfloat16",
                                                            "h100/bfloat16"]  # fmt: skip
    assert decode[0].config.num_blocks > decode[1].config.num_blocks  # 80 GB vs 48 GB
    from pdserve.sim.cluster import SimCluster

    ids = sorted(SimCluster(spec).instances)
    assert ids == ["decode-0", "decode-1", "decode-2", "prefill-0"]
