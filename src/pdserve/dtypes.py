"""The one table of dtypes pdserve supports (torch imported only when a torch dtype is asked)."""

from __future__ import annotations

from typing import Any

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # dtype name -> bytes per element
DTYPE_NAMES = tuple(ITEMSIZE)


KV_RAW_DTYPES = {"int8": "int8", "fp8_e4m3": "uint8"}  # quantized KV: raw rows (kv/quant.py)


def torch_dtype(name: str) -> Any:
    """torch.<name> for a supported dtype name (a quantized KV dtype: the dtype of its raw
    rows); ValueError otherwise."""
    if name not in ITEMSIZE and name not in KV_RAW_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(ITEMSIZE)}")
    import torch

    return getattr(torch, KV_RAW_DTYPES.get(name, name))
