"""Leader and standby on one etcd store (real processes, real etcd): a standby answers reads and refuses the
rest naming the leader, takes over when the leader dies or shuts down; a leader paused past its lease is fenced
off and turns standby, and a client given both addresses follows the leader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from controller.store_backends import parse_store
from launcher.processes import ServerProcess, start_server
from mesh_runtime.errors import error_info
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, events_pb2, observability_pb2, registry_pb2
from tests.etcd_server import etcd_cluster, needs_etcd
from tests.processes import clean_env
from tests.waiting import wait_until

pytestmark = [needs_etcd, pytest.mark.timeout(120)]


async def controller(tmp: Path, name: str, store: str, ttl_s: int) -> ServerProcess:
    config = tmp / f"{name}.yaml"
    config.write_text(f"store: {store}\nstore_lease_ttl_s: {ttl_s}\nnode_id: {name}\n")
    return await start_server("controller", ["--config", str(config), "--listen", "127.0.0.1:0"], env=clean_env(),
                              log_path=tmp / f"{name}.log", ready_timeout_s=90)


async def register(address: str, node: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await controller_pb2_grpc.ControllerServiceStub(channel).RegisterNode(registry_pb2.RegisterNodeRequest(
            node_id=node, address="127.0.0.1:40001", slots_total=1), timeout=10)


async def nodes(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(registry_pb2.ListNodesRequest(),
                                                                                    timeout=10)
    return sorted(n.node_id for n in reply.nodes)


async def stop(start: asyncio.Task) -> None:
    """End a controller started in the background, whether it is still waiting for the store or serving."""
    start.cancel()   # a start still waiting kills its child (launcher.processes.start_server)
    results = await asyncio.gather(start, return_exceptions=True)
    if isinstance(results[0], ServerProcess):
        await results[0].kill()


async def status_cli(*args: str) -> subprocess.CompletedProcess:
    """``rollmesh status ARGS`` as a user runs it."""
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "launcher.cli", "status", *args],
                                   capture_output=True, text=True, env=clean_env(), timeout=60)


async def history(address: str) -> list:
    """Every lifecycle event the controller holds, oldest first."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        newest = (await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)).last_event_sequence
        events = []
        call = stub.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True), timeout=30)
        async for message in call:
            events.append(message.event)
            if message.event.sequence >= newest:
                break
        call.cancel()
    return events


@contextlib.asynccontextmanager
async def leader_and_standby(tmp: Path, store: str, ttl_s: int):
    """``first`` leading ``store`` and ``second`` serving as its standby; both ended after."""
    first = await controller(tmp, "first", store, ttl_s)
    second = None
    try:
        second = await controller(tmp, "second", store, ttl_s)
        yield first, second
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.process.send_signal(signal.SIGCONT)   # a paused one must wake to be killed and reaped
        await first.kill()
        if second is not None:
            await second.kill()


async def status(address: str) -> controller_pb2.GetStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await controller_pb2_grpc.ControllerServiceStub(channel).GetStatus(controller_pb2.GetStatusRequest(),
                                                                                   timeout=10)


async def role_of(address: str) -> int:
    return (await status(address)).role


async def wait_role(address: str, role: int, timeout_s: float = 30) -> None:
    async def reached() -> bool:
        return await role_of(address) == role
    await wait_until(reached, timeout_s, what=f"{address} to be {controller_pb2.ControllerRole.Name(role)}")


LEADER, STANDBY = controller_pb2.CONTROLLER_ROLE_LEADER, controller_pb2.CONTROLLER_ROLE_STANDBY


def stored_nodes(store: str) -> list[str]:
    backend = parse_store(store, "")
    try:
        documents = [json.loads(v) for v in backend.load_prefix("registry/node/")]
        return sorted(d["node"]["node_id"] for d in documents if d.get("node"))
    finally:
        backend.close()


