"""`pdserve up` as a real subprocess: READY line, `pdserve generate --addr` / `status` against
it, the same tokens as `pdserve generate --model` in process, and SIGTERM stops everything
(exit 0, no child left)."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

READY = "PDSERVE_READY "


def _pdserve() -> list[str]:
    exe = Path(sys.executable).with_name("pdserve")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("pdserve")
    return [found] if found else [sys.executable, "-m", "pdserve.cli.main"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Up:
    """A `pdserve up` process whose stdout lines are collected by a thread."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if line.startswith(READY):
                return json.loads(line[len(READY) :])
        raise AssertionError("no READY line from `pdserve up`:\n" + "\n".join(self.lines[-40:]))

    def drain_output(self) -> None:
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                return
            if line is None:
                return
            self.lines.append(line)


def _run(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    res = subprocess.run([*_pdserve(), *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"pdserve {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def up(serving_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up-logs")
    argv = [
        *_pdserve(), "up", "--port", "0", "--http-port", "0", "--prefill", "1", "--decode", "1",
        "--routers", "2",  # two router replicas and their Redis, as a user starts them
        "--model", str(serving_model_dir), "--worker-arg=--num-blocks=256",
        "--log-dir", str(log_dir),
    ]  # fmt: skip
    handle = Up(argv)
    try:
        info = handle.wait_ready(180)
        yield handle, info, log_dir
    finally:
        if handle.proc.poll() is None:
            os.killpg(handle.proc.pid, signal.SIGKILL)
            handle.proc.wait(10)


def test_ready_line(up):
    handle, info, log_dir = up
    assert info["service"] == "cluster"
    assert isinstance(info["port"], int) and info["port"] > 0
    assert Path(info["log_dir"]) == log_dir
    routers = info["routers"]
    assert len(routers) == 2 and routers[0] == f"127.0.0.1:{info['port']}"
    deadline = time.monotonic() + 10  # (printed right after the READY line)
    while time.monotonic() < deadline and not any("PDSERVE_ROUTERS=" in x for x in handle.lines):
        handle.drain_output()
        time.sleep(0.05)
    assert f"PDSERVE_ROUTERS={','.join(routers)}" in handle.lines


def test_both_replicas_serve_and_status_lists_them(up):
    _handle, info, _ = up
    addrs = ",".join(info["routers"])
    common = ["--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "0", "--json"]
    out = {json.dumps(json.loads(_run(["generate", "--addr", a, *common]).stdout)["token_ids"])
           for a in info["routers"]}  # fmt: skip
    assert len(out) == 1  # the same tokens from either replica
    status = json.loads(_run(["status", "--addr", addrs, "--json"]).stdout)
    assert sorted(r["address"] for r in status["routers"]) == sorted(info["routers"])
    assert status["shared_store"] == "redis up"
    table = _run(["status", "--addr", addrs]).stdout
    assert "routers (2 known" in table


def test_generate_over_addr_matches_in_process(up, serving_model_dir):
    _handle, info, _ = up
    addr = f"127.0.0.1:{info['port']}"
    common = ["--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "0", "--json"]
    remote = json.loads(_run(["generate", "--addr", addr, *common]).stdout)
    for key in (
        "token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens",
        "ttft_ms", "tpot_ms", "e2e_ms",
    ):  # fmt: skip
        assert key in remote, f"generate --json lacks {key}: {remote}"
    assert len(remote["token_ids"]) <= 5 and remote["token_ids"]
    assert all(isinstance(t, int) for t in remote["token_ids"])
    assert isinstance(remote["text"], str)
    assert remote["finish_reason"] in ("length", "stop")
    assert remote["prompt_tokens"] == 3
    assert remote["cached_tokens"] == 0  # 3 tokens: no full block, nothing to reuse
    assert remote["e2e_ms"] >= remote["ttft_ms"] > 0
    local = json.loads(_run(["generate", "--model", str(serving_model_dir), *common]).stdout)
    assert remote["token_ids"] == local["token_ids"]
    assert remote["finish_reason"] == local["finish_reason"]


def test_status(up):
    _handle, info, _ = up
    res = _run(["status", "--addr", f"127.0.0.1:{info['port']}", "--json"])
    status = json.loads(res.stdout)
    text = json.dumps(status)
    assert "prefill" in text and "decode" in text
    res = _run(["status", "--addr", f"127.0.0.1:{info['port']}"])  # the table
    assert "prefill" in res.stdout and "decode" in res.stdout


def test_banner_and_http(up):
    handle, info, _ = up
    banner = "\n".join(handle.lines)
    assert f"OpenAI-compatible HTTP API on http://127.0.0.1:{info['http_port']}/v1" in banner
    assert "the API is open" in banner
    assert "RANDOM weights" not in banner  # --model given
    # The printed commands work as printed: the first word is an executable path.
    cmd = re.search(r"try:\s+(\S+)", banner).group(1)
    assert os.access(cmd, os.X_OK), banner
    import httpx

    r = httpx.get(f"http://127.0.0.1:{info['http_port']}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_sigterm_stops_everything(up):
    """Runs last in this module (pytest keeps file order)."""
    handle, _info, log_dir = up
    banner = "\n".join(handle.lines)
    pids = [int(p) for p in re.findall(r"\(pid (\d+), port", banner)]
    # redis, kvstore (on by default), router, router1, prefill0, decode0
    assert len(pids) == 6, banner
    logs = sorted(p.stem for p in log_dir.glob("*.log"))
    assert logs == ["decode0", "kvstore", "prefill0", "redis", "router", "router1"]
    assert all(_alive(pid) for pid in pids)
    handle.proc.send_signal(signal.SIGTERM)
    assert handle.proc.wait(60) == 0
    handle.drain_output()
    assert any("stopping" in line for line in handle.lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "child processes left behind"
