"""Mutual TLS of the internal plane, with grpc's own SSL credentials.

A service finds its material from settings (`--tls-dir DIR` [+ `--tls-name NAME`], or the
three explicit files `--tls-ca-file/--tls-cert-file/--tls-key-file`); `--insecure` turns TLS
off for local debugging (loudly). With neither, a service refuses to start: an internal plane
that anyone can call is never a silent default.

Servers require a client certificate signed by the cluster CA (`require_client_auth=True`);
clients verify the server against the cluster CA and the name `pdserve.internal` (every
certificate carries it, so a worker dialled by IP still verifies). Who the peer is comes from
its certificate's SPIFFE-style URI (`pdserve.rpc.certs.Identity`); what it may call is
`pdserve.rpc.authz`.

Process-wide client credentials: `configure_client(...)` (called once by the service runner)
makes every `pdserve.rpc.channels.make_channel` channel of the process use them, so the
router's worker channels, the workers' registration and kvstore channels all speak mTLS
without each call site knowing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from pdserve.logging import get_logger
from pdserve.rpc.certs import SERVER_NAME, Identity

_log = get_logger(__name__)

TARGET_NAME_OPTION = ("grpc.ssl_target_name_override", SERVER_NAME)
INSECURE_WARNING = (
    "INSECURE: TLS is OFF on the internal plane (--insecure). Anyone who can reach the "
    "internal ports can register fake workers, control workers and write to the kvstore. "
    "Use this for local debugging only."
)


class TlsConfigError(ValueError):
    """TLS settings are missing or inconsistent."""


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str], name: str) -> TlsFiles:
        d = Path(directory)
        return cls(d / "ca.crt", d / f"{name}.crt", d / f"{name}.key")

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()
        except OSError as exc:
            raise TlsConfigError(f"cannot read TLS material: {exc}") from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        ca, cert, key = self.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(ca, key, cert)

    def identity(self) -> Identity | None:
        from pdserve.rpc.certs import identity_of_pem

        return identity_of_pem(self.read()[1])


def files_from_settings(settings: Any, default_name: str) -> TlsFiles | None:
    """The TLS files a service uses, or None when it runs `--insecure`. Raises
    TlsConfigError when nothing is configured (and not insecure) or a file is missing."""
    explicit = (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    if settings.insecure:
        if settings.tls_dir or any(explicit):
            raise TlsConfigError("--insecure contradicts --tls-dir / --tls-*-file: pick one")
        return None
    if any(explicit):
        if not all(explicit):
            raise TlsConfigError("--tls-ca-file, --tls-cert-file and --tls-key-file go together")
        files = TlsFiles(*(Path(p) for p in explicit))  # type: ignore[arg-type]
    elif settings.tls_dir:
        files = TlsFiles.in_dir(settings.tls_dir, settings.tls_name or default_name)
    else:
        raise TlsConfigError(
            "no TLS material for the internal plane: set --tls-dir DIR (env PDSERVE_TLS_DIR; "
            "`pdserve certs make DIR` creates one) or the --tls-*-file flags; "
            "--insecure (env PDSERVE_INSECURE=1) turns TLS off for local debugging"
        )
    for path in (files.ca, files.cert, files.key):
        if not path.is_file():
            raise TlsConfigError(f"TLS file not found: {path}")
    return files


# ---------------------------------------------------------------- process-wide client side

_client_credentials: grpc.ChannelCredentials | None = None


def configure_client(files: TlsFiles | None) -> None:
    """Make every internal channel of this process (make_channel) use mTLS with `files`
    (None: plaintext, the --insecure mode)."""
    global _client_credentials
    _client_credentials = files.channel_credentials() if files is not None else None


def client_credentials() -> grpc.ChannelCredentials | None:
    return _client_credentials


def secure_channel(
    addr: str, files: TlsFiles, options: list[tuple[str, Any]] | None = None
) -> aio.Channel:
    """An mTLS grpc.aio channel with `files` (e.g. a test or an admin tool)."""
    return aio.secure_channel(
        addr, files.channel_credentials(), options=[*(options or []), TARGET_NAME_OPTION]
    )


def secure_channel_sync(addr: str, files: TlsFiles) -> grpc.Channel:
    """A blocking mTLS channel with `files`."""
    return grpc.secure_channel(addr, files.channel_credentials(), options=[TARGET_NAME_OPTION])


# ---------------------------------------------------------------- server side: who is calling


def peer_identity(context: aio.ServicerContext) -> Identity | None:
    """The caller's identity from its verified client certificate (None on a plaintext
    connection or a certificate without a pdserve URI)."""
    try:
        auth = context.auth_context()
    except Exception:
        return None
    for key in ("peer_spiffe_id", "peer_uri", "x509_subject_alternative_name"):
        for raw in auth.get(key, ()):
            text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
            ident = Identity.from_uri(text)
            if ident is not None:
                return ident
    return None


def log_insecure() -> None:
    _log.warning(INSECURE_WARNING)
