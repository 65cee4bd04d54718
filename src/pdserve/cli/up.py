"""`pdserve up`: every service as local processes on 127.0.0.1, in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

DEFAULT_HTTP_PORT = 8000


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start kvstore + router + workers as local processes",
        description="Start a pdserve deployment on 127.0.0.1 and keep it in the foreground; "
        "Ctrl-C or SIGTERM stops all of it.",
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disagg)")
    p.add_argument("--colocated", type=int, default=2, help="colocated workers (colocated)")
    p.add_argument(
        "--kvstore",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the host-memory KV store, part of the system: prefix KV reuse across "
        "workers and turns (default: on; --no-kvstore runs without it)",
    )
    p.add_argument("--kvstore-capacity-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--kvstore-disk-dir",
        default=None,
        help="the kvstore's disk tier: blocks evicted from RAM are kept as files here (mode "
        "0600), verified on read, and found again after a restart (default: RAM only)",
    )
    p.add_argument(
        "--kvstore-disk-bytes",
        type=int,
        default=16 << 30,
        help="disk tier budget in block bytes (with --kvstore-disk-dir)",
    )
    p.add_argument(
        "--port", type=int, default=50051, help="router port (0 = any free port; replica i: +i)"
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas, active-active: any takes any request; workers register with "
        "each; with 2 or more a Redis server is started for per-key limits and the flip "
        "leader (default: 1)",
    )
    p.add_argument(
        "--redis-url",
        help="use this Redis (redis://HOST:PORT/DB) as the replicas' shared store instead of "
        "starting one",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="OpenAI-compatible HTTP API port (0 = any free port; default 8000, or any free "
        "port with --port 0)",
    )
    p.add_argument("--no-http", action="store_true", help="no HTTP API (gRPC only)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this API key (repeatable); default: an open API",
    )
    p.add_argument(
        "--api-keys-file", help="JSON keys file with per-key limits (see docs/HTTP_API.md)"
    )
    p.add_argument("--pin-cpus", action="store_true", help="pin each worker to its own core")
    p.add_argument("--policy", help="router placement policy")
    p.add_argument("--log-dir", help="where each process writes its log (default: a temp dir)")
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for every worker, e.g. --worker-arg=--num-blocks=512 (repeatable)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the router, e.g. --router-arg=--flip-enabled (repeatable)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS on the internal plane (LOCAL DEBUGGING ONLY: anyone on this host can "
        "join the cluster). Default: mutual TLS with certificates made in the log dir",
    )
    p.add_argument("--tls-dir", help="use (and complete) the certificates in this directory")
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a service that dies, with back-off (default: on)",
    )
    p.add_argument(
        "--restart-backoff-s",
        type=float,
        default=0.5,
        help="delay before the first restart; it doubles with each consecutive crash",
    )
    p.add_argument(
        "--restart-backoff-max-s", type=float, default=30.0, help="the longest restart delay"
    )
    p.add_argument(
        "--restart-healthy-s",
        type=float,
        default=30.0,
        help="a service up this long counts as healthy again: the back-off starts over",
    )
    g = p.add_argument_group("emulated engine (pdserve.emulate): the serving stack is real, "
                             "only each step's forward pass is a modelled duration")  # fmt: skip
    g.add_argument("--emulate", metavar="HW", help="accelerator to emulate: h100, h200, a100, "
                   "l40s, mi300x (NAMExTP: tensor parallel); per pool: prefill=h100,decode=l40s "
                   "(a pool's HW+HW list is dealt to its workers in order)")  # fmt: skip
    g.add_argument("--model-config", help="emulated model: llama3-8b, llama3-70b, qwen2.5-32b, "
                   "a config.json or a directory (default: --model's)")  # fmt: skip
    g.add_argument("--profile", help="`pdserve profile` JSON: its measured costs, not a roofline")
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per modelled second (> 1 fits more workers on few cores)",
    )
    g.add_argument("--tokenizer", help="tokenizer directory of the emulated model (default: "
                   "--model's, else the built-in tiny model's)")  # fmt: skip
    p.set_defaults(func=run)


def _emulate_error(spec: str, mode: str) -> str:
    """Why `--emulate spec` cannot serve a cluster of `mode` ('' when it can)."""
    from pdserve.costmodel.pools import PoolHardware

    try:
        hw = PoolHardware.parse(spec)
    except ValueError as exc:
        return str(exc)
    roles = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    missing = [r for r in roles if not hw.has(r)]
    return f"no hardware for the {', '.join(missing)} pool" if missing else ""


def run(args: argparse.Namespace) -> int:
    from pdserve.launcher import Cluster, ClusterConfig
    from pdserve.supervisor import RestartPolicy, Supervisor

    for name in ("prefill", "decode", "colocated", "routers"):
        if getattr(args, name) < 1:
            print(f"pdserve up: --{name} must be at least 1", file=sys.stderr)
            return 2
    router_args = list(args.router_arg)
    for key in args.api_key:
        router_args += ["--api-key", key]
    if args.api_keys_file:
        router_args += ["--api-keys-file", args.api_keys_file]
    try:
        policy = RestartPolicy(
            initial_s=args.restart_backoff_s,
            max_s=args.restart_backoff_max_s,
            healthy_s=args.restart_healthy_s,
        )
    except ValueError as exc:
        print(f"pdserve up: restart back-off: {exc}", file=sys.stderr)
        return 2
    config = ClusterConfig(
        model=args.model,
        mode=args.mode,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        kvstore=args.kvstore,
        kvstore_capacity_bytes=args.kvstore_capacity_bytes,
        kvstore_disk_dir=args.kvstore_disk_dir,
        kvstore_disk_bytes=args.kvstore_disk_bytes,
        port=args.port,
        routers=args.routers,
        redis_url=args.redis_url,
        pin_cpus=args.pin_cpus,
        policy=args.policy,
        log_dir=args.log_dir,
        worker_args=list(args.worker_arg),
        router_args=router_args,
        http_port=None if args.no_http else _http_port(args),
        api_key=args.api_key[0] if args.api_key else _first_file_key(args.api_keys_file),
        tls=not args.insecure,
        tls_dir=args.tls_dir,
        emulate=args.emulate,
        model_config=args.model_config,
        emulate_profile=args.profile,
        time_scale=args.time_scale,
        tokenizer=args.tokenizer,
    )
    if (args.model_config or args.profile or args.tokenizer) and not args.emulate:
        print("pdserve up: --model-config/--profile/--tokenizer need --emulate HW", file=sys.stderr)
        return 2
    if args.emulate and not (args.model_config or args.model or args.profile):
        print("pdserve up: --emulate needs --model-config (or --model)", file=sys.stderr)
        return 2
    if args.time_scale <= 0:
        print("pdserve up: --time-scale must be > 0", file=sys.stderr)
        return 2
    if args.emulate:
        error = _emulate_error(args.emulate, args.mode)
        if error:
            print(f"pdserve up: --emulate: {error}", file=sys.stderr)
            return 2
    if args.insecure:
        from pdserve.rpc.tls import INSECURE_WARNING

        bar = "!" * 78
        print(f"{bar}\npdserve up: {INSECURE_WARNING}\n{bar}", file=sys.stderr, flush=True)
    # A plain flag: a signal handler must not take locks (threading.Event.set does, and a
    # second signal arriving inside it deadlocks the launcher).
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_signals.append(signum))

    cluster = Cluster(config)
    print(f"pdserve: starting ({args.mode}); logs in {cluster.log_dir}", flush=True)
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: failed to start: {exc}", file=sys.stderr)
        return 1
    supervisor = Supervisor(
        cluster, policy, notify=lambda msg: print(f"pdserve: {msg}", flush=True)
    )
    try:
        _print_banner(cluster, args)
        while not stop_signals:
            time.sleep(0.2)  # interrupted by a signal; the handler only appends to a list
            if args.restart:
                supervisor.tick()
                continue
            for name, proc in cluster.processes.items():
                if not proc.alive and name in (*cluster.router_names(), "kvstore", "redis"):
                    print(f"pdserve: {name} exited (--no-restart); stopping", file=sys.stderr)
                    stop_signals.append(0)
    finally:
        print("pdserve: stopping", flush=True)
        cluster.stop()
    return 0


def _http_port(args: argparse.Namespace) -> int:
    """--http-port, else 8000; with --port 0 (tests, benchmarks) a free port too, so that
    clusters started side by side never collide on 8000."""
    if args.http_port is not None:
        return args.http_port
    return 0 if args.port == 0 else DEFAULT_HTTP_PORT


def _first_file_key(path: str | None) -> str | None:
    """A key from the keys file, for the launcher's own Status polls."""
    if not path:
        return None
    from pdserve.router.frontdoor.auth import read_keys_file

    try:
        entries = read_keys_file(Path(path))
    except ValueError:
        return None  # the router reports the problem
    return str(entries[0].get("key")) if entries else None


