"""The controller's state store on a real etcd: the backend contract (same as SQLite), batches past etcd's
transaction limits, a member lost, quorum lost and back, and a controller whose machine is gone."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from controller.store import StateStore
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from controller.store_backends import MAX_TXN_OPS, SqliteBackend, StoreUnavailable, parse_store, parse_store_url
from mesh_runtime.config import ConfigError
from mesh_runtime.errors import error_info, retry_delay
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, registry_pb2
from tests.etcd_server import etcd_cluster, needs_etcd
from tests.processes import running_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with etcd_cluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


def _exercise(backend) -> None:
    backend.write([("doc", '{"v": 1}'), ("registry/node/a", '"A"'), ("registry/node/b", '"B"'),
                   ("registry/nodes", '"not a member"')], [], [(1, '"e1"'), (2, '"e2"'), (3, '"e3"')])
    assert backend.load("doc") == '{"v": 1}' and backend.load("missing") is None
    assert backend.load_prefix("registry/node/") == ['"A"', '"B"']   # member order; a sibling key is not in it
    backend.write([("doc", '{"v": 2}')], ["registry/node/a"], [(4, '"e4"')])
    assert backend.load("doc") == '{"v": 2}' and backend.load_prefix("registry/node/") == ['"B"']
    assert backend.load_events(2) == ['"e3"', '"e4"'] and backend.load_events(10) == ['"e1"', '"e2"', '"e3"', '"e4"']
    backend.prune_events(2)
    assert backend.load_events(10) == ['"e3"', '"e4"']
    backend.delete("doc")
    assert backend.load("doc") is None


@needs_etcd
@pytest.mark.parametrize("kind", ["sqlite", "etcd"])
def test_both_backends_keep_the_same_contract(kind, etcd, tmp_path):
    backend = (SqliteBackend(tmp_path / "s.sqlite") if kind == "sqlite"
               else parse_store(etcd.url(f"/contract-{tmp_path.name}"), ""))
    try:
        _exercise(backend)
    finally:
        backend.close()


@needs_etcd
def test_a_batch_past_the_transaction_limits_is_written_whole(etcd, tmp_path):
    backend = parse_store(etcd.url("/big"), "")
    nodes = [(f"registry/node/n{i:04d}", json.dumps({"id": i, "pad": "x" * 5000})) for i in range(3 * MAX_TXN_OPS)]
    backend.write(nodes, [], [(i, json.dumps(i)) for i in range(1, 300)])   # 683 operations, ~2 MiB
    assert [json.loads(v)["id"] for v in backend.load_prefix("registry/node/")] == list(range(3 * MAX_TXN_OPS))
    assert len(backend.load_events(1000)) == 299
    other = parse_store(etcd.url("/other"), "")
    assert other.load_prefix("registry/node/") == []   # prefixes keep two meshes on one etcd apart
    backend.close()
    other.close()


@needs_etcd
async def test_state_store_commits_are_durable_in_etcd(etcd):
    url = etcd.url("/durable")
    store = StateStore(parse_store(url, ""))
    state = {"current_step": 0}
    store.track("scheduler", lambda: state_pb2.SchedulerDocument(**state))
    changes: list[tuple[str, state_pb2.NodeDocument | None]] = []
    store.track_collection("registry/node", lambda: [changes.pop() for _ in list(changes)])
    state["current_step"] = 7
    changes.append(("n1", state_pb2.NodeDocument(node=state_pb2.Node(node_id="n1"))))
    store.append_event(1, state_pb2.Event(sequence=1, type="NODE_REGISTERED"))
    await store.commit()
    store.close()
    again = StateStore(parse_store(url, ""))   # a new controller, another machine: nothing on a local disk
    assert again.load("scheduler", state_pb2.SchedulerDocument).current_step == 7
    assert [d.node.node_id for d in again.load_collection("registry/node", state_pb2.NodeDocument)] == ["n1"]
    assert [e.type for e in again.load_events(10)] == ["NODE_REGISTERED"]
    again.close()


@needs_etcd
def test_an_etcd_with_client_certificates_is_reached_over_tls_and_only_with_one(tmp_path, monkeypatch):
    from controller.config import StoreTlsConfig
    from launcher.pki import LocalPki

    # the environment can neither re-trust nor reroute the store's traffic
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    pki = LocalPki(tmp_path / "pki")
    with etcd_cluster(tmp_path / "etcd-tls", tls=pki.section("controller", "etcd")) as cluster:
        client = pki.section("controller", "c1")
        backend = parse_store(cluster.url("/tls"), "", StoreTlsConfig(**client))
        assert backend.description.endswith("(TLS)")
        _exercise(backend)
        backend.close()
        without = parse_store(cluster.url("/tls"), "", StoreTlsConfig(ca=client["ca"]))   # no client certificate
        with pytest.raises(StoreUnavailable):
            without.load("doc")
        plaintext = parse_store(cluster.url("/tls"), "")
        with pytest.raises(StoreUnavailable):
            plaintext.load("doc")


def test_a_remote_etcd_needs_tls_or_insecure(tmp_path):
    from controller.config import ControllerConfig
    from mesh_runtime.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(ControllerConfig, None, overrides={"store": "etcd://127.0.0.1:2379,10.0.0.7:2379/m"})
    assert "10.0.0.7:2379 is not on loopback" in str(info.value) and "store_tls" in str(info.value)
    assert load_config(ControllerConfig, None, overrides={"store": "etcd://10.0.0.7:2379/m", "insecure": True})
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert load_config(ControllerConfig, None, overrides={"store": "etcd://10.0.0.7:2379/m",
                                                          "store_tls": {"ca": str(ca)}}).store_tls.ca == str(ca)
    for tls, says in [({"ca": str(ca), "cert": str(ca)}, "cert and key together"),
                      ({"ca": str(tmp_path / "none.pem")}, "no such file")]:
        with pytest.raises(ConfigError) as info:
            load_config(ControllerConfig, None, overrides={"store": "etcd://10.0.0.7:2379/m", "store_tls": tls})
        assert says in str(info.value)


def test_store_urls_are_checked():
    assert parse_store_url("etcd://a:2379,b:2379/mesh/one") == ("etcd", ([("a", 2379), ("b", 2379)], "/mesh/one"))
    assert parse_store_url("etcd://a:2379")[1][1] == "/rollmesh"
    assert parse_store_url("sqlite:///var/lib/rollmesh/c.sqlite")[1].name == "c.sqlite"
    for bad, says in [("redis://x:1/p", "sqlite:// or etcd://"), ("etcd:///p", "etcd://HOST:PORT"),
                      ("etcd://a:0/p", "etcd member 'a:0'"), ("etcd://a/p", "etcd member 'a'"),
                      ("sqlite://host/x.sqlite", "sqlite:///ABSOLUTE"), ("sqlite:///dir/", "sqlite:///ABSOLUTE"),
                      ("etcd://a:1/p?x=1", "plain path"), ("etcd://" + "h" * 500, "...")]:
        with pytest.raises(ConfigError) as info:
            parse_store_url(bad)
        assert says in str(info.value) and len(str(info.value)) < 240, str(info.value)


@needs_etcd
async def test_three_members_survive_one_lost_and_stop_without_quorum_then_resume(tmp_path):
    with etcd_cluster(tmp_path / "etcd3", size=3) as cluster:
        store = StateStore(parse_store(cluster.url("/ha"), ""))
        state = {"next_cycle": 0}
        store.track("metrics", lambda: state_pb2.MetricsDocument(**state))
        cluster.stop(cluster.members[0], kill=True)   # the first endpoint: calls move to the next member
        state["next_cycle"] = 1
        await store.commit()
        assert store.load("metrics", state_pb2.MetricsDocument).next_cycle == 1

        cluster.stop(cluster.members[1], kill=True)   # one of three left: no quorum, no write acknowledged
        state["next_cycle"] = 2
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            await store.commit()
        assert time.monotonic() - started < 60 and "no member answered" in str(info.value)
        assert info.value.retry_delay_s == 1.0

        for member in cluster.members[:2]:
            cluster.start(member, state="existing")
        cluster.wait_healthy()
        await store.commit()   # the refused batch was kept: it is written now
        assert StateStore(parse_store(cluster.url("/ha"), "")).load("metrics", state_pb2.MetricsDocument).next_cycle == 2
        store.close()


@needs_etcd
async def test_a_controller_on_etcd_comes_back_on_another_machine(etcd, tmp_path):
    config = f"store: {etcd.url('/machine-' + tmp_path.name)}\n"
    first = tmp_path / "first.yaml"
    first.write_text(config + f"state_dir: {tmp_path / 'disk-one'}\n")
    with running_server("controller", ["--config", str(first)], log_path=tmp_path / "first.log") as (address, proc):
        async with grpc.aio.insecure_channel(address) as channel:
            await controller_pb2_grpc.ControllerServiceStub(channel).RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:40001", slots_total=2), timeout=10)
        proc.kill()   # acknowledged means in etcd: nothing needs a clean shutdown
        proc.wait(timeout=10)
    second = tmp_path / "second.yaml"
    second.write_text(config + f"state_dir: {tmp_path / 'disk-two'}\n")   # another, empty disk
    with running_server("controller", ["--config", str(second)], log_path=tmp_path / "second.log") as (address, _):
        async with grpc.aio.insecure_channel(address) as channel:
            nodes = await controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(registry_pb2.ListNodesRequest(),
                                                                                        timeout=10)
            status = await controller_pb2_grpc.ControllerServiceStub(channel).GetStatus(
                controller_pb2.GetStatusRequest(), timeout=10)
    assert [n.node_id for n in nodes.nodes] == ["n1"]
    assert status.state_store == etcd.url("/machine-" + tmp_path.name)
    assert not (tmp_path / "disk-one" / "controller.sqlite").exists()   # store wins over state_dir


@needs_etcd
async def test_a_call_whose_state_cannot_be_stored_is_unavailable_with_a_retry_delay(tmp_path):
    with etcd_cluster(tmp_path / "etcd-gone") as cluster:
        path = tmp_path / "c.yaml"
        path.write_text(f"store: {cluster.url('/gone')}\n")
        with running_server("controller", ["--config", str(path)], log_path=tmp_path / "c.log") as (address, _):
            cluster.stop(cluster.members[0], kill=True)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = controller_pb2_grpc.ControllerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                        node_id="n1", address="127.0.0.1:40001", slots_total=1), timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert error_info(info.value).reason == "STORE_UNAVAILABLE"
                assert retry_delay(info.value) == 1.0
                cluster.start(cluster.members[0], state="existing")
                cluster.wait_healthy()
                await stub.RegisterNode(registry_pb2.RegisterNodeRequest(   # the client's retry now succeeds
                    node_id="n1", address="127.0.0.1:40001", slots_total=1), timeout=30)
