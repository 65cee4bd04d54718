"""deploy/k8s agrees with the Kubernetes schemas (kubernetes-validate, offline, strict) and
with the code: every container runs a module that exists with flags and env its own settings
accept, probes and Services point at ports the container listens on, workers register with
the control-plane Service and advertise their pod IP, every service finds its mTLS
certificate in the `pdserve-tls` Secret (the files `pdserve certs make` writes) and probes its
port the way that port answers (gRPC on the router's public port, the admin certificate on an
internal one), each worker pool has an HPA, the NetworkPolicies select pods that exist."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from pdserve.config import flat_fields

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"
SETTINGS = {
    "pdserve.router": "pdserve.router.settings:RouterSettings",
    "pdserve.worker": "pdserve.worker.settings:WorkerSettings",
    "pdserve.kvstore": "pdserve.kvstore.settings:KVStoreSettings",
}
COMPONENT = "app.kubernetes.io/component"


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> list[dict]:
    out = []
    for name in kustomization["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return out


def _by_kind(objects, kind) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _settings(module: str):
    mod, cls = SETTINGS[module].split(":")
    return getattr(importlib.import_module(mod), cls)


def test_every_manifest_is_listed_and_valid(kustomization, objects):
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "kustomization.yaml and the files disagree"
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any error
    for f in kustomization.get("secretGenerator", []):
        if f["name"] == "pdserve-tls":  # made by the user: `pdserve certs make deploy/k8s/certs`
            continue
        for spec in f["files"]:
            source = K8S / spec.split("=", 1)[-1]
            if source.suffix == ".json":  # the API keys
                keys = json.loads(source.read_text())["keys"]
                assert keys and all(k["key"] and k["name"] for k in keys)
            else:  # the resume secret: what the routers' --resume-secret-file accepts
                assert len(source.read_bytes().strip()) >= 16, source


def test_validation_catches_a_broken_manifest(objects):
    """The schema check is real: a misspelt field fails."""
    bad = json.loads(json.dumps(_by_kind(objects, "Deployment")["pdserve-router"]))
    bad["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_four_services_and_their_commands(objects, monkeypatch):
    from pdserve.config import load_settings

    monkeypatch.delenv("PDSERVE_INSECURE", raising=False)  # (the test session's plaintext)
    deployments = _pdserve_deployments(objects)
    components = {
        d["spec"]["template"]["metadata"]["labels"][COMPONENT] for d in deployments.values()
    }
    assert components == {"router", "prefill", "decode", "kvstore"}
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        cmd = [str(c) for c in container["command"]]
        assert cmd[:2] == ["python", "-m"] and cmd[2] in SETTINGS, f"{name}: {cmd}"
        cls = _settings(cmd[2])
        for env in container.get("env", []):
            value = env.get("value", "10.0.0.1")  # fieldRef: the pod IP
            monkeypatch.setenv(env["name"], value)
            field = env["name"].removeprefix("PDSERVE_").lower()
            assert field in flat_fields(cls), f"{name}: {env['name']} is no setting"
        settings = load_settings(cls, cmd[3:], prog=name, exit_on_error=False)
        for env in container.get("env", []):
            monkeypatch.delenv(env["name"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == settings.port and settings.host == "0.0.0.0", name
        assert ports["metrics"] == 9090
        for probe in ("readinessProbe", "livenessProbe"):
            if cmd[2] == "pdserve.router":  # the public port: plaintext, the kubelet's probe
                assert container[probe]["grpc"]["port"] == settings.port, f"{name} {probe}"
            else:  # an mTLS port: the probe presents the admin certificate (PDSERVE_TLS_DIR)
                probe_cmd = container[probe]["exec"]["command"]
                assert probe_cmd == [
                    "python", "-m", "pdserve.rpc.health_probe", f"127.0.0.1:{settings.port}"
                ], f"{name} {probe}"  # fmt: skip
        _check_tls(objects, dep, container, settings, cmd[2])
        assert container["resources"]["requests"]["cpu"], name
        if cmd[2] == "pdserve.router":
            assert ports["http"] == settings.http_port
            assert settings.keys.api_keys_file == "/etc/pdserve/keys.json"
            kv_host, kv_port = settings.kvstore_addr.split(":")
            kvstore = _by_kind(objects, "Service")[kv_host]
            assert kvstore["spec"]["ports"][0]["port"] == int(kv_port)
        if cmd[2] == "pdserve.router":
            redis = settings.replicas.redis_url.removeprefix("redis://").split("/")[0]
            host, port = redis.split(":")
            svc = _by_kind(objects, "Service")[host]
            assert svc["spec"]["ports"][0]["port"] == int(port)
            assert ports["internal"] == settings.internal_port
            assert settings.replicas.resume_secret_file
        if cmd[2] == "pdserve.worker":
            assert settings.role == labels[COMPONENT]
            host, port = settings.router_addr.split(":")
            control = _by_kind(objects, "Service")[host]
            assert control["spec"]["type"] == "ClusterIP"
            assert control["spec"]["clusterIP"] == "None"  # headless: every router pod
            assert settings.router_discovery == "dns"
            assert control["spec"]["selector"][COMPONENT] == "router"
            assert control["spec"]["ports"][0]["port"] == int(port)
            assert control["spec"]["ports"][0]["targetPort"] == "internal"
            env = {e["name"]: e for e in container["env"]}
            ref = env["PDSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "status.podIP"


TLS_NAMES = {"pdserve.router": "router", "pdserve.worker": "worker", "pdserve.kvstore": "kvstore"}


def _tls_secret_files(kustomization: dict) -> set[str]:
    (gen,) = [g for g in kustomization["secretGenerator"] if g["name"] == "pdserve-tls"]
    return {Path(f.split("=", 1)[-1]).name for f in gen["files"]}


def _check_tls(objects, dep: dict, container: dict, settings, module: str) -> None:
    """The service's TLS directory is the pdserve-tls Secret, which holds its certificate."""
    assert not settings.insecure, module
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[settings.tls_dir]]
    assert volume["secret"]["secretName"] == "pdserve-tls"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    name = settings.tls_name or TLS_NAMES[module]
    files = _tls_secret_files(kustomization)
    assert {"ca.crt", f"{name}.crt", f"{name}.key", "admin.crt", "admin.key"} <= files


