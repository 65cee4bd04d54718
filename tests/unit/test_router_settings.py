"""RouterSettings in groups: every flag and PDSERVE_<FIELD> name users, docs/studies and the
k8s files rely on still works and lands in its group; cross-field checks; one default."""

from __future__ import annotations

import inspect

import pytest

from pdserve.config import (
    SettingsError,
    build_parser,
    flat_fields,
    load_settings,
    settings_to_argv,
)
from pdserve.router.scheduling.admission import AdmissionConfig
from pdserve.router.scheduling.overload_queue import OverloadQueue
from pdserve.router.settings import RouterSettings

# Names used by docs/studies, compose.yaml and deploy/k8s (a sample of each group).
OLD_FLAGS = {
    "--max-request-bytes": ("limits", "max_request_bytes", "4096", 4096),
    "--key-max-concurrent": ("keys", "key_max_concurrent", "3", 3),
    "--max-running": ("admission", "max_running", "5", 5),
    "--queue-max-running-per-decode": ("admission", "queue_max_running_per_decode", "2", 2),
    "--queue-order": ("admission", "queue_order", "fcfs", "fcfs"),
    "--kv-queue-timeout-s": ("admission", "kv_queue_timeout_s", "1.5", 1.5),
    "--decode-placement": ("placement", "decode_placement", "predicted", "predicted"),
    "--reserve-max-tokens": ("placement", "reserve_max_tokens", "64", 64),
    "--predictor": ("length", "predictor", "ewma", "ewma"),
    "--max-migrations": ("lifecycle", "max_migrations", "0", 0),
    "--flip-interval-s": ("flip", "flip_interval_s", "0.5", 0.5),
}


def test_every_old_flag_still_works_and_lands_in_its_group():
    for flag, (group, name, text, value) in OLD_FLAGS.items():
        s = load_settings(RouterSettings, [flag, text], exit_on_error=False)
        assert getattr(getattr(s, group), name) == value, flag
    s = load_settings(RouterSettings, ["--flip-enabled", "--no-session-affinity"])
    assert s.flip.flip_enabled and not s.placement.session_affinity
    s = load_settings(RouterSettings, ["--api-key", "a", "--api-key", "b,c"])
    assert s.keys.api_key == ["a", "b", "c"]


def test_flat_env_names_reach_groups_and_flags_win(monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_QUEUE", "7")
    monkeypatch.setenv("PDSERVE_QUEUE_TIMEOUT_S", "3")
    monkeypatch.setenv("PDSERVE_API_KEY", "k1,k2")
    monkeypatch.setenv("PDSERVE_PORT", "6000")
    s = load_settings(RouterSettings, ["--max-queue", "9"])
    assert s.admission.max_queue == 9  # flag over env
    assert s.admission.queue_timeout_s == 3.0  # env, same group, merged
    assert s.keys.api_key == ["k1", "k2"] and s.port == 6000
    monkeypatch.setenv("PDSERVE_MAX_QUEUE", "lots")
    with pytest.raises(SettingsError, match="--max-queue"):
        load_settings(RouterSettings, [], exit_on_error=False)


def test_predictor_alpha_only_with_ewma(monkeypatch):
    with pytest.raises(SettingsError, match="--predictor-alpha"):
        load_settings(RouterSettings, ["--predictor-alpha", "0.5"], exit_on_error=False)
    s = load_settings(RouterSettings, ["--predictor", "ewma", "--predictor-alpha", "0.5"])
    assert s.length.predictor_alpha == 0.5
    monkeypatch.setenv("PDSERVE_PREDICTOR_ALPHA", "0.3")
    with pytest.raises(SettingsError, match="--predictor-alpha"):
        load_settings(RouterSettings, [], exit_on_error=False)


def test_flag_names_are_unique_and_round_trip():
    names = flat_fields(RouterSettings)
    assert len(names) > 60 and "max_queue" in names and "port" in names
    s = load_settings(
        RouterSettings,
        ["--max-queue", "3", "--flip-enabled", "--api-key", "x", "--port", "7", "--lease-s", "2"],
    )
    again = load_settings(RouterSettings, settings_to_argv(s))
    assert again.model_dump(exclude={"instance_id"}) == s.model_dump(exclude={"instance_id"})
    assert "--max-queue" in settings_to_argv(s) and "--policy" not in settings_to_argv(s)


def test_help_shows_the_groups_and_why_defaults_are_off():
    text = build_parser(RouterSettings, "pdserve-router").format_help()
    for group in ("admission:", "length:", "flip:", "limits:", "lifecycle:"):
        assert group in text
    assert "PDSERVE_MAX_QUEUE" in text
    assert "Off by default" in text  # admission and flip say why


def test_queue_max_wait_s_has_one_default():
    queue_default = inspect.signature(OverloadQueue).parameters["max_wait_s"].default
    assert RouterSettings().admission.queue_max_wait_s == queue_default
    assert AdmissionConfig().max_wait_s == queue_default
    assert queue_default < RouterSettings().admission.queue_timeout_s  # so that it matters
