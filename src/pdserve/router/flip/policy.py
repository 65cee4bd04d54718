"""The flip decision: which pool is starved, and which instance of the other pool moves.

`FlipPolicy` decides (pure: no gRPC, no clock; the time is passed in). Each pool's pressure is
in units of "full" (1.0 = saturated):
    prefill = prompt tokens the router has in flight on prefill instances (queued there or in
              prefill; exact router counters) per prefill instance / `prefill_tokens_full`
    decode  = max(running sequences per decode instance (heartbeat) / `decode_seqs_full`,
                  used fraction of the decode pool's KV blocks (reservations included),
                  predicted demand: the predicted peak KV tokens of everything the router
                  placed on the pool (prompt + generated + predicted remaining) / its KV
                  capacity -- long generations that just started count before they grow)
A pool is starved when its pressure >= `starved` and >= `ratio` x the other pool's. Then the
least loaded instance of the other (donor) pool moves over, but only when
  - the condition held for `ticks` consecutive ticks (hysteresis: one quiet tick resets it),
  - `cooldown_s` passed since the last flip ended (flipped or failed),
  - no instance is flipping right now (one flip at a time),
  - the donor pool keeps >= 1 serving instance, and its pressure projected onto one instance
    fewer stays below `starved` (a flip never starves the pool it takes from, so the next
    tick cannot want it back).
Only serving, non-suspect prefill/decode instances count; colocated ones are not flipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..cluster.registry import ROLE_DECODE, ROLE_NAMES, ROLE_PREFILL


@dataclass(frozen=True)
class InstanceLoad:
    """What the policy sees of one instance (a copy: the registry keeps changing)."""

    instance_id: str
    role: int
    state: str  # serving | flipping | draining | suspect | ...
    inflight_tokens: int = 0  # router: prompt tokens in prefill there
    inflight_requests: int = 0  # router: requests placed there, not finished
    num_running: int = 0  # heartbeat: sequences in the running batch
    num_reserved: int = 0  # heartbeat: reservations waiting for KV / Decode
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    predicted_kv_tokens: int = 0  # router: predicted peak KV of what it placed there


@dataclass(frozen=True)
class Pressure:
    prefill: float
    decode: float
    n_prefill: int
    n_decode: int
    prefill_tokens: int  # prompt tokens in flight on the prefill pool
    decode_running: int  # running sequences on the decode pool
    decode_used_blocks: int
    decode_total_blocks: int
    decode_predicted_fraction: float = 0.0  # predicted peak KV / the pool's KV capacity


@dataclass(frozen=True)
class FlipDecision:
    action: Literal["hold", "flip"]
    reason: str
    pressure: Pressure
    streak: int = 0
    instance_id: str = ""
    from_role: int = 0
    to_role: int = 0

    def log_fields(self) -> dict[str, object]:
        p = self.pressure
        return dict(
            action=self.action, reason=self.reason, streak=self.streak,
            instance=self.instance_id or None,
            direction=direction(self.from_role, self.to_role) if self.to_role else None,
            prefill_pressure=round(p.prefill, 3), decode_pressure=round(p.decode, 3),
            n_prefill=p.n_prefill, n_decode=p.n_decode, prefill_tokens=p.prefill_tokens,
            decode_running=p.decode_running, decode_used_blocks=p.decode_used_blocks,
            decode_total_blocks=p.decode_total_blocks,
        )  # fmt: skip


def direction(from_role: int, to_role: int) -> str:
    return f"{ROLE_NAMES.get(from_role, from_role)}_to_{ROLE_NAMES.get(to_role, to_role)}"


@dataclass(frozen=True)
class FlipThresholds:
    prefill_tokens_full: float = 2048.0
    decode_seqs_full: float = 32.0
    starved: float = 1.0
    ratio: float = 3.0
    ticks: int = 3
    cooldown_s: float = 30.0


class FlipPolicy:
    """Stateful across ticks (streak, last flip time) but pure: no I/O, no clock reads."""

    def __init__(self, thresholds: FlipThresholds) -> None:
        self.t = thresholds
        self._want = 0  # role the current streak wants more of (0 = none)
        self._streak = 0
        self._last_flip_end: float | None = None

    def flip_ended(self, now: float) -> None:
        """The controller finished a flip (either way): the cooldown starts now."""
        self._last_flip_end = now

    # -- pressure --------------------------------------------------------------
    def pressure(self, pools: Sequence[InstanceLoad]) -> Pressure:
        prefill = _serving(pools, ROLE_PREFILL)
        decode = _serving(pools, ROLE_DECODE)
        tokens = sum(i.inflight_tokens for i in prefill)
        running = sum(i.num_running for i in decode)
        total = sum(i.total_blocks for i in decode)
        used = total - sum(min(i.free_blocks, i.total_blocks) for i in decode)
        capacity = sum(i.total_blocks * i.block_size for i in decode)
        predicted = sum(i.predicted_kv_tokens for i in decode)
        frac = predicted / capacity if capacity > 0 else 0.0
        return Pressure(
            prefill=self._prefill_pressure(tokens, len(prefill)),
            decode=max(self._decode_pressure(running, used, total, len(decode)), frac),
            n_prefill=len(prefill), n_decode=len(decode), prefill_tokens=tokens,
            decode_running=running, decode_used_blocks=used, decode_total_blocks=total,
            decode_predicted_fraction=frac,
        )  # fmt: skip

    def _prefill_pressure(self, tokens: int, n: int) -> float:
        return tokens / n / self.t.prefill_tokens_full if n else 0.0

    def _decode_pressure(self, running: int, used: int, total: int, n: int) -> float:
        if not n:
            return 0.0
        blocks = used / total if total > 0 else (float("inf") if used > 0 else 0.0)
        return max(running / n / self.t.decode_seqs_full, blocks)

    # -- decision --------------------------------------------------------------
    def decide(self, pools: Sequence[InstanceLoad], now: float) -> FlipDecision:
        p = self.pressure(pools)
        if any(i.state == "flipping" for i in pools):
            return self._hold("flip in progress", p, reset=True)
        if not p.n_prefill or not p.n_decode:
            return self._hold("no serving prefill and decode pools", p, reset=True)
        want = self._starved_pool(p)
        if not want:
            return self._hold("balanced", p, reset=True)
        self._streak = self._streak + 1 if want == self._want else 1
        self._want = want
        donor_role = ROLE_DECODE if want == ROLE_PREFILL else ROLE_PREFILL
        donors = _serving(pools, donor_role)
        if len(donors) < 2:
            return self._hold(f"{ROLE_NAMES[donor_role]} pool has one instance", p)
        pick = min(donors, key=_idleness)
        projected = self._projected_donor_pressure(p, donor_role, pick)
        if projected >= self.t.starved:
            return self._hold(
                f"{ROLE_NAMES[donor_role]} pool would be starved "
                f"(pressure {projected:.2f} with one instance fewer)", p
            )  # fmt: skip
        if self._streak < self.t.ticks:
            return self._hold(f"hysteresis {self._streak}/{self.t.ticks}", p)
        if self._last_flip_end is not None and now - self._last_flip_end < self.t.cooldown_s:
            left = self.t.cooldown_s - (now - self._last_flip_end)
            return self._hold(f"cooldown ({left:.1f} s left)", p)
        streak, self._streak, self._want = self._streak, 0, 0
        return FlipDecision(
            "flip", f"{ROLE_NAMES[want]} pool starved", p, streak,
            pick.instance_id, donor_role, want,
        )  # fmt: skip

    def _starved_pool(self, p: Pressure) -> int:
        t = self.t
        if p.prefill >= t.starved and p.prefill >= t.ratio * p.decode:
            return ROLE_PREFILL
        if p.decode >= t.starved and p.decode >= t.ratio * p.prefill:
            return ROLE_DECODE
        return 0

    def _projected_donor_pressure(self, p: Pressure, donor: int, pick: InstanceLoad) -> float:
        """The donor pool's pressure with the same load on one instance fewer."""
        if donor == ROLE_PREFILL:
            return self._prefill_pressure(p.prefill_tokens, p.n_prefill - 1)
        total = p.decode_total_blocks - pick.total_blocks
        now = self._decode_pressure(p.decode_running, p.decode_used_blocks, total, p.n_decode - 1)
        if p.decode_predicted_fraction and total > 0:  # same demand on less capacity
            now = max(now, p.decode_predicted_fraction * p.decode_total_blocks / total)
        return now

    def _hold(self, reason: str, p: Pressure, reset: bool = False) -> FlipDecision:
        if reset:
            self._streak, self._want = 0, 0
        return FlipDecision("hold", reason, p, self._streak)


def _serving(pools: Sequence[InstanceLoad], role: int) -> list[InstanceLoad]:
    return [i for i in pools if i.role == role and i.state == "serving"]


def _idleness(i: InstanceLoad) -> tuple[int, ...]:
    """Lower = less work to drain: the donor to pick (min is stable: ties -> lowest id)."""
    return (i.inflight_requests, i.inflight_tokens, i.num_running + i.num_reserved, -i.free_blocks)
