"""The SDK's router list (client/routers.py): parsing "a:1,b:2" and lists, round robin over
live replicas, skipping one that failed lately, an error naming every address."""

from __future__ import annotations

import pytest

from pdserve.client import Unavailable
from pdserve.client.routers import DOWN_S, Routers, parse_addrs


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_parse() -> None:
    assert parse_addrs("a:1") == ["a:1"]
    assert parse_addrs("a:1, b:2,,a:1") == ["a:1", "b:2"]
    assert parse_addrs(["a:1", "b:2,c:3"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError, match="no router address"):
        parse_addrs(" , ")
    with pytest.raises(ValueError):
        parse_addrs([])
    with pytest.raises(TypeError):
        parse_addrs([1])  # type: ignore[list-item]


def test_round_robin_skips_a_failed_router_until_it_may_be_back() -> None:
    clock = Clock()
    r = Routers(["a:1", "b:2", "c:3"], clock=clock)
    first = [r.pick() for _ in range(3)]
    assert sorted(first) == ["a:1", "b:2", "c:3"]  # each once per round
    r.failed("b:2")
    assert "b:2" not in [r.pick() for _ in range(4)]
    assert r.backoff(3, 0.1) == 0.0  # another is up: no wait
    clock.t += DOWN_S
    assert "b:2" in [r.pick() for _ in range(3)]


def test_all_down_picks_the_least_recently_failed_and_backs_off() -> None:
    clock = Clock()
    r = Routers("a:1,b:2", clock=clock)
    r.failed("a:1")
    clock.t += 0.5
    r.failed("b:2")
    assert r.pick() == "a:1"
    assert r.backoff(0, 0.1) == pytest.approx(0.1)
    assert r.backoff(10, 0.1) == 1.0  # bounded
    assert r.in_order()[0] == "a:1"


def test_unavailable_names_every_address() -> None:
    r = Routers("a:1,b:2")
    last = Unavailable("connection refused")
    err = r.unavailable(last, {"a:1": "connection refused", "b:2": "socket closed"})
    assert isinstance(err, Unavailable)
    assert "a:1: connection refused" in err.message and "b:2: socket closed" in err.message
    assert Routers("a:1").unavailable(last, {"a:1": "x"}) is last  # one router: its own words
