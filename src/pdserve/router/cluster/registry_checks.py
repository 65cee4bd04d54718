"""Checks of the registry calls (Register, Heartbeat, Deregister): every field, and who may
speak for an instance.

An instance id belongs to the identity (certificate URI) that registered it while the router
knows the instance: a re-registration, heartbeat or deregistration under that id from any
other identity is PERMISSION_DENIED. Once the instance is forgotten (deregistered, expired)
the id is free again.
"""

from __future__ import annotations

import math

from pdserve.dtypes import DTYPE_NAMES
from pdserve.errors import InvalidRequestError, OverloadedError, PermissionDeniedError
from pdserve.rpc.authz import current_peer
from pdserve.rpc.ids import check_id
from pdserve.v1 import common_pb2, router_pb2

from .registry import State

MAX_ADDRESS_CHARS = 255
MAX_FINGERPRINT_CHARS = 256
MAX_BLOCK_SIZE = 1024
MAX_REPORTED_ROUTERS = 64  # router replicas one heartbeat may report
STATES = ("", *State)  # "" = unchanged
ROLES = (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED)


def check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    ok = (
        0 < len(address) <= MAX_ADDRESS_CHARS
        and sep
        and host
        and address.isascii()
        and address.isprintable()
        and " " not in address
        and port.isdigit()
        and 0 < int(port) < 65536
    )
    if not ok:
        raise InvalidRequestError("address", "must be HOST:PORT (printable ASCII, port 1-65535)")


def check_load(load: common_pb2.WorkerLoad) -> None:
    if not math.isfinite(load.step_ms_ewma) or load.step_ms_ewma < 0:
        raise InvalidRequestError("load.step_ms_ewma", "must be a finite number >= 0")
    if load.free_blocks > load.total_blocks:
        raise InvalidRequestError("load.free_blocks", "must not exceed load.total_blocks")


def check_register(req: router_pb2.RegisterRequest) -> None:
    check_id("instance_id", req.instance_id)
    check_address(req.address)
    if req.role not in ROLES:
        raise InvalidRequestError("role", "must be ROLE_PREFILL, ROLE_DECODE or ROLE_COLOCATED")
    fp = req.model_fingerprint
    if not fp or len(fp) > MAX_FINGERPRINT_CHARS or not fp.isascii() or not fp.isprintable():
        raise InvalidRequestError(
            "model_fingerprint", f"must be 1-{MAX_FINGERPRINT_CHARS} printable ASCII characters"
        )
    if not 1 <= req.block_size <= MAX_BLOCK_SIZE:
        raise InvalidRequestError("block_size", f"must be in [1, {MAX_BLOCK_SIZE}]")
    if req.dtype and req.dtype not in DTYPE_NAMES:
        raise InvalidRequestError("dtype", f"must be empty or one of {', '.join(DTYPE_NAMES)}")
    check_load(req.load)


def check_heartbeat(req: router_pb2.HeartbeatRequest) -> None:
    check_id("instance_id", req.instance_id)
    if req.role and req.role not in ROLES:
        raise InvalidRequestError("role", "must be unset or a known role")
    if req.state not in STATES:
        raise InvalidRequestError("state", f"must be one of {', '.join(s for s in STATES if s)}")
    check_load(req.load)
    if len(req.routers) > MAX_REPORTED_ROUTERS:
        raise InvalidRequestError("routers", f"at most {MAX_REPORTED_ROUTERS} routers")
    for i, r in enumerate(req.routers):
        check_id(f"routers[{i}].router_id", r.router_id)
        for name in ("address", "http_address"):
            value = getattr(r, name)
            if value:
                try:
                    check_address(value)
                except InvalidRequestError:
                    raise InvalidRequestError(
                        f"routers[{i}].{name}", "must be HOST:PORT (printable ASCII)"
                    ) from None


class Owners:
    """instance id -> the identity that registered it (None in --insecure mode).
    `max_per_identity` > 0 caps the live instances one identity may hold (a worker
    certificate cannot flood the registry with fake instances; 0 = no cap, e.g. when every
    worker shares one certificate)."""

    def __init__(self, max_per_identity: int = 0) -> None:
        self._owner: dict[str, str | None] = {}
        self.max_per_identity = max_per_identity

    @staticmethod
    def caller() -> str | None:
        peer = current_peer()
        return peer.uri if peer is not None else None

    def check(self, instance_id: str, known: bool) -> None:
        """PERMISSION_DENIED when a known instance belongs to someone else."""
        if not known:
            self._owner.pop(instance_id, None)
            return
        owner, caller = self._owner.get(instance_id), self.caller()
        if instance_id in self._owner and owner != caller:
            raise PermissionDeniedError(
                f"instance_id {instance_id!r} is registered by another identity"
            )

    def check_quota(self, instance_id: str, live: set[str]) -> None:
        """RESOURCE_EXHAUSTED when the caller already holds max_per_identity other live
        instances (`live`: the ids the registry knows now)."""
        caller = self.caller()
        if not self.max_per_identity or caller is None:
            return
        held = sum(
            1
            for iid, who in self._owner.items()
            if who == caller and iid in live and iid != instance_id
        )
        if held >= self.max_per_identity:
            raise OverloadedError(
                f"identity {caller} already holds {held} instances "
                f"(max_instances_per_identity={self.max_per_identity})"
            )

    def claim(self, instance_id: str) -> None:
        self._owner[instance_id] = self.caller()

    def release(self, instance_id: str) -> None:
        self._owner.pop(instance_id, None)
