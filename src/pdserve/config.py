"""Service settings: pydantic-settings models with command-line flags on top.

Precedence (lowest to highest): field defaults < environment (`PDSERVE_<FIELD>`) < CLI flags
(`--<field-name>`). Settings objects are frozen.

Each service declares its own subclass in its package::

    class RouterSettings(ServiceSettings):
        port: int = Field(50051, description="gRPC port")
        policy: Literal["round_robin", "least_load"] = "least_load"

    settings = load_settings(RouterSettings, sys.argv[1:], prog="pdserve-router")

Flags are generated from the fields: `--field-name VALUE`; bools as `--x/--no-x`; list/tuple
fields take a comma-separated list or a JSON array, and may be repeated (values add up).

Settings may come in **groups**: a field whose type is a `SettingsGroup` (a frozen pydantic
model) nests its fields (`settings.admission.max_queue`), while its flags and environment
names stay flat (`--max-queue`, `PDSERVE_MAX_QUEUE`), so a group's field names are unique
across the whole settings class. `--help` lists each group under its own heading.
Values are validated by pydantic, so a bad value (from the environment or a flag) fails
with the flag, the env variable and the reason.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
import typing
import uuid
from collections.abc import Sequence
from typing import Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings import SettingsError as _SourceError

ENV_PREFIX = "PDSERVE_"


class SettingsError(ValueError):
    """A bad flag or a bad setting value (raised when `exit_on_error=False`)."""


def _new_instance_id() -> str:
    return uuid.uuid4().hex[:12]


class SettingsGroup(BaseModel):
    """A group of settings (a field of a ServiceSettings); flat flags and env names."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _group(annotation: Any) -> type[SettingsGroup] | None:
    ann = _strip_optional(annotation)
    return ann if isinstance(ann, type) and issubclass(ann, SettingsGroup) else None


def flat_fields(cls: type[BaseModel]) -> dict[str, tuple[str | None, FieldInfo]]:
    """Every flag-level field: name -> (its group's field name or None, FieldInfo)."""
    out: dict[str, tuple[str | None, FieldInfo]] = {}
    for name, info in cls.model_fields.items():
        group = _group(info.annotation)
        if group is None:
            out[name] = (None, info)
            continue
        for inner, inner_info in group.model_fields.items():
            if inner in out or inner in cls.model_fields:
                raise TypeError(f"{cls.__name__}: setting {inner!r} is declared twice")
            out[inner] = (name, inner_info)
    return out


class _FlatGroupEnv(EnvSettingsSource):
    """`PDSERVE_<FIELD>` for the fields of groups: {group: {field: value}}."""

    def __call__(self) -> dict[str, Any]:
        out: dict[str, dict[str, Any]] = {}
        for name, (group, info) in flat_fields(self.settings_cls).items():
            if group is None:
                continue
            env = _env_name(self.settings_cls, name)
            raw = self.env_vars.get(env.lower() if not self.case_sensitive else env)
            if raw is None:
                continue
            value: Any = raw
            if _is_sequence(info.annotation):
                value = _parse_sequence(raw)
            out.setdefault(group, {})[name] = value
        return out


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses add their own and may override defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address the gRPC server binds to")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = off)"
    )
    log_format: Literal["json", "console"] = Field("json", description="log line format")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="minimum log level"
    )
    instance_id: str = Field(
        default_factory=_new_instance_id, description="unique id of this process (generated)"
    )
    router_addr: str | None = Field(
        None,
        description="HOST:PORT of the router to register with; several replicas "
        "comma-separated (a:1,b:2): a worker registers with each (none = standalone)",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="longest wait for in-flight work on shutdown, seconds"
    )
    grace_s: float = Field(5.0, ge=0, description="gRPC stop grace after draining, seconds")
    # -- mutual TLS of the internal plane (pdserve.rpc.tls)
    tls_dir: str | None = Field(
        None, description="directory with ca.crt and <tls-name>.crt/.key (pdserve certs make)"
    )
    tls_name: str | None = Field(
        None, description="which certificate of --tls-dir (default: the service's role)"
    )
    tls_ca_file: str | None = Field(None, description="cluster CA certificate (PEM)")
    tls_cert_file: str | None = Field(None, description="this service's certificate (PEM)")
    tls_key_file: str | None = Field(None, description="this service's private key (PEM)")
    insecure: bool = Field(
        False, description="no TLS on the internal plane: LOCAL DEBUGGING ONLY (anyone can join)"
    )

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (init) > env (flat names, groups too) > defaults
        return (
            init_settings,
            env_settings,
            _FlatGroupEnv(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )


S = TypeVar("S", bound=BaseSettings)


# --------------------------------------------------------------------------- type helpers


def _strip_optional(annotation: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_bool(annotation: Any) -> bool:
    return _strip_optional(annotation) is bool


def _is_sequence(annotation: Any) -> bool:
    origin = typing.get_origin(_strip_optional(annotation))
    return origin in (list, tuple, set, frozenset)


def _choices(annotation: Any) -> list[str] | None:
    ann = _strip_optional(annotation)
    if typing.get_origin(ann) is Literal:
        values = typing.get_args(ann)
        if all(isinstance(v, str) for v in values):
            return list(values)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return [str(m.value) for m in ann]
    return None


def _choice_matcher(choices: list[str]) -> typing.Callable[[str], str]:
    """argparse type for choice flags: case-insensitive match onto the canonical spelling."""
    by_lower = {c.lower(): c for c in choices}

    def match(text: str) -> str:
        return by_lower.get(text.lower(), text)

    return match


def _parse_sequence(text: str) -> list[Any]:
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list):
            raise ValueError("expected a JSON array")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(cls: type[BaseSettings], name: str) -> str:
    prefix = cls.model_config.get("env_prefix", "") or ""
    return f"{prefix}{name}".upper()


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "generated"
    if info.is_required():
        return "required"
    default = info.default
    if isinstance(default, enum.Enum):
        default = default.value
    return "none" if default is None else repr(default)


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises SettingsError instead of exiting, when asked to."""

    def __init__(self, *args: Any, raise_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._raise_errors = raise_errors

    def error(self, message: str) -> typing.NoReturn:
        if self._raise_errors:
            raise SettingsError(message)
        super().error(message)


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one flag per field of `cls`. Absent flags do not appear in the namespace
    (default=SUPPRESS), so the environment and the field defaults stay in charge."""
    groups: dict[str, Any] = {}
    for name, (group, info) in flat_fields(cls).items():
        target: Any = parser
        if group is not None:
            if group not in groups:
                title = _group(cls.model_fields[group].annotation)
                doc = " ".join((title.__doc__ or "").split()) or None  # type: ignore[union-attr]
                groups[group] = parser.add_argument_group(group, doc)
            target = groups[group]
        flag = _flag(name)
        env = _env_name(cls, name)
        desc = info.description or name.replace("_", " ")
        help_text = f"{desc} [env {env}; default {_default_text(info)}]".replace("%", "%%")
        if _is_bool(info.annotation):
            target.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": help_text,
            "metavar": name.upper(),
        }
        choices = _choices(info.annotation)
        if choices is not None:
            kwargs["choices"] = choices
            kwargs["type"] = _choice_matcher(choices)
            kwargs["metavar"] = "{" + ",".join(choices) + "}"
        if _is_sequence(info.annotation):
            kwargs["type"] = _parse_sequence
            kwargs["metavar"] = "A,B,..."
            kwargs["action"] = "extend"  # repeatable: --x a --x b,c -> [a, b, c]
        target.add_argument(flag, **kwargs)


