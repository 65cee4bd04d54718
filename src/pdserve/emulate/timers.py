"""Control-plane timers of an emulated cluster, in modelled time.

`--time-scale X` makes a modelled second last X wall seconds. The forward pass and the KV link
follow it (runner.py, link.py); so must every duration the control plane decides by: heartbeat
period and timeout, queue timeouts and aging, the flip controller's period, cooldown and
timeout, RPC deadlines and ticket leases. Otherwise an emulated router would see X heartbeats per
modelled second, flip X times as often as configured, and time out X times too early, and its
decisions would differ from the simulator's (which reads the same settings in modelled seconds).

Every such setting given to an emulated cluster is read in modelled seconds: its default (or
`PDSERVE_*` value), and a flag the user passes, are multiplied by X (a rate per second is
divided by X) before the process starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic_settings import BaseSettings

# (setting, exponent): wall value = modelled value * scale ** exponent
ROUTER_TIMERS: tuple[tuple[str, int], ...] = (
    ("heartbeat_interval_s", 1), ("heartbeat_timeout_s", 1),
    ("queue_timeout_s", 1), ("queue_max_wait_s", 1), ("queue_aging_tokens_per_s", -1),
    ("kv_queue_timeout_s", 1),
    ("reserve_deadline_s", 1), ("prefill_deadline_s", 1), ("first_token_deadline_s", 1),
    ("decode_idle_deadline_s", 1), ("abort_deadline_s", 1), ("migration_wait_s", 1),
    ("lease_s", 1),
    ("flip_interval_s", 1), ("flip_cooldown_s", 1), ("flip_timeout_s", 1),
)  # fmt: skip
WORKER_TIMERS: tuple[tuple[str, int], ...] = (
    ("heartbeat_interval_s", 1), ("lease_s", 1), ("max_lease_s", 1),
    ("transfer_timeout_s", 1), ("kvstore_timeout_s", 1),
)  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _effective(settings: BaseSettings, name: str) -> float:
    """The value `settings` (a service's, without flags: defaults and PDSERVE_* env) holds."""
    from pdserve.config import flat_fields

    group, _ = flat_fields(type(settings))[name]
    return float(getattr(getattr(settings, group) if group else settings, name))


def modelled_timer_args(
    cls: type[BaseSettings],
    timers: Sequence[tuple[str, int]],
    args: Sequence[str],
    scale: float,
) -> list[str]:
    """`args` (a service's extra flags) with every timer in `timers` converted from modelled to
    wall seconds: flags given in `args` (`--x-s=V` or `--x-s V`) are scaled in place, the others
    are added with their effective value scaled. Unchanged when `scale` is 1."""
    out = list(args)
    if scale == 1.0:
        return out
    from pdserve.config import load_settings

    defaults = load_settings(cls, [], exit_on_error=False)
    for name, exponent in timers:
        factor = scale**exponent
        flag = _flag(name)
        given = False
        for i, arg in enumerate(out):
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={float(arg.split('=', 1)[1]) * factor!r}"
                given = True
            elif arg == flag and i + 1 < len(out):
                out[i + 1] = repr(float(out[i + 1]) * factor)
                given = True
        if not given:
            out.insert(0, f"{flag}={_effective(defaults, name) * factor!r}")
    return out
