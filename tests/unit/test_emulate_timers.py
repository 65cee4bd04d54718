"""An emulated cluster's control-plane timers run in modelled time: `--time-scale X` stretches
every duration setting (defaults, env and the user's own flags) by X before the router and the
workers start, and the stretched flags are ones the services accept."""

from __future__ import annotations

import pytest

from pdserve.config import load_settings
from pdserve.emulate.timers import ROUTER_TIMERS, WORKER_TIMERS, modelled_timer_args
from pdserve.launcher import Cluster, ClusterConfig
from pdserve.router.settings import RouterSettings
from pdserve.worker.settings import WorkerSettings


def test_router_defaults_and_user_flags_are_stretched(monkeypatch):
    monkeypatch.setenv("PDSERVE_QUEUE_TIMEOUT_S", "7")
    base = load_settings(RouterSettings, [])
    args = modelled_timer_args(
        RouterSettings, ROUTER_TIMERS,
        ["--flip-cooldown-s=5", "--heartbeat-timeout-s", "10", "--policy", "least_loaded"], 10.0,
    )  # fmt: skip
    s = load_settings(RouterSettings, args)
    assert s.heartbeat_interval_s == pytest.approx(10 * base.heartbeat_interval_s)
    assert s.heartbeat_timeout_s == pytest.approx(100.0)  # the user's 10 modelled seconds
    assert s.flip.flip_cooldown_s == pytest.approx(50.0)
    assert s.flip.flip_interval_s == pytest.approx(10 * base.flip.flip_interval_s)
    assert s.admission.queue_timeout_s == pytest.approx(70.0)  # env value, in modelled seconds
    assert s.admission.queue_aging_tokens_per_s == pytest.approx(
        base.admission.queue_aging_tokens_per_s / 10  # a rate: divided
    )
    assert s.lifecycle.first_token_deadline_s == pytest.approx(
        10 * base.lifecycle.first_token_deadline_s
    )
    assert s.placement.policy == "least_loaded"  # other flags untouched


def test_worker_timers_are_stretched():
    base = load_settings(WorkerSettings, [])
    s = load_settings(WorkerSettings, modelled_timer_args(WorkerSettings, WORKER_TIMERS, [], 4.0))
    for name, _ in WORKER_TIMERS:
        assert getattr(s, name) == pytest.approx(4 * getattr(base, name)), name


def test_scale_one_and_real_clusters_are_unchanged(tmp_path):
    args = ["--flip-cooldown-s=5"]
    assert modelled_timer_args(RouterSettings, ROUTER_TIMERS, args, 1.0) == args
    real = Cluster(ClusterConfig(log_dir=str(tmp_path), router_args=args, time_scale=10.0))
    assert real._modelled(args, "router") == args  # not emulated: wall seconds as given
    emulated = Cluster(
        ClusterConfig(log_dir=str(tmp_path), emulate="h100", time_scale=10.0, router_args=args)
    )
    out = emulated._modelled(args, "router")
    assert "--flip-cooldown-s=50.0" in out and "--heartbeat-interval-s=10.0" in out
