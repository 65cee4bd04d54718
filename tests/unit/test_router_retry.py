"""`Tries` (lifecycle/retry.py): the one retry rule of the orchestrator's loops and its one
error vocabulary (a colocated request never reads "prefill failed")."""

from __future__ import annotations

import grpc
import pytest

from pdserve.errors import InvalidRequestError, UnavailableError
from pdserve.router.cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Registry
from pdserve.router.cluster.workers import RemoteError
from pdserve.router.lifecycle.retry import Tries


def _registry() -> Registry:
    reg = Registry()
    for i in (1, 2):
        reg.register(f"p{i}", f"127.0.0.1:{i}", ROLE_PREFILL, "fp", 16)
        reg.register(f"c{i}", f"127.0.0.1:{10 + i}", ROLE_COLOCATED, "fp", 16)
    reg.register("d1", "127.0.0.1:21", ROLE_DECODE, "fp", 16)
    return reg


def _down(what: str) -> RemoteError:
    return RemoteError(grpc.StatusCode.UNAVAILABLE, f"{what}: connection reset")


def first(cands):
    return cands[0]


def test_tries_every_instance_once_then_names_its_step():
    tries = Tries(_registry(), ROLE_COLOCATED, max_attempts=5)
    a = tries.pick(first)
    tries.failed(_down("c1"), 1)  # another one is left: try it
    b = tries.pick(first)
    assert {a.instance_id, b.instance_id} == {"c1", "c2"}
    with pytest.raises(UnavailableError) as info:
        tries.failed(_down("c2"), 2)
    assert str(info.value).startswith("colocated failed on 2 instance(s); last: ")
    assert "prefill" not in str(info.value)
    with pytest.raises(UnavailableError, match=r"no colocated instance is available \(tried 2\)"):
        tries.pick(first)


def test_attempt_bound_non_retryable_errors_and_forget():
    tries = Tries(_registry(), ROLE_PREFILL, max_attempts=1)
    tries.pick(first)
    with pytest.raises(UnavailableError, match="prefill failed on 1 instance"):
        tries.failed(_down("p1"), 1)  # p2 is left, but the attempt bound is reached
    tries = Tries(_registry(), ROLE_PREFILL, max_attempts=3)
    p = tries.pick(first)
    bad = InvalidRequestError("prompt", "too long")
    with pytest.raises(InvalidRequestError):  # another instance would not help
        tries.failed(bad, 1)
    tries.forget(p)  # not its fault: it may be picked again
    assert tries.pick(first).instance_id == p.instance_id
    tries.reset()
    assert tries.tried == set()


def test_a_decode_step_says_decode():
    tries = Tries(_registry(), ROLE_DECODE)
    tries.pick(first)
    with pytest.raises(UnavailableError, match=r"^decode failed on 1 instance"):
        tries.failed(_down("d1"))