async def test_a_standby_answers_reads_refuses_the_rest_and_takes_over_when_the_leader_dies(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/owned")
        async with leader_and_standby(tmp_path, store, ttl_s=2) as (first, second):
            leading, waiting = await status(first.address), await status(second.address)
            assert (leading.role, leading.leader_address) == (LEADER, first.address)
            assert (waiting.role, waiting.leader_address) == (STANDBY, first.address)
            assert waiting.leader_name.startswith("first at ")
            await register(first.address, "n1")

            async def copied() -> bool:   # the standby's read-only copy follows the store
                return await nodes(second.address) == ["n1"]
            await wait_until(copied, 15, what="the standby's copy to show n1")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register(second.address, "n-refused")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            info = error_info(refused.value)
            assert info.reason == "NOT_LEADER" and info.metadata["leader"] == first.address
            async with grpc.aio.insecure_channel(second.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as watch_refused:
                    async for _ in controller_pb2_grpc.ControllerServiceStub(channel).WatchEvents(
                            observability_pb2.WatchEventsRequest(include_history=True), timeout=10):
                        pass
            assert error_info(watch_refused.value).reason == "NOT_LEADER"
            assert stored_nodes(store) == ["n1"]   # the refused registration did nothing
            shown = await status_cli(f"{second.address},{first.address}")   # the CLI finds the leader
            assert shown.returncode == 0, shown.stderr
            assert f"listening on {first.address}" in shown.stdout.splitlines()[0]
            assert f"  {second.address}: standby, leader: {first.address}" in shown.stdout

            await first.kill()   # kill -9: its lease runs out in 2 s and the standby takes over
            await wait_role(second.address, LEADER)
            shown = await status_cli(f"{first.address},{second.address}", "--json")
            assert shown.returncode == 0, shown.stderr
            answers = json.loads(shown.stdout)
            assert answers["leader"] == second.address
            assert answers["controllers"][second.address]["role"] == "CONTROLLER_ROLE_LEADER"
            assert "error" in answers["controllers"][first.address]   # the dead one, said so
            assert (await status(second.address)).leader_address == second.address
            assert await nodes(second.address) == ["n1"]   # what the first acknowledged
            changes = [e for e in await history(second.address) if e.type == events_pb2.EVENT_TYPE_LEADER_CHANGED]
            assert [(e.from_state.split(" at ")[0], e.to_state.split(" at ")[0]) for e in changes] == [
                ("", "first"), ("first", "second")]   # both takeovers, in the one event log of the store
            assert changes[-1].details["waited_s"] > 0 and changes[-1].details["fence_revision"] > 0
            await register(second.address, "n2")
            assert stored_nodes(store) == ["n1", "n2"]


async def test_an_event_stream_resumes_on_the_new_leader_with_nothing_missed_or_invented(tmp_path):
    from trainer_client import MeshClient

    with etcd_cluster(tmp_path / "etcd") as etcd:
        async with leader_and_standby(tmp_path, etcd.url("/watched"), ttl_s=2) as (first, second):
            watched: list = []

            async def watch() -> None:
                async with MeshClient(f"{first.address},{second.address}") as client:
                    async for event in client.events(include_history=True):
                        watched.append(event)
            watcher = asyncio.create_task(watch())
            await register(first.address, "n0")
            await wait_until(lambda: any(e.node_id == "n0" for e in watched), 15, what="n0's event on the stream")

            async with grpc.aio.insecure_channel(first.address) as channel:   # a burst the kill lands inside
                stub = controller_pb2_grpc.ControllerServiceStub(channel)
                burst = [asyncio.ensure_future(stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                    node_id=f"b{i}", address=f"127.0.0.1:{41000 + i}", slots_total=1), timeout=10))
                    for i in range(40)]
                await wait_until(lambda: any(f.done() for f in burst), 15, what="the burst to be under way")
                await first.kill()
                await asyncio.gather(*burst, return_exceptions=True)
            await wait_role(second.address, LEADER)
            await register(second.address, "n-after")
            await wait_until(lambda: any(e.node_id == "n-after" for e in watched), 30,
                             what="the stream to resume on the new leader")
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            kept = await history(second.address)
            seen = [(e.sequence, e.type, e.node_id, e.reason) for e in watched]
            assert [s[0] for s in seen] == list(range(1, len(seen) + 1))   # each once, in order, none skipped
            # exactly what the store kept: no event shown by the dead leader and lost with it
            assert seen == [(e.sequence, e.type, e.node_id, e.reason) for e in kept][:len(seen)]
            assert [e.to_state.split(" at ")[0] for e in watched
                    if e.type == events_pb2.EVENT_TYPE_LEADER_CHANGED] == ["first", "second"]


