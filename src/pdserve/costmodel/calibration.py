"""Roofline efficiencies per accelerator: fitted on published measurements where there are
some (`fitted/calibration.json`, each entry naming its data, their commit and the fit), assumed
everywhere else (DEFAULT_EFFICIENCY). The form they enter is `roofline.RooflineStep`'s."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pdserve.costmodel.hardware import split_hardware

# Assumed fractions of peak (prefill MFU ~0.5-0.6, HBM reads ~0.6-0.8 are typical of
# vLLM-class engines) and a 2 ms step floor, for accelerators without a calibration.
DEFAULT_EFFICIENCY: dict[str, float] = {
    "compute": 0.55,  # dense matmuls: fraction of peak dense FLOP/s
    "memory": 0.75,  # weight reads: fraction of memory bandwidth
    "attention_compute": 0.55,  # attention FLOPs (prefill)
    "attention_memory": 0.75,  # KV reads (decode)
    "step_overhead_s": 0.002,  # per step
    "layer_overhead_s": 0.0,  # per layer per step (kernel launches a layer's bytes do not explain)
}
FRACTIONS = ("compute", "memory", "attention_compute", "attention_memory")
CALIBRATION_FILE = Path(__file__).parent / "fitted" / "calibration.json"


def _check(name: str, eff: dict[str, Any]) -> dict[str, float]:
    unknown = set(eff) - set(DEFAULT_EFFICIENCY)
    if unknown:
        raise ValueError(f"calibration {name!r}: unknown keys {sorted(unknown)}")
    out = {k: float(v) for k, v in eff.items()}
    for k, v in out.items():
        if k in FRACTIONS and not 0.0 < v <= 1.0:
            raise ValueError(f"calibration {name!r}: {k}={v} is not a fraction in (0, 1]")
        if k not in FRACTIONS and v < 0.0:
            raise ValueError(f"calibration {name!r}: {k}={v} is negative")
    return out


def parse_calibration(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Accelerator name -> efficiency keys it sets. An entry holds `efficiency` (fitted) or
    `derived_from` (another entry's values, e.g. the same die with other memory); every
    entry names its `source`."""
    entries = raw.get("accelerators") or {}
    out: dict[str, dict[str, float]] = {}
    for name, entry in entries.items():
        if not entry.get("source"):
            raise ValueError(f"calibration {name!r}: no source")
        base = entry.get("derived_from")
        if base:
            if "efficiency" in (entries.get(base) or {}):
                out[name] = _check(name, entries[base]["efficiency"])
                continue
            raise ValueError(f"calibration {name!r}: derived from {base!r}, which has no fit")
        out[name] = _check(name, entry.get("efficiency") or {})
    return out


@lru_cache(maxsize=4)
def load_calibration(path: str = str(CALIBRATION_FILE)) -> dict[str, dict[str, float]]:
    return parse_calibration(json.loads(Path(path).read_text()))


def calibration_entry(name: str, path: str = str(CALIBRATION_FILE)) -> dict[str, Any] | None:
    """The raw entry (source, data, fit) of accelerator `name`, or None."""
    raw = json.loads(Path(path).read_text())
    return (raw.get("accelerators") or {}).get(name.lower())


def efficiency_for(hardware: str) -> dict[str, float]:
    """Efficiencies of 'h100' or 'h100x2' (tensor parallel: the same fractions per device):
    the calibration where there is one, else DEFAULT_EFFICIENCY."""
    name = split_hardware(hardware)[0]
    return DEFAULT_EFFICIENCY | load_calibration().get(name, {})


def is_calibrated(hardware: str) -> bool:
    return split_hardware(hardware)[0] in load_calibration()
