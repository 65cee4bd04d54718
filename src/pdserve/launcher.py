"""Start a whole pdserve deployment as local processes on 127.0.0.1.

`Cluster` is what `pdserve up`, the benchmarks and the integration tests use: kvstore
(`ClusterConfig.kvstore`: off unless asked for, so that tests and benchmarks choose; `pdserve up`
asks for it unless `--no-kvstore`) -> router -> workers, each a real OS process running its service's `python -m` entry point.
A process is ready when it prints the `PDSERVE_READY {json}` line (written by the shared server
lifecycle); the cluster is ready when the router lists every worker as registered.
Torch-free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.rpc.parent import PARENT_PID_ENV
from pdserve.rpc.ready import parse_ready_line


@dataclass
class ManagedProcess:
    """One child process and where its output goes."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cpu: int | None = None
    popen: subprocess.Popen | None = None
    port: int | None = None
    info: dict = field(default_factory=dict)  # the READY line's JSON
    started_at: float = 0.0  # time.monotonic() of the last start
    # A program that prints no READY line (the shared Redis): ready once its log holds
    # `ready_text`, on the port it was given.
    ready_text: str | None = None
    fixed_port: int | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.started_at = time.monotonic()
        env = {**self.env, PARENT_PID_ENV: str(os.getpid())}
        # No preexec_fn (unsafe with threads, see die_with_parent): the child sets its
        # parent-death signal itself, and the CPU pin is applied from here right after.
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches the launcher only
        )
        log.close()
        if self.cpu is not None and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(self.popen.pid, {self.cpu})
            except OSError:  # it died already
                pass

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def ready_info(self) -> dict | None:
        """The JSON of the child's ready line, once it printed one."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        if self.ready_text is not None:
            return {"port": self.fixed_port} if self.ready_text in text else None
        for line in text.splitlines():
            info = parse_ready_line(line)
            if info is not None:
                return info
        return None

    def wait_ready(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            info = self.ready_info()
            if info is not None:
                self.port = int(info["port"])
                self.info = info
                return self.port
            if not self.alive:
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.returncode if self.popen else '?'} "
                    f"before it was ready; log: {self.log_path}\n{self.tail()}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in time; log: {self.log_path}\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


@dataclass
class ClusterConfig:
    model: str | None = None  # checkpoint directory; None = the built-in tiny model
    mode: str = "disagg"  # disagg | colocated
    prefill: int = 1
    decode: int = 1
    colocated: int = 2
    kvstore: bool = False
    kvstore_capacity_bytes: int = 1 << 30
    # the kvstore's disk tier (pdserve.kvstore.disk): a directory for block files, and its
    # budget in block bytes (modelled bytes on an emulated cluster, like the RAM capacity)
    kvstore_disk_dir: str | None = None
    kvstore_disk_bytes: int = 16 << 30
    port: int = 50051  # router port; 0 = any free port (replica i: port + i)
    http_port: int | None = None  # router's OpenAI HTTP API; 0 = any free port; None = off
    # Router replicas (docs/ARCHITECTURE.md, "Router replicas"): processes router, router1,
    # ...; every worker registers with each. With 2 or more a Redis server is started for
    # what they share (per-key limits, the flip leader), unless `redis_url` names one.
    routers: int = 1
    redis_url: str | None = None
    api_key: str | None = None  # a key the router accepts (for the launcher's Status polls)
    pin_cpus: bool = False
    policy: str | None = None
    log_dir: str | None = None
    log_format: str = "json"
    worker_args: list[str] = field(default_factory=list)  # extra flags for every worker
    router_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Mutual TLS on the internal plane (the default): certificates are generated in
    # tls_dir (default: <log_dir>/certs). tls=False is `pdserve up --insecure`.
    tls: bool = True
    tls_dir: str | None = None
    # The emulated engine (pdserve.emulate): workers model `emulate` hardware (one for all,
    # or per pool: costmodel.pools, e.g. 'prefill=h100,decode=l40s') running
    # `model_config` (default: `model`'s config.json), with `tokenizer` (default: `model`'s,
    # else the built-in tiny one). kvstore_capacity_bytes is then in modelled bytes.
    emulate: str | None = None
    model_config: str | None = None
    emulate_profile: str | None = None
    time_scale: float = 1.0
    tokenizer: str | None = None
    # interpreter flags before the router's `-m pdserve.router` (e.g. -m cProfile -o FILE)
    router_python_args: list[str] = field(default_factory=list)


class Cluster:
    """A running deployment. Use as a context manager, or start()/stop()."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.processes: dict[str, ManagedProcess] = {}
        self.model_dir: str = ""
        self.router_port: int | None = None
        self.router_internal_port: int | None = None
        self.http_port: int | None = None
        self.kvstore_port: int | None = None
        self.redis_port: int | None = None
        # every router replica's ports: name -> (public, internal, http or None)
        self.router_ports: dict[str, tuple[int, int, int | None]] = {}
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="pdserve-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._next_cpu = 0

    # ---------------------------------------------------------------- public
    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    @property
    def internal_addr(self) -> str:
        """The router's internal listener (registry), where workers register."""
        return f"127.0.0.1:{self.router_internal_port}"

    @property
    def addrs(self) -> list[str]:
        """Every router replica's public gRPC address (PDSERVE_ROUTERS)."""
        return [f"127.0.0.1:{p[0]}" for p in self.router_ports.values()]

    @property
    def http_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p[2]}/v1" for p in self.router_ports.values() if p[2]]

    @property
    def internal_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p[1]}" for p in self.router_ports.values()]

    def router_names(self) -> list[str]:
        return ["router", *(f"router{i}" for i in range(1, max(1, self.config.routers)))]

    @property
    def shared_redis_url(self) -> str | None:
        """The replicas' shared store: the given one, or the Redis this cluster runs."""
        if self.config.redis_url:
            return self.config.redis_url
        return f"redis://127.0.0.1:{self.redis_port}/0" if self.redis_port else None

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (…/v1), when it is on."""
        return f"http://127.0.0.1:{self.http_port}/v1" if self.http_port else None

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    @property
    def tls_dir(self) -> Path | None:
        if not self.config.tls:
            return None
        return Path(self.config.tls_dir) if self.config.tls_dir else self._log_dir / "certs"

    def tls_files(self, name: str):
        """The TlsFiles of certificate `name` (router, kvstore, admin, a worker's name)."""
        from pdserve.rpc.tls import TlsFiles

        if self.tls_dir is None:
            raise RuntimeError("this cluster runs --insecure: no certificates")
        return TlsFiles.in_dir(self.tls_dir, name)

    def internal_channel(self, target: str, as_name: str = "admin"):
        """A blocking channel to an internal service (a process name or HOST:PORT), with the
        certificate `as_name` (plaintext when the cluster runs --insecure)."""
        import grpc

        from pdserve.rpc.tls import secure_channel_sync

        proc = self.processes.get(target)
        addr = f"127.0.0.1:{proc.port}" if proc is not None else target
        if target in self.router_ports:
            addr = f"127.0.0.1:{self.router_ports[target][1]}"
        if self.tls_dir is None:
            return grpc.insecure_channel(addr)
        return secure_channel_sync(addr, self.tls_files(as_name))

    def worker_counters(self, name: str, timeout: float = 10.0) -> dict[str, float]:
        """Worker `name`'s Info counters, over the internal plane (an admin certificate
        under TLS)."""
        from pdserve.v1 import worker_pb2, worker_pb2_grpc

        with self.internal_channel(name, as_name="admin") as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Info(
                worker_pb2.InfoRequest(), timeout=timeout
            )
        return dict(info.counters)

    def worker_names(self) -> list[str]:
        return [n for n in self.processes if n.startswith(("prefill", "decode", "colocated"))]

    def start(self, timeout: float = 180.0) -> Cluster:
        deadline = time.monotonic() + timeout
        self.model_dir = self._resolve_model()
        try:
            self._make_certs()
            c = self.config
            if c.routers > 1 and not c.redis_url:
                self.redis_port = _free_port()
                self._spawn_redis().wait_ready(deadline)
            if self.config.kvstore:
                kv = self._spawn("kvstore", self._kvstore_argv())
                self.kvstore_port = kv.wait_ready(deadline)
            for i, name in enumerate(self.router_names()):
                port, http = (self._replica_port(p, i) for p in (c.port, c.http_port))
                self._spawn(name, self._router_argv(port, 0, http))
            for name in self.router_names():
                self._router_ready(name, deadline)
            for name, role in self._worker_plan():
                self._spawn(name, self._worker_argv(role, name), cpu=self._pick_cpu())
            for name in self.worker_names():
                self.processes[name].wait_ready(deadline)
            self.wait_registered(len(self.worker_names()), deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _router_ready(self, name: str, deadline: float) -> None:
        proc = self.processes[name]
        port = proc.wait_ready(deadline)
        info = proc.ready_info() or {}
        self.router_ports[name] = (port, int(info["internal_port"]), info.get("http_port"))
        if name == "router":
            self.router_port, self.router_internal_port = port, int(info["internal_port"])
            self.http_port = info.get("http_port")

    @staticmethod
    def _replica_port(port: int | None, i: int) -> int | None:
        """Replica i's port: `port` + i (0 = any free port, None = off)."""
        return port if not port else port + i

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM workers, then routers, kvstore and Redis; SIGKILL what is still alive."""
        order = [*self.worker_names(), *self.router_names(), "kvstore", "redis"]
        for name in order:
            proc = self.processes.get(name)
            if proc is not None:
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in order:
            proc = self.processes.get(name)
            if proc is None:
                continue
            if proc.wait(max(0.1, deadline - time.monotonic())) is None:
                proc.signal(signal.SIGKILL)
                proc.wait(5)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.processes[name]
        proc.signal(sig)
        proc.wait(10)

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start a (killed) process again under the same name and wait until it is ready: a
        worker until it registers; the kvstore and the router on their old ports (the other
        processes keep the addresses they were given), the kvstore empty."""
        if self.processes[name].alive:
            self.kill(name)
        deadline = time.monotonic() + timeout
        new = self.respawn(name)
        port = new.wait_ready(deadline)
        if name == "kvstore":
            self.kvstore_port = port
        elif name in self.router_ports:
            self._router_ready(name, deadline)
        if name in ("kvstore", "redis"):
            return
        # Other workers may be dead on purpose (fault tests): count and watch the live ones.
        live = [n for n in self.worker_names() if self.processes[n].alive]
        self.wait_registered(len(live), deadline, names=live)

    def respawn(self, name: str) -> ManagedProcess:
        """Start the dead process `name` again (same role, CPU and port where it matters);
        returns at once: see `poll_ready`. Used by `restart` and by the Supervisor."""
        old = self.processes[name]
        if old.alive:
            raise RuntimeError(
                f"{name} is still running (pid {old.popen.pid if old.popen else '?'})"
            )
        if name == "kvstore":
            return self._spawn(name, self._kvstore_argv(port=self.kvstore_port or 0))
        if name == "redis":
            return self._spawn_redis()
        if name in self.router_ports:
            # the same ports: clients and workers keep the addresses they were given
            port, internal, http = self.router_ports[name]
            return self._spawn(name, self._router_argv(port, internal, http))
        role = name.rstrip("0123456789")
        return self._spawn(name, self._worker_argv(role, name), cpu=old.cpu)

    def poll_ready(self, name: str) -> bool:
        """Whether process `name` printed its ready line (and learn its port); never blocks."""
        proc = self.processes[name]
        info = proc.ready_info()
        if info is None:
            return False
        proc.port = int(info["port"])
        return True

    def wait_registered(
        self, count: int, deadline: float, names: Sequence[str] | None = None
    ) -> None:
        """Poll every live router's Status until each lists `count` registered instances;
        fail at once when one of the workers `names` (default: all) dies meanwhile."""
        while time.monotonic() < deadline:
            try:
                addrs = [
                    f"127.0.0.1:{self.router_ports[n][0]}"
                    for n in self.router_names()
                    if n in self.router_ports and self.processes[n].alive
                ] or [self.addr]
                if all(registered_instances(a, 2.0, self.config.api_key) >= count for a in addrs):
                    return
            except Exception:  # router still starting
                pass
            for name in self.worker_names() if names is None else names:
                proc = self.processes[name]
                if not proc.alive:
                    raise RuntimeError(f"{name} died during start-up; log:\n{proc.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"fewer than {count} instances registered with the router in time")

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------- helpers
    def _resolve_model(self) -> str:
        if self.config.emulate:
            return self._emulated_model_dir()
        if self.config.model:
            return str(Path(self.config.model).resolve())
        from pdserve.model.tiny import ensure_builtin_tiny

        return str(ensure_builtin_tiny())

    def _emulated_model_dir(self) -> str:
        from pdserve.emulate.model_dir import make_emulated_dir
        from pdserve.model.tiny import ensure_builtin_tiny

        c = self.config
        model = c.model
        if not (model or c.model_config) and c.emulate_profile:  # the profiled checkpoint's
            import json

            model = json.loads(Path(c.emulate_profile).read_text()).get("model")
        tokenizer = c.tokenizer or model or str(ensure_builtin_tiny())
        out = make_emulated_dir(self._log_dir / "emulated-model", c.model_config, tokenizer,
                                model, {"hardware": c.emulate})  # fmt: skip
        return str(out.resolve())

    def _emulate_argv(self, role: str, name: str) -> list[str]:
        """A worker's emulation flags: the hardware its pool deals it (`costmodel.pools`:
        'h100', or per pool 'prefill=h100,decode=l40s', a '+' list dealt in order)."""
        c = self.config
        if not c.emulate:
            return []
        from pdserve.costmodel.pools import PoolHardware

        index = int(name[len(role) :]) if name[len(role) :].isdigit() else 0
        hw = PoolHardware.parse(c.emulate).for_worker(role, index)
        argv = ["--emulate", hw, "--time-scale", str(c.time_scale)]
        if c.emulate_profile:
            argv += ["--emulate-profile", c.emulate_profile]
        return argv

    def _worker_plan(self) -> list[tuple[str, str]]:
        c = self.config
        if c.mode == "colocated":
            return [(f"colocated{i}", "colocated") for i in range(c.colocated)]
        if c.mode != "disagg":
            raise ValueError(f"mode must be 'disagg' or 'colocated', got {c.mode!r}")
        plan = [(f"prefill{i}", "prefill") for i in range(c.prefill)]
        plan += [(f"decode{i}", "decode") for i in range(c.decode)]
        return plan

    def _spawn_redis(self) -> ManagedProcess:
        """The routers' shared store: a real redis-server (from the venv or PATH) on
        127.0.0.1, nothing persisted (leases and the flip lock are renewed state)."""
        binary = Path(sys.executable).parent / "redis-server"
        program = str(binary) if binary.exists() else "redis-server"
        argv = [
            sys.executable, "-m", "pdserve.rpc.exec_with_parent", program,
            "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self._log_dir),
        ]  # fmt: skip
        proc = self._spawn("redis", argv)
        proc.ready_text, proc.fixed_port = "Ready to accept connections", self.redis_port
        return proc

    def _resume_secret(self) -> Path:
        """One secret for every router replica's resume tokens (mode 0600)."""
        path = self._log_dir / "resume.secret"
        if not path.exists():
            import secrets

            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        return path

    def _make_certs(self) -> None:
        """A CA and one certificate per process (+ admin, for operators and tests)."""
        if self.tls_dir is None:
            return
        from pdserve.rpc.certs import make_dev_pki

        services = [("router", "router"), ("kvstore", "kvstore"), ("admin", "admin")]
        services.append(("worker", "worker"))  # a spare worker identity (tools, tests)
        services += [("worker", name) for name, _role in self._worker_plan()]
        make_dev_pki(self.tls_dir, services)

    def _tls_argv(self, name: str) -> list[str]:
        if self.tls_dir is None:
            return ["--insecure"]
        return ["--no-insecure", "--tls-dir", str(self.tls_dir), "--tls-name", name]

    def _pick_cpu(self) -> int | None:
        if not self.config.pin_cpus or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = sorted(os.sched_getaffinity(0))
        cpu = cpus[self._next_cpu % len(cpus)]
        self._next_cpu += 1
        return cpu

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PDSERVE_LOG_FORMAT", self.config.log_format)
        env.update(self.config.env)
        return env

    def _spawn(self, name: str, argv: Sequence[str], cpu: int | None = None) -> ManagedProcess:
        log_path = self._log_dir / f"{name}.log"
        if log_path.exists():  # a restart: keep the old log, start a fresh one
            log_path.rename(log_path.with_suffix(f".{int(time.time() * 1000)}.log"))
        env = self._env()
        if cpu is not None:
            env["PDSERVE_THREADS"] = "1"
        proc = ManagedProcess(name, list(argv), env, log_path, cpu=cpu)
        proc.start()
        self.processes[name] = proc
        return proc

    def _kvstore_argv(self, port: int = 0) -> list[str]:
        argv = [
            sys.executable, "-m", "pdserve.kvstore", "--port", str(port),
            "--capacity-bytes", str(self._wire_bytes(self.config.kvstore_capacity_bytes)),
            *self._tls_argv("kvstore"),
        ]  # fmt: skip
        if self.config.kvstore_disk_dir:
            argv += [
                "--disk-dir", self.config.kvstore_disk_dir,
                "--disk-bytes", str(self._wire_bytes(self.config.kvstore_disk_bytes)),
            ]  # fmt: skip
        return argv

    def _wire_bytes(self, cap: int) -> int:
        """A kvstore budget in wire bytes: an emulated cluster's blocks are a few bytes each,
        and the store holds as many of them as the modelled budget holds modelled blocks."""
        if not self.config.emulate:
            return cap
        from pdserve.emulate.model_dir import wire_ratio

        return max(1 << 16, int(cap * wire_ratio(self.model_dir)))

    def _router_argv(
        self, port: int | None = None, internal_port: int = 0, http_port: int | None = None
    ) -> list[str]:
        """A router replica's command (`http_port` None: no HTTP API)."""
        port = self.config.port if port is None else port
        argv = [
            sys.executable, *self.config.router_python_args, "-m", "pdserve.router",
            "--port", str(port),
            "--internal-port", str(internal_port), "--model", self.model_dir,
            "--resume-secret-file", str(self._resume_secret()),
            *self._tls_argv("router"),
        ]  # fmt: skip
        if self.kvstore_port is not None:
            argv += ["--kvstore-addr", f"127.0.0.1:{self.kvstore_port}"]
        if self.shared_redis_url:
            argv += ["--redis-url", self.shared_redis_url]
        if self.config.policy:
            argv += ["--policy", self.config.policy]
        if http_port is not None:
            argv += ["--http-port", str(http_port)]
        return argv + self._modelled(self.config.router_args, "router")

    def _worker_argv(self, role: str, name: str) -> list[str]:
        return [
            sys.executable, "-m", "pdserve.worker", "--port", "0", "--role", role,
            "--model", self.model_dir, "--router-addr", ",".join(self.internal_addrs),
            *self._tls_argv(name), *self._emulate_argv(role, name),
            *self._modelled(self.config.worker_args, "worker"),
        ]  # fmt: skip

    def _modelled(self, args: list[str], service: str) -> list[str]:
        """A service's extra flags; on an emulated cluster with its control-plane timers in
        modelled seconds (pdserve.emulate.timers)."""
        if not self.config.emulate:
            return list(args)
        from pdserve.emulate import timers

        if service == "router":
            from pdserve.router.settings import RouterSettings as cls

            table = timers.ROUTER_TIMERS
        else:
            from pdserve.worker.settings import WorkerSettings as cls

            table = timers.WORKER_TIMERS
        return timers.modelled_timer_args(cls, table, args, self.config.time_scale)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def registered_instances(addr: str, timeout: float, api_key: str | None = None) -> int:
    """How many serving instances the router at `addr` lists (a sync Status call)."""
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    with grpc.insecure_channel(addr) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(
            router_pb2.StatusRequest(), timeout=timeout, metadata=metadata
        )
    return sum(1 for inst in status.instances if inst.state == "serving")
