"""`pdserve up`'s banner: commands that work as printed, the random-weights warning for the
built-in model, whether the API is open, the HTTP URL."""

from __future__ import annotations

import os
import shlex
from types import SimpleNamespace

from pdserve.cli.up import banner_lines, pdserve_command


def _cluster(http: bool = True):
    proc = SimpleNamespace(popen=SimpleNamespace(pid=123), port=50051)
    return SimpleNamespace(
        processes={"router": proc},
        model_dir="/m",
        addr="127.0.0.1:50051",
        internal_addr="127.0.0.1:50061",
        tls_dir="/tmp/pdserve-certs",
        http_url="http://127.0.0.1:8000/v1" if http else None,
    )


def test_builtin_model_open_api():
    text = "\n".join(banner_lines(_cluster(), False, [], None))
    assert "RANDOM weights" in text and "gibberish" in text
    assert "the API is open" in text
    assert "OpenAI-compatible HTTP API on http://127.0.0.1:8000/v1" in text
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in text
    assert "--api-key" not in text
    assert "internal plane mutual TLS, certificates in /tmp/pdserve-certs" in text


def test_keys_and_own_model():
    text = "\n".join(banner_lines(_cluster(http=False), True, ["k"], None, restart=True))
    assert "RANDOM" not in text and "curl" not in text
    assert "API keys required" in text and "chat --addr 127.0.0.1:50051 --api-key KEY" in text
    assert "restarted" in text


def test_commands_work_as_printed():
    argv = shlex.split(pdserve_command())
    assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK)
    line = next(x for x in banner_lines(_cluster(), False, [], None) if "try:" in x)
    assert line.split("try:")[1].split()[0] == argv[0]


def test_http_port_defaults():
    from pdserve.cli.main import build_parser
    from pdserve.cli.up import _http_port

    parse = build_parser().parse_args
    assert _http_port(parse(["up"])) == 8000
    assert _http_port(parse(["up", "--port", "0"])) == 0  # side-by-side clusters never collide
    assert _http_port(parse(["up", "--port", "0", "--http-port", "9000"])) == 9000


def test_kvstore_on_by_default():
    """`pdserve up` starts the system the README describes, kvstore included."""
    from pdserve.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["up"]).kvstore is True
    assert parse(["up", "--no-kvstore"]).kvstore is False
    assert parse(["up", "--kvstore"]).kvstore is True


def test_bench_arms_choose_the_kvstore():
    """Benchmark arms keep their meaning: no kvstore unless the arm asks for it."""
    from pdserve.bench.cluster import UpProcess

    assert "--no-kvstore" in UpProcess([]).cmd
    cmd = UpProcess(["--kvstore"]).cmd
    assert cmd.index("--kvstore") > cmd.index("--no-kvstore")  # the arm's flag wins
    from pdserve.cli.main import build_parser

    assert build_parser().parse_args(cmd[cmd.index("up") :]).kvstore is True


def test_router_replicas_in_the_banner():
    cluster = _cluster()
    cluster.addrs = ["127.0.0.1:50051", "127.0.0.1:50052"]
    cluster.internal_addrs = ["127.0.0.1:50061", "127.0.0.1:50062"]
    cluster.http_urls = ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    cluster.shared_redis_url = "redis://127.0.0.1:6390/0"
    text = "\n".join(banner_lines(cluster, True, [], None))
    assert "2 router replicas, gRPC API on 127.0.0.1:50051, 127.0.0.1:50052" in text
    assert "share Redis at redis://127.0.0.1:6390/0" in text
    assert "HTTP API on http://127.0.0.1:8000/v1, http://127.0.0.1:8001/v1" in text
    assert "generate --addr 127.0.0.1:50051,127.0.0.1:50052" in text  # the SDK takes both


def test_routers_flag():
    from pdserve.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["up"]).routers == 1
    assert parse(["up", "--routers", "3", "--redis-url", "redis://h:1/0"]).routers == 3
