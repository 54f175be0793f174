"""A development certificate authority and the certificates of a mesh (``rollmesh certs``).

``rollmesh certs create-ca --dir D`` writes ``D/ca.pem`` and ``D/ca.key``;
``rollmesh certs create --dir D --role ROLE --name NAME [--host H ...] [--days N]``
signs ``D/<role>-<name>.pem`` and ``.key`` with it. Every certificate names its
holder as a SPIFFE-style URI SAN, ``spiffe://rollmesh/<role>/<name>``
(:mod:`mesh_runtime.identity`), and is good for both ends of a connection
(server and client authentication), so one certificate serves a process's
listener and its outgoing channels. ``--host`` adds DNS names or IP addresses
the holder is reached at; without any, ``localhost``, ``127.0.0.1`` and ``::1``
are used. Keys are ECDSA P-256, written with mode 0600.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .identity import ROLES, Identity

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_CERT, CA_KEY = "ca.pem", "ca.key"


class CertError(ValueError):
    """A certificate cannot be made as asked (no CA, bad role or name, bad host)."""


def _write(path: Path, data: bytes, *, private: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)   # a reader (certificate reload) never sees half a file


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(directory: str | Path, *, days: int = 3650, common_name: str = "rollmesh development CA",
              overwrite: bool = False) -> tuple[Path, Path]:
    """Write a self-signed CA (``ca.pem``, ``ca.key``) into ``directory``; returns both paths."""
    if days < 1:
        raise CertError(f"--days must be at least 1, got {days}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    if not overwrite and (cert_path.exists() or key_path.exists()):
        raise CertError(f"{cert_path} already exists; a new CA would invalidate every certificate it signed")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rollmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path, key_path


def _host_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if not host or len(host) > 253 or not all(
            label and len(label) <= 63 and all(c.isalnum() or c == "-" for c in label.replace("*", "a", 1))
            for label in labels):
        raise CertError(f"--host {host[:64]!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host)


def create_cert(directory: str | Path, role: str, name: str, *, hosts: Sequence[str] = (), days: int = 365,
                valid_from: dt.datetime | None = None, ca_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Sign a certificate for ``spiffe://rollmesh/<role>/<name>`` with the CA in ``ca_dir`` (default
    ``directory``); writes ``<role>-<name>.pem`` and ``.key`` into ``directory`` and returns both paths.

    ``valid_from`` (tests) backdates the certificate, e.g. to make one that has already expired.
    """
    identity = Identity(role, name)
    identity.check()
    if days < 1:
        raise CertError(f"--days must be at least 1, got {days}")
    ca_root = Path(ca_dir or directory)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_root / CA_CERT).read_bytes())
        ca_key = serialization.load_pem_private_key((ca_root / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError:
        raise CertError(f"no CA in {ca_root} (run `rollmesh certs create-ca --dir {ca_root}` first)") from None
    entries = [x509.UniformResourceIdentifier(identity.uri)] + [_host_entry(h) for h in (hosts or DEFAULT_HOSTS)]
    key = ec.generate_private_key(ec.SECP256R1())
    start = valid_from or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rollmesh"),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                                     x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(entries), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / f"{role}-{name}.pem", out / f"{role}-{name}.key"
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path, key_path


# ------------------------------------------------------------------ the `rollmesh certs` tool
HELP = "make a development CA and the certificates of a mesh (mutual TLS)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="certs_command", required=True, metavar="{create-ca,create}")
    ca = sub.add_parser("create-ca", help="write DIR/ca.pem and DIR/ca.key")
    ca.add_argument("--dir", required=True, metavar="DIR")
    ca.add_argument("--days", type=int, default=3650, help="validity (3650)")
    ca.add_argument("--overwrite", action="store_true", help="replace an existing CA")
    cert = sub.add_parser("create", help="write DIR/<role>-<name>.pem and .key, signed by DIR's CA")
    cert.add_argument("--dir", required=True, metavar="DIR")
    cert.add_argument("--role", required=True, choices=ROLES)
    cert.add_argument("--name", required=True, help="e.g. the node id of an agent")
    cert.add_argument("--host", action="append", default=[], metavar="H",
                      help="DNS name or IP the holder is reached at (repeatable; default localhost, 127.0.0.1, ::1)")
    cert.add_argument("--days", type=int, default=365, help="validity (365)")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    try:
        if args.certs_command == "create-ca":
            paths = create_ca(args.dir, days=args.days, overwrite=args.overwrite)
        else:
            paths = create_cert(args.dir, args.role, args.name, hosts=args.host, days=args.days)
    except (CertError, ValueError) as err:
        print(f"rollmesh certs: error: {err}", file=sys.stderr, flush=True)
        return 2
    for path in paths:
        print(path)
    return 0
