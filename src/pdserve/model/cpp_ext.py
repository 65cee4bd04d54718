"""This package's C++ kernels: one loader class (`CppKernel`) for all of them.

Building and loading are two steps:
- `CppKernel.build(variant)` compiles one ISA variant with `torch.utils.cpp_extension.load`
  (a C++ compiler and ninja) into `build_dir(...)` and writes a stamp there (a hash of the
  sources, the flags, torch and Python). `pdserve kernels build` (run by `make setup` and the
  Dockerfile) builds every kernel this CPU can run. It never raises: without a compiler a
  kernel is reported as falling back, and why.
- `CppKernel.load(variant)` only imports a prebuilt module whose stamp matches the sources:
  it never compiles (no compiler needed at run time). When the module is missing, stale or
  refused (e.g. the OS denies AMX) it returns None and `why_unavailable` says why, in words a
  log line, a test skip and `pdserve status` can show.

Builds are cached per kernel, ISA variant, torch and Python version in `$TORCH_EXTENSIONS_DIR`
or `$PDSERVE_HOME/torch_extensions` (default ~/.cache/pdserve/torch_extensions).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.logging import get_logger

_log = get_logger(__name__)
STAMP = "pdserve-build.json"  # in a build dir: what was built, from which sources
BUILD_HINT = "run `pdserve kernels build`"


def build_dir(name: str, variant: str) -> Path:
    """The build directory of one module `{name}_{variant}` (name: e.g. pdserve_fixed_attn)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        home = os.environ.get("PDSERVE_HOME") or Path.home() / ".cache" / "pdserve"
        root = str(Path(home) / "torch_extensions")
    tv = torch.__version__.replace("+", "_")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"{name}-{variant}-torch{tv}-{py}"


