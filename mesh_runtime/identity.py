"""Who is calling: the role and name a peer's certificate gives it.

A rollmesh certificate names its holder as a SPIFFE-style URI SAN,
``spiffe://rollmesh/<role>/<name>``. :func:`peer_identity` reads it from a
call's TLS auth context (mutual TLS: the handshake has already checked that
the certificate chains to the mesh's CA and has not expired). The identity of
the call being served is also kept in a context variable
(:func:`current_identity`), so a servicer can check what depends on the
request itself (an agent registers only the node its certificate names).
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ROLES = ("controller", "lb", "replica-agent", "trainer-agent", "client", "operator", "operator-readonly")
"""Every role a certificate can name."""

SCHEME = "spiffe://rollmesh/"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class IdentityError(ValueError):
    """A certificate's identity is missing or malformed."""


@dataclass(frozen=True)
class Identity:
    role: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.role}/{self.name}"

    def check(self) -> None:
        if self.role not in ROLES:
            raise IdentityError(f"unknown role {self.role[:32]!r}; roles: {', '.join(ROLES)}")
        if not _NAME.match(self.name):
            raise IdentityError(f"name {self.name[:32]!r} must be 1-128 letters, digits, '.', '_' or '-', "
                                "starting with a letter or digit")

    def __str__(self) -> str:
        return self.uri


def parse_uri(uri: str) -> Identity | None:
    """The identity a ``spiffe://rollmesh/<role>/<name>`` URI names, or None for any other URI."""
    if not uri.startswith(SCHEME):
        return None
    rest = uri[len(SCHEME):].split("/")
    if len(rest) != 2:
        return None
    identity = Identity(*rest)
    try:
        identity.check()
    except IdentityError:
        return None
    return identity


@functools.lru_cache(maxsize=4096)
def identity_from_pem(pem: bytes) -> Identity | None:
    """The rollmesh identity in a PEM certificate's URI SANs (None if it has none); cached: one parse
    per peer certificate, not per call."""
    from cryptography import x509  # noqa: PLC0415

    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = {parse_uri(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)} - {None}
    return found.pop() if len(found) == 1 else None   # two rollmesh identities in one certificate: none


def peer_identity(auth_context: Mapping[str, Iterable[bytes]]) -> Identity | None:
    """The identity of a TLS peer from ``context.auth_context()`` (None: no TLS, or no rollmesh identity)."""
    uris = auth_context.get("peer_uri")
    if uris is not None:   # gRPC lists the verified certificate's URI SANs: no parsing per call
        found = {parse_uri(u.decode("utf-8", "replace")) for u in uris} - {None}
        return found.pop() if len(found) == 1 else None
    pems = list(auth_context.get("x509_pem_cert") or [])
    return identity_from_pem(pems[0]) if pems else None


_current: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("rollmesh_identity", default=None)


def current_identity() -> Identity | None:
    """The verified identity of the caller of the RPC being served (None on an insecure server)."""
    return _current.get()


def set_current_identity(identity: Identity | None) -> contextvars.Token:
    return _current.set(identity)
