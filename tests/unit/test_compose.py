"""compose.yaml and the Dockerfile agree with the code: every command runs a module that
exists with flags its own parser accepts, ports line up, workers scale (no host ports, no
fixed addresses), the model is a volume, healthchecks use the shared probe."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from pdserve.config import flat_fields

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("prefill", "decode")
# `python -m <module>` -> the settings class its entry point parses flags with
SETTINGS = {
    "pdserve.router": "pdserve.router.settings:RouterSettings",
    "pdserve.worker": "pdserve.worker.settings:WorkerSettings",
    "pdserve.kvstore": "pdserve.kvstore.settings:KVStoreSettings",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _command(svc: dict) -> list[str]:
    cmd = svc["command"]
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def _module_and_args(svc: dict) -> tuple[str, list[str]]:
    cmd = _command(svc)
    assert cmd[:2] == ["python", "-m"], f"not a `python -m` command: {cmd}"
    return cmd[2], cmd[3:]


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _settings_class(module: str):
    mod, cls = SETTINGS[module].split(":")
    return getattr(importlib.import_module(mod), cls)


def _published(ports: list) -> list[int]:
    """Container-side ports of a `ports:` list ("HOST:CONTAINER" or "CONTAINER")."""
    return [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in ports]


def _server_services(services: dict) -> list[str]:
    """pdserve's own long-running services (not the one-shot jobs, not Redis)."""
    return [n for n in services if not n.endswith("-init") and n not in NOT_PDSERVE]


NOT_PDSERVE = ("redis",)  # the router replicas' shared store: the official image
ROUTERS = ("router", "router-2")


def test_expected_services(services):
    assert {"router", "prefill", "decode", "kvstore", "model-init"} <= set(services)


