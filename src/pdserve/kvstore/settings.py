"""KVStoreSettings: env PDSERVE_<FIELD> (capacity also PDSERVE_KVSTORE_CAPACITY_BYTES), flags
--<field-name> on top."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from pdserve.config import ServiceSettings


def _env(name: str) -> AliasChoices:
    return AliasChoices(f"PDSERVE_KVSTORE_{name.upper()}", f"PDSERVE_{name.upper()}")


class KVStoreSettings(ServiceSettings):
    """pdserve kvstore: host-memory KV block store (control over gRPC, bytes over UCX)."""

    # populate_by_name: flags arrive as field names, the environment through the aliases
    model_config = {**ServiceSettings.model_config, "populate_by_name": True}

    metrics_port: int = Field(
        0, ge=0, le=65535, validation_alias=_env("metrics_port"),
        description="Prometheus /metrics HTTP port (0 = off)",
    )  # fmt: skip
    port: int = Field(50060, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    capacity_bytes: int = Field(
        1 << 30, gt=0, validation_alias=_env("capacity_bytes"),
        description="block memory, allocated once at start",
    )  # fmt: skip
    block_bytes: int = Field(
        0, ge=0, validation_alias=_env("block_bytes"),
        description="bytes per block (0 = any size, arenas per size carved from the budget)",
    )  # fmt: skip
    disk_dir: str | None = Field(
        None, validation_alias=_env("disk_dir"),
        description="disk tier: a directory for block files (none = RAM only); blocks are "
        "written through to it, read back (verified) on a hit, and found again after a restart",
    )  # fmt: skip
    disk_bytes: int = Field(
        16 << 30, ge=0, validation_alias=_env("disk_bytes"),
        description="disk tier budget in block bytes (each file adds a ~300 B header)",
    )  # fmt: skip
    staging_bytes: int = Field(
        256 << 20, gt=0, validation_alias=_env("staging_bytes"),
        description="most bytes in flight in put/fetch staging buffers (beyond capacity)",
    )  # fmt: skip
    min_block_bytes: int = Field(
        256, ge=1, description="smallest block a put may declare (a real KV block is KBs)"
    )
    max_open_puts: int = Field(
        1024, ge=1, description="most puts begun and not yet committed; more are rejected"
    )
    put_timeout_s: float = Field(
        30.0, gt=0, description="drop a put not committed within this time, seconds"
    )
    commit_wait_s: float = Field(
        5.0, gt=0, description="CommitPut: longest wait for the put's bytes, seconds"
    )
    send_timeout_s: float = Field(10.0, gt=0, description="Fetch: UCX send timeout, seconds")
