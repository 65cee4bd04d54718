"""A measured `pdserve profile` against the calibrated roofline of the same accelerator.

For each step shape the profile measured (prefill of one or more prompts, a chunk over a
context, decode batches by context, mixed steps), the median measured time beside the
roofline's time for the profile's own model (`costmodel.roofline.RooflineStep` built from the
checkpoint's config.json, the profile's dtype, and the accelerator's calibrated efficiencies),
and their ratio. The accelerator comes from `--hardware`, or from the CUDA device name the
profile recorded (H100, H200, A100, L40S, MI300X). The roofline's constants are not changed.

    python -m benchmarks.profile_vs_roofline --profile prof.json [--hardware h100] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

KNOWN = ("h200", "h100", "a100", "l40s", "mi300x")  # H200 before H100: names are matched in order


def hardware_from_name(device_name: str) -> str | None:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; None for a device the cost model does not know."""
    low = device_name.lower().replace(" ", "")
    for hw in KNOWN:
        if hw in low:
            return hw
    return None


def _p2(x: float) -> int:
    """x rounded to the nearest power of two (shapes are grouped by it)."""
    return 1 << max(0, round(math.log2(max(1.0, x))))


def shape_key(batch: list[list[int]]) -> str:
    """A readable group for one step's (start, new) entries: prompt tokens and the start of
    the latest chunk, decodes and their median context, each rounded to a power of two."""
    pre = [(s, n) for s, n in batch if n > 1]
    dec = [(s, n) for s, n in batch if n == 1]
    parts = []
    if pre:
        start = max(s for s, _ in pre)
        tokens = sum(n for _, n in pre)
        parts.append(
            f"prefill {len(pre)}x ~{_p2(tokens)} tok" + (f" @~{_p2(start)}" if start else "")
        )
    if dec:
        ctx = statistics.median(s + 1 for s, _ in dec)
        parts.append(f"decode {_p2(len(dec))} @ctx~{_p2(ctx)}")
    return " + ".join(parts)


def compare(profile: dict[str, Any], hardware: str, model_dir: str | None = None) -> dict[str, Any]:
    """Rows (shape, steps, measured_ms, roofline_ms, ratio = measured / roofline) and a
    summary: median, min and max ratio over the shapes."""
    from pdserve.costmodel.roofline import RooflineStep
    from pdserve.costmodel.shapes import load_model_config

    model_dir = model_dir or profile["model"]
    shape = load_model_config(str(Path(model_dir) / "config.json"))
    roof = RooflineStep.build(shape, hardware, profile.get("dtype", "bfloat16"))
    groups: dict[str, list[tuple[float, float]]] = {}
    for s in profile["engine"]["samples"]:
        batch = [tuple(x) for x in s["batch"]]
        groups.setdefault(shape_key(s["batch"]), []).append((s["s"], roof.step_s(batch)))
    rows = []
    for key, pts in sorted(groups.items()):
        meas = statistics.median(p[0] for p in pts)
        model = statistics.median(p[1] for p in pts)
        rows.append({"shape": key, "steps": len(pts), "measured_ms": meas * 1e3,
                     "roofline_ms": model * 1e3, "ratio": meas / model if model else None})  # fmt: skip
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    summary = {
        "hardware": hardware,
        "model": shape.name or str(model_dir),
        "dtype": profile.get("dtype"),
        "shapes": len(rows),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
        "max_ratio": max(ratios) if ratios else None,
    }
    return {"summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_vs_roofline")
    p.add_argument("--profile", required=True, help="`pdserve profile` JSON")
    p.add_argument("--hardware", help="h100, h200, a100, ... (default: the profile's device)")
    p.add_argument("--model", help="checkpoint dir (default: the profile's)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    prof = json.loads(Path(a.profile).read_text())
    hw = a.hardware or hardware_from_name((prof.get("machine") or {}).get("device_name", ""))
    if hw is None:
        print("profile_vs_roofline: no --hardware and the profile's device is not one the cost "
              "model knows", file=sys.stderr)  # fmt: skip
        return 2
    out = compare(prof, hw, a.model)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'step shape':<52}{'steps':>6}{'measured ms':>13}{'roofline ms':>13}{'ratio':>8}")
    for r in out["rows"]:
        print(f"{r['shape']:<52}{r['steps']:>6}{r['measured_ms']:>13.3f}{r['roofline_ms']:>13.3f}"
              f"{r['ratio']:>8.2f}")  # fmt: skip
    s = out["summary"]
    print(f"{hw}: median ratio {s['median_ratio']:.2f} (min {s['min_ratio']:.2f}, max "
          f"{s['max_ratio']:.2f}) over {s['shapes']} shapes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
