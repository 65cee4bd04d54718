"""Building a placement policy by name: a base policy from `policies.POLICIES`, a decode
placement around it (`decode_placement.py`), session affinity outermost."""

from __future__ import annotations

from .decode_placement import with_decode_placement
from .demand import DecodeDemand
from .policies import POLICIES, PlacementPolicy, SessionAffinity


def make_policy(
    name: str,
    session_affinity: bool = False,
    decode_placement: str = "count",
    demand: DecodeDemand | None = None,
    length_routing_tokens: int = 0,
) -> PlacementPolicy:
    """`decode_placement`: "count" = the policy's own choice (request counts), or a decode
    placement wrapped around it (`decode_placement.py`: "predicted" = PredictedFootprint over
    `demand`, "length" = LengthRouted at `length_routing_tokens`)."""
    try:
        policy = POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    policy = with_decode_placement(policy, decode_placement, demand, length_routing_tokens)
    return SessionAffinity(policy) if session_affinity else policy
