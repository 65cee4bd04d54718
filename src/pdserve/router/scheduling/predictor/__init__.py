"""Output-length prediction for the router (numpy only, no torch): an offline
text model shipped as package data, online learning from finished requests,
and the EWMA baseline / oracle used by benchmarks."""

from .base import (
    EwmaPredictor,
    LengthEstimate,
    LengthQuery,
    OraclePredictor,
    OutputLengthPredictor,
)

__all__ = [
    "EwmaPredictor",
    "LengthEstimate",
    "LengthQuery",
    "OraclePredictor",
    "OutputLengthPredictor",
]
