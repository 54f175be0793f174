"""A throwaway CA with one certificate per role, for the security tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh_runtime import certs
from mesh_runtime.config import TlsConfig
from mesh_runtime.identity import ROLES


@dataclass
class Pki:
    root: Path

    @property
    def ca(self) -> Path:
        return self.root / certs.CA_CERT

    def tls(self, role: str, name: str = "n0", **kwargs) -> TlsConfig:
        """The TlsConfig of ``spiffe://rollmesh/<role>/<name>`` (made on first use)."""
        cert, key = self.root / f"{role}-{name}.pem", self.root / f"{role}-{name}.key"
        if kwargs or not cert.exists():
            cert, key = certs.create_cert(self.root, role, name, **kwargs)
        return TlsConfig(cert=str(cert), key=str(key), ca=str(self.ca))

    def section(self, role: str, name: str = "n0") -> dict[str, str]:
        """The ``tls`` config section of that identity."""
        tls = self.tls(role, name)
        return {"cert": tls.cert, "key": tls.key, "ca": tls.ca}

    def yaml(self, role: str, name: str = "n0") -> str:
        t = self.section(role, name)
        return f"tls: {{cert: {t['cert']}, key: {t['key']}, ca: {t['ca']}}}\n"


def make_pki(root: Path) -> Pki:
    certs.create_ca(root)
    pki = Pki(root)
    for role in ROLES:
        pki.tls(role)
    return pki
