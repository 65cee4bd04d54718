"""Zero-copy byte views of transfer buffers (numpy arrays, CPU torch tensors). Torch-free:
torch is only touched when the caller passes a tensor."""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_torch_tensor(buf: Any) -> bool:
    return type(buf).__module__.startswith("torch") and hasattr(buf, "untyped_storage")


def as_bytes(buf: Any, *, writable: bool = False) -> np.ndarray:
    """A flat uint8 numpy view sharing memory with `buf` (never a copy).

    Accepts numpy arrays, CPU torch tensors (any dtype, bfloat16 included) and objects with
    the buffer protocol (bytes only when `writable` is False). Raises ValueError for
    non-contiguous or device buffers, since a silent copy would send or fill the wrong memory.
    """
    if _is_torch_tensor(buf):
        if buf.device.type != "cpu":
            raise ValueError(f"tensor must be on the CPU, got {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous")
        flat = buf.reshape(-1)
        if flat.element_size() != 1:
            import torch

            flat = flat.view(torch.uint8)  # bf16/f32 -> bytes: a view, same storage
        return flat.detach().numpy().view(np.uint8).reshape(-1)
    arr = np.asarray(memoryview(buf)) if not isinstance(buf, np.ndarray) else buf
    if not arr.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("receive buffer is read-only")
    return arr.reshape(-1).view(np.uint8)
