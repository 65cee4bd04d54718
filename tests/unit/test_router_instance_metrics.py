"""The router forgets a departed instance's per-instance Prometheus series (deregister or
expiry), and a role change replaces the old series instead of leaving it behind."""

from prometheus_client import CollectorRegistry

from pdserve.router.app import RouterApp
from pdserve.router.cluster.registry import ROLE_DECODE, ROLE_PREFILL
from pdserve.router.settings import RouterSettings
from pdserve.rpc.metrics import Metrics

GAUGE = "router_instance_inflight"


def _app():
    metrics = Metrics(CollectorRegistry())
    return RouterApp(RouterSettings(), metrics), metrics


def _series(metrics: Metrics) -> set[tuple[str, str]]:
    out = set()
    for family in metrics.registry.collect():
        if family.name == "pdserve_" + GAUGE:
            out |= {(s.labels["instance"], s.labels["role"]) for s in family.samples}
    return out


def _register(app, iid, role):
    return app.registry.register(iid, f"127.0.0.1:{5000 + len(iid)}", role, "fp", 16)


def test_deregister_removes_the_series():
    app, metrics = _app()
    _register(app, "p1", ROLE_PREFILL)
    _register(app, "d1", ROLE_DECODE)
    app.metrics.set_inflight("p1", "prefill", 2)
    app.metrics.set_inflight("d1", "decode", 3)
    assert metrics.value(GAUGE, {"instance": "d1", "role": "decode"}) == 3
    assert app.registry.deregister("d1")
    assert _series(metrics) == {("p1", "prefill")}
    assert metrics.value(GAUGE, {"instance": "d1", "role": "decode"}) is None


def test_expiry_removes_the_series():
    app, metrics = _app()
    inst = _register(app, "p1", ROLE_PREFILL)
    _register(app, "p2", ROLE_PREFILL)
    app.metrics.set_inflight("p1", "prefill", 1)
    app.metrics.set_inflight("p2", "prefill", 0)
    inst.last_heartbeat -= 10 * app.registry.heartbeat_timeout_s  # silent for long
    assert app.registry.expire() == ["p1"]
    assert _series(metrics) == {("p2", "prefill")}


def test_role_change_replaces_the_series_and_forgetting_twice_is_harmless():
    app, metrics = _app()
    _register(app, "w1", ROLE_PREFILL)
    app.metrics.set_inflight("w1", "prefill", 1)
    app.metrics.set_inflight("w1", "decode", 4)  # flipped
    assert _series(metrics) == {("w1", "decode")}
    app.metrics.forget_instance("w1")
    app.metrics.forget_instance("w1")
    app.metrics.forget_instance("never-seen")
    assert _series(metrics) == set()
