"""Start and stop a `pdserve up` cluster as a subprocess (one per benchmark arm).

`pdserve up` prints `PDSERVE_READY {"service": "cluster", "port": N}` once every instance has
registered; SIGTERM makes it drain and stop its services. The output is copied to a log file.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from pdserve.rpc.ready import READY_PREFIX, parse_ready_line


class ClusterError(RuntimeError):
    pass


class UpProcess:
    """`with UpProcess(["--mode", "colocated"], port=50051) as addr: ...`"""

    def __init__(
        self,
        up_args: list[str],
        port: int = 50051,
        ready_timeout_s: float = 600.0,
        stop_timeout_s: float = 60.0,
        log_path: str | Path | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """`launcher` replaces `python -m pdserve.cli.main up` (tests use a fake).

        An arm starts without a kvstore unless its flags say `--kvstore` (they come later and
        win): the arms in docs/RESULTS.md were measured so."""
        base = launcher or [sys.executable, "-m", "pdserve.cli.main", "up", "--no-kvstore"]
        self.cmd = [*base, *up_args, "--port", str(port)]
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._ready_port: int | None = None
        self.tls_dir: str | None = None  # from the ready line: admin calls over mutual TLS
        self._tail: list[str] = []
        self._reader: threading.Thread | None = None

    def _pump(self, stream: IO[str], log: IO[str] | None) -> None:
        for line in stream:
            if log:
                log.write(line)
                log.flush()
            self._tail = [*self._tail[-30:], line.rstrip()]
            info = parse_ready_line(line)
            # the cluster's own line only: a service's (a worker's, relayed into this output
            # while the cluster is still starting) names a port that is not the router's
            cluster_line = info is not None and info.get("service", "cluster") == "cluster"
            if cluster_line and not self._ready.is_set():
                port = info.get("port")
                self._ready_port = port if isinstance(port, int) else self.port
                tls = info.get("tls_dir")  # the cluster's certificates (None: --insecure)
                self.tls_dir = tls if isinstance(tls, str) else None
                self._ready.set()
        if log:
            log.close()

    def start(self) -> str:
        """Launch and wait for the ready line; returns "127.0.0.1:PORT"."""
        log = None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("w")
            log.write("$ " + shlex.join(self.cmd) + "\n")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=self._pump, args=(self.proc.stdout, log), daemon=True
        )
        self._reader.start()
        deadline_hit = not self._wait_ready()
        if deadline_hit or self._ready_port is None:
            self.stop()
            why = "exited" if self.proc.returncode is not None else "timed out"
            raise ClusterError(
                f"`{shlex.join(self.cmd)}` {why} before {READY_PREFIX}; last output:\n"
                + "\n".join(self._tail[-15:])
            )
        return f"127.0.0.1:{self._ready_port}"

    def _wait_ready(self) -> bool:
        step = 0.5
        waited = 0.0
        assert self.proc is not None
        while waited < self.ready_timeout_s:
            if self._ready.wait(step):
                return True
            if self.proc.poll() is not None:
                return self._ready.is_set()
            waited += step
        return False

    def stop(self) -> int | None:
        """SIGTERM, wait; SIGKILL the process group we created if it does not stop."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # children that outlived the launcher (same session we created): stop them too
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if self._reader:
            self._reader.join(timeout=5)
        return self.proc.returncode

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
