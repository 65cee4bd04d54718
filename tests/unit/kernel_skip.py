"""Skipping a test whose C++ kernel is not here, with the true reason (no compiler, not built,
not for this CPU, the OS refuses AMX); a kernel whose build is broken fails instead."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.model.cpp_ext import CppKernel


def require(kernel: CppKernel, variant: str | None = None) -> Any:
    """The prebuilt module of `variant` (default: this CPU's), else skip (or fail) with why."""
    st = kernel.status(variant)
    if st.module is not None:
        return st.module
    if st.build_broken:
        pytest.fail(str(st.reason))
    pytest.skip(str(st.reason))


def unless_loads(kernel: CppKernel, variant: str | None = None) -> pytest.MarkDecorator:
    """A skipif mark for a module or test: skip when the kernel does not load for a reason of
    the machine; a broken build is not skipped (its tests then fail, naming it)."""
    st = kernel.status(variant)
    return pytest.mark.skipif(st.module is None and not st.build_broken, reason=str(st.reason))