def pdserve_command() -> str:
    """How to run `pdserve` so that the printed line works as is: the console script next to
    this Python when there is one (a venv's bin/), else `python -m pdserve.cli.main`."""
    script = Path(sys.executable).parent / "pdserve"
    if script.exists():
        return str(script)
    return f"{sys.executable} -m pdserve.cli.main"


def banner_lines(
    cluster,
    model_given: bool,
    keys: list[str],
    keys_file: str | None,
    restart: bool = False,
) -> list[str]:
    procs = ", ".join(
        f"{n} (pid {p.popen.pid}, port {p.port})" for n, p in cluster.processes.items()
    )
    cmd = pdserve_command()
    lines = [f"pdserve: model {cluster.model_dir}"]
    if not model_given:
        lines.append(
            "pdserve: this is the built-in tiny model with RANDOM weights: its replies are "
            "gibberish; start with --model DIR for a real checkpoint"
        )
    lines.append(f"pdserve: processes: {procs}")
    addrs = getattr(cluster, "addrs", None) or [cluster.addr]
    if len(addrs) > 1:
        lines.append(
            f"pdserve: {len(addrs)} router replicas, gRPC API on {', '.join(addrs)} "
            f"(internal plane: {', '.join(cluster.internal_addrs)}); any takes any request"
        )
        if getattr(cluster, "shared_redis_url", None):
            lines.append(f"pdserve: the replicas share Redis at {cluster.shared_redis_url}")
    else:
        lines.append(
            f"pdserve: gRPC API on {cluster.addr} (internal plane: {cluster.internal_addr})"
        )
    tls = cluster.tls_dir
    lines.append(
        f"pdserve: internal plane {'mutual TLS, certificates in ' + str(tls) if tls else 'INSECURE'}"
    )
    urls = getattr(cluster, "http_urls", None) or ([cluster.http_url] if cluster.http_url else [])
    if urls:
        lines.append(f"pdserve: OpenAI-compatible HTTP API on {', '.join(urls)}")
    if keys or keys_file:
        lines.append("pdserve: API keys required (authorization: Bearer KEY)")
        key_flag = " --api-key KEY"
        curl_auth = " -H 'authorization: Bearer KEY'"
    else:
        lines.append("pdserve: no API key configured: the API is open to anyone who can reach it")
        key_flag = curl_auth = ""
    addr = ",".join(addrs)  # the SDK and the CLI take every replica, and move on if one dies
    lines += [
        f'  try:  {cmd} generate --addr {addr}{key_flag} --prompt "Hello" --max-tokens 16',
        f"        {cmd} chat --addr {addr}{key_flag}",
        f"        {cmd} status --addr {addr}{key_flag}",
    ]
    if cluster.http_url:
        body = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
        lines.append(
            f"        curl -s {cluster.http_url}/chat/completions{curl_auth} "
            f"-H 'content-type: application/json' -d '{body}'"
        )
    if sys.prefix != sys.base_prefix:  # a virtual environment: `pdserve` after activating it
        lines.append(f"  (or `source {sys.prefix}/bin/activate` and use plain `pdserve`)")
    if restart:  # supervision (`--restart`, when the launcher has it)
        lines.append("pdserve: a service that dies is restarted (--no-restart to stop instead)")
    lines.append("pdserve: Ctrl-C stops everything")
    return lines


def _print_banner(cluster, args: argparse.Namespace) -> None:
    from pdserve.rpc.ready import format_ready_line

    restart = bool(getattr(args, "restart", False))
    for line in banner_lines(cluster, bool(args.model), args.api_key, args.api_keys_file, restart):
        print(line)
    info = {
        "service": "cluster",
        "port": cluster.router_port,
        "internal_port": cluster.router_internal_port,
        "log_dir": str(cluster.log_dir),
        "tls_dir": str(cluster.tls_dir) if cluster.tls_dir else None,
    }
    if cluster.http_port:
        info["http_port"] = cluster.http_port
    info["routers"] = cluster.addrs
    print(format_ready_line(info), flush=True)
    print(f"PDSERVE_ROUTERS={','.join(cluster.addrs)}", flush=True)
