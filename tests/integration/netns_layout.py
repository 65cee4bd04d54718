"""The plumbing of tests/integration/test_multihost.py: a scripts/netns-cluster.sh layout
(one network namespace set per host) and the client agent on its `client` host
(netns_agent.py), which the test drives from the machine's own namespace."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "netns-cluster.sh"
AGENT = Path(__file__).with_name("netns_agent.py")


def script(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root for ip netns, veth pairs and a bridge (CI runs as root)"
    try:
        r = script("check", timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scripts/netns-cluster.sh check failed: {exc}"
    return None if r.returncode == 0 else f"ip netns unusable here: {(r.stdout + r.stderr).strip()}"


class Agent:
    """The client agent on the `client` host: one JSON request/reply per line."""

    def __init__(self, ns: str, cert_dir: Path, log: Path) -> None:
        self._stderr = open(log, "wb")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(AGENT), str(cert_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def call(self, op: str, timeout: float = 30.0, **kw):
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"agent: no reply to {op} in {timeout} s") from None
        if not reply["ok"]:
            raise AssertionError(f"agent {op}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._stderr.close()


class Layout:
    """A running scripts/netns-cluster.sh layout and the client agent on its `client` host."""

    def __init__(self, name: str, state: Path, agent: Agent) -> None:
        self.name, self.state, self.agent = name, state, agent
        self.hosts: dict[str, tuple[str, str]] = {}  # host -> (namespace, address)
        for line in (state / "hosts").read_text().splitlines():
            host, ns, addr = line.split()
            self.hosts[host] = (ns, addr)
        self.routers = sorted(h for h in self.hosts if h.startswith("router"))
        self.router = ",".join(self.public(h) for h in self.routers)  # the SDK's list

    def addr(self, host: str) -> str:
        return self.hosts[host][1]

    def public(self, router: str) -> str:
        """A router host's public gRPC address."""
        return f"{self.addr(router)}:50051"

    def worker(self, host: str) -> str:
        return f"{self.addr(host)}:50070"

    def script(self, *args: str) -> None:
        r = script("--name", self.name, "--dir", str(self.state), *args)
        assert r.returncode == 0, f"netns-cluster.sh {' '.join(args)}: {r.stdout}{r.stderr}"

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes of the host's interface."""
        out = subprocess.run(
            ["ip", "-n", self.hosts[host][0], "-j", "-s", "link", "show", "dev", "eth0"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def status(self, router: str = "router0") -> dict:
        """One router's Status: instances, request counts, the routers it knows of."""
        return self.agent.call("status", router=self.public(router))

    def instances(self, router: str = "router0") -> list[dict]:
        return self.status(router)["instances"]

    def instance_at(self, host: str, router: str = "router0") -> list[dict]:
        return [i for i in self.instances(router) if i["address"] == self.worker(host)]

    def info(self, host: str) -> dict:
        return self.agent.call("info", addr=self.worker(host))

    def counter(self, router: str, metric: str, label: str) -> float:
        """A labelled counter of one router's /metrics page (0 when absent)."""
        text = self.agent.call("metrics", url=f"http://{self.addr(router)}:9090/metrics")
        line = f"pdserve_router_{metric}_total{{{label}}} "
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))

    def migrations(self, reason: str, routers: list[str] | None = None) -> float:
        """Streams moved to another worker, summed over the routers (default: all)."""
        return sum(
            self.counter(r, "migrations", f'reason="{reason}"') for r in routers or self.routers
        )

    def registrations(self, instance_id: str, router: str = "router0") -> int:
        """How many times the router logged the instance as registered."""
        log = (self.state / "logs" / f"{router}.log").read_text(errors="replace")
        pattern = re.compile(r'"event": "instance registered"')
        return sum(
            1
            for line in log.splitlines()
            if pattern.search(line) and f'"instance": "{instance_id}"' in line
        )

    def idle(self, host: str) -> bool:
        c = self.info(host)["counters"]
        return (
            c["pool_free_blocks"] == c["pool_total_blocks"]
            and c["pool_reservations"] == 0
            and c["pool_held_blocks"] == 0
        )

    def logs(self) -> str:
        tails = []
        for path in sorted((self.state / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(tails)
