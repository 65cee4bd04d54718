"""A development PKI for the internal plane: one cluster CA and one certificate per service.

Every certificate names its holder in a SAN URI `spiffe://pdserve/<role>/<name>`; the role
(router, worker, kvstore, admin) is what the authorization table of `pdserve.rpc.authz`
checks, the whole URI is the peer's identity (e.g. a worker's registration is bound to it).
Every certificate also carries the DNS name `pdserve.internal` (clients verify the server
against that name, wherever it runs), `localhost`, its own name and 127.0.0.1, plus the
addresses or DNS names of the host it serves on when given (`hosts`: a multi-host layout,
where tools that verify a server by the address they dial need its address in the SAN).

Files in DIR: `ca.crt`, `ca.key`, `<name>.crt`, `<name>.key` (keys: EC P-256, PEM, mode 0600).
`pdserve certs make DIR` (pdserve.cli.certs) is the command line; the launcher calls
`make_dev_pki` for `pdserve up`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "pdserve"
SERVER_NAME = "pdserve.internal"  # DNS SAN of every certificate; clients check this name
ROLES = ("router", "worker", "kvstore", "admin")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HOST_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
VALID_DAYS = 365
DEFAULT_SERVICES: tuple[tuple[str, str], ...] = (
    ("router", "router"),
    ("kvstore", "kvstore"),
    ("worker", "worker"),
    ("admin", "admin"),
)


@dataclass(frozen=True)
class Identity:
    """Who a peer is, from its certificate: role + name."""

    role: str
    name: str

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity | None:
        prefix = f"spiffe://{TRUST_DOMAIN}/"
        if not uri.startswith(prefix):
            return None
        role, _, name = uri[len(prefix) :].partition("/")
        if role not in ROLES or not NAME_RE.fullmatch(name):
            return None
        return cls(role, name)

    def __str__(self) -> str:
        return self.uri


def _check(role: str, name: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"name must match {NAME_RE.pattern}, got {name!r}")


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)  # clock skew


def make_ca(
    directory: str | os.PathLike[str],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Create (or load, when present) DIR/ca.crt + DIR/ca.key."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    crt, key = d / "ca.crt", d / "ca.key"
    if crt.exists() and key.exists():
        return load_ca(d)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve cluster CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(key, _key_pem(ca_key), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM))
    return cert, ca_key


def load_ca(
    directory: str | os.PathLike[str],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    d = Path(directory)
    cert = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{d / 'ca.key'}: expected an EC key")
    return cert, key


def host_san(host: str) -> x509.GeneralName:
    """The SAN entry naming `host`: an IP address (v4 or v6) or a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not HOST_RE.fullmatch(host):
        raise ValueError(f"host must be an IP address or a DNS name, got {host!r}")
    return x509.DNSName(host.lower())


def make_cert(
    directory: str | os.PathLike[str],
    role: str,
    name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
    hosts: Iterable[str] = (),
) -> Identity:
    """Write DIR/<name>.crt + DIR/<name>.key signed by the CA in DIR (created if missing)."""
    _check(role, name)
    d = Path(directory)
    ca_cert, ca_key = ca if ca is not None else make_ca(d)
    key = ec.generate_private_key(ec.SECP256R1())
    ident = Identity(role, name)
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(ident.uri),
        x509.DNSName(SERVER_NAME),
        x509.DNSName("localhost"),
        x509.DNSName(name),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for host in dict.fromkeys(hosts):  # each once, in order
        san = host_san(host)
        if san not in sans:
            sans.append(san)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(d / f"{name}.key", _key_pem(key), private=True)
    _write(d / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    return ident


def make_dev_pki(
    directory: str | os.PathLike[str],
    services: Iterable[tuple[str, str]] = DEFAULT_SERVICES,
    hosts: dict[str, Sequence[str]] | None = None,
    common_hosts: Sequence[str] = (),
) -> list[Identity]:
    """A CA (reused if DIR already has one) and a certificate per (role, name). The
    certificate of `name` also names `hosts[name]` and `common_hosts` (IP addresses or DNS
    names) in its SAN."""
    ca = make_ca(directory)
    per = hosts or {}
    return [
        make_cert(directory, role, name, ca, [*per.get(name, ()), *common_hosts])
        for role, name in services
    ]


def san_hosts(pem: bytes) -> list[str]:
    """The IP addresses and DNS names in a PEM certificate's SAN, in order."""
    cert = x509.load_pem_x509_certificate(pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [
        *map(str, san.get_values_for_type(x509.IPAddress)),
        *san.get_values_for_type(x509.DNSName),
    ]


def identity_of_pem(pem: bytes) -> Identity | None:
    """The pdserve identity in a PEM certificate's SAN URIs (None when it has none)."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        ident = Identity.from_uri(uri)
        if ident is not None:
            return ident
    return None
