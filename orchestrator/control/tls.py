"""The controller's own certificate authority: its API serves TLS wherever it listens beyond loopback.

Cloud nodes reach the API over networks tfsn does not own, and the heartbeat's answer carries the job's
command and environment (API keys). So one CA per $TFSN_HOME is made on the first start off loopback and
kept in $TFSN_HOME/tls (every file 0600, written whole): a restarted controller keeps it, and the agents
and workers that pin it carry on. It signs the server certificate for the names nodes use (the advertised
address, the bind host), made again, by the same CA, when those change. Nodes get the CA and its
fingerprint in their environment (`Authority.node_env`); the SDK's client trusts nothing else.

`cryptography` is imported by the functions that make or read certificates only: a CLI that never starts
a controller does not load it.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import ssl
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.sdk.client import CA_FINGERPRINT_ENV, CA_PEM_ENV, fingerprint

CA_KEY, CA_CERT = "ca.key", "ca.pem"
SERVER = "server.pem"         # the server's certificate and key in one file: replaced whole, never half
VALID_DAYS = 3650             # the server certificate too: a controller running for months must not expire
CLOCK_SKEW = datetime.timedelta(hours=1)   # a node whose clock is behind still accepts a new certificate
WILDCARDS = ("", "0.0.0.0", "::")          # bind hosts that listen on loopback too


class AuthorityError(Exception):
    """The CA on disk cannot be used (half of it is missing)."""


def folder(home: Path) -> Path:
    """Where a controller's CA and server certificate live."""
    return home / "tls"


def serves_tls(host: str) -> bool:
    """Whether an API bound to `host` serves TLS: everywhere but loopback, which no other machine reaches."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name: it names an interface other machines may reach
        return True


def server_names(host: str, advertise: str) -> list[str]:
    """The names the server certificate covers: the advertised address, the bind host, and loopback when
    the bind host is a wildcard (the controller's own machine reaches it there)."""
    names = [advertise, host] + (["127.0.0.1", "localhost"] if host in WILDCARDS else [])
    return list(dict.fromkeys(n for n in names if n))


@dataclass(frozen=True)
class Authority:
    """A controller's CA certificate, and the server's TLS context with the certificate it signed."""

    ca_pem: str
    server_context: ssl.SSLContext

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.ca_pem)

    def node_env(self) -> dict[str, str]:
        """What an agent (and the workers it starts) needs to trust this controller and nothing else."""
        return {CA_PEM_ENV: self.ca_pem, CA_FINGERPRINT_ENV: self.fingerprint}


def ensure_authority(home: Path, names: Iterable[str]) -> Authority:
    """The CA of `home` (made on first use) and a server certificate it signed covering `names` (made again
    when it does not cover them, is of another CA, or runs out)."""
    with _locked(home) as path:
        ca_key, ca_cert = _load_or_make_ca(path)
        wanted = list(names)
        if not _server_cert_fits(path, ca_cert, wanted):
            _make_server_cert(path, ca_key, ca_cert, wanted)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(path / SERVER)
        return Authority((path / CA_CERT).read_text(), context)


def ca_files(home: Path) -> dict[str, str]:
    """The CA's key and certificate as text (made on first use), to keep them elsewhere (the operator's Secret)."""
    with _locked(home) as path:
        _load_or_make_ca(path)
        return {name: (path / name).read_text() for name in (CA_KEY, CA_CERT)}


def restore_ca(home: Path, files: dict[str, str]) -> None:
    """Put a CA kept elsewhere (`ca_files`) back in `home`; the next `ensure_authority` signs with it."""
    with _locked(home) as path:
        for name in (CA_KEY, CA_CERT):
            _write_private(path / name, files[name].encode())


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[Path]:
    """The TLS folder of `home`, held by this process alone (two controllers starting at once make one CA)."""
    path = folder(home)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


def _load_or_make_ca(path: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    have = [(path / name).exists() for name in (CA_KEY, CA_CERT)]
    if all(have):
        key = serialization.load_pem_private_key((path / CA_KEY).read_bytes(), password=None)
        return key, x509.load_pem_x509_certificate((path / CA_CERT).read_bytes())
    if any(have):
        raise AuthorityError(f"{path} holds half a CA (one of {CA_KEY}, {CA_CERT} is missing). To fix: put the "
                             "missing file back, or delete both to make a new CA (nodes running now will refuse "
                             "the controller and their jobs restart on new nodes)")
    return _make_ca(path)


def _make_ca(path: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tfsn controller CA {os.urandom(4).hex()}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(path / CA_KEY, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    _write_private(path / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _server_cert_fits(path: Path, ca_cert: Any, names: list[str]) -> bool:
    """Whether the server certificate on disk was signed by this CA, covers `names` and has time left."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate((path / SERVER).read_bytes())
        cert.verify_directly_issued_by(ca_cert)
        covered = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    have = {str(n) for n in covered.get_values_for_type(x509.IPAddress)}
    have |= set(covered.get_values_for_type(x509.DNSName))
    fresh = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc) > datetime.timedelta(days=30)
    return fresh and {_san(n) for n in names} <= have


def _make_server_cert(path: Path, ca_key: Any, ca_cert: Any, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    sans = [x509.IPAddress(ipaddress.ip_address(n)) if _is_ip(n) else x509.DNSName(n) for n in names]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (_builder(subject, ca_cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(path / SERVER, cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _builder(subject: Any, issuer: Any, public_key: Any) -> Any:
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _san(name: str) -> str:
    """A name as the certificate lists it (an IP address in its canonical form)."""
    return str(ipaddress.ip_address(name)) if _is_ip(name) else name


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` whole (readers see the old file or the new) and readable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)   # a stale temporary file keeps its mode through O_CREAT
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
