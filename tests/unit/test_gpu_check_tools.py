"""The CPU-testable pieces of scripts/gpu-check.sh: the accelerator named by a CUDA device,
a profile's step shapes against the roofline (benchmarks/profile_vs_roofline.py), and the
script's skip on a machine without CUDA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.profile_vs_roofline import compare, hardware_from_name, shape_key

ROOT = Path(__file__).resolve().parents[2]


def test_the_accelerator_of_a_cuda_device_name():
    assert hardware_from_name("NVIDIA H100 80GB HBM3") == "h100"
    assert hardware_from_name("NVIDIA H200") == "h200"  # not taken for an H100
    assert hardware_from_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert hardware_from_name("NVIDIA L40S") == "l40s"
    assert hardware_from_name("cpu") is None


def test_profile_steps_against_the_roofline(tmp_path):
    from pdserve.costmodel.roofline import RooflineStep
    from pdserve.costmodel.shapes import load_model_config
    from pdserve.model.tiny import TinySpec, make_tiny

    model = make_tiny(tmp_path / "m", TinySpec(family="llama", vocab=512))
    roof = RooflineStep.build(load_model_config(str(model / "config.json")), "h100", "bfloat16")
    batches = [[[0, 64]], [[0, 64]], [[100, 1], [300, 1]], [[0, 256], [40, 1]]]
    # measured: twice the roofline for prompts, three times for decodes
    samples = [{"batch": b, "s": roof.step_s([tuple(x) for x in b]) * (2 if b[0][1] > 1 else 3)}
               for b in batches]  # fmt: skip
    out = compare(
        {"model": str(model), "dtype": "bfloat16", "engine": {"samples": samples}}, "h100"
    )
    rows = {r["shape"]: r for r in out["rows"]}
    assert rows[shape_key([[0, 64]])]["steps"] == 2
    assert rows[shape_key([[0, 64]])]["ratio"] == pytest.approx(2.0)
    assert rows[shape_key([[100, 1], [300, 1]])]["ratio"] == pytest.approx(3.0)
    assert out["summary"]["hardware"] == "h100" and out["summary"]["shapes"] == 3
    assert (out["summary"]["min_ratio"], out["summary"]["max_ratio"]) == pytest.approx((2.0, 3.0))
    json.dumps(out)  # the script's summary reads it as JSON


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with a GPU")
def test_gpu_check_skips_without_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_PY"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0
    assert out.stdout.strip().startswith("gpu-check: skipped: no CUDA device")
    assert len(out.stdout.strip().splitlines()) == 1
