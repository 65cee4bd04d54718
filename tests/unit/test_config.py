"""load_settings: defaults < env < flags, bool flags, lists, errors, frozen objects."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field, ValidationError

from pdserve.config import (
    ServiceSettings,
    SettingsError,
    build_parser,
    load_settings,
    settings_to_argv,
)


class ToySettings(ServiceSettings):
    """Example of a service's own settings (each service declares one in its package)."""

    port: int = Field(50051, ge=0, le=65535, description="gRPC port")
    enable_cache: bool = Field(True, description="use the prefix cache")
    policy: Literal["round_robin", "least_load"] = Field("least_load", description="routing")
    peers: list[str] = Field(default_factory=list, description="peer addresses")
    kv_bytes: int | None = Field(None, description="KV cache size")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("PDSERVE_"):
            monkeypatch.delenv(key)


def test_defaults() -> None:
    s = load_settings(ToySettings, [])
    assert s.host == "127.0.0.1"
    assert s.port == 50051
    assert s.metrics_port == 0
    assert s.log_format == "json"
    assert s.enable_cache is True
    assert s.router_addr is None
    assert len(s.instance_id) >= 8
    assert load_settings(ToySettings, []).instance_id != s.instance_id  # generated per object


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PORT", "6000")
    monkeypatch.setenv("PDSERVE_GRACE_S", "1.5")
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "console")
    s = load_settings(ToySettings, ["--port", "7000"])
    assert s.port == 7000  # flag beats env
    assert s.grace_s == 1.5  # env beats default
    assert s.log_format == "console"
    assert load_settings(ToySettings, []).port == 6000


def test_log_settings_are_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("PDSERVE_UNRELATED_THING", "1")  # other PDSERVE_* vars are ignored
    s = load_settings(ToySettings, ["--log-format", "Console"])
    assert (s.log_level, s.log_format) == ("warning", "console")


def test_bool_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(ToySettings, ["--no-enable-cache"]).enable_cache is False
    monkeypatch.setenv("PDSERVE_ENABLE_CACHE", "false")
    assert load_settings(ToySettings, []).enable_cache is False
    assert load_settings(ToySettings, ["--enable-cache"]).enable_cache is True


def test_list_literal_optional_fields() -> None:
    s = load_settings(
        ToySettings,
        ["--peers", "a:1, b:2", "--policy", "round_robin", "--kv-bytes", "1024"],
    )
    assert s.peers == ["a:1", "b:2"]
    assert s.policy == "round_robin"
    assert s.kv_bytes == 1024
    assert load_settings(ToySettings, ["--peers", '["x:1"]']).peers == ["x:1"]


def test_unknown_flag_is_a_clear_error() -> None:
    with pytest.raises(SettingsError, match="unrecognized arguments: --bogus"):
        load_settings(ToySettings, ["--bogus", "1"], exit_on_error=False)


def test_bad_flag_value_names_flag_and_env() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(ToySettings, ["--port", "99999"], exit_on_error=False)
    assert "--port" in str(info.value) and "PDSERVE_PORT" in str(info.value)
    with pytest.raises(SettingsError, match="invalid choice"):
        load_settings(ToySettings, ["--policy", "random"], exit_on_error=False)


def test_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_DRAIN_TIMEOUT_S", "soon")
    with pytest.raises(SettingsError, match="--drain-timeout-s / PDSERVE_DRAIN_TIMEOUT_S"):
        load_settings(ToySettings, [], exit_on_error=False)
    # A flag overrides the bad env value, so it is never validated.
    assert load_settings(ToySettings, ["--drain-timeout-s", "2"]).drain_timeout_s == 2.0


def test_exit_on_error_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(ToySettings, ["--log-level", "loud"], prog="toy")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: toy" in err and "--log-level" in err


def test_frozen() -> None:
    s = load_settings(ToySettings, [])
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]


def test_help_mentions_env_and_description() -> None:
    text = build_parser(ToySettings, "toy").format_help()
    assert "--enable-cache, --no-enable-cache" in text
    assert "PDSERVE_METRICS_PORT" in text
    assert "use the prefix cache" in text


def test_settings_to_argv_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    s = load_settings(ToySettings, ["--no-enable-cache", "--peers", "a:1,b:2", "--port", "9"])
    argv = settings_to_argv(s)
    monkeypatch.delenv("PDSERVE_HOST")
    again = load_settings(ToySettings, argv)
    assert again.model_dump(exclude={"instance_id"}) == s.model_dump(exclude={"instance_id"})
