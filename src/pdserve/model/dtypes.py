"""The one table of dtypes pdserve supports (torch imported only when a torch dtype is asked)."""

from __future__ import annotations

from typing import Any

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # dtype name -> bytes per element
DTYPE_NAMES = tuple(ITEMSIZE)


def torch_dtype(name: str) -> Any:
    """torch.<name> for a supported dtype name; ValueError otherwise."""
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(ITEMSIZE)}")
    import torch

    return getattr(torch, name)
