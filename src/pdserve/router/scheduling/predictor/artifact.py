"""Byte-for-byte reproducible storage of a predictor artifact: `model.json`
(sorted keys) and `weights.npz` (a zip with fixed timestamps, arrays in name
order), so `pdserve predictor train` twice gives identical files."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

META = "model.json"
WEIGHTS = "weights.npz"


def save(out_dir: str | Path, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n")
    with zipfile.ZipFile(out / WEIGHTS, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())
    return out


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    p = Path(path)
    meta = json.loads((p / META).read_text())
    with np.load(p / WEIGHTS, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta, arrays
