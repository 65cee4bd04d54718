"""`pdserve up`: every service as local processes on 127.0.0.1, in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start router + workers (+ kvstore) as local processes",
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
        default=False,
        help="start the host-memory KV store",
    )
    p.add_argument("--kvstore-capacity-bytes", type=int, default=1 << 30)
    p.add_argument("--port", type=int, default=50051, help="router port (0 = any free port)")
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.launcher import Cluster, ClusterConfig

    for name in ("prefill", "decode", "colocated"):
        if getattr(args, name) < 1:
            print(f"pdserve up: --{name} must be at least 1", file=sys.stderr)
            return 2
    config = ClusterConfig(
        model=args.model,
        mode=args.mode,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        kvstore=args.kvstore,
        kvstore_capacity_bytes=args.kvstore_capacity_bytes,
        port=args.port,
        pin_cpus=args.pin_cpus,
        policy=args.policy,
        log_dir=args.log_dir,
        worker_args=list(args.worker_arg),
        router_args=list(args.router_arg),
    )
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
    try:
        _print_banner(cluster)
        while not stop_signals:
            time.sleep(0.2)  # interrupted by a signal; the handler only appends to a list
            for name, proc in cluster.processes.items():
                if not proc.alive and name in ("router", "kvstore"):
                    print(f"pdserve: {name} exited; stopping", file=sys.stderr)
                    stop_signals.append(0)
    finally:
        print("pdserve: stopping", flush=True)
        cluster.stop()
    return 0


def _print_banner(cluster) -> None:
    from pdserve.rpc.ready import format_ready_line

    workers = ", ".join(
        f"{n} (pid {p.popen.pid}, port {p.port})" for n, p in cluster.processes.items()
    )
    print(f"pdserve: model {cluster.model_dir}")
    print(f"pdserve: processes: {workers}")
    print(f"pdserve: router listening on {cluster.addr}")
    print(f'  try:  pdserve generate --addr {cluster.addr} --prompt "Hello" --max-tokens 16')
    print(f"        pdserve chat --addr {cluster.addr}")
    print(f"        pdserve status --addr {cluster.addr}")
    print("pdserve: Ctrl-C stops everything")
    info = {"service": "cluster", "port": cluster.router_port, "log_dir": str(cluster.log_dir)}
    print(format_ready_line(info), flush=True)
