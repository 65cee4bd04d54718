"""API keys of the public front doors (gRPC Router service and the OpenAI HTTP API).

Keys come from `--api-key KEY` (repeatable; PDSERVE_API_KEY as a JSON array) and/or a keys
file (`--api-keys-file`, PDSERVE_API_KEYS_FILE), JSON:

    {"keys": [{"name": "team-a", "key": "sk-...", "max_concurrent": 8,
               "tokens_per_minute": 200000}]}

`name` labels the key in metrics and logs (the secret never appears there); a key given on
the command line is named `key-<first 8 hex of its sha256>`. Per-key limits left out (or 0)
take the router-wide defaults (`--key-max-concurrent`, `--key-tokens-per-minute`; 0 =
unlimited). Clients send `authorization: Bearer KEY` (gRPC metadata or HTTP header). With no
key configured the API is open: every caller is the key `anonymous`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import UnauthenticatedError

AUTH_HEADER = "authorization"


@dataclass(frozen=True)
class ApiKey:
    name: str  # metric label / log field; never the secret
    max_concurrent: int = 0  # concurrent streams; 0 = unlimited
    tokens_per_minute: int = 0  # prompt + completion tokens per rolling minute; 0 = unlimited


ANONYMOUS = ApiKey("anonymous")


def key_id(secret: str) -> str:
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


class ApiKeys:
    def __init__(self, keys: Mapping[str, ApiKey] | None = None) -> None:
        self._keys = dict(keys or {})

    @property
    def open(self) -> bool:
        """No key configured: every request is accepted as ANONYMOUS."""
        return not self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def names(self) -> list[str]:
        """Every configured key's name (never a secret)."""
        return [k.name for k in self._keys.values()]

    @classmethod
    def load(
        cls,
        secrets: Iterable[str] = (),
        file: str | Path | None = None,
        *,
        max_concurrent: int = 0,
        tokens_per_minute: int = 0,
    ) -> ApiKeys:
        """Keys from the command line and the keys file; defaults fill unset limits. Raises
        ValueError naming the problem (bad file, duplicate name or key, empty key)."""
        keys: dict[str, ApiKey] = {}
        names: set[str] = set()

        def add(secret: str, name: str, mc: int, tpm: int) -> None:
            if not secret:
                raise ValueError("an API key must not be empty")
            if secret in keys:
                raise ValueError(f"API key {name!r} is configured twice")
            if name in names:
                raise ValueError(f"API key name {name!r} is used twice")
            if mc < 0 or tpm < 0:
                raise ValueError(f"API key {name!r}: limits must be >= 0")
            names.add(name)
            keys[secret] = ApiKey(name, mc or max_concurrent, tpm or tokens_per_minute)

        for secret in secrets:
            add(secret.strip(), key_id(secret.strip()), 0, 0)
        if file:
            for entry in read_keys_file(Path(file)):
                secret = str(entry.get("key") or "")
                add(
                    secret,
                    str(entry.get("name") or key_id(secret)),
                    int(entry.get("max_concurrent") or 0),
                    int(entry.get("tokens_per_minute") or 0),
                )
        return cls(keys)

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key of an `authorization` header/metadata value; UnauthenticatedError if it
        is missing or unknown (only when keys are configured)."""
        if self.open:
            return ANONYMOUS
        if not authorization:
            raise UnauthenticatedError(
                "missing API key: send the header 'authorization: Bearer KEY'"
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise UnauthenticatedError("malformed authorization: expected 'Bearer KEY'")
        found = None
        for secret, key in self._keys.items():  # constant time per key
            if hmac.compare_digest(secret.encode(), token.encode()):
                found = key
        if found is None:
            raise UnauthenticatedError("invalid API key")
        return found


def read_keys_file(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"API keys file {path}: {exc}") from exc
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(
            f'API keys file {path}: expected {{"keys": [{{"name": ..., "key": ...}}]}}'
        )
    return entries


def metadata_value(
    metadata: Iterable[tuple[str, Any]] | None, name: str = AUTH_HEADER
) -> str | None:
    """A gRPC invocation metadata value (str) by key."""
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None
