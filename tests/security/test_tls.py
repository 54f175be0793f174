"""Mutual TLS at the handshake: who gets in, rotation without restart, the insecure and health-only modes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import socket
import ssl
import subprocess

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import loadbalancer.server
from mesh_runtime import certs
from mesh_runtime.channels import open_channel
from mesh_runtime.config import ConfigError, TlsConfig, load_config
from mesh_runtime.errors import error_info
from rollmesh.common.v1 import status_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from tests.security.pki import make_pki

pytestmark = pytest.mark.timeout(60)


async def _lb(pki, **overrides):
    config = load_config(loadbalancer.server.CONFIG_CLASS, None,
                         overrides={"listen": "127.0.0.1:0", "tls": pki.section("lb"), **overrides})
    return await loadbalancer.server.SPEC.create(config)


async def _status(channel) -> status_pb2.ServerStatus:
    stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
    return (await stub.GetStatus(pb.GetStatusRequest(), timeout=5)).status


async def _refused(channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _status(channel)
    return info.value.code()


async def test_a_mesh_certificate_gets_in_and_status_says_mutual_tls(pki):
    server, port = await _lb(pki)
    try:
        async with open_channel(f"127.0.0.1:{port}", tls=pki.tls("client")) as channel:
            status = await _status(channel)
        assert status.transport_security == status_pb2.TRANSPORT_SECURITY_MUTUAL_TLS
        assert status.identity == "spiffe://rollmesh/lb/n0"
    finally:
        await server.stop(0)


async def test_plaintext_another_ca_and_an_expired_certificate_fail_the_handshake(pki, tmp_path):
    other = make_pki(tmp_path / "other")
    expired = pki.tls("client", "old", valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=3), days=1)
    server, port = await _lb(pki)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _refused(channel) == grpc.StatusCode.UNAVAILABLE
        foreign = other.tls("client")   # another CA's certificate, trusting our CA so only the server can refuse
        foreign = TlsConfig(cert=foreign.cert, key=foreign.key, ca=str(pki.ca))
        async with open_channel(f"127.0.0.1:{port}", tls=foreign) as channel:
            assert await _refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with open_channel(f"127.0.0.1:{port}", tls=expired) as channel:
            assert await _refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with open_channel(f"127.0.0.1:{port}", tls=other.tls("client", ca_dir=other.root)) as channel:
            assert await _refused(channel) == grpc.StatusCode.UNAVAILABLE   # the client refuses the server too
    finally:
        await server.stop(0)


def _cert_without_identity(pki, path) -> TlsConfig:
    """A certificate our CA signed that names no rollmesh role (no URI SAN)."""
    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((pki.root / certs.CA_KEY).read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "anon")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (path / "anon.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / "anon.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return TlsConfig(cert=str(path / "anon.pem"), key=str(path / "anon.key"), ca=str(pki.ca))


async def test_a_certificate_without_a_role_is_unauthenticated_and_cannot_start_a_server(pki, tmp_path):
    anon = _cert_without_identity(pki, tmp_path)
    server, port = await _lb(pki)
    try:
        async with open_channel(f"127.0.0.1:{port}", tls=anon) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _status(channel)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_info(info.value).reason == "NO_IDENTITY"
    finally:
        await server.stop(0)
    with pytest.raises(ConfigError, match="names no rollmesh identity"):
        await _lb(pki, tls={"cert": anon.cert, "key": anon.key, "ca": anon.ca})


def _served_certificate(port: int, client: TlsConfig) -> bytes:
    """The DER certificate a new TLS connection to ``port`` is served (Python's ssl, with ALPN h2)."""
    context = ssl.create_default_context(cafile=client.ca)
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return tls.getpeercert(binary_form=True)


async def test_rotated_files_serve_new_connections_while_open_ones_keep_working(pki, tmp_path):
    files = tmp_path / "lb"
    files.mkdir()
    for suffix in ("pem", "key"):
        shutil.copy(pki.root / f"lb-n0.{suffix}", files / f"lb.{suffix}")
    tls = {"cert": str(files / "lb.pem"), "key": str(files / "lb.key"), "ca": str(pki.ca)}
    server, port = await _lb(pki, tls=tls)
    client = pki.tls("client")
    loop = asyncio.get_running_loop()
    try:
        before = await loop.run_in_executor(None, _served_certificate, port, client)
        async with open_channel(f"127.0.0.1:{port}", tls=client) as old:
            await _status(old)
            new_cert, new_key = certs.create_cert(tmp_path / "new", "lb", "rotated", ca_dir=pki.root)
            os.replace(new_key, files / "lb.key")
            os.replace(new_cert, files / "lb.pem")
            after = await loop.run_in_executor(None, _served_certificate, port, client)
            assert after != before
            assert x509.load_der_x509_certificate(after).subject.rfc4514_string().startswith("CN=rotated")
            await _status(old)   # the connection made before the rotation still works
        async with open_channel(f"127.0.0.1:{port}", tls=client) as fresh:
            await _status(fresh)
    finally:
        await server.stop(0)


async def test_plaintext_needs_a_loopback_address_or_insecure(pki):
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_config(loadbalancer.server.CONFIG_CLASS, None, overrides={"listen": "0.0.0.0:0"})
    config = load_config(loadbalancer.server.CONFIG_CLASS, None, overrides={"listen": "0.0.0.0:0", "insecure": True})
    server, port = await loadbalancer.server.SPEC.create(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = await _status(channel)
        assert status.transport_security == status_pb2.TRANSPORT_SECURITY_PLAINTEXT_INSECURE
    finally:
        await server.stop(0)


async def test_the_health_listener_serves_plaintext_health_and_nothing_else(pki):
    server, port = await _lb(pki, health_listen="127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(server.health_address()) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _status(channel)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _refused(channel) == grpc.StatusCode.UNAVAILABLE   # the main port stays TLS-only
    finally:
        await server.stop(0)


async def test_the_node_client_and_buf_curl_speak_mutual_tls_with_reflection(pki, node, buf):
    server, port = await _lb(pki)
    client = pki.tls("operator-readonly")
    try:
        env = {**os.environ, "ROLLMESH_TLS_CA": client.ca, "ROLLMESH_TLS_CERT": client.cert,
               "ROLLMESH_TLS_KEY": client.key}
        result = await asyncio.to_thread(subprocess.run, [node, "tests/e2e/clients/status_client.js",
                                                          f"rollmesh.loadbalancer.v1.LoadBalancerService=127.0.0.1:{port}"],
                                         capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        status = json.loads(result.stdout)["status"]
        assert status["transportSecurity"] == "TRANSPORT_SECURITY_MUTUAL_TLS"
        flags = ["--protocol", "grpc", "--cacert", client.ca, "--cert", client.cert, "--key", client.key]
        listed = await asyncio.to_thread(subprocess.run, [str(buf), "curl", *flags, "--list-services",
                                                          f"https://127.0.0.1:{port}"],
                                         capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "rollmesh.loadbalancer.v1.LoadBalancerService" in listed.stdout.split()
        called = await asyncio.to_thread(subprocess.run, [str(buf), "curl", *flags, "-d", "{}",
                                                          f"https://127.0.0.1:{port}/rollmesh.loadbalancer.v1."
                                                          "LoadBalancerService/GetStatus"],
                                         capture_output=True, text=True, timeout=60)
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["status"]["identity"] == "spiffe://rollmesh/lb/n0"
        denied = await asyncio.to_thread(subprocess.run, [str(buf), "curl", *flags, "-d", '{"replicaIds": ["x"]}',
                                                          f"https://127.0.0.1:{port}/rollmesh.loadbalancer.v1."
                                                          "LoadBalancerService/RemoveReplicas"],
                                         capture_output=True, text=True, timeout=60)
        assert denied.returncode != 0 and "permission_denied" in denied.stderr.lower()
        plain = await asyncio.to_thread(subprocess.run, [str(buf), "curl", "--protocol", "grpc",
                                                         "--http2-prior-knowledge", "--list-services",
                                                         f"http://127.0.0.1:{port}"],
                                        capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0   # plaintext is refused
    finally:
        await server.stop(0)


async def test_a_channel_pool_picks_up_a_rotated_client_certificate(pki, tmp_path):
    # the pool's owner rotates its certificate (here from the client role to the controller's): calls made
    # after the rotation carry the new identity, without a restart
    from mesh_runtime.channels import ChannelPool

    files = tmp_path / "me"
    files.mkdir()
    for suffix in ("pem", "key"):
        shutil.copy(pki.root / f"client-n0.{suffix}", files / f"me.{suffix}")
    mine = TlsConfig(cert=str(files / "me.pem"), key=str(files / "me.key"), ca=str(pki.ca))
    server, port = await _lb(pki)
    pool = ChannelPool(tls=mine)
    remove = pb.RemoveReplicasRequest(replica_ids=["nobody"])
    try:
        first = pool.get(f"127.0.0.1:{port}")
        assert pool.get(f"127.0.0.1:{port}") is first   # one channel per address
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(first)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RemoveReplicas(remove, timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        cert, key = certs.create_cert(tmp_path / "new", "controller", "rotated", ca_dir=pki.root)
        os.replace(key, files / "me.key")
        os.replace(cert, files / "me.pem")
        await asyncio.sleep(1.1)   # the pool looks at the files at most once a second
        fresh = pool.get(f"127.0.0.1:{port}")
        assert fresh is not first
        reply = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(fresh).RemoveReplicas(remove, timeout=5)
        assert list(reply.removed_replica_ids) == []
        await _status(first)   # the channel from before the rotation still works until it is retired
    finally:
        await pool.close()
        await server.stop(0)
