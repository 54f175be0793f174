"""The throwaway CA of a local mesh (``rollmesh train``, ``rollmesh up``): made on first use in the run directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mesh_runtime import certs
from mesh_runtime.config import TlsConfig


class LocalPki:
    """``root/ca.pem`` and one certificate per identity, each made the first time it is asked for."""

    def __init__(self, root: Path, *, ca_name: str = "rollmesh local CA") -> None:
        self.root = root
        self._ca_name = ca_name

    def section(self, role: str, name: str, hosts: Sequence[str] = ()) -> dict[str, str]:
        """The ``tls`` config section of ``spiffe://rollmesh/<role>/<name>``, valid for loopback and
        ``hosts`` (made the first time)."""
        if not (self.root / certs.CA_CERT).exists():
            certs.create_ca(self.root, common_name=self._ca_name)
        cert, key = self.root / f"{role}-{name}.pem", self.root / f"{role}-{name}.key"
        if not cert.exists():
            cert, key = certs.create_cert(self.root, role, name, hosts=["127.0.0.1", "localhost", *hosts], days=30)
        return {"cert": str(cert), "key": str(key), "ca": str(self.root / certs.CA_CERT)}

    def tls(self, role: str, name: str) -> TlsConfig:
        return TlsConfig(**self.section(role, name))

    def env(self, prefix: str, role: str, name: str) -> dict[str, str]:
        """The same section as a server's environment overrides (``<PREFIX>__TLS__CERT`` ...)."""
        return {f"{prefix}__TLS__{key.upper()}": value for key, value in self.section(role, name).items()}
