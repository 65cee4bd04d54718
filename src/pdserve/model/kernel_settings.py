"""The switches of the forward pass's kernels: one settings group, torch-free.

Each field is a flag of the worker (`--no-amx-linear`, `--attn-kernel scalar`) and keeps its
`PDSERVE_<FIELD>` environment name (`PDSERVE_AMX_LINEAR=0`). They only say what may run;
`pdserve.model.kernels.select_kernels` decides what does, once per engine, from these, the
dtype, the device, batch invariance, the CPU and the prebuilt kernels. In-process engines
without a settings object (`EngineConfig.kernels=None`, `pdserve generate --model`, tests)
read the same names from the environment (`KernelSettings.from_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from pdserve.config import ENV_PREFIX, SettingsError, SettingsGroup

AttnKernel = Literal["auto", "avx512", "scalar", "off"]


class KernelSettings(SettingsGroup):
    """Kernel switches (what may run; `pdserve kernels` shows what does and why)."""

    pack_weights: bool = Field(
        True,
        description="CPU: linears on prepacked weights (oneDNN or the bf16 kernels); "
        "--no-pack-weights: plain torch linears (fp32 then not batch-invariant)",
    )
    attn_kernel: AttnKernel = Field(
        "auto",
        description="batch-invariant attention on the fused C++ kernel: auto (the build for "
        "this CPU), avx512 or scalar (force a build), off (the torch fixed path)",
    )
    amx_linear: bool = Field(
        True, description="bf16 invariant linears on the AMX kernel (CPUs with AMX)"
    )
    avx512_bf16_linear: bool = Field(
        True,
        description="bf16 invariant linears on the AVX512-BF16 kernel (CPUs with it and no AMX)",
    )
    bf16_pointwise: bool = Field(
        True, description="bf16 on AVX-512: fused norm / RoPE / SiLU kernels (off: torch ops)"
    )
    direct_loop: bool = Field(
        True, description="call the layers' kernels directly when every op has one"
    )

    @field_validator("attn_kernel", mode="before")
    @classmethod
    def _legacy_values(cls, value: Any) -> Any:
        """PDSERVE_ATTN_KERNEL=1 / 0 (its former spelling) mean auto / off."""
        return {"1": "auto", "0": "off"}.get(value, value) if isinstance(value, str) else value

    @staticmethod
    def env_name(field: str) -> str:
        return f"{ENV_PREFIX}{field.upper()}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The `PDSERVE_*` values set in `environ` (default: os.environ), defaults elsewhere."""
        env = os.environ if environ is None else environ
        values = {f: env[cls.env_name(f)] for f in cls.model_fields if cls.env_name(f) in env}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            bad = "; ".join(
                f"{cls.env_name(str(e['loc'][0]))}={e.get('input')!r}: {e['msg']}"
                for e in exc.errors()
            )
            raise SettingsError(f"invalid kernel setting: {bad}") from None

    def switch(self, field: str) -> str:
        """How a switch that is off reads in a reason: `PDSERVE_AMX_LINEAR=0`."""
        value = getattr(self, field)
        return f"{self.env_name(field)}={'0' if value is False else value}"
