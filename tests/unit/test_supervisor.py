"""Supervisor logic with a fake cluster and a fake clock: back-off doubles per consecutive
crash, is bounded, starts over after a healthy period; exits, restarts and readiness are
reported. (The real processes: tests/integration/test_supervision.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.supervisor import Backoff, RestartPolicy, Supervisor


def test_backoff_doubles_is_bounded_and_resets_after_a_healthy_run():
    b = Backoff(RestartPolicy(initial_s=0.5, max_s=4.0, factor=2.0, healthy_s=10.0))
    assert [b.on_exit(uptime_s=1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.on_exit(uptime_s=10.0) == 0.5  # it stayed up 10 s: healthy, start over
    assert b.on_exit(uptime_s=0.1) == 1.0


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        RestartPolicy(initial_s=5, max_s=1)
    with pytest.raises(ValueError):
        RestartPolicy(factor=0.5)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakePopen:
    pid: int
    returncode: int | None = None


@dataclass
class FakeProc:
    popen: FakePopen
    started_at: float
    ready: bool = False
    port: int | None = None

    @property
    def alive(self) -> bool:
        return self.popen.returncode is None


@dataclass
class FakeCluster:
    clock: Clock
    processes: dict[str, FakeProc] = field(default_factory=dict)
    spawned: list[str] = field(default_factory=list)
    next_pid: int = 1000

    def add(self, name: str) -> FakeProc:
        self.next_pid += 1
        proc = FakeProc(FakePopen(self.next_pid), self.clock(), ready=True, port=7000)
        self.processes[name] = proc
        return proc

    def respawn(self, name: str) -> FakeProc:
        assert not self.processes[name].alive
        self.spawned.append(name)
        proc = self.add(name)
        proc.ready, proc.port = False, None
        return proc

    def poll_ready(self, name: str) -> bool:
        proc = self.processes[name]
        if proc.ready:
            proc.port = 7001
        return proc.ready


def test_a_dead_process_is_restarted_after_its_backoff_and_reported_back():
    clock = Clock()
    cluster = FakeCluster(clock)
    cluster.add("router")
    cluster.add("decode0")
    said: list[str] = []
    sup = Supervisor(
        cluster, RestartPolicy(initial_s=1.0, max_s=8.0, healthy_s=60.0), said.append, clock
    )
    sup.tick()
    assert said == [] and not sup.pending()
    clock.t += 5
    cluster.processes["decode0"].popen.returncode = -9
    sup.tick()
    assert said[-1].startswith("decode0 (pid 1002) exited with code -9 after 5.0 s")
    assert "restarting in 1 s" in said[-1]
    clock.t += 0.5
    sup.tick()
    assert cluster.spawned == []  # not yet due
    clock.t += 0.6
    sup.tick()
    assert cluster.spawned == ["decode0"]
    assert said[-1] == "restarted decode0 (pid 1003, restart 1)"
    sup.tick()
    assert sup.pending()  # not ready yet
    cluster.processes["decode0"].ready = True
    sup.tick()
    assert said[-1] == "decode0 is back (pid 1003, port 7001)"
    assert not sup.pending()
    assert cluster.processes["router"].alive


def test_a_crash_loop_backs_off_and_a_crash_before_ready_counts():
    clock = Clock()
    cluster = FakeCluster(clock)
    cluster.add("kvstore")
    said: list[str] = []
    sup = Supervisor(
        cluster, RestartPolicy(initial_s=1.0, max_s=4.0, healthy_s=60.0), said.append, clock
    )
    delays = []
    for _ in range(5):
        cluster.processes["kvstore"].popen.returncode = 1  # dies (before it was ready)
        sup.tick()
        delays.append(float(said[-1].rsplit("restarting in ", 1)[1].split()[0]))
        clock.t += delays[-1]
        sup.tick()  # restarted
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert sup.restarts == {"kvstore": 5}
    clock.t += 60  # healthy for a minute
    cluster.processes["kvstore"].ready = True
    sup.tick()
    cluster.processes["kvstore"].popen.returncode = 1
    sup.tick()
    assert "restarting in 1 s" in said[-1]