def compiler() -> str:
    """The C++ compiler torch's extension builder runs: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


def missing_tool() -> str | None:
    """Why nothing can be compiled here (no compiler, no ninja), or None."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx} not found; install g++ or set CXX)"
    _ninja_on_path()
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    return None


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: add the venv's bin (the `ninja` wheel) when the
    interpreter runs without an activated venv."""
    venv_ninja = Path(sys.executable).parent / "ninja"
    if shutil.which("ninja") is None and venv_ninja.exists():
        os.environ["PATH"] = f"{venv_ninja.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _import_file(name: str, path: Path) -> Any:
    """The extension module `name` from `path` (the one already imported, e.g. by a build in
    this process, when it is that file)."""
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")) == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(name: str, variant: str, source: Path, flags: list[str]) -> Any:
    """Compile (or find up to date) and import the module `{name}_{variant}` of one source;
    raises when it cannot. The low-level step of `CppKernel.build` (lab scripts use it for
    baseline builds of older sources)."""
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


@dataclass(frozen=True)
class LoadStatus:
    """What `CppKernel.load` found: the module, or why not."""

    module: Any
    state: str  # loaded | cpu | missing | stale | failed | broken | refused
    reason: str | None  # None when loaded

    @property
    def build_broken(self) -> bool:
        """A compiler was there and the build failed, or its module does not import: a bug
        in the kernel or its flags (the other states are conditions of the machine)."""
        return self.state in ("failed", "broken")


@dataclass(frozen=True)
class BuildResult:
    """One line of `pdserve kernels build`."""

    kernel: str
    variant: str | None
    state: str  # built | cached | unsupported | failed (the last two: the fallback runs)
    reason: str = ""  # why not built, or where it lies
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state in ("built", "cached")


class CppKernel:
    """One C++ extension: its source (and the headers it includes), a compiler-flag list per
    ISA variant (in order of preference), which variants this CPU runs, and an optional check
    run once the module is imported (`init(module) -> reason or None`)."""

    def __init__(
        self,
        name: str,
        source: Path,
        flags: Mapping[str, Sequence[str]],
        headers: Sequence[Path] = (),
        cpu_lacks: Callable[[str], str | None] = lambda variant: None,
        init: Callable[[Any], str | None] | None = None,
        not_served: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.name = name  # short name: fixed_attn, amx_linear, ...
        self.source = source
        self.flags = {v: list(f) for v, f in flags.items()}
        self.headers = tuple(headers)
        self._cpu_lacks = cpu_lacks
        self._init = init
        self._not_served = not_served  # why no engine here serves it (then only --all builds it)
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadStatus] = {}  # variant -> what load found

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(self.flags)

    def cpu_lacks(self, variant: str) -> str | None:
        """Why this CPU cannot run `variant` (e.g. "no AMX on this CPU"), or None."""
        if variant not in self.flags:
            return f"no build variant {variant!r} (one of {', '.join(self.flags)})"
        return self._cpu_lacks(variant)

    def default_variant(self) -> str | None:
        """The preferred variant this CPU runs, or None."""
        return next((v for v in self.variants if self.cpu_lacks(v) is None), None)

    def not_served(self) -> str | None:
        """Why no engine on this CPU serves this kernel although it runs here (e.g. the
        AVX512-BF16 linear where AMX is), or None; `pdserve kernels build` then skips it."""
        return self._not_served()

    def runnable_variants(self) -> list[str]:
        return [v for v in self.variants if self.cpu_lacks(v) is None]

    def module_name(self, variant: str) -> str:
        return f"pdserve_{self.name}_{variant}"

    def build_dir(self, variant: str) -> Path:
        return build_dir(f"pdserve_{self.name}", variant)

    def stamp(self, variant: str) -> str:
        """Hash of everything a build of `variant` depends on (sources, flags, torch, Python)."""
        h = hashlib.sha256()
        for path in (self.source, *self.headers):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        h.update(" ".join(self.flags[variant]).encode())
        h.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ run time
    def load(self, variant: str | None = None) -> Any | None:
        """The prebuilt module of `variant` (default: this CPU's preferred one), or None. Never
        compiles. Tried once per variant and process; the reason is logged once."""
        return self._try(variant).module

    def available(self, variant: str | None = None) -> bool:
        return self.load(variant) is not None

    def why_unavailable(self, variant: str | None = None) -> str | None:
        """None when `load(variant)` gives the module, else the reason, e.g.
        "fixed_attn kernel (avx512bf16) not built: no C++ compiler (c++ not found; ...)"."""
        return self._try(variant).reason

    def status(self, variant: str | None = None) -> LoadStatus:
        """`load`'s outcome: the module, or a state and the reason."""
        return self._try(variant)

    def forget(self) -> None:
        """Drop what `load` remembered (after a build, or in tests)."""
        with self._lock:
            self._loaded.clear()

    def _try(self, variant: str | None) -> LoadStatus:
        variant = variant or self.default_variant()
        key = variant or ""
        with self._lock:
            if key not in self._loaded:
                t0 = time.perf_counter()
                st = self._loaded[key] = self._import(variant)
                if st.module is not None:
                    _log.info(
                        "kernel loaded", kernel=self.name, variant=variant,
                        load_s=round(time.perf_counter() - t0, 3),
                    )  # fmt: skip
                else:
                    _log.info("kernel unavailable", kernel=self.name, reason=st.reason)
            return self._loaded[key]

    def _import(self, variant: str | None) -> LoadStatus:
        what = f"{self.name} kernel"
        if variant is None:
            reasons = sorted({r for v in self.variants if (r := self.cpu_lacks(v))})
            return LoadStatus(None, "cpu", f"{what}: {' / '.join(reasons)}")
        lacks = self.cpu_lacks(variant)
        if lacks is not None:
            return LoadStatus(None, "cpu", f"{what} ({variant}): {lacks}")
        state, why = self._state(variant)
        if why is not None:
            return LoadStatus(None, state, f"{what} ({variant}) {why}")
        path = self.build_dir(variant) / f"{self.module_name(variant)}.so"
        try:
            module = _import_file(self.module_name(variant), path)
        except Exception as exc:  # a broken or foreign .so
            why = f"cannot be loaded: {type(exc).__name__}: {exc}"
            return LoadStatus(None, "broken", f"{what} ({variant}) {why}")
        refused = self._init(module) if self._init is not None else None
        if refused is not None:
            return LoadStatus(None, "refused", f"{what} ({variant}): {refused}")
        return LoadStatus(module, "loaded", None)

    def is_built(self, variant: str) -> bool:
        """A current build of `variant` is cached (then `build` only reports it)."""
        return self._state(variant)[0] == "built"

    def _state(self, variant: str) -> tuple[str, str | None]:
        """("built", None) when a current build of `variant` lies in its build dir, else
        (state, what is wrong): missing, stale or failed."""
        d = self.build_dir(variant)
        served = variant == self.default_variant() and self.not_served() is None
        hint = BUILD_HINT if served else BUILD_HINT[:-1] + " --all`"
        try:
            record = json.loads((d / STAMP).read_text())
        except (OSError, ValueError):
            no_tool = missing_tool()
            return "missing", f"not built: {no_tool}" if no_tool else f"not built ({hint})"
        if record.get("stamp") != self.stamp(variant):
            return "stale", f"built from other sources or flags ({hint})"
        if record.get("error"):
            return "failed", f"did not build: {record['error']}"
        if not (d / f"{self.module_name(variant)}.so").exists():
            return "missing", f"not built ({hint})"
        return "built", None

    # ------------------------------------------------------------------ build time
    def build(self, variant: str | None = None, force: bool = False) -> BuildResult:
        """Compile `variant` (default: this CPU's preferred one) unless a current build is
        cached. Never raises: a failure is a result (state "failed") and is recorded, so that
        `load` names it."""
        variant = variant or self.default_variant()
        if variant is None or self.cpu_lacks(variant) is not None:
            lacks = self.cpu_lacks(variant) if variant else self._import(None).reason
            return BuildResult(self.name, variant, "unsupported", str(lacks))
        d, stamp = self.build_dir(variant), self.stamp(variant)
        if not force and self.is_built(variant):
            return BuildResult(self.name, variant, "cached", str(d))
        missing = missing_tool()
        if missing is not None:
            return BuildResult(self.name, variant, "failed", missing)
        if force:  # ninja would find the old objects up to date
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            build(f"pdserve_{self.name}", variant, self.source, self.flags[variant])
            error = ""
        except Exception as exc:  # compiler errors, an assembler without AMX, ...
            error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        d.mkdir(parents=True, exist_ok=True)
        (d / STAMP).write_text(json.dumps({"stamp": stamp, "error": error}))
        self.forget()
        seconds = time.perf_counter() - t0
        if error:
            return BuildResult(self.name, variant, "failed", error, seconds)
        return BuildResult(self.name, variant, "built", str(d), seconds)
