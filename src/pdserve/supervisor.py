"""Supervision of a local deployment: restart a service process that dies, with back-off.

`Supervisor.tick()` is called periodically by `pdserve up` (or a test's thread); it never
blocks. A process that exits while the cluster runs is restarted after a delay that doubles
with each consecutive crash (`RestartPolicy.initial_s` .. `max_s`, bounded) and falls back to
`initial_s` once the process has stayed up for `healthy_s`. A crash loop therefore keeps
retrying, at most once every `max_s` seconds, and says so each time. Every exit, restart and
return to service is reported through `notify` (the console) and the structured log.

A restarted worker registers with the router by itself (it is given the router's address);
the kvstore and the router come back on the port they had, which the others still use.
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.logging import get_logger

if TYPE_CHECKING:
    from pdserve.launcher import Cluster

log = get_logger("pdserve.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 0.5  # delay before the first restart after a healthy run
    max_s: float = 30.0  # the delay never grows beyond this
    factor: float = 2.0
    healthy_s: float = 30.0  # up this long = healthy: the back-off starts over

    def __post_init__(self) -> None:
        if not 0 <= self.initial_s <= self.max_s:
            raise ValueError("need 0 <= initial_s <= max_s")
        if self.factor < 1 or self.healthy_s < 0:
            raise ValueError("need factor >= 1 and healthy_s >= 0")


class Backoff:
    """Consecutive-crash counter of one process and the delay before its next restart."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.crashes = 0  # consecutive, since the last healthy period

    def on_exit(self, uptime_s: float) -> float:
        """The process died after `uptime_s` seconds up: the delay before restarting it."""
        p = self.policy
        if uptime_s >= p.healthy_s:
            self.crashes = 0
        self.crashes += 1
        return min(p.max_s, p.initial_s * p.factor ** (self.crashes - 1))


class Supervisor:
    """Restarts the dead processes of a started `Cluster` (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy | None = None,
        notify: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self._notify = notify or (lambda _msg: None)
        self._clock = clock
        self._backoff: dict[str, Backoff] = {}
        self._due: dict[str, float] = {}  # name -> when to restart it
        self._starting: set[str] = set()  # restarted, not ready yet
        self.restarts: dict[str, int] = {}  # name -> restarts so far

    def tick(self) -> None:
        now = self._clock()
        for name, proc in list(self.cluster.processes.items()):
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self._restart(name)
                continue
            if not proc.alive:
                self._starting.discard(name)
                self._on_exit(name, now)
            elif name in self._starting and self.cluster.poll_ready(name):
                self._starting.discard(name)
                new = self.cluster.processes[name]
                pid = new.popen.pid if new.popen else "?"
                self._say(f"{name} is back (pid {pid}, port {new.port})", name=name, pid=pid)

    def pending(self) -> bool:
        """Some process is waiting for its restart or its ready line."""
        return bool(self._due or self._starting)

    def _on_exit(self, name: str, now: float) -> None:
        proc = self.cluster.processes[name]
        code = proc.popen.returncode if proc.popen else None
        uptime = now - proc.started_at
        delay = self._backoff.setdefault(name, Backoff(self.policy)).on_exit(uptime)
        self._due[name] = now + delay
        self._say(
            f"{name} (pid {proc.popen.pid if proc.popen else '?'}) exited with code {code} "
            f"after {uptime:.1f} s; restarting in {delay:g} s",
            name=name,
            code=code,
            uptime_s=round(uptime, 3),
            delay_s=delay,
            level="warning",
        )

    def _restart(self, name: str) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        try:
            proc = self.cluster.respawn(name)
        except OSError as exc:  # e.g. the executable vanished: try again later
            self._on_exit(name, self._clock())
            log.warning("restart failed", name=name, error=str(exc))
            return
        self._starting.add(name)
        pid = proc.popen.pid if proc.popen else "?"
        self._say(
            f"restarted {name} (pid {pid}, restart {self.restarts[name]})",
            name=name,
            pid=pid,
            restarts=self.restarts[name],
        )

    def _say(self, message: str, level: str = "info", **fields: object) -> None:
        getattr(log, level)(message, **fields)
        self._notify(message)


class SupervisorThread:
    """Ticks a Supervisor on a daemon thread (tests and embedders; `pdserve up` ticks it from
    its main loop). Use as a context manager; stop it before `Cluster.stop()`."""

    def __init__(self, supervisor: Supervisor, interval_s: float = 0.1) -> None:
        import threading

        self.supervisor = supervisor
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdserve-supervisor", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.supervisor.tick()
            except Exception as exc:  # keep supervising; say what went wrong
                log.error("supervisor tick failed", error=repr(exc))

    def __enter__(self) -> SupervisorThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