async def test_a_clean_shutdown_hands_the_store_over_without_waiting_out_the_lease(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/handover")
        # a 300 s lease, which no test would wait out
        async with leader_and_standby(tmp_path, store, ttl_s=300) as (first, second):
            assert await role_of(second.address) == STANDBY
            assert await first.terminate() == 0   # SIGTERM: it revokes its lease on the way out
            await wait_role(second.address, LEADER, timeout_s=15)
            assert await nodes(second.address) == []


async def test_a_leader_paused_past_its_lease_cannot_write_turns_standby_and_its_clients_move(tmp_path):
    from mesh_runtime.channels import open_channel

    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/fenced")
        async with leader_and_standby(tmp_path, store, ttl_s=2) as (first, second):
            # a client given both addresses, the first of them first: it talks to the first controller
            following = open_channel(f"{first.address},{second.address}")
            stub = controller_pb2_grpc.ControllerServiceStub(following)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="n1", address="127.0.0.1:40001",
                                                                     slots_total=1), timeout=10)
            first.process.send_signal(signal.SIGSTOP)   # frozen past its lease: the second takes over
            await wait_role(second.address, LEADER)
            await register(second.address, "n2")
            first.process.send_signal(signal.SIGCONT)   # it wakes up believing it still leads
            with contextlib.suppress(grpc.aio.AioRpcError):   # refused: fenced, or already a standby
                await register(first.address, "intruder")
            await wait_role(first.address, STANDBY)   # it stops acting by itself, without exiting
            assert first.process.returncode is None

            async def names_the_new_leader() -> bool:
                return (await status(first.address)).leader_address == second.address
            await wait_until(names_the_new_leader, 15, what="the deposed leader to name the new one")
            assert "stopped acting: lost the state store" in (tmp_path / "first.log").read_text()
            assert stored_nodes(store) == ["n1", "n2"]   # nothing of the deposed leader landed
            # the client still pointed at the first controller moves to the new leader by itself
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="n3", address="127.0.0.1:40003",
                                                                     slots_total=1), timeout=20)
            assert following.current == second.address
            assert stored_nodes(store) == ["n1", "n2", "n3"]
            reads = await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=10)
            assert sorted(n.node_id for n in reads.nodes) == ["n1", "n2", "n3"]
            await following.close()


