"""Attention backends behind one interface (see base.AttentionBackend).

`select_backend(device, ...)`: "torch" on CPU, "flashinfer" on CUDA when importable.
flashinfer is imported only inside its own module and only for a cuda device.
"""

from __future__ import annotations

# aliased: importing the submodule `.torch` rebinds the name `torch` in this package
import torch as _torch

from pdserve.model.attention.base import AttentionBackend
from pdserve.model.attention.metadata import AttentionMetadata
from pdserve.model.attention.torch import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "auto_backend_name",
    "select_backend",
]


def auto_backend_name(device: _torch.device | str) -> str:
    """The automatic choice: "flashinfer" on a cuda device where it imports, else "torch"."""
    if _torch.device(device).type == "cuda":
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    return "torch"


def select_backend(
    device: _torch.device | str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    name: str | None = None,
) -> AttentionBackend:
    """name: None = automatic (flashinfer on cuda if installed, else torch), "torch" or
    "flashinfer" (cuda only; raises if unavailable)."""
    device = _torch.device(device)
    if name is None:
        name = auto_backend_name(device)
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer backend needs a cuda device")
        from pdserve.model.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(num_heads, num_kv_heads, head_dim, device)
    raise ValueError(f"unknown attention backend {name!r} (torch | flashinfer)")
