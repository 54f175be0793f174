"""Mutual TLS for every rollmesh hop: the ``tls: {cert, key, ca}`` config block and its credentials.

A server with ``tls`` listens with TLS and requires a client certificate
signed by ``ca`` (no certificate, another CA's, or an expired one fails the
handshake). Its certificate and CA are re-read when their files change:
:func:`server_credentials` hands gRPC a fetcher that gRPC calls on each new
handshake, so a rotation needs no restart; connections already open keep the
certificate they were made with until closed. Client channels
(:mod:`mesh_runtime.channels`) present ``cert``/``key`` and trust ``ca``;
they read the files when opened, so channels opened after a rotation use the
new certificate.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

import grpc

from .config import ConfigError, TlsConfig

__all__ = ["TlsConfig", "channel_credentials", "server_credentials"]

log = logging.getLogger(__name__)


def tls_stamp(tls: TlsConfig | None) -> tuple:
    """What changes when any of the three files is replaced or rewritten (empty without TLS)."""
    if tls is None:
        return ()
    stamp: list[tuple[int, int, int] | None] = []
    for path in (tls.cert, tls.key, tls.ca):
        try:
            st = os.stat(path)
            stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamp.append(None)
    return tuple(stamp)


class _Reloader:
    """Hands gRPC a new server certificate configuration when the files changed since the last one."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._stamp = tls_stamp(tls)
        self.reloads = 0

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = _files(self.tls)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                stamp = tls_stamp(self.tls)
                if stamp == self._stamp or None in stamp:
                    return None
                config = self.configuration()
            except (OSError, ValueError) as err:   # mid-rotation or unreadable: keep serving the old one
                log.warning("TLS files not reloaded (%s); the previous certificate stays in use", err)
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info("TLS certificate files changed: new connections use the new certificate")
            return config


def _files(tls: TlsConfig) -> tuple[bytes, bytes, bytes]:
    """(cert chain, private key, CA bundle) as read now."""
    return Path(tls.cert).read_bytes(), Path(tls.key).read_bytes(), Path(tls.ca).read_bytes()


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS server credentials requiring a client certificate from ``tls.ca``, reloaded on change."""
    reloader = _Reloader(tls)
    # grpc documents a fetcher's None as "keep the current certificate"; typeshed's stub leaves None out
    return grpc.dynamic_ssl_server_credentials(reloader.configuration(), reloader,  # type: ignore[arg-type]
                                               require_client_authentication=True)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Client credentials presenting ``tls.cert`` and trusting ``tls.ca`` (files read now)."""
    cert, key, ca = _files(tls)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cacert/--cert/--key``: the mutual-TLS identity a tool presents (grpcurl's and buf curl's names)."""
    parser.add_argument("--cacert", metavar="PEM", help="CA the server's certificate must chain to")
    parser.add_argument("--cert", metavar="PEM", help="this tool's certificate (e.g. an operator-readonly one)")
    parser.add_argument("--key", metavar="PEM", help="private key of --cert")


def client_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the three flags give (None when none is given); ConfigError when only some are."""
    given = {name: getattr(args, name, None) for name in ("cacert", "cert", "key")}
    if not any(given.values()):
        return None
    missing = [f"--{name}" for name, value in given.items() if not value]
    if missing:
        raise ConfigError("", f"mutual TLS needs --cacert, --cert and --key together; missing {', '.join(missing)}")
    tls = TlsConfig(cert=str(given["cert"]), key=str(given["key"]), ca=str(given["cacert"]))
    tls.validate()
    return tls