def test_the_tls_secret_holds_what_certs_make_writes(kustomization, tmp_path):
    """Every file the Secret lists is one `pdserve certs make` writes (the CA's key stays out)."""
    from pdserve.rpc.certs import make_dev_pki

    make_dev_pki(tmp_path)
    written = {p.name for p in tmp_path.iterdir()}
    assert _tls_secret_files(kustomization) == written - {"ca.key"}


def _pdserve_deployments(objects) -> dict[str, dict]:
    """The Deployments running the pdserve image (not the routers' Redis)."""
    return {
        n: d
        for n, d in _by_kind(objects, "Deployment").items()
        if d["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve"
    }


def test_router_replicas_with_a_disruption_budget_and_redis(objects):
    """At least 2 router pods, rolled one at a time, a PDB keeping one, and a Redis."""
    router = _by_kind(objects, "Deployment")["pdserve-router"]
    assert router["spec"]["replicas"] >= 2
    assert router["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (pdb,) = _by_kind(objects, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    redis = _by_kind(objects, "Deployment")["pdserve-redis"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:")


def test_services_target_named_container_ports(objects):
    deployments = _by_kind(objects, "Deployment")
    for name, svc in _by_kind(objects, "Service").items():
        pods = [
            d for d in deployments.values()
            if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(pods) == 1, f"service {name} selects {len(pods)} deployments"
        (container,) = pods[0]["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, f"{name}: no container port {port['targetPort']}"
    public = _by_kind(objects, "Service")["pdserve-api"]
    assert public["spec"]["type"] == "LoadBalancer"
    assert {p["targetPort"] for p in public["spec"]["ports"]} == {"grpc", "http"}


def test_an_hpa_per_worker_pool(objects):
    deployments = _by_kind(objects, "Deployment")
    targets = {
        h["spec"]["scaleTargetRef"]["name"]
        for h in _by_kind(objects, "HorizontalPodAutoscaler").values()
    }
    pools = {
        n
        for n, d in deployments.items()
        if d["spec"]["template"]["metadata"]["labels"][COMPONENT] in ("prefill", "decode")
    }
    assert targets == pools


def test_network_policies_select_existing_pods(objects):
    components = {
        d["spec"]["template"]["metadata"]["labels"][COMPONENT]
        for d in _by_kind(objects, "Deployment").values()
    }
    policies = _by_kind(objects, "NetworkPolicy")
    assert policies["pdserve-default-deny"]["spec"]["podSelector"] == {}
    for name, pol in policies.items():
        sel = pol["spec"]["podSelector"]
        chosen = set(components)
        if COMPONENT in sel.get("matchLabels", {}):
            chosen = {sel["matchLabels"][COMPONENT]}
        for expr in sel.get("matchExpressions", []):
            chosen &= set(expr["values"])
        assert chosen, f"{name} selects no pod"
        for rule in pol["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                for expr in peer.get("podSelector", {}).get("matchExpressions", []):
                    assert set(expr["values"]) <= components, f"{name}: unknown {expr}"