def running_with(argument: str) -> list[int]:
    """Pids of the live processes whose command line holds ``argument``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and argument in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and (proc / "stat").read_text().split(") ")[-1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def test_a_start_given_up_on_leaves_no_waiting_controller_behind(tmp_path):
    from mesh_runtime.net import free_port

    store = f"etcd://127.0.0.1:{free_port()}/abandoned"   # no etcd there: the controller waits for it
    start = asyncio.create_task(controller(tmp_path, "second", store, 60))
    await wait_until(lambda: "retrying" in (tmp_path / "second.log").read_text()
                     if (tmp_path / "second.log").exists() else False, 60, what="the controller to wait for etcd")
    assert running_with(str(tmp_path / "second.yaml"))   # it is there, waiting for the store
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert running_with(str(tmp_path / "second.yaml")) == []   # and gone with the start that gave up


def test_the_fence_refuses_every_write_of_a_deposed_owner(tmp_path):
    from controller.store_backends import StoreFenced
    from controller.store_owner import StoreOwnership

    with etcd_cluster(tmp_path / "etcd") as etcd:
        lost: list[str] = []
        old_backend, new_backend = parse_store(etcd.url("/fence"), ""), parse_store(etcd.url("/fence"), "")
        old = StoreOwnership(old_backend, owner="old", ttl_s=60, on_lost=lost.append)
        old_backend.on_fenced = old.lose
        old.acquire()
        old_backend.write([("doc", '"old"')], [], [])
        old._stop.set()                  # frozen: it renews nothing more ...
        old._revoke(old._lease_id)       # ... and its lease runs out (at once here, instead of after 60 s)
        new = StoreOwnership(new_backend, owner="new", ttl_s=60, on_lost=lost.append)
        new.acquire(deadline_s=10)
        new_backend.write([("doc", '"new"')], [], [])
        with pytest.raises(StoreFenced) as info:   # the old owner wakes up and writes: nothing lands
            old_backend.write([("doc", '"stale"'), ("other", '"stale"')], [], [(1, '"stale event"')])
        assert "no longer owns the state store" in str(info.value)
        assert lost == ["a write was fenced off"]   # and it is told it lost the store
        assert new_backend.load("doc") == '"new"' and new_backend.load("other") is None
        assert new_backend.load_events(10) == []
        assert new.holder() == "new"
        new.release()
        assert new.holder() == ""
        old_backend.close()
        new_backend.close()


async def test_owning_the_store_is_a_span_and_an_event(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from controller.config import ControllerConfig
    from controller.core.events import EventType
    from controller.leadership import Leadership
    from mesh_runtime.config import load_config

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with etcd_cluster(tmp_path / "etcd") as etcd:
        config = load_config(ControllerConfig, None, overrides={"store": etcd.url("/traced"), "node_id": "solo"})
        leadership = Leadership(config, provider)
        mesh = leadership.mesh
        try:
            assert leadership.role == "leader"
            span = next(s for s in exporter.get_finished_spans() if s.name == "store.acquire")
            assert span.attributes["rollmesh.store"] == etcd.url("/traced")
            assert span.attributes["rollmesh.owner"].startswith("solo at ")
            changed = [e for e in mesh.events.since(0)[0] if e.type is EventType.LEADER_CHANGED]
            assert len(changed) == 1 and changed[0].from_state == "" and changed[0].to_state.startswith("solo")
        finally:
            await mesh.close()


async def test_quorum_lost_stops_acting_reads_still_answer_and_the_mesh_resumes_with_quorum(tmp_path):
    from mesh_runtime.channels import open_channel

    with etcd_cluster(tmp_path / "etcd3", size=3) as cluster:
        store = cluster.url("/quorum")
        async with leader_and_standby(tmp_path, store, ttl_s=2) as (first, second):
            following = open_channel(f"{first.address},{second.address}")
            stub = controller_pb2_grpc.ControllerServiceStub(following)

            async def register_following(node: str, timeout_s: float = 20) -> None:
                await stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id=node, address="127.0.0.1:40001",
                                                                         slots_total=1), timeout=timeout_s)

            cluster.stop(cluster.members[0], kill=True)   # one member of three lost: the mesh keeps working
            await register_following("n1")
            cluster.stop(cluster.members[1], kill=True)   # quorum lost: nobody may act
            await wait_role(first.address, STANDBY, timeout_s=90)
            for address in (first.address, second.address):   # reads are still answered, from the copies
                assert await role_of(address) == STANDBY
            assert await nodes(first.address) == ["n1"]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register(first.address, "n-refused")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            for member in cluster.members[:2]:
                cluster.start(member, state="existing")
            cluster.wait_healthy()

            async def someone_leads() -> bool:
                return LEADER in {await role_of(first.address), await role_of(second.address)}
            await wait_until(someone_leads, 60, what="a controller to lead again once quorum is back")
            await register_following("n2", timeout_s=30)
            assert stored_nodes(store) == ["n1", "n2"]
            await following.close()
