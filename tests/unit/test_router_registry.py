"""Registry: registration, heartbeats, expiry with a fake clock, suspicion."""

import pytest

from pdserve.errors import FailedPreconditionError, InvalidRequestError
from pdserve.router.cluster.registry import (
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_PREFILL,
    LoadReport,
    Registry,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def reg(clock):
    return Registry(heartbeat_timeout_s=3.0, suspect_s=1.0, clock=clock)


def add(reg, iid, role=ROLE_PREFILL, fp="fp-a"):
    return reg.register(iid, f"127.0.0.1:{len(iid) + 5000}", role, fp, 16)


def test_register_and_candidates_by_role(reg):
    add(reg, "p1")
    add(reg, "d1", ROLE_DECODE)
    add(reg, "c1", ROLE_COLOCATED)
    assert [i.instance_id for i in reg.candidates(ROLE_PREFILL)] == ["p1"]
    assert [i.instance_id for i in reg.candidates(ROLE_DECODE)] == ["d1"]
    assert [i.instance_id for i in reg.candidates(ROLE_COLOCATED)] == ["c1"]


def test_expiry_after_silence(reg, clock):
    add(reg, "p1")
    add(reg, "p2")
    clock.t += 2.0
    assert reg.heartbeat("p2", ROLE_PREFILL, "serving", LoadReport(num_running=1))
    clock.t += 2.0  # p1 silent 4 s > 3 s, p2 silent 2 s
    assert [i.instance_id for i in reg.candidates(ROLE_PREFILL)] == ["p2"]  # filtered at once
    assert reg.expire() == ["p1"]
    assert reg.get("p1") is None
    assert reg.get("p2").load.num_running == 1
    # The forgotten instance learns it must register again.
    assert reg.heartbeat("p1", ROLE_PREFILL, "serving", LoadReport()) is False


def test_forget_listener_and_deregister(reg, clock):
    gone = []
    reg.on_forget(gone.append)
    add(reg, "p1")
    add(reg, "p2")
    assert reg.deregister("p1")
    assert not reg.deregister("p1")
    clock.t += 10
    reg.expire()
    assert gone == ["p1", "p2"]
    assert reg.model_fingerprint is None  # empty registry accepts any model again


def test_fingerprint_mismatch_rejected(reg):
    add(reg, "p1", fp="fp-a")
    with pytest.raises(FailedPreconditionError, match="fingerprint"):
        add(reg, "d1", ROLE_DECODE, fp="fp-b")
    add(reg, "p1", fp="fp-b")  # the only instance may re-register with a new model
    assert reg.model_fingerprint == "fp-b"


def test_bad_registration(reg):
    with pytest.raises(InvalidRequestError, match="role"):
        reg.register("x", "127.0.0.1:1", 0, "fp", 16)
    with pytest.raises(InvalidRequestError, match="instance_id"):
        reg.register("", "127.0.0.1:1", ROLE_DECODE, "fp", 16)


def test_suspect_skipped_until_heartbeat_after_window(reg, clock):
    add(reg, "d1", ROLE_DECODE)
    add(reg, "d2", ROLE_DECODE)
    reg.mark_suspect("d1")
    assert [i.instance_id for i in reg.candidates(ROLE_DECODE)] == ["d2"]
    clock.t += 0.5
    reg.heartbeat("d1", ROLE_DECODE, "serving", LoadReport())  # too soon: still suspect
    assert [i.instance_id for i in reg.candidates(ROLE_DECODE)] == ["d2"]
    clock.t += 1.0
    reg.heartbeat("d1", ROLE_DECODE, "serving", LoadReport())
    assert [i.instance_id for i in reg.candidates(ROLE_DECODE)] == ["d1", "d2"]


def test_draining_state_and_role_flip(reg):
    add(reg, "w1", ROLE_PREFILL)
    reg.heartbeat("w1", ROLE_PREFILL, "draining", LoadReport())
    assert reg.candidates(ROLE_PREFILL) == []
    reg.heartbeat("w1", ROLE_DECODE, "serving", LoadReport())
    assert [i.instance_id for i in reg.candidates(ROLE_DECODE)] == ["w1"]


def test_charge_counters_survive_reregistration(reg):
    add(reg, "p1")
    reg.charge("p1", requests=2, tokens=100)
    add(reg, "p1")
    inst = reg.get("p1")
    assert (inst.inflight_requests, inst.inflight_tokens) == (2, 100)
    reg.charge("p1", requests=-5, tokens=-500)
    assert (inst.inflight_requests, inst.inflight_tokens) == (0, 0)
