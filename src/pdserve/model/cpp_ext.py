"""Building this package's C++ kernels: `torch.utils.cpp_extension.load` on first use (g++ and
ninja), cached per torch / Python version and per ISA variant in `$TORCH_EXTENSIONS_DIR` or
`$PDSERVE_HOME/torch_extensions` (default ~/.cache/pdserve/torch_extensions). A failed build
raises; each kernel's loader decides its fallback."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch


def build_dir(name: str, variant: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        home = os.environ.get("PDSERVE_HOME") or Path.home() / ".cache" / "pdserve"
        root = str(Path(home) / "torch_extensions")
    tv = torch.__version__.replace("+", "_")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"{name}-{variant}-torch{tv}-{py}"


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: add the venv's bin (the `ninja` wheel) when the
    interpreter runs without an activated venv."""
    venv_ninja = Path(sys.executable).parent / "ninja"
    if shutil.which("ninja") is None and venv_ninja.exists():
        os.environ["PATH"] = f"{venv_ninja.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def build(name: str, variant: str, source: Path, flags: list[str]) -> Any:
    """The compiled module `{name}_{variant}` of one C++ source (built once, then cached)."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    path = build_dir(name, variant)
    path.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"{name}_{variant}",
        sources=[str(source)],
        extra_cflags=flags,
        build_directory=str(path),
        verbose=False,
    )