def test_two_router_replicas_share_redis(services):
    """Two routers with the same command (any takes any request), each on its own host
    ports, pointed at the redis service; Redis is internal only."""
    a, b = (services[n] for n in ROUTERS)
    assert _command(a) == _command(b)
    assert set(_published(a["ports"])) == set(_published(b["ports"]))
    host_ports = [str(p).rsplit(":", 1)[0] for svc in (a, b) for p in svc["ports"]]
    assert len(set(host_ports)) == 4, host_ports  # no clash on the host
    for svc in (a, b):
        assert svc["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    redis = services["redis"]
    assert redis["image"].startswith("redis:") and redis["networks"] == ["internal"]
    assert "6379" in [str(p) for p in redis["expose"]] and not redis.get("ports")


def test_commands_run_existing_modules_with_known_flags(services, monkeypatch):
    from pdserve.config import load_settings

    for name in _server_services(services):
        svc = services[name]
        module, args = _module_and_args(svc)
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert module in SETTINGS, f"{name}: unexpected module {module}"
        cls = _settings_class(module)
        # environment the service sets must be valid settings too (PDSERVE_<FIELD>)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        for key, value in env.items():
            if "${" in value:  # compose interpolation: use its default
                value = re.sub(r"\$\{[^:}]+:-([^}]*)\}", r"\1", value)
            monkeypatch.setenv(key, value)
        settings = load_settings(cls, args, prog=name, exit_on_error=False)
        for key in env:
            field = key.removeprefix("PDSERVE_").lower()
            if field not in ("log_format", "log_level"):
                assert field in flat_fields(cls), f"{name}: {key} is no setting of {cls}"
        if module == "pdserve.worker":
            assert settings.role == name, f"{name} starts in role {settings.role}"
        for key in env:
            monkeypatch.delenv(key)


def test_ports_match_expose_and_healthcheck(services):
    for name in _server_services(services):
        svc = services[name]
        _module, args = _module_and_args(svc)
        port = int(_flag(args, "--port"))
        exposed = [int(p) for p in svc.get("expose", [])] + _published(svc.get("ports", []))
        assert port in exposed, f"{name}: --port {port} not in expose/ports {exposed}"
        test = [str(t) for t in svc["healthcheck"]["test"]]
        assert test[:4] == ["CMD", "python", "-m", "pdserve.rpc.health_probe"], test
        assert importlib.util.find_spec("pdserve.rpc.health_probe") is not None
        assert test[4] == f"127.0.0.1:{port}", f"{name}: healthcheck probes {test[4]}"


def test_workers_scale(services):
    router_port = int(_flag(_module_and_args(services["router"])[1], "--internal-port"))
    for name in WORKERS:
        svc = services[name]
        _module, args = _module_and_args(svc)
        assert not svc.get("ports"), f"{name} publishes host ports: --scale would clash"
        assert "container_name" not in svc, f"{name} has a fixed container name"
        assert _flag(args, "--router-addr") == ",".join(f"{r}:{router_port}" for r in ROUTERS)
        assert _flag(args, "--advertise-host") is None, f"{name} advertises a fixed address"
        assert _flag(args, "--host") == "0.0.0.0"
        assert _flag(args, "--instance-id") is None, f"{name} has a fixed instance id"


def test_no_hard_coded_instance_addresses(services):
    ip = re.compile(r"\b\d{1,3}(\.\d{1,3}){3}\b")
    for name in _server_services(services):
        _module, args = _module_and_args(services[name])
        for a in args:
            if a in ("0.0.0.0",):  # a bind address, not an instance address
                continue
            assert not ip.search(a), f"{name}: hard-coded address {a!r}"
            for part in a.split(","):  # (several routers: a list)
                _check_service_address(services, name, part)


def _check_service_address(services: dict, name: str, a: str) -> None:
    """A HOST:PORT argument must name a compose service and one of its ports."""
    m = re.fullmatch(r"([a-z][a-z0-9-]*):(\d+)", a)
    if not m:
        return
    host, port = m.group(1), int(m.group(2))
    assert host in services, f"{name}: {a} names no service"
    target = _module_and_args(services[host])[1]
    ports = {int(_flag(target, f) or 0) for f in ("--port", "--internal-port")}
    assert port in ports, f"{name}: {a} wrong port"


def test_two_planes_only_the_public_port_is_published(compose, services):
    """Internal traffic on an `internal: true` network; only the router joins the public one
    and publishes exactly its public --port; workers reach its --internal-port."""
    nets = compose["networks"]
    assert nets["internal"].get("internal") is True
    router_args = _module_and_args(services["router"])[1]
    public, internal = int(_flag(router_args, "--port")), int(_flag(router_args, "--internal-port"))
    http = int(_flag(router_args, "--http-port"))  # the OpenAI-compatible HTTP API
    assert sorted(_published(services["router"]["ports"])) == sorted([public, http])
    assert internal not in _published(services["router"]["ports"])
    assert internal != public and internal in [int(p) for p in services["router"]["expose"]]
    for name in _server_services(services):
        svc = services[name]
        assert "internal" in svc["networks"], f"{name} is not on the internal network"
        if name not in ROUTERS:
            assert svc["networks"] == ["internal"], f"{name} joins {svc['networks']}"
            assert not svc.get("ports"), f"{name} publishes ports"


def test_services_run_mutual_tls_with_certificates_from_certs_init(services):
    from pdserve.cli.main import build_parser

    cmd = _command(services["certs-init"])
    assert cmd[:3] == ["pdserve", "certs", "make"]
    build_parser().parse_args(cmd[1:])
    target = cmd[3]
    for name in _server_services(services):
        svc = services[name]
        assert svc["environment"]["PDSERVE_TLS_DIR"] == target, f"{name}: no TLS dir"
        assert any(str(v).split(":")[-1] == target for v in svc["volumes"]), name
        assert "--insecure" not in _command(svc), f"{name} runs --insecure"
        assert services[name]["depends_on"]["certs-init"]["condition"] == (
            "service_completed_successfully"
        )


def test_model_directory_is_a_volume(services):
    for name, svc in services.items():
        cmd = _command(svc)
        model = _flag(cmd, "--model") if "--model" in " ".join(cmd) else None
        if name == "model-init":
            model = cmd[cmd.index("make-tiny") + 1]
        if model is None:
            continue
        mounts = [str(v).split(":") for v in svc.get("volumes", [])]
        assert any(m[-1] == model or (len(m) > 2 and m[-2] == model) for m in mounts), (
            f"{name}: {model} is not a mounted volume ({svc.get('volumes')})"
        )


def test_model_init_command_parses():
    """compose's model-init: `pdserve model make-tiny /model --if-missing`."""
    from pdserve.cli.main import build_parser

    args = build_parser().parse_args(["model", "make-tiny", "/model", "--if-missing"])
    assert args.if_missing is True


def test_make_tiny_if_missing_keeps_an_existing_checkpoint(tmp_path):
    from pdserve.cli.main import main

    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a checkpoint someone mounted
    assert main(["model", "make-tiny", str(target), "--if-missing"]) == 0
    assert (target / "config.json").read_text() == "{}"
    assert not (target / "model.safetensors").exists()


def test_dockerfile_installs_the_service_packages(services):
    docker = (ROOT / "Dockerfile").read_text()
    installs = " ".join(
        line for line in docker.replace("\\\n", " ").splitlines() if "pip install" in line
    )
    for name in _server_services(services):
        pkg = "router" if name in ROUTERS else name  # services/<service>/ deploys it
        assert (ROOT / "services" / pkg / "pyproject.toml").exists()
        assert f"./services/{pkg}" in installs, f"Dockerfile does not install services/{pkg}"
    # the root package (the `pdserve` CLI of model-init) with the extras the workers need
    m = re.search(r"pip install '\.\[([a-z,]+)\]'", installs)
    assert m, "Dockerfile does not install the root package"
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in m.group(1).split(","):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"no extra [{extra}]"
    assert {"engine", "ucx"} <= set(m.group(1).split(","))
    for copied in re.findall(r"^COPY (\S+)", docker, re.M):
        assert (ROOT / copied).exists(), f"Dockerfile copies missing {copied}"


def test_long_running_services_restart_and_the_init_job_does_not(services):
    """Supervision under Docker Compose: a service that dies is restarted (Docker backs off);
    the one-shot init jobs (model-init, certs-init) are not."""
    for name, svc in services.items():
        expected = "no" if name.endswith("-init") else "unless-stopped"
        assert svc.get("restart") == expected, f"{name}: restart is {svc.get('restart')!r}"