def build_parser(
    cls: type[BaseSettings], prog: str | None = None, *, exit_on_error: bool = True
) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None,
        epilog=f"Precedence: defaults < environment ({ENV_PREFIX}<FIELD>) < flags.",
        raise_errors=not exit_on_error,
    )
    add_settings_arguments(parser, cls)
    return parser


def _explain(cls: type[BaseSettings], exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        name = str(loc[0]) if loc else "?"
        if _group(getattr(cls.model_fields.get(name), "annotation", None)) is not None:
            loc = loc[1:]  # a group's field: named by its own (flat) flag
            name = str(loc[0]) if loc else "?"
        if name in flat_fields(cls):
            where = f"{_flag(name)} / {_env_name(cls, name)}"
        else:
            where = name
        got = err.get("input")
        if not loc:  # a check across fields (model validator): its message names them
            lines.append(str(err.get("msg")).removeprefix("Value error, "))
            continue
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"invalid value for {where}: {err.get('msg')}{got_text}")
    return "; ".join(lines) or str(exc)


def load_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    prog: str | None = None,
    *,
    exit_on_error: bool = True,
) -> S:
    """Build `cls` from defaults, then `PDSERVE_*` environment, then `argv` flags.

    argv=None reads sys.argv[1:]. An unknown flag or a value that fails validation prints a
    usage error and exits with status 2 (argparse style), or raises SettingsError when
    `exit_on_error=False`.
    """
    parser = build_parser(cls, prog, exit_on_error=exit_on_error)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    overrides = nest(cls, vars(args))  # only the flags actually given (default=SUPPRESS)
    try:
        return cls(**overrides)
    except ValidationError as exc:
        parser.error(_explain(cls, exc))
    except _SourceError as exc:  # e.g. an env value that is not valid JSON for a list field
        parser.error(str(exc))


def nest(cls: type[BaseModel], flat: dict[str, Any]) -> dict[str, Any]:
    """Flat {field: value} (flags) -> the settings' shape ({group: {field: value}})."""
    fields = flat_fields(cls)
    out: dict[str, Any] = {}
    for name, value in flat.items():
        group = fields[name][0] if name in fields else None
        if group is None:
            out[name] = value
        else:
            out.setdefault(group, {})[name] = value
    return out


def settings_to_argv(settings: BaseSettings, *, only_set: bool = True) -> list[str]:
    """Turn settings back into flags (e.g. for a launcher that starts a service process).

    only_set=True emits only the fields explicitly set (by env or flags) on `settings`."""
    argv: list[str] = []
    for name, (group, info) in flat_fields(type(settings)).items():
        owner: Any = settings if group is None else getattr(settings, group)
        if only_set and (
            name not in owner.model_fields_set
            or (group is not None and group not in settings.model_fields_set)
        ):
            continue
        value = getattr(owner, name)
        flag = _flag(name)
        if _is_bool(info.annotation):
            if value is not None:
                argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            continue
        elif _is_sequence(info.annotation):
            argv += [flag, json.dumps(list(value))]
        elif isinstance(value, enum.Enum):
            argv += [flag, str(value.value)]
        else:
            argv += [flag, str(value)]
    return argv
