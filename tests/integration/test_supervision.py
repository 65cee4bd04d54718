"""`pdserve up` supervises its services: a worker killed with SIGKILL is restarted (and says
so), registers again and serves; the router forgets the dead instance and its per-instance
metric series; the kvstore and the router come back on their old ports. Every wait is bounded (hang guards)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request

import pytest

from .conftest import wait_until
from .test_cli_up import Up, _alive, _pdserve

pytestmark = pytest.mark.integration

PROMPT = list(range(3, 23))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(addr: str):
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        return router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=5)


def _serving_ids(addr: str, role_name: str) -> set[str]:
    from pdserve.v1 import common_pb2

    role = common_pb2.Role.Value("ROLE_" + role_name.upper())
    try:
        return {
            i.instance_id
            for i in _status(addr).instances
            if i.role == role and i.state == "serving"
        }
    except Exception:  # the router may be restarting
        return set()


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _generate(addr: str) -> list[int] | None:
    from pdserve.client import Client, PdserveClientError

    try:
        with Client(addr, timeout=30.0) as c:
            return c.generate(
                token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True
            ).token_ids
    except PdserveClientError:
        return None


def _wait_line(handle: Up, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handle.drain_output()
        for line in handle.lines:
            m = re.search(pattern, line)
            if m:
                return m
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(handle.lines[-30:]))


def test_killed_worker_kvstore_and_router_come_back(serving_model_dir, tmp_path):
    metrics_port = _free_port()
    argv = [
        *_pdserve(), "up", "--port", "0", "--prefill", "1", "--decode", "1", "--kvstore",
        "--kvstore-capacity-bytes", str(64 << 20), "--model", str(serving_model_dir),
        "--worker-arg=--num-blocks=64", f"--router-arg=--metrics-port={metrics_port}",
        "--restart-backoff-s", "0.2", "--log-dir", str(tmp_path),
    ]  # fmt: skip
    handle = Up(argv)
    pids: set[int] = set()
    try:
        info = handle.wait_ready(180)
        addr = f"127.0.0.1:{info['port']}"
        handle.drain_output()
        banner = "\n".join(handle.lines)
        assert "restarted (--no-restart" in banner
        procs = {
            m[0]: (int(m[1]), int(m[2]))
            for m in re.findall(r"(\w+) \(pid (\d+), port (\d+)\)", banner)
        }
        pids |= {pid for pid, _ in procs.values()}
        expected = _generate(addr)
        assert expected
        (old_id,) = _serving_ids(addr, "decode")
        wait_until(lambda: old_id in _metrics(metrics_port), 20, "the decode's in-flight gauge")

        os.kill(procs["decode0"][0], signal.SIGKILL)
        _wait_line(handle, r"decode0 \(pid \d+\) exited with code -9 .*restarting in", 30)
        back = _wait_line(handle, r"decode0 is back \(pid (\d+), port (\d+)\)", 120)
        pids.add(int(back[1]))
        wait_until(lambda: _serving_ids(addr, "decode") - {old_id}, 60, "a new decode registers")
        wait_until(lambda: old_id not in _serving_ids(addr, "decode"), 30, "the dead one expires")
        assert _generate(addr) == expected  # it serves, the same tokens
        wait_until(
            lambda: old_id not in _metrics(metrics_port), 20, "the dead decode's series removed"
        )
        (new_id,) = _serving_ids(addr, "decode")
        wait_until(lambda: new_id in _metrics(metrics_port), 20, "the new decode's series")

        kv_pid, kv_port = procs["kvstore"]
        os.kill(kv_pid, signal.SIGKILL)
        back = _wait_line(handle, r"kvstore is back \(pid (\d+), port (\d+)\)", 120)
        pids.add(int(back[1]))
        assert int(back[2]) == kv_port  # the others keep using the old address
        wait_until(lambda: _generate(addr) == expected, 60, "serving after the kvstore restart")

        router_pid, router_port = procs["router"]
        os.kill(router_pid, signal.SIGKILL)
        back = _wait_line(handle, r"router is back \(pid (\d+), port (\d+)\)", 120)
        pids.add(int(back[1]))
        assert int(back[2]) == router_port == info["port"]  # clients keep their address
        # the workers register again with the new router process, and it serves
        wait_until(lambda: _generate(addr) == expected, 60, "serving after the router restart")

        handle.proc.send_signal(signal.SIGTERM)
        assert handle.proc.wait(60) == 0
    finally:
        if handle.proc.poll() is None:
            os.killpg(handle.proc.pid, signal.SIGKILL)
            handle.proc.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "services left behind"
